"""The in-tree gang API of Kubernetes 1.36 against a real control plane started with its alpha gates:
discovery picks the version gang.py writes, the apiserver accepts gang.py's Workload and PodGroup as
they are, and the scheduler binds a gang whole or not at all.

This module starts a second local control plane of its own, with the flags docs/scheduling.md lists
appended to the apiserver's, scheduler's and controller-manager's command lines
(ddp_harness.GANG_SCHEDULING_FLAGS through ClusterOptions.extra_flags)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.kueue_harness import MANAGED_NAMESPACE_LABEL, ensure_built, start_kueue
from tests.integration.operator_harness import REPO, OperatorProcess, ddpjob, wait_for
from tests.integration.topology_nodes import (
    HOST_LABEL,
    ORDER_ANNOTATION,
    RACK_LABEL,
    Pool,
    node_pool,
    ranks_by_order,
)

from ddp_harness import (
    EXIT_CODE_ANNOTATION,
    GANG_SCHEDULING_FLAGS,
    ClusterOptions,
    LocalCluster,
    default_bin_dir,
    down,
    up,
)
from ddp_harness.binaries import pinned_versions, stale_binaries
from ddp_operator import builders, gang, names
from ddp_operator.spec import parse_job

pytestmark = pytest.mark.integration

GPU = names.GPU_RESOURCE


@pytest.fixture(scope="module")
def gated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if shutil.which("openssl") is None:
        pytest.skip("the local control plane needs the `openssl` command for its certificates")
    bin_dir = default_bin_dir()
    if stale_binaries(bin_dir, pinned_versions()) and shutil.which("go") is None:
        pytest.skip(f"no Go toolchain to build the control plane, and {bin_dir} lacks prebuilt binaries")
    state_dir = tmp_path_factory.mktemp("gated-cluster")
    cluster = up(
        ClusterOptions(state_dir=state_dir, bin_dir=bin_dir, nodes=4, extra_flags=GANG_SCHEDULING_FLAGS)
    )
    try:
        yield cluster
    finally:
        down(state_dir, keep_state=True)
        shutil.rmtree(cluster.layout.etcd_data_dir, ignore_errors=True)


def group_versions(cluster: LocalCluster) -> list[str]:
    apis = json.loads(cluster.kubectl_run("get", "--raw", "/apis").stdout)
    return [v["groupVersion"] for g in apis["groups"] for v in g["versions"]]


def test_discovery_serves_v1alpha2(gated_cluster: LocalCluster) -> None:
    assert gang.served_version(group_versions(gated_cluster)) == "v1alpha2"
    resources = gated_cluster.kubectl_run("api-resources", "--api-group=scheduling.k8s.io").stdout
    assert "workloads" in resources and "podgroups" in resources, resources


def _job(namespace: str, name: str, replicas: int, gpus: int) -> dict[str, Any]:
    job = ddpjob(name, replicas, gpus=gpus, namespace=namespace, scheduling={"gang": "Workload"})
    job["metadata"]["uid"] = str(uuid.uuid4())
    return job


def _create_gang(cluster: LocalCluster, namespace: str, name: str, replicas: int, gpus: int) -> None:
    """What phase 2's controller will do for attempt 0: Workload, PodGroup, then the pods (standalone
    here: no DDPJob object exists, so the owner references are dropped)."""
    spec = parse_job(_job(namespace, name, replicas, gpus))
    objects = gang.gang_objects(spec, 0, gang.served_version(group_versions(cluster)))
    assert objects is not None
    children = [objects.workload, objects.pod_group] + [
        builders.build_rank_pod(spec, rank, 0, pod_spec_patch=objects.pod_spec_patch)
        for rank in range(replicas)
    ]
    for child in children:
        del child["metadata"]["ownerReferences"]
    cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": children[:2]})
    cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": children[2:]})


def _bound(cluster: LocalCluster, namespace: str, job: str) -> list[str]:
    pods = cluster.get_json("pods", "-n", namespace, "-l", names.label_selector(job))["items"]
    return [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")]


def test_the_apiserver_accepts_the_adapters_objects_and_the_scheduler_binds_the_gang(
    gated_cluster: LocalCluster,
) -> None:
    namespace = f"gang-{uuid.uuid4().hex[:6]}"
    gated_cluster.create_namespace(namespace)
    _create_gang(gated_cluster, namespace, "fits", replicas=3, gpus=8)
    pod = gated_cluster.get_json("pod", "fits-0-0", "-n", namespace)
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "fits-0"}, "the apiserver kept the field"
    wait_for("all 3 ranks bound", lambda: len(_bound(gated_cluster, namespace, "fits")) == 3, timeout=60)
    pod_group = gated_cluster.get_json("podgroups.scheduling.k8s.io", "fits-0", "-n", namespace)
    assert pod_group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 3}}

    # 4 nodes x 8 GPUs: 3 are taken, so a second gang of 3 x 8 cannot be placed: once the scheduler
    # has tried its PodGroup and said so, none of it is bound.
    _create_gang(gated_cluster, namespace, "waits", replicas=3, gpus=8)

    def verdict() -> tuple[bool | None, str]:
        return gang.pod_group_scheduled(
            gated_cluster.get_json("podgroups.scheduling.k8s.io", "waits-0", "-n", namespace)
        )

    placed, message = wait_for(
        "the scheduler's verdict on waits-0", lambda: (v := verdict())[0] is not None and v
    )
    print(f"PodGroup waits-0: scheduled={placed} {message}")
    assert placed is False
    assert _bound(gated_cluster, namespace, "waits") == [], "a gang binds whole or not at all"

    # The first gang goes: the second is placed whole.
    gated_cluster.kubectl_run(
        "delete", "pods", "-n", namespace, "-l", names.label_selector("fits"), "--wait=false"
    )
    wait_for(
        "the second gang bound whole", lambda: len(_bound(gated_cluster, namespace, "waits")) == 3, timeout=90
    )
    gated_cluster.kubectl_run("delete", "namespace", namespace, "--wait=false")


# ---- the operator asks for the gang: the deadlock and its absence ---------------------------------


def _operator_job(name: str, gang_mode: str, priority_class: str | None = None) -> dict[str, Any]:
    job = _job("", name, replicas=3, gpus=8)
    job["metadata"].pop("namespace", None)
    job["spec"]["scheduling"] = {"gang": gang_mode}
    if priority_class is not None:
        job["spec"]["template"]["spec"]["priorityClassName"] = priority_class
    return job


def _priority_class(name: str, preemption_policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name},
        "value": 1000,
        "preemptionPolicy": preemption_policy,
        "description": "test_gang_api: training jobs, above the default priority 0 of the batch pods",
    }


def _batch_pod(name: str) -> dict[str, Any]:
    """Someone else's preemptible work holding a node's 8 GPUs: a plain pod of the default priority 0,
    which nothing recreates once it is preempted."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "batch"}},
        "spec": {
            "containers": [{"name": "work", "image": "batch:test", "resources": {"limits": {GPU: "8"}}}],
        },
    }


def _pods(cluster: LocalCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]
    return items


def _pods_on_nodes(cluster: LocalCluster) -> list[str]:
    """Pods of any namespace that hold a node's resources (bound, not finished)."""
    pods = cluster.get_json("pods", "-A", "--field-selector", "status.phase!=Succeeded,status.phase!=Failed")
    return [p["metadata"]["name"] for p in pods["items"] if p["spec"].get("nodeName")]


def _unschedulable(pod: dict[str, Any]) -> bool:
    """The scheduler tried the pod and found no node for it."""
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
        for c in pod.get("status", {}).get("conditions") or []
    )


def _condition_false(obj: dict[str, Any], kind: str) -> bool:
    """The object's controller has written its verdict: the condition is there, and False."""
    return any(
        c.get("type") == kind and c.get("status") == "False"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def _status(cluster: LocalCluster, namespace: str, job: str) -> dict[str, Any]:
    status: dict[str, Any] = cluster.get_json("ddpjob", job, "-n", namespace).get("status") or {}
    return status


def _finish(cluster: LocalCluster, namespace: str, job: str) -> None:
    """Every bound rank of the job exits 0 (kwok's exit-code stage): its nodes are free again."""
    pods = _bound(cluster, namespace, job)
    assert pods, f"{job} has no bound pod to finish"
    cluster.kubectl_run("annotate", "pod", *pods, "-n", namespace, f"{EXIT_CODE_ANNOTATION}=0")


def _refused_by_the_scheduler(cluster: LocalCluster, namespace: str, job: str, gang_mode: str) -> bool:
    """The scheduler has tried the job's waiting pods (gang None) or its PodGroup (Workload) and said no."""
    pods = _pods(cluster, namespace, names.label_selector(job))
    if len(pods) != 3:
        return False
    if gang_mode == "None":
        return all(_unschedulable(p) for p in pods if not p["spec"].get("nodeName"))
    pod_group = cluster.get_json("podgroups.scheduling.k8s.io", f"{job}-0", "-n", namespace)
    return gang.pod_group_scheduled(pod_group)[0] is False


@pytest.mark.parametrize("gang_mode", ["None", "Workload"])
def test_two_jobs_that_each_fit_deadlock_pod_by_pod_and_run_one_after_the_other_as_gangs(
    gated_cluster: LocalCluster, tmp_path: Path, gang_mode: str
) -> None:
    """4 nodes x 8 GPUs, two DDPJobs of 3 x 8 GPUs, `first` and `second`, each of which fits alone, on
    a busy cluster: 2 nodes hold preemptible batch pods (plain pods, priority 0). Both jobs have
    priority 1000; `first`'s class never preempts, `second`'s may.

    Pod by pod (gang None): `first` binds the 2 free nodes and its third rank waits; `second` preempts
    the 2 batch pods for 2 of its ranks and its third rank waits: each job holds 16 of the 24 GPUs it
    needs, every node is taken, neither job can ever run. With `gang: Workload`: `first`'s gang does
    not fit in 2 nodes and binds nothing; `second`'s gang preempts one batch pod and binds whole (3
    nodes) and runs while `first` still binds nothing; once `second` is done, `first` binds whole and
    runs. The test asserts that one gang binds whole and the other nothing, not which one.

    Why it is deterministic, with nothing paused and no order imposed on the scheduler: each step waits
    for a state the scheduler reached on its own and cannot leave until a node frees up, and the one
    contest, which waiting pod gets a node a batch pod leaves, is settled by the scheduler's rules, not
    by timing: the preemptor is nominated to the node before its victim is deleted, and a pending pod
    of no higher priority (`first`'s waiting rank) is never placed on a node nominated for another.
    Letting the batch pods finish instead would race, whatever the priorities: seen once, the waiting
    rank of a priority-100 first job took the first freed node ahead of a priority-1000 second job's
    ranks, and the first job ran.
    """
    gated_cluster.kubectl_run("apply", "--server-side", "-f", str(REPO / "crds"))
    gated_cluster.wait_established("ddpjobs.ddp.dev")
    suffix = uuid.uuid4().hex[:6]
    namespace = f"gang-op-{suffix}"
    waits, preempts = f"gang-test-waits-{suffix}", f"gang-test-preempts-{suffix}"
    gated_cluster.apply_json(
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": [_priority_class(waits, "Never"), _priority_class(preempts, "PreemptLowerPriority")],
        }
    )
    gated_cluster.create_namespace(namespace)
    operator = OperatorProcess(gated_cluster.kubeconfig, [namespace], tmp_path / "operator.log").start()
    passed = False

    def bound() -> dict[str, int]:
        return {job: len(_bound(gated_cluster, namespace, job)) for job in ("first", "second")}

    def batch_bound() -> int:
        return sum(1 for p in _pods(gated_cluster, namespace, "app=batch") if p["spec"].get("nodeName"))

    try:
        # An idle cluster first (earlier tests' namespaces may still be going), then a busy one.
        wait_for("no pod on any node", lambda: not _pods_on_nodes(gated_cluster), timeout=120)
        gated_cluster.apply_json(
            {"apiVersion": "v1", "kind": "List", "items": [_batch_pod("batch-0"), _batch_pod("batch-1")]},
            "-n",
            namespace,
        )
        wait_for("the 2 batch pods bound", lambda: batch_bound() == 2, timeout=60)

        gated_cluster.apply_json(_operator_job("first", gang_mode, waits), "-n", namespace)
        wait_for(
            "the scheduler to refuse first's waiting pods",
            lambda: _refused_by_the_scheduler(gated_cluster, namespace, "first", gang_mode),
            timeout=90,
        )
        assert bound()["first"] == (2 if gang_mode == "None" else 0), bound()

        gated_cluster.apply_json(_operator_job("second", gang_mode, preempts), "-n", namespace)

        if gang_mode == "None":

            def every_node_taken() -> dict[str, int] | None:
                counts = bound()
                return counts if sum(counts.values()) == 4 else None

            counts = wait_for("second's ranks on the batch pods' nodes", every_node_taken, timeout=90)
            print(f"pod by pod: bound ranks {counts}, batch pods bound {batch_bound()}")
            assert counts == {"first": 2, "second": 2}, f"a job got all its ranks: no deadlock: {counts}"
            # What the operator saw: 2 of 3 ranks ready in each job, and no job Running.
            wait_for(
                "both jobs to report 2 ready ranks",
                lambda: all(
                    _status(gated_cluster, namespace, j).get("readyReplicas") == 2
                    for j in ("first", "second")
                ),
                timeout=60,
            )
            # The scheduler has tried each job's waiting rank with every node taken and found no node,
            # not even by preemption (no node nominated): nothing can move until a node frees up.
            wait_for(
                "the scheduler to refuse both jobs' waiting ranks, none nominated",
                lambda: all(
                    _unschedulable(p) and not p.get("status", {}).get("nominatedNodeName")
                    for job in ("first", "second")
                    for p in _pods(gated_cluster, namespace, names.label_selector(job))
                    if not p["spec"].get("nodeName")
                ),
                timeout=60,
            )
            counts = bound()
            assert counts == {"first": 2, "second": 2}, f"the deadlock holds: {counts}"
            for job in ("first", "second"):
                phase = _status(gated_cluster, namespace, job).get("phase")
                assert phase != "Running", f"{job} is {phase} with {counts[job]} of 3 ranks bound"
            print("deadlock: both jobs hold GPUs, neither runs")
            passed = True
            return

        # As gangs: exactly one job binds all of its pods, the other none.
        def one_gang_whole() -> str | None:
            counts = bound()
            assert sorted(counts.values()) in ([0, 0], [0, 1], [0, 2], [0, 3]), (
                f"a gang binds whole or not at all: {counts}"
            )
            return next((job for job, n in counts.items() if n == 3), None)

        winner = wait_for("one gang bound whole", one_gang_whole, timeout=90)
        loser = "second" if winner == "first" else "first"
        print(f"as gangs: {winner} bound whole first, {loser} waits; batch pods bound {batch_bound()}")
        wait_for(
            f"{winner} Running",
            lambda: _status(gated_cluster, namespace, winner).get("phase") == "Running",
            timeout=60,
        )
        assert bound()[loser] == 0, bound()

        _finish(gated_cluster, namespace, winner)
        wait_for(f"{loser} bound whole", lambda: bound()[loser] == 3, timeout=90)
        wait_for(
            f"{loser} Running",
            lambda: _status(gated_cluster, namespace, loser).get("phase") == "Running",
            timeout=60,
        )
        passed = True
    finally:
        operator.stop()
        if not passed:
            print(operator.log_tail(30))
        gated_cluster.kubectl_run("delete", "namespace", namespace, "--wait=false")
        gated_cluster.kubectl_run("delete", "priorityclass", waits, preempts, "--ignore-not-found")


def test_one_new_member_of_a_scheduled_pod_group_is_placed_alone(
    gated_cluster: LocalCluster, tmp_path: Path
) -> None:
    """restartMode InPlace with `gang: Workload` (docs/scheduling.md): rank 1's pod of a gang the scheduler
    placed whole is deleted; its replacement names the same PodGroup, which the scheduler already
    scheduled and never returns to not-scheduled. What the 1.36 scheduler does with that one new member:
    it places it alone (the gang's minimum was met once), and the job keeps its other pods."""
    gated_cluster.kubectl_run("apply", "--server-side", "-f", str(REPO / "crds"))
    gated_cluster.wait_established("ddpjobs.ddp.dev")
    namespace = f"gang-mend-{uuid.uuid4().hex[:6]}"
    gated_cluster.create_namespace(namespace)
    operator = OperatorProcess(gated_cluster.kubeconfig, [namespace], tmp_path / "operator.log").start()
    passed = False
    try:
        wait_for("no pod on any node", lambda: not _pods_on_nodes(gated_cluster), timeout=120)
        job = _operator_job("mend", "Workload")
        job["spec"]["runPolicy"] = {"backoffLimit": 2}
        gated_cluster.apply_json(job, "-n", namespace)
        wait_for("mend bound whole", lambda: len(_bound(gated_cluster, namespace, "mend")) == 3, timeout=90)
        wait_for("mend Running", lambda: _status(gated_cluster, namespace, "mend").get("phase") == "Running")
        pods = {p["metadata"]["name"]: p for p in _pods(gated_cluster, namespace, "ddp.dev/job-name=mend")}
        gated_cluster.kubectl_run("delete", "pod", "mend-1-0", "-n", namespace, "--wait=false")

        def replacement_bound() -> dict[str, Any] | None:
            now = {p["metadata"]["name"]: p for p in _pods(gated_cluster, namespace, "ddp.dev/job-name=mend")}
            new = now.get("mend-1-0r1")
            return new if new is not None and new["spec"].get("nodeName") else None

        new = wait_for("the replacement bound", replacement_bound, timeout=90)
        wanted = pods["mend-0-0"]["spec"].get("schedulingGroup") or pods["mend-0-0"]["spec"].get(
            "workloadRef"
        )
        assert (new["spec"].get("schedulingGroup") or new["spec"].get("workloadRef")) == wanted, new["spec"]
        survivors = {
            p["metadata"]["name"]: p["metadata"]["uid"]
            for p in _pods(gated_cluster, namespace, "ddp.dev/job-name=mend")
        }
        for name in ("mend-0-0", "mend-2-0"):
            assert survivors[name] == pods[name]["metadata"]["uid"], f"{name} kept its pod"
        status = _status(gated_cluster, namespace, "mend")
        assert (status["attempt"], status["restarts"]) == (0, 1), status
        print(f"one new member of a scheduled PodGroup: bound to {new['spec']['nodeName']}")
        passed = True
    finally:
        operator.stop()
        if not passed:
            print(operator.log_tail(30))
        gated_cluster.kubectl_run("delete", "namespace", namespace, "--wait=false")


def test_an_elastic_gang_asks_the_scheduler_for_min_replicas(
    gated_cluster: LocalCluster, tmp_path: Path
) -> None:
    """An elastic job's PodGroup has minCount = minReplicas (docs/elastic.md). What the 1.36 scheduler does
    with it, seen here: with room for only 2 of its 4 pods (two of the four nodes cordoned), it binds
    2, which is enough for the group to train, and the job is Running; the other two wait."""
    gated_cluster.kubectl_run("apply", "--server-side", "-f", str(REPO / "crds"))
    gated_cluster.wait_established("ddpjobs.ddp.dev")
    namespace = f"gang-elastic-{uuid.uuid4().hex[:6]}"
    gated_cluster.create_namespace(namespace)
    nodes = sorted(n["metadata"]["name"] for n in gated_cluster.get_json("nodes")["items"])[:2]
    operator = OperatorProcess(gated_cluster.kubeconfig, [namespace], tmp_path / "operator.log").start()
    passed = False
    try:
        wait_for("no pod on any node", lambda: not _pods_on_nodes(gated_cluster), timeout=120)
        for node in nodes:
            gated_cluster.kubectl_run("cordon", node)
        job = _operator_job("stretch", "Workload")
        del job["spec"]["replicas"]
        job["spec"]["elastic"] = {"minReplicas": 2, "maxReplicas": 4}
        gated_cluster.apply_json(job, "-n", namespace)
        wait_for("2 of 4 bound", lambda: len(_bound(gated_cluster, namespace, "stretch")) == 2, timeout=90)
        pod_group = gated_cluster.get_json("podgroups.scheduling.k8s.io", "stretch-0", "-n", namespace)
        assert pod_group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}}
        placed = set(_bound(gated_cluster, namespace, "stretch"))
        if "stretch-0-0" in placed:
            wait_for(
                "stretch Running",
                lambda: _status(gated_cluster, namespace, "stretch").get("phase") == "Running",
            )
        # The scheduler has tried the other two with the nodes as they are and found no room for them.
        wait_for(
            "the scheduler to refuse stretch's other 2 pods",
            lambda: (
                len(
                    waiting := [
                        p
                        for p in _pods(gated_cluster, namespace, names.label_selector("stretch"))
                        if not p["spec"].get("nodeName")
                    ]
                )
                == 2
                and all(_unschedulable(p) for p in waiting)
            ),
            timeout=60,
        )
        assert len(_bound(gated_cluster, namespace, "stretch")) == 2, "no room for more"
        print(f"elastic gang minCount 2 of 4 with room for 2: bound {sorted(placed)}")
        passed = True
    finally:
        for node in nodes:
            gated_cluster.kubectl_run("uncordon", node, check=False)
        operator.stop()
        if not passed:
            print(operator.log_tail(30))
        gated_cluster.kubectl_run("delete", "namespace", namespace, "--wait=false")


# ---- both together: Kueue admits the gang, the scheduler places it whole -------------------------------


def test_kueue_admission_and_the_in_tree_gang_combine(gated_cluster: LocalCluster, tmp_path: Path) -> None:
    """A DDPJob with a LocalQueue and `gang: Workload`: Kueue gates its pods until it admits the group
    (the job is Queued, nothing bound), then the scheduler binds the gang whole; a second such job
    beyond the quota stays Queued with no pod bound, and runs once the first is done."""
    prefix = ensure_built()
    gated_cluster.kubectl_run("apply", "--server-side", "-f", str(REPO / "crds"))
    gated_cluster.wait_established("ddpjobs.ddp.dev")
    kueue = start_kueue(gated_cluster, tmp_path / "kueue", prefix)
    suffix = uuid.uuid4().hex[:6]
    namespace, cluster_queue = f"gang-kueue-{suffix}", f"cq-{suffix}"
    operator: OperatorProcess | None = None
    try:
        gated_cluster.create_namespace(namespace)
        gated_cluster.kubectl_run("label", "namespace", namespace, f"{MANAGED_NAMESPACE_LABEL}=true")
        queue_objects = [
            {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": "gpus"}},
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "ClusterQueue",
                "metadata": {"name": cluster_queue},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": [GPU],
                            "flavors": [{"name": "gpus", "resources": [{"name": GPU, "nominalQuota": 24}]}],
                        }
                    ],
                },
            },
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "LocalQueue",
                "metadata": {"name": "gpus", "namespace": namespace},
                "spec": {"clusterQueue": cluster_queue},
            },
        ]
        gated_cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": queue_objects})
        operator = OperatorProcess(gated_cluster.kubeconfig, [namespace], tmp_path / "operator.log").start()

        def queued_job(name: str) -> dict[str, Any]:
            job = _operator_job(name, "Workload")
            job["metadata"]["labels"] = {names.KUEUE_QUEUE_LABEL: "gpus"}
            return job

        def phase(name: str) -> str:
            return str(gated_cluster.get_json("ddpjob", name, "-n", namespace).get("status", {}).get("phase"))

        # The ClusterQueue may take a moment to turn active: the first job waits Queued until then.
        gated_cluster.apply_json(queued_job("first"), "-n", namespace)
        wait_for("first Running", lambda: phase("first") == "Running", timeout=120)
        pods = gated_cluster.get_json("pods", "-n", namespace, "-l", names.label_selector("first"))["items"]
        assert len(pods) == 3
        for pod in pods:
            assert pod["spec"]["schedulingGroup"] == {"podGroupName": "first-0"}, "the in-tree gang"
            assert pod["metadata"]["labels"].get(names.KUEUE_MANAGED_LABEL) == "true", "Kueue's group"

        # 24 GPUs of quota, 24 held: the second gang is not admitted; nothing of it binds.
        gated_cluster.apply_json(queued_job("second"), "-n", namespace)
        wait_for("second Queued", lambda: phase("second") == "Queued", timeout=60)
        # Kueue has tried the second group against the quota and left it pending: its pods stay gated.
        second_pods = _pods(gated_cluster, namespace, names.label_selector("second"))
        second_group = second_pods[0]["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL]
        wait_for(
            "Kueue to leave the second group pending",
            lambda: _condition_false(
                gated_cluster.get_json("workloads.kueue.x-k8s.io", second_group, "-n", namespace),
                "QuotaReserved",
            ),
            timeout=60,
        )
        assert _bound(gated_cluster, namespace, "second") == []

        for pod in _bound(gated_cluster, namespace, "first"):
            gated_cluster.kubectl_run("annotate", "pod", pod, "-n", namespace, f"{EXIT_CODE_ANNOTATION}=0")
        wait_for("first Succeeded", lambda: phase("first") == "Succeeded", timeout=90)
        wait_for("second Running", lambda: phase("second") == "Running", timeout=120)
        assert len(_bound(gated_cluster, namespace, "second")) == 3
        for pod in _bound(gated_cluster, namespace, "second"):
            gated_cluster.kubectl_run("annotate", "pod", pod, "-n", namespace, f"{EXIT_CODE_ANNOTATION}=0")
        wait_for("second Succeeded", lambda: phase("second") == "Succeeded", timeout=90)

        # Deleting the jobs takes everything with them: the PodGroups too, whose protection finalizer
        # the controller-manager removes once no pod uses them (GANG_SCHEDULING_FLAGS).
        gated_cluster.kubectl_run("delete", "ddpjobs", "--all", "-n", namespace, "--wait=false")
        wait_for(
            "no pod, Workload or PodGroup left",
            lambda: (
                not gated_cluster.get_json(
                    "pods,podgroups.scheduling.k8s.io,workloads.scheduling.k8s.io", "-n", namespace
                )["items"]
            ),
            timeout=90,
        )
    finally:
        try:
            left = gated_cluster.kubectl_run(
                "get",
                "pods,podgroups.scheduling.k8s.io,workloads.scheduling.k8s.io,workloads.kueue.x-k8s.io",
                "-n",
                namespace,
                "-o",
                "custom-columns=KIND:.kind,NAME:.metadata.name,DELETED:.metadata.deletionTimestamp,"
                "FINALIZERS:.metadata.finalizers,PHASE:.status.phase",
                check=False,
            )
            print("left in the namespace:\n" + left.stdout)
            if operator is not None:
                operator.stop()
                print(operator.log_tail(30))
            # Kueue's finalizers need Kueue: end the groups and the namespace while it still runs.
            for args in (
                ("delete", "workloads.kueue.x-k8s.io", "--all", "-n", namespace, "--timeout=40s"),
                ("delete", "namespace", namespace, "--timeout=40s"),
                ("delete", "clusterqueue", cluster_queue, "--timeout=30s"),
            ):
                with contextlib.suppress(subprocess.SubprocessError):
                    kueue.kubectl(*args, check=False)
        finally:
            kueue.stop()


# ---- topology (docs/scheduling.md#topology) -------------------------------------------------------


def _racks(cluster: LocalCluster, pool: Pool, namespace: str, job: str) -> dict[int, str]:
    return pool.placed(_pods(cluster, namespace, names.label_selector(job)), RACK_LABEL)


def _topology_job(pool: Pool, name: str, replicas: int, topology: dict[str, str]) -> dict[str, Any]:
    job = ddpjob(name, replicas, gpus=1, scheduling={"gang": "Workload", "topology": topology})
    job["spec"]["template"]["spec"].update(pool.pod_spec())
    job["spec"]["runPolicy"] = {"backoffLimit": 2}
    return job


def test_a_required_rack_places_the_gang_and_its_replacement_in_one_rack_or_not_at_all(
    gated_cluster: LocalCluster, tmp_path: Path
) -> None:
    """The in-tree path (Kubernetes 1.36, TopologyAwareWorkloadScheduling): a pool of 2 blocks x 2 racks
    x 2 hosts x 2 GPUs. A 3-rank job of 1 GPU per rank with `topology.required: <rack>` is bound whole in
    one rack (the PodGroup carries the constraint; status.topology names the rack, no ring link crosses
    one); rank 1's pod deleted, its replacement joins the scheduled group and lands in the same rack,
    though free GPUs wait in every other rack. A 5-rank job fits no rack (4 GPUs each): none of its pods
    is bound, the PodGroup is refused by the scheduler."""
    gated_cluster.kubectl_run("apply", "--server-side", "-f", str(REPO / "crds"))
    gated_cluster.wait_established("ddpjobs.ddp.dev")
    namespace = f"gang-topo-{uuid.uuid4().hex[:6]}"
    gated_cluster.create_namespace(namespace)
    with node_pool(gated_cluster) as pool:
        operator = OperatorProcess(gated_cluster.kubeconfig, [namespace], tmp_path / "operator.log").start()
        passed = False
        try:
            gated_cluster.apply_json(
                _topology_job(pool, "near", 3, {"required": RACK_LABEL}), "-n", namespace
            )
            wait_for(
                "near Running", lambda: _status(gated_cluster, namespace, "near").get("phase") == "Running"
            )
            racks = _racks(gated_cluster, pool, namespace, "near")
            assert len(racks) == 3 and len(set(racks.values())) == 1, racks
            pod_group = gated_cluster.get_json("podgroups.scheduling.k8s.io", "near-0", "-n", namespace)
            assert pod_group["spec"]["schedulingConstraints"] == {"topology": [{"key": RACK_LABEL}]}
            shown = wait_for(
                "status.topology",
                lambda: _status(gated_cluster, namespace, "near").get("topology"),
                timeout=30,
            )
            rack = racks[0]
            assert shown == {
                "key": RACK_LABEL,
                "path": "PodGroup",
                "domains": [{"name": rack, "ranks": "0-2"}],
                "ringCrossings": 0,
            }, shown

            gated_cluster.kubectl_run("delete", "pod", "near-1-0", "-n", namespace, "--wait=false")
            wait_for(
                "rank 1's replacement bound",
                lambda: any(
                    p["metadata"]["name"] == "near-1-0r1" and p["spec"].get("nodeName")
                    for p in _pods(gated_cluster, namespace, names.label_selector("near"))
                ),
                timeout=90,
            )
            assert _racks(gated_cluster, pool, namespace, "near") == dict.fromkeys(range(3), rack)

            # The replacement got its rendezvous order key (it joins the survivors' next round by it).
            def keyed() -> list[dict[str, Any]] | None:
                bound = [
                    p
                    for p in _pods(gated_cluster, namespace, names.label_selector("near"))
                    if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
                ]
                annotations = [p["metadata"].get("annotations") or {} for p in bound]
                return bound if len(bound) == 3 and all(ORDER_ANNOTATION in a for a in annotations) else None

            ranks_by_order(
                wait_for("every pod's order key", keyed, timeout=30),
                {n: pool.label_of(n, HOST_LABEL) for n in pool.nodes},
            )

            gated_cluster.apply_json(
                _topology_job(pool, "wide", 5, {"required": RACK_LABEL}), "-n", namespace
            )
            wait_for(
                "wide's PodGroup refused by the scheduler",
                lambda: (
                    gang.pod_group_scheduled(
                        gated_cluster.get_json("podgroups.scheduling.k8s.io", "wide-0", "-n", namespace)
                    )[0]
                    is False
                ),
                timeout=60,
            )
            assert _bound(gated_cluster, namespace, "wide") == []
            assert _status(gated_cluster, namespace, "wide").get("phase") in ("Pending", "Starting")
            passed = True
        finally:
            gated_cluster.kubectl_run(
                "delete", "ddpjobs", "--all", "-n", namespace, "--wait=false", check=False
            )
            wait_for(
                "the jobs' pods gone",
                lambda: not gated_cluster.get_json("pods", "-n", namespace)["items"],
                timeout=90,
            )
            operator.stop()
            if not passed:
                print(operator.log_tail(40))
            gated_cluster.kubectl_run("delete", "namespace", namespace, "--wait=false")
