"""Real Kueue (hack/build-kueue.sh) against the local control plane: the plain-pod group contract the
operator's rank pods rely on (docs/scheduling.md).

A ClusterQueue of 16 nvidia.com/gpu over one ResourceFlavor, a LocalQueue, and groups of plain pods
labelled as builders.build_rank_pod labels them: Kueue's webhook gates every pod, admits a group that
fits as one Workload (and only then lets the scheduler bind its pods), keeps a group that does not fit
gated with none of its pods bound, and admits it once quota is free."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.kueue_harness import (
    MANAGED_NAMESPACE_LABEL,
    REPO,
    KueueProcess,
    is_built,
    kueue_prefix,
    start_kueue,
)
from tests.integration.operator_harness import wait_for

from ddp_operator import builders, names
from ddp_operator.spec import parse_job

pytestmark = pytest.mark.integration

GPU = names.GPU_RESOURCE
FLAVOR = "gpu-flavor"


@pytest.fixture(scope="module")
def kueue(local_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KueueProcess]:
    prefix = kueue_prefix()
    if not is_built(prefix):
        if shutil.which("go") is None:
            pytest.skip(f"no Go toolchain to build Kueue, and {prefix} holds no build")
        print("[kueue] building with hack/build-kueue.sh (10+ min when cold)", file=sys.stderr, flush=True)
        subprocess.run([str(REPO / "hack" / "build-kueue.sh")], check=True, timeout=3600)
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
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": cluster_queue},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": [GPU],
                        "flavors": [{"name": FLAVOR, "resources": [{"name": GPU, "nominalQuota": 16}]}],
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
    yield namespace, local_queue
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
    obj = {
        "apiVersion": names.API_GROUP_VERSION,
        "kind": names.KIND,
        "metadata": {
            "name": job,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "labels": {names.KUEUE_QUEUE_LABEL: queue},
        },
        "spec": {
            "replicas": replicas,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "ddp-trainer:test",
                            "resources": {"limits": {GPU: str(gpus)}},
                        }
                    ]
                }
            },
        },
    }
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
        lambda: (
            (w := kueue_workload(kueue, namespace, second_group))
            and condition(w, "QuotaReserved") is False
            and w
        ),
        timeout=30,
    )
    # Queued, not partially bound: every pod is still gated and none has a node, for a while.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        waiting = job_pods(kueue, namespace, "waiting")
        assert len(waiting) == 2
        assert all(gated(p) and not p["spec"].get("nodeName") for p in waiting), waiting
        time.sleep(0.5)
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
    wait_for(f"Kueue Workload {group} created", lambda: kueue_workload(kueue, namespace, group), timeout=30)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        assert all(gated(p) and not p["spec"].get("nodeName") for p in job_pods(kueue, namespace, "huge"))
        time.sleep(0.5)
    assert not condition(kueue_workload(kueue, namespace, group), "QuotaReserved")


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
