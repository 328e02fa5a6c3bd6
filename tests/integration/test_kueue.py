"""Real Kueue (hack/build-kueue.sh) against the local control plane: the plain-pod group contract the
operator's rank pods rely on (docs/scheduling.md).

A ClusterQueue of 16 nvidia.com/gpu over one ResourceFlavor, a LocalQueue, and groups of plain pods
labelled as builders.build_rank_pod labels them: Kueue's webhook gates every pod, admits a group that
fits as one Workload (and only then lets the scheduler bind its pods), keeps a group that does not fit
gated with none of its pods bound, and admits it once quota is free."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from tests.integration.kueue_harness import (
    MANAGED_NAMESPACE_LABEL,
    REPO,
    KueueProcess,
    ensure_built,
    start_kueue,
)
from tests.integration.operator_harness import OperatorProcess, wait_for
from tests.integration.operator_harness import ddpjob as gpu_ddpjob
from tests.integration.topology_nodes import (
    BLOCK_LABEL,
    HOST_LABEL,
    POOL_LABEL,
    RACK_LABEL,
    Pool,
    node_pool,
    ranks_by_order,
    ranks_of,
)

from ddp_harness import EXIT_CODE_ANNOTATION
from ddp_operator import builders, names
from ddp_operator.spec import parse_job

pytestmark = pytest.mark.integration

GPU = names.GPU_RESOURCE
FLAVOR = "gpu-flavor"


@pytest.fixture(scope="module")
def kueue(local_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KueueProcess]:
    prefix = ensure_built()
    process = start_kueue(local_cluster, tmp_path_factory.mktemp("kueue"), prefix)
    try:
        yield process
    finally:
        process.stop()
        print(f"--- kueue log ({process.log}) ---\n{process.log_tail(60)}", file=sys.stderr)


def kubectl(kueue: KueueProcess, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return kueue.kubectl(*args, stdin=stdin)


def get_json(kueue: KueueProcess, *args: str) -> Any:
    return json.loads(kubectl(kueue, "get", *args, "-o", "json").stdout)


def apply(kueue: KueueProcess, *objects: dict[str, Any]) -> None:
    kubectl(
        kueue,
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}),
    )


@pytest.fixture
def queue(kueue: KueueProcess) -> Iterator[tuple[str, str]]:
    """(namespace, LocalQueue name): a managed namespace whose LocalQueue feeds a 16-GPU ClusterQueue.
    Everything is deleted while Kueue still runs (its finalizers need it)."""
    with managed_queue(
        kueue,
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
    ) as made:
        yield made


@contextlib.contextmanager
def managed_queue(
    kueue: KueueProcess, flavor: dict[str, Any], *before: dict[str, Any]
) -> Iterator[tuple[str, str]]:
    """A managed namespace whose LocalQueue feeds a 16-GPU ClusterQueue over ``flavor`` (created after
    ``before``, e.g. its Topology); all of it deleted while Kueue still runs."""
    suffix = uuid.uuid4().hex[:6]
    namespace, cluster_queue, local_queue = f"kueue-{suffix}", f"cq-{suffix}", "gpu-queue"
    kubectl(kueue, "create", "namespace", namespace)
    kubectl(kueue, "label", "namespace", namespace, f"{MANAGED_NAMESPACE_LABEL}=true")
    wait_for(
        f"serviceaccount default in {namespace}",
        lambda: (
            kueue.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0
        ),
    )
    apply(
        kueue,
        *before,
        flavor,
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": cluster_queue},
            "spec": {
                "namespaceSelector": {},
                # A higher-priority workload may evict a lower one of the same queue (the preemption test).
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": [GPU],
                        "flavors": [
                            {
                                "name": flavor["metadata"]["name"],
                                "resources": [{"name": GPU, "nominalQuota": 16}],
                            }
                        ],
                    }
                ],
            },
        },
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "LocalQueue",
            "metadata": {"name": local_queue, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue},
        },
    )
    wait_for(
        f"ClusterQueue {cluster_queue} Active",
        lambda: any(
            c["type"] == "Active" and c["status"] == "True"
            for c in get_json(kueue, "clusterqueue", cluster_queue).get("status", {}).get("conditions", [])
        ),
    )
    try:
        yield namespace, local_queue
    finally:
        # A group's pods keep Kueue's finalizer until the group finishes or its Workload is deleted (pods
        # deleted by a namespace, or by garbage collection, do not finish it): delete the Workloads first.
        kueue.kubectl(
            "delete", "workloads.kueue.x-k8s.io", "--all", "-n", namespace, "--timeout=50s", check=False
        )
        deleted = kueue.kubectl("delete", "namespace", namespace, "--timeout=50s", check=False)
        if deleted.returncode != 0:
            stuck = get_json(kueue, "pods,workloads.kueue.x-k8s.io", "-n", namespace)["items"]
            for obj in stuck:
                kind = "pod" if obj["kind"] == "Pod" else "workloads.kueue.x-k8s.io"
                patch = json.dumps({"metadata": {"finalizers": None}})
                kueue.kubectl(
                    "patch",
                    kind,
                    obj["metadata"]["name"],
                    "-n",
                    namespace,
                    "--type=merge",
                    "-p",
                    patch,
                    check=False,
                )
            pytest.fail(
                f"namespace {namespace} was not deleted while Kueue ran (stuck: "
                f"{[o['metadata']['name'] for o in stuck]}); finalizers stripped\n{deleted.stderr}"
            )
        kubectl(kueue, "delete", "clusterqueue", cluster_queue, "--timeout=60s")


def rank_pods(
    namespace: str, queue: str, job: str, replicas: int, gpus: int, attempt: int = 0
) -> list[dict[str, Any]]:
    """Pods exactly as the operator builds them for a DDPJob labelled with the queue."""
    obj = ddpjob(namespace, job, queue, replicas, gpus)
    obj["metadata"]["uid"] = str(uuid.uuid4())
    spec = parse_job(obj)
    pods = [builders.build_rank_pod(spec, rank, attempt) for rank in range(replicas)]
    for pod in pods:
        # No DDPJob object exists here: the pods stand alone (the controller's own tests own the rest).
        del pod["metadata"]["ownerReferences"]
    return pods


def job_pods(kueue: KueueProcess, namespace: str, job: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(kueue, "pods", "-n", namespace, "-l", names.label_selector(job))[
        "items"
    ]
    return items


def gated(pod: dict[str, Any]) -> bool:
    return any(g["name"] == names.KUEUE_ADMISSION_GATE for g in pod["spec"].get("schedulingGates") or [])


def kueue_workload(kueue: KueueProcess, namespace: str, name: str) -> dict[str, Any] | None:
    result = kueue.kubectl(
        "get", "workloads.kueue.x-k8s.io", name, "-n", namespace, "-o", "json", check=False
    )
    return json.loads(result.stdout) if result.returncode == 0 else None


def condition(obj: dict[str, Any] | None, kind: str) -> bool:
    return any(
        c["type"] == kind and c["status"] == "True"
        for c in ((obj or {}).get("status") or {}).get("conditions", [])
    )


def left_pending(kueue: KueueProcess, namespace: str, group: str) -> bool:
    """Kueue has tried the group's Workload against the quota and said no: QuotaReserved is there and
    False (absent, Kueue has not looked yet). Nothing changes for the group until the quota does."""
    workload = kueue_workload(kueue, namespace, group)
    return any(
        c["type"] == "QuotaReserved" and c["status"] == "False"
        for c in ((workload or {}).get("status") or {}).get("conditions", [])
    )


def test_kueue_gates_a_pod_group_and_admits_it_as_one_workload(
    kueue: KueueProcess, queue: tuple[str, str]
) -> None:
    namespace, local_queue = queue
    pods = rank_pods(namespace, local_queue, "first", replicas=2, gpus=8)
    group = pods[0]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
    apply(kueue, *pods)

    # Kueue's webhook took the pods over: gate (or already lifted), finalizer, managed label.
    for pod in job_pods(kueue, namespace, "first"):
        assert pod["metadata"]["labels"].get(names.KUEUE_MANAGED_LABEL) == "true"
        assert names.KUEUE_POD_FINALIZER in pod["metadata"].get("finalizers", [])

    workload = wait_for(
        f"Kueue Workload {group} admitted",
        lambda: (w := kueue_workload(kueue, namespace, group)) and condition(w, "Admitted") and w,
        timeout=60,
    )
    (pod_set,) = workload["spec"]["podSets"]
    assert pod_set["count"] == 2, "one Workload for the whole gang"
    bound = wait_for(
        "both ranks ungated and bound",
        lambda: (
            (p := job_pods(kueue, namespace, "first"))
            and all(not gated(x) and x["spec"].get("nodeName") for x in p)
            and p
        ),
        timeout=60,
    )
    assert len(bound) == 2


def test_a_group_beyond_the_free_quota_waits_gated_until_quota_frees(
    kueue: KueueProcess, queue: tuple[str, str]
) -> None:
    namespace, local_queue = queue
    first = rank_pods(namespace, local_queue, "big", replicas=2, gpus=8)  # 16 GPUs: the whole quota
    apply(kueue, *first)
    wait_for(
        "the first gang bound",
        lambda: (
            (p := job_pods(kueue, namespace, "big"))
            and len(p) == 2
            and all(x["spec"].get("nodeName") for x in p)
        ),
        timeout=60,
    )
    second = rank_pods(namespace, local_queue, "waiting", replicas=2, gpus=8)
    second_group = second[0]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
    apply(kueue, *second)
    wait_for(
        f"Kueue Workload {second_group} pending",
        lambda: left_pending(kueue, namespace, second_group),
        timeout=30,
    )
    # Queued, not partially bound: Kueue's verdict is in, and every pod is still gated without a node.
    waiting = job_pods(kueue, namespace, "waiting")
    assert len(waiting) == 2
    assert all(gated(p) and not p["spec"].get("nodeName") for p in waiting), waiting
    workload = kueue_workload(kueue, namespace, second_group)
    assert workload is not None and not condition(workload, "Admitted")

    # The first gang finishes (kwok ends every container with exit code 0): quota frees, the second runs.
    for pod in first:
        kubectl(
            kueue, "annotate", "pod", pod["metadata"]["name"], "-n", namespace, "kwok.ddp.dev/exit-code=0"
        )
    wait_for(
        "the second gang admitted, ungated and bound",
        lambda: (
            (p := job_pods(kueue, namespace, "waiting"))
            and all(not gated(x) and x["spec"].get("nodeName") for x in p)
            and p
        ),
        timeout=90,
    )
    assert condition(kueue_workload(kueue, namespace, second_group), "Admitted")


def test_a_group_larger_than_the_quota_never_binds(kueue: KueueProcess, queue: tuple[str, str]) -> None:
    namespace, local_queue = queue
    pods = rank_pods(namespace, local_queue, "huge", replicas=3, gpus=8)  # 24 GPUs > 16
    group = pods[0]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
    apply(kueue, *pods)
    wait_for(f"Kueue Workload {group} pending", lambda: left_pending(kueue, namespace, group), timeout=30)
    huge = job_pods(kueue, namespace, "huge")
    assert len(huge) == 3 and all(gated(p) and not p["spec"].get("nodeName") for p in huge), huge


def test_pods_outside_managed_namespaces_never_meet_kueue(kueue: KueueProcess, local_cluster: Any) -> None:
    namespace = f"plain-{uuid.uuid4().hex[:6]}"
    kubectl(kueue, "create", "namespace", namespace)
    try:
        wait_for(
            f"serviceaccount default in {namespace}",
            lambda: (
                kueue.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode
                == 0
            ),
        )
        pods = rank_pods(namespace, "no-such-queue", "free", replicas=1, gpus=1)
        apply(kueue, *pods)
        (pod,) = job_pods(kueue, namespace, "free")
        assert not gated(pod) and names.KUEUE_POD_FINALIZER not in pod["metadata"].get("finalizers", [])
    finally:
        kubectl(kueue, "delete", "namespace", namespace, "--wait=false")


def test_harness_state_is_local(kueue: KueueProcess) -> None:
    """Everything the harness started listens on 127.0.0.1 (the brief of every harness here)."""
    config = Path(kueue.log).parent / "config.yaml"
    text = config.read_text()
    assert "127.0.0.1" in text and "0.0.0.0" not in text


# ---- the operator with Kueue --------------------------------------------------------------------------
# DDPJobs labelled with the LocalQueue, run by the operator: what a user sees (docs/scheduling.md).


@pytest.fixture
def operator(
    kueue: KueueProcess, queue: tuple[str, str], local_cluster: Any, tmp_path: Path
) -> Iterator[OperatorProcess]:
    namespace, _ = queue
    with serving(kueue, local_cluster, namespace, tmp_path) as process:
        yield process


@contextlib.contextmanager
def serving(
    kueue: KueueProcess, local_cluster: Any, namespace: str, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """The operator serving ``namespace``, the CRD installed first."""
    local_cluster.kubectl_run("apply", "--server-side", "-f", str(REPO / "crds"))
    local_cluster.wait_established("ddpjobs.ddp.dev")
    process = OperatorProcess(local_cluster.kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        yield process
    finally:
        # Jobs go while the operator and Kueue still run: the queue fixture then finds nothing held.
        kueue.kubectl("delete", "ddpjobs", "--all", "-n", namespace, "--wait=false", check=False)
        process.stop()
        print(f"--- operator log ---\n{process.log_tail(40)}", file=sys.stderr)


def ddpjob(
    namespace: str,
    name: str,
    local_queue: str,
    replicas: int,
    gpus: int,
    priority: str | None = None,
    startup_deadline: int | None = None,
    backoff_limit: int = 0,
    pod_spec: dict[str, Any] | None = None,
    restart_mode: str | None = None,
) -> dict[str, Any]:
    labels = {names.KUEUE_QUEUE_LABEL: local_queue}
    if priority is not None:
        labels[names.KUEUE_PRIORITY_CLASS_LABEL] = priority
    run_policy: dict[str, Any] = {"backoffLimit": backoff_limit}
    if startup_deadline is not None:
        run_policy["startupDeadlineSeconds"] = startup_deadline
    if restart_mode is not None:
        run_policy["restartMode"] = restart_mode
    return gpu_ddpjob(
        name,
        replicas,
        run_policy=run_policy,
        pod_spec=pod_spec,
        gpus=gpus,
        namespace=namespace,
        labels=labels,
    )


def job_status(kueue: KueueProcess, namespace: str, name: str) -> dict[str, Any]:
    result = kueue.kubectl("get", "ddpjob", name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        return {}
    status: dict[str, Any] = json.loads(result.stdout).get("status") or {}
    return status


def phase_is(kueue: KueueProcess, namespace: str, name: str, phase: str) -> bool:
    return job_status(kueue, namespace, name).get("phase") == phase


def true_condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next(
        (c for c in status.get("conditions", []) if c["type"] == kind and c["status"] == "True"), None
    )


def finish(kueue: KueueProcess, namespace: str, job: str) -> None:
    """Every live rank pod of the job exits 0 (kwok reports it)."""
    for pod in job_pods(kueue, namespace, job):
        if pod["metadata"].get("deletionTimestamp") or pod["status"].get("phase") != "Running":
            continue
        kubectl(
            kueue, "annotate", "pod", pod["metadata"]["name"], "-n", namespace, f"{EXIT_CODE_ANNOTATION}=0"
        )


def cluster_queue_of(kueue: KueueProcess, namespace: str, local_queue: str) -> str:
    return str(get_json(kueue, "localqueue", local_queue, "-n", namespace)["spec"]["clusterQueue"])


def test_the_operator_queues_a_third_gang_names_kueue_and_frees_quota_when_a_job_is_deleted(
    kueue: KueueProcess, queue: tuple[str, str], operator: OperatorProcess
) -> None:
    """16 GPUs of quota, three DDPJobs of 2 x 4 GPUs: two run; the third is Queued (status names the
    LocalQueue, the ClusterQueue and Kueue's reason) with every pod gated and none bound, longer than
    its startupDeadlineSeconds, which does not run while queued; deleting a running job releases its
    group (no pod stays behind on Kueue's finalizer) and the third is admitted and runs."""
    namespace, local_queue = queue
    cluster_queue = cluster_queue_of(kueue, namespace, local_queue)
    apply(
        kueue, ddpjob(namespace, "first", local_queue, 2, 4), ddpjob(namespace, "second", local_queue, 2, 4)
    )
    for job in ("first", "second"):
        wait_for(f"{job} Running", lambda job=job: phase_is(kueue, namespace, job, "Running"), timeout=90)

    startup_deadline = 15
    apply(kueue, ddpjob(namespace, "third", local_queue, 2, 4, startup_deadline=startup_deadline))
    status = wait_for(
        "third Queued, naming its ClusterQueue",
        lambda: (
            (s := job_status(kueue, namespace, "third")).get("phase") == "Queued"
            and f"ClusterQueue {cluster_queue}" in (true_condition(s, "Queued") or {}).get("message", "")
            and s
        ),
        timeout=60,
    )
    queued = true_condition(status, "Queued")
    assert queued is not None and queued["reason"] == "Queued"
    assert f"LocalQueue {local_queue}" in queued["message"], queued
    print(f"third: {queued['message']}")
    # Past its startup deadline (counted from its first pod, were queued time counted), the operator
    # decides on the job once more: a spec change it must answer with the new observedGeneration. That
    # decision keeps it Queued, not Failed, and nothing of it is bound.
    first_pod = min(
        datetime.fromisoformat(p["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
        for p in job_pods(kueue, namespace, "third")
    )
    due = first_pod + timedelta(seconds=startup_deadline + 1)
    wait_for("third's startup deadline past", lambda: datetime.now(UTC) > due, timeout=startup_deadline + 30)
    patched = json.loads(
        kubectl(
            kueue, "patch", "ddpjob", "third", "-n", namespace, "--type", "merge",
            "-p", json.dumps({"spec": {"runPolicy": {"backoffLimit": 1}}}), "-o", "json",
        ).stdout
    )  # fmt: skip
    generation = patched["metadata"]["generation"]
    status = wait_for(
        "the operator's decision on the changed spec",
        lambda: (s := job_status(kueue, namespace, "third")).get("observedGeneration") == generation and s,
        timeout=60,
    )
    assert status.get("phase") == "Queued", status
    pods = job_pods(kueue, namespace, "third")
    assert len(pods) == 2 and all(gated(p) and not p["spec"].get("nodeName") for p in pods), pods

    # The first job is deleted while running: its pods go (Kueue's finalizer is released with its
    # group's Workload), the quota frees and the third job is admitted.
    first_group = job_pods(kueue, namespace, "first")[0]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
    kubectl(kueue, "delete", "ddpjob", "first", "-n", namespace, "--wait=false")
    wait_for("the first job's pods gone", lambda: not job_pods(kueue, namespace, "first"), timeout=60)
    wait_for("its Kueue Workload gone", lambda: kueue_workload(kueue, namespace, first_group) is None)
    wait_for("third Running", lambda: phase_is(kueue, namespace, "third", "Running"), timeout=90)
    left_queue = next(c for c in job_status(kueue, namespace, "third")["conditions"] if c["type"] == "Queued")
    assert left_queue["status"] == "False"

    for job in ("second", "third"):
        finish(kueue, namespace, job)
    for job in ("second", "third"):
        wait_for(f"{job} Succeeded", lambda job=job: phase_is(kueue, namespace, job, "Succeeded"), timeout=90)


def test_a_gang_larger_than_the_quota_stays_queued_with_kuees_reason(
    kueue: KueueProcess, queue: tuple[str, str], operator: OperatorProcess
) -> None:
    namespace, local_queue = queue
    apply(kueue, ddpjob(namespace, "huge", local_queue, 3, 8))  # 24 GPUs > 16
    status = wait_for(
        "huge Queued with Kueue's reason",
        lambda: (
            (s := job_status(kueue, namespace, "huge")).get("phase") == "Queued"
            and "Workload" in (true_condition(s, "Queued") or {}).get("message", "")
            and "gated" in (true_condition(s, "Queued") or {}).get("message", "")
            and s
        ),
        timeout=60,
    )
    print(f"huge: {true_condition(status, 'Queued')}")
    pods = job_pods(kueue, namespace, "huge")
    group = pods[0]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
    wait_for(f"Kueue Workload {group} pending", lambda: left_pending(kueue, namespace, group), timeout=30)
    pods = job_pods(kueue, namespace, "huge")
    assert len(pods) == 3 and not any(p["spec"].get("nodeName") for p in pods), pods
    kubectl(kueue, "delete", "ddpjob", "huge", "-n", namespace, "--wait=false")
    wait_for("huge's gated pods gone", lambda: not job_pods(kueue, namespace, "huge"), timeout=60)


@pytest.fixture
def priorities(kueue: KueueProcess) -> Iterator[tuple[str, str]]:
    suffix = uuid.uuid4().hex[:6]
    low, high = f"low-{suffix}", f"high-{suffix}"
    apply(
        kueue,
        *(
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": n},
                "value": v,
            }
            for n, v in ((low, 100), (high, 1000))
        ),
    )
    yield low, high
    kueue.kubectl("delete", "workloadpriorityclass", low, high, "--wait=false", check=False)


def test_a_preempted_job_is_requeued_without_spending_backoff_and_finishes(
    kueue: KueueProcess, queue: tuple[str, str], operator: OperatorProcess, priorities: tuple[str, str]
) -> None:
    """A low-priority job holds the whole quota; a high-priority one arrives and Kueue preempts the
    low one. The low job restarts with reason Preempted without spending backoffLimit (0 here), waits
    Queued for its quota, and runs and succeeds once the high one is done."""
    namespace, local_queue = queue
    low, high = priorities
    apply(kueue, ddpjob(namespace, "low", local_queue, 2, 8, priority=low))
    wait_for("low Running", lambda: phase_is(kueue, namespace, "low", "Running"), timeout=90)

    apply(kueue, ddpjob(namespace, "high", local_queue, 2, 8, priority=high))
    status = wait_for(
        "low preempted",
        lambda: (s := job_status(kueue, namespace, "low")).get("preemptions") == 1 and s,
        timeout=90,
    )
    assert status.get("restarts", 0) == 0, "a preemption does not spend backoffLimit"
    events = get_json(
        kueue, "events", "-n", namespace, "--field-selector", "involvedObject.name=low,reason=Preempted"
    )["items"]
    assert events and "does not count against backoffLimit" in events[0]["message"], events
    wait_for("high Running", lambda: phase_is(kueue, namespace, "high", "Running"), timeout=90)
    wait_for("low Queued for attempt 1", lambda: phase_is(kueue, namespace, "low", "Queued"), timeout=60)
    assert job_status(kueue, namespace, "low")["attempt"] == 1

    finish(kueue, namespace, "high")
    wait_for("high Succeeded", lambda: phase_is(kueue, namespace, "high", "Succeeded"), timeout=90)
    wait_for(
        "low admitted again and Running", lambda: phase_is(kueue, namespace, "low", "Running"), timeout=90
    )
    finish(kueue, namespace, "low")
    wait_for("low Succeeded", lambda: phase_is(kueue, namespace, "low", "Succeeded"), timeout=90)
    final = job_status(kueue, namespace, "low")
    assert (final.get("restarts", 0), final.get("preemptions")) == (0, 1)


# Pods that give up quickly on a lost node: evicted 2 s after it turns unreachable, 2 s of grace.
QUICK_EVICTION: dict[str, Any] = {
    "terminationGracePeriodSeconds": 2,
    "tolerations": [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 2}
        for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ],
}


def test_a_pod_stuck_on_a_lost_node_does_not_make_kueue_delete_the_next_attempt(
    kueue: KueueProcess, queue: tuple[str, str], local_cluster: Any, tmp_path: Path
) -> None:
    """A rank's node is lost: its pod is evicted but stays Terminating (no kubelet confirms), with
    Kueue's finalizer, and Kueue counts it in the group: the next attempt's pods would be "excess" and
    deleted. The operator drops the finalizer and force-deletes the pod once its deletion is overdue,
    so attempt 1 joins the group that still holds the quota, is ungated and runs."""
    local_cluster.kubectl_run("apply", "--server-side", "-f", str(REPO / "crds"))
    namespace, local_queue = queue
    operator = OperatorProcess(
        local_cluster.kubeconfig, [namespace], tmp_path / "operator.log", ["--unconfirmed-deletion", "3"]
    ).start()
    node = ""
    try:
        # The next attempt (whole gang): the in-place replacement is the next test's.
        lost = ddpjob(
            namespace,
            "lost",
            local_queue,
            2,
            8,
            backoff_limit=1,
            pod_spec=QUICK_EVICTION,
            restart_mode="Recreate",
        )
        apply(kueue, lost)
        wait_for("lost Running", lambda: phase_is(kueue, namespace, "lost", "Running"), timeout=90)
        victim = next(p for p in job_pods(kueue, namespace, "lost") if p["metadata"]["name"] == "lost-1-0")
        node = victim["spec"]["nodeName"]
        local_cluster.lose_node(node)
        wait_for(
            "attempt 1 Running",
            lambda: (
                (s := job_status(kueue, namespace, "lost")).get("attempt") == 1
                and s.get("phase") == "Running"
            ),
            timeout=120,
        )
        pods = job_pods(kueue, namespace, "lost")
        names_left = sorted(p["metadata"]["name"] for p in pods)
        assert names_left == ["lost-0-1", "lost-1-1"], f"the stuck pod was force-deleted: {names_left}"
        assert all(p["spec"]["nodeName"] != node for p in pods)
        excess = get_json(kueue, "events", "-n", namespace, "--field-selector", "reason=ExcessPodDeleted")[
            "items"
        ]
        assert not excess, [e["message"] for e in excess]
        status = job_status(kueue, namespace, "lost")
        assert status["restarts"] == 1 and "preemptions" not in status
        assert "action=force-delete pods=lost-1-0" in operator.log_path.read_text()
        finish(kueue, namespace, "lost")
        wait_for("lost Succeeded", lambda: phase_is(kueue, namespace, "lost", "Succeeded"), timeout=90)
    finally:
        if node:
            local_cluster.restore_node(node)
        kueue.kubectl("delete", "ddpjobs", "--all", "-n", namespace, "--wait=false", check=False)
        operator.stop()
        print(f"--- operator log ---\n{operator.log_tail(40)}", file=sys.stderr)


def suspend(kueue: KueueProcess, namespace: str, job: str, value: bool) -> None:
    patch = json.dumps({"spec": {"runPolicy": {"suspend": value}}})
    kubectl(kueue, "patch", "ddpjob", job, "-n", namespace, "--type=merge", "-p", patch)


def test_a_suspended_job_gives_its_quota_back_and_queues_again_when_resumed(
    kueue: KueueProcess, queue: tuple[str, str], operator: OperatorProcess
) -> None:
    namespace, local_queue = queue
    apply(kueue, ddpjob(namespace, "holder", local_queue, 2, 8))  # the whole 16-GPU quota
    wait_for("holder Running", lambda: phase_is(kueue, namespace, "holder", "Running"), timeout=90)
    apply(kueue, ddpjob(namespace, "waiter", local_queue, 2, 8))
    wait_for("waiter Queued", lambda: phase_is(kueue, namespace, "waiter", "Queued"), timeout=60)

    suspend(kueue, namespace, "holder", True)
    wait_for("holder Suspended", lambda: phase_is(kueue, namespace, "holder", "Suspended"), timeout=60)
    wait_for(
        "waiter admitted and Running", lambda: phase_is(kueue, namespace, "waiter", "Running"), timeout=90
    )
    wait_for("holder's pods gone", lambda: not job_pods(kueue, namespace, "holder"), timeout=60)

    suspend(kueue, namespace, "holder", False)
    wait_for("holder Queued again", lambda: phase_is(kueue, namespace, "holder", "Queued"), timeout=60)
    assert job_status(kueue, namespace, "holder")["attempt"] == 1
    finish(kueue, namespace, "waiter")
    wait_for("holder Running again", lambda: phase_is(kueue, namespace, "holder", "Running"), timeout=90)
    assert job_status(kueue, namespace, "holder").get("restarts", 0) == 0


def test_a_lost_pod_of_an_admitted_group_is_replaced_alone_inside_the_group(
    kueue: KueueProcess, queue: tuple[str, str], operator: OperatorProcess
) -> None:
    """restartMode InPlace under Kueue (docs/scheduling.md): rank 1's pod of an admitted 2 x 4-GPU group
    is deleted; the operator creates one replacement with the group's labels, and Kueue admits it into
    the same group (same Kueue Workload, not requeued) instead of holding it gated; the survivor keeps
    its pod and the job finishes."""
    namespace, local_queue = queue
    apply(kueue, ddpjob(namespace, "mend", local_queue, 2, 4, backoff_limit=2))
    wait_for("mend Running", lambda: phase_is(kueue, namespace, "mend", "Running"), timeout=90)
    before = {p["metadata"]["name"]: p for p in job_pods(kueue, namespace, "mend")}
    group = before["mend-0-0"]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
    workload_uid = (kueue_workload(kueue, namespace, group) or {}).get("metadata", {}).get("uid")
    assert workload_uid, "the admitted group has a Kueue Workload"
    kubectl(kueue, "delete", "pod", "mend-1-0", "-n", namespace, "--wait=false")

    def replacement_runs() -> dict[str, Any] | None:
        pods = {p["metadata"]["name"]: p for p in job_pods(kueue, namespace, "mend")}
        new = pods.get("mend-1-0r1")
        running = new is not None and new["status"].get("phase") == "Running" and not gated(new)
        return new if running else None

    new = wait_for("the replacement admitted and Running", replacement_runs, timeout=90)
    assert new["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL] == group
    survivor = next(p for p in job_pods(kueue, namespace, "mend") if p["metadata"]["name"] == "mend-0-0")
    assert survivor["metadata"]["uid"] == before["mend-0-0"]["metadata"]["uid"]
    assert (kueue_workload(kueue, namespace, group) or {}).get("metadata", {}).get("uid") == workload_uid
    status = job_status(kueue, namespace, "mend")
    assert (status["phase"], status["attempt"], status["restarts"]) == ("Running", 0, 1), status
    finish(kueue, namespace, "mend")
    wait_for("mend Succeeded", lambda: phase_is(kueue, namespace, "mend", "Succeeded"), timeout=90)


def elastic(job: dict[str, Any], minimum: int) -> dict[str, Any]:
    """``job`` as an elastic job of ``minimum`` to its replicas pods (docs/elastic.md)."""
    maximum = job["spec"].pop("replicas")
    job["spec"]["elastic"] = {"minReplicas": minimum, "maxReplicas": maximum, "replacementWaitSeconds": 5}
    job["spec"]["runPolicy"]["restartMode"] = "InPlace"
    return job


def test_kueue_admits_an_elastic_group_whole_at_max_replicas(
    kueue: KueueProcess, queue: tuple[str, str], operator: OperatorProcess
) -> None:
    """What Kueue v0.17 admits of an elastic job (docs/elastic.md): its pods form one plain-pod group of
    maxReplicas (the pod-group total count), admitted whole or not at all. A job of 2..5 x 4 GPUs
    stays Queued on a 16-GPU queue although its minimum (8) would fit; one of 2..3 x 4 GPUs is admitted
    as a group of 3 and runs; a pod lost from it is replaced inside the admitted group."""
    namespace, local_queue = queue
    apply(kueue, elastic(ddpjob(namespace, "wide", local_queue, 5, 4, backoff_limit=2), 2))
    wait_for("wide Queued", lambda: phase_is(kueue, namespace, "wide", "Queued"), timeout=60)
    pods = job_pods(kueue, namespace, "wide")
    assert len(pods) == 5 and all(gated(p) for p in pods), "all 5 pods are created, gated"
    counts = {p["metadata"]["annotations"].get(names.KUEUE_POD_GROUP_TOTAL_COUNT_ANNOTATION) for p in pods}
    assert counts == {"5"}, counts
    group = pods[0]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
    wait_for(f"Kueue Workload {group} pending", lambda: left_pending(kueue, namespace, group), timeout=30)
    assert not any(p["spec"].get("nodeName") for p in job_pods(kueue, namespace, "wide")), (
        "Kueue admits no part of a group: its minimum alone never runs"
    )
    kubectl(kueue, "delete", "ddpjob", "wide", "-n", namespace, "--wait=false")
    wait_for("wide's gated pods gone", lambda: not job_pods(kueue, namespace, "wide"), timeout=60)

    apply(kueue, elastic(ddpjob(namespace, "fits", local_queue, 3, 4, backoff_limit=2), 2))
    wait_for("fits Running", lambda: phase_is(kueue, namespace, "fits", "Running"), timeout=90)
    group = job_pods(kueue, namespace, "fits")[0]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
    kubectl(kueue, "delete", "pod", "fits-2-0", "-n", namespace, "--wait=false")

    def replacement_runs() -> dict[str, Any] | None:
        new = {p["metadata"]["name"]: p for p in job_pods(kueue, namespace, "fits")}.get("fits-2-0r1")
        return new if new is not None and new["status"].get("phase") == "Running" and not gated(new) else None

    new = wait_for("the replacement admitted into the group", replacement_runs, timeout=90)
    assert new["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL] == group
    status = job_status(kueue, namespace, "fits")
    assert (status["phase"], status["attempt"], status["elastic"]["maxReplicas"]) == ("Running", 0, 3), status
    finish(kueue, namespace, "fits")
    wait_for("fits Succeeded", lambda: phase_is(kueue, namespace, "fits", "Succeeded"), timeout=90)


# ---- topology-aware scheduling (docs/scheduling.md#topology) ----------------------------------------


@pytest.fixture
def tas_queue(kueue: KueueProcess, local_cluster: Any) -> Iterator[tuple[str, str, Pool]]:
    """(namespace, LocalQueue, pool): a 16-GPU ClusterQueue over a ResourceFlavor with a Topology of
    block, rack and host, whose nodes are a pool of 2 blocks x 2 racks x 2 hosts x 2 GPUs (so a rack
    holds 4 GPUs and a block 8)."""
    with node_pool(local_cluster) as pool:
        topology_name = f"{pool.name}-topology"
        flavor = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": f"{pool.name}-flavor"},
            "spec": {"nodeLabels": {POOL_LABEL: pool.name}, "topologyName": topology_name},
        }
        topology_object = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "Topology",
            "metadata": {"name": topology_name},
            "spec": {
                "levels": [{"nodeLabel": BLOCK_LABEL}, {"nodeLabel": RACK_LABEL}, {"nodeLabel": HOST_LABEL}]
            },
        }
        try:
            with managed_queue(kueue, flavor, topology_object) as (namespace, local_queue):
                yield namespace, local_queue, pool
        finally:
            kueue.kubectl(
                "delete", "resourceflavor", flavor["metadata"]["name"], "--timeout=60s", check=False
            )
            kueue.kubectl("delete", "topology", topology_name, "--timeout=60s", check=False)


@pytest.fixture
def tas_operator(
    kueue: KueueProcess, tas_queue: tuple[str, str, Pool], local_cluster: Any, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """The operator serving the TAS queue's namespace."""
    namespace, _, _ = tas_queue
    with serving(kueue, local_cluster, namespace, tmp_path) as process:
        yield process


def topology_job(
    namespace: str, local_queue: str, pool: Pool, name: str, replicas: int, topology: dict[str, str]
) -> dict[str, Any]:
    job = ddpjob(namespace, name, local_queue, replicas, 1, pod_spec=pool.pod_spec())
    job["spec"]["scheduling"] = {"topology": topology}
    return job


def placed(kueue: KueueProcess, namespace: str, job: str, pool: Pool, key: str) -> dict[int, str]:
    return pool.placed(job_pods(kueue, namespace, job), key)


def runs_of(values: dict[int, str]) -> list[str]:
    """The values in rank order with consecutive repeats folded: [a, a, b] -> [a, b]."""
    ordered = [values[rank] for rank in sorted(values)]
    return [v for i, v in enumerate(ordered) if i == 0 or ordered[i - 1] != v]


def test_kueue_places_a_required_rack_whole_with_ranks_in_host_order_and_queues_a_gang_no_rack_fits(
    kueue: KueueProcess, tas_queue: tuple[str, str, Pool], tas_operator: OperatorProcess
) -> None:
    """`topology.required: <rack>` on a queued job is Kueue's topology-aware scheduling: 4 ranks of 1 GPU
    land in one rack (4 GPUs), two ranks per host with consecutive ranks sharing a host (our rank is
    the group's pod index); status.topology names the rack, 0 ring crossings. A 6-rank job fits no rack:
    it stays Queued with Kueue's reason in its condition and none of its pods bound."""
    namespace, local_queue, pool = tas_queue
    apply(kueue, topology_job(namespace, local_queue, pool, "near", 4, {"required": RACK_LABEL}))
    wait_for("near Running", lambda: phase_is(kueue, namespace, "near", "Running"), timeout=120)
    racks = placed(kueue, namespace, "near", pool, RACK_LABEL)
    hosts = placed(kueue, namespace, "near", pool, HOST_LABEL)
    assert len(racks) == 4 and len(set(racks.values())) == 1, racks
    # Two hosts of 2 GPUs, each holding two consecutive ranks.
    assert len(runs_of(hosts)) == 2 and len(set(hosts.values())) == 2, hosts
    shown = wait_for(
        "status.topology", lambda: job_status(kueue, namespace, "near").get("topology"), timeout=30
    )
    assert shown == {
        "key": RACK_LABEL,
        "path": "Kueue",
        "domains": [{"name": racks[0], "ranks": "0-3"}],
        "ringCrossings": 0,
    }, shown
    # The rendezvous order (the operator's keys) keeps each host's ranks together too.
    ranks_by_order(job_pods(kueue, namespace, "near"), {n: pool.label_of(n, HOST_LABEL) for n in pool.nodes})

    apply(kueue, topology_job(namespace, local_queue, pool, "wide", 6, {"required": RACK_LABEL}))
    status = wait_for(
        "wide Queued with Kueue's topology reason",
        lambda: (
            (s := job_status(kueue, namespace, "wide")).get("phase") == "Queued"
            and "topology" in (true_condition(s, "Queued") or {}).get("message", "")
            and s
        ),
        timeout=60,
    )
    print(f"wide: {true_condition(status, 'Queued')}")
    assert not any(p["spec"].get("nodeName") for p in job_pods(kueue, namespace, "wide"))
    finish(kueue, namespace, "near")
    wait_for("near Succeeded", lambda: phase_is(kueue, namespace, "near", "Succeeded"), timeout=90)


def test_kueue_spreads_a_preferred_rack_only_as_far_as_it_must_in_rank_order(
    kueue: KueueProcess, tas_queue: tuple[str, str, Pool], tas_operator: OperatorProcess
) -> None:
    """`topology.preferred: <rack>` with 6 ranks of 1 GPU (a rack holds 4): Kueue keeps them in one block
    over two racks, each rack holding consecutive ranks, so the ring crosses between racks twice and no
    more; status.topology says so."""
    namespace, local_queue, pool = tas_queue
    apply(kueue, topology_job(namespace, local_queue, pool, "spread", 6, {"preferred": RACK_LABEL}))
    wait_for("spread Running", lambda: phase_is(kueue, namespace, "spread", "Running"), timeout=120)
    racks = placed(kueue, namespace, "spread", pool, RACK_LABEL)
    blocks = placed(kueue, namespace, "spread", pool, BLOCK_LABEL)
    assert len(racks) == 6 and len(set(blocks.values())) == 1, (racks, blocks)
    assert len(set(racks.values())) == 2 and len(runs_of(racks)) == 2, racks
    shown = wait_for(
        "status.topology", lambda: job_status(kueue, namespace, "spread").get("topology"), timeout=30
    )
    assert shown["ringCrossings"] == 2 and shown["path"] == "Kueue", shown
    assert {d["name"] for d in shown["domains"]} == set(racks.values()), shown
    by_rank = ranks_by_order(
        job_pods(kueue, namespace, "spread"), {n: pool.label_of(n, RACK_LABEL) for n in pool.nodes}
    )
    listed = {rank: d["name"] for d in shown["domains"] for rank in ranks_of(d["ranks"])}
    assert listed == dict(enumerate(by_rank)), (shown, by_rank)
    finish(kueue, namespace, "spread")
    wait_for("spread Succeeded", lambda: phase_is(kueue, namespace, "spread", "Succeeded"), timeout=90)


def test_a_required_topology_nothing_here_can_place_fails_naming_the_field_and_the_ways_out(
    kueue: KueueProcess, queue: tuple[str, str], operator: OperatorProcess
) -> None:
    """This control plane serves no in-tree gang API and the job names no queue: a required topology
    cannot be honoured by anything, so the job fails InvalidSpec at once with no pod created."""
    namespace, _ = queue
    job = gpu_ddpjob(
        "nowhere", 2, gpus=1, namespace=namespace, scheduling={"topology": {"required": RACK_LABEL}}
    )
    apply(kueue, job)
    status = wait_for(
        "nowhere Failed",
        lambda: (s := job_status(kueue, namespace, "nowhere")).get("phase") == "Failed" and s,
    )
    failed = true_condition(status, "Failed")
    assert failed is not None and failed["reason"] == "InvalidSpec", status
    for part in ("spec.scheduling.topology.required", "in-tree gang API", names.KUEUE_QUEUE_LABEL):
        assert part in failed["message"], failed
    assert job_pods(kueue, namespace, "nowhere") == []
