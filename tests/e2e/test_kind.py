"""The e2e suite on kind: a single-node kind cluster from our own node image (hack/build-kind.sh: no
registry involved), our two images loaded with `kind load docker-image`, the chart installed with helm.

The tests are the real-node suite's (tests/e2e/test_real_node.py) that carry the `kind_suite` mark, run
here against the kind cluster: DNS and a ClusterIP Service from a pod, the digits example across two ranks
with a checkpoint volume from the default StorageClass (local-path-provisioner), metrics scraped from both
ranks through the apiserver's pod proxy, and a rank exiting 1 failing the job with its reason; and the
recovery modes of docs/restarts.md with a real kubelet (a SIGKILLed worker and a rank exiting 137 restart
the gang in place, rank 0's deleted pod is replaced alone, in a fixed-size and in an elastic job, a pod killed with its launcher and a frozen pod are
replaced alone, an elastic job shrinks and grows); and stragglers: under `stragglerPolicy: Report` a rank
slowed by its CPU limit (its pod resized in place) is named and nothing is replaced, and under `Replace`
at 3 ranks one pod slowed by its CPU quota and one by its link (tbf), each cut from the node, are each
replaced alone, and every rank ends with the parameters of an uninterrupted run of the same job.
`make test` runs the other real-node tests (the job's
NetworkPolicy fencing its ranks, the Recreate path) on the real node
only, beside this suite, so no behaviour is run twice (docs/testing.md). The node image has no NetworkPolicy
enforcer of its own (kind's, kube-network-policies, needs CONFIG_NFT_QUEUE, which these machines' kernel
lacks), so kube-router's firewall runs as a process of this machine inside the node container's network
namespace (docs/kind.md); the suite checks that it enforces before any job runs.

Prerequisites: Docker with both images (hack/build-images.sh), kind and the node image
(hack/build-kind.sh; `make kind` builds both), kubectl and helm (hack/build-k8s.sh), and for the
enforcer root, kube-router, iptables and ipset (hack/build-kube-router.sh). A missing one fails the
module in CI (DDP_CI_STRICT=1), since `make test-e2e` builds them all.

Environment: KIND_NODE_IMAGE (default: the image hack/build-kind.sh built), DDP_E2E_KIND_CLUSTER
(the cluster's name, ddp-e2e), DDP_E2E_KIND_KUBECONFIG (a cluster of that name already up, as
hack/kind-cluster.sh brings it: `make test` does so beside the earlier tiers; deleted at the end all the
same), DDP_E2E_KEEP_CLUSTER=1 (leave it for a look: `kind delete cluster --name ddp-e2e` afterwards). Set DDP_E2E_KUBECONFIG to run test_real_node.py against any cluster instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

# pytest imports test modules by their basename (tests/ has no packages): the same module object.
import test_real_node as suite
import yaml
from test_real_node import (  # noqa: F401  (fixtures and tests that run here on kind)
    checkpoint_storage,
    operator_release,
    restricted_namespace,
    test_a_pod_resolves_kubernetes_default_and_reaches_a_cluster_ip_service,
    test_a_rank_exiting_1_fails_the_job_with_the_reason,
    test_a_rank_pod_slowed_by_its_cpu_limit_is_named_the_straggler,
    test_digits_trains_across_two_pods_with_equal_allreduce_bytes_and_succeeds,
)

from ddp_harness import kind_faults, netpol_enforcer
from ddp_harness.processes import stop_components, write_json

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
BUILD_KIND = REPO / "hack" / "build-kind.sh"
KIND_CLUSTER_SCRIPT = REPO / "hack" / "kind-cluster.sh"
KIND_CLUSTER = os.environ.get("DDP_E2E_KIND_CLUSTER", "ddp-e2e")
# kind's default Service subnet: hack/kind/cluster.yaml leaves it.
KIND_SERVICE_SUBNET = "10.96.0.0/16"


HOSTNAME_LABEL = "kubernetes.io/hostname"
ORDER_ANNOTATION = "ddp.dev/rank-order"


def _progress(message: str) -> None:
    print(f"[kind] {message}", file=sys.stderr, flush=True)


def _print(flag: str) -> str:
    return subprocess.run(
        [str(BUILD_KIND), flag], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def _docker_has(image: str) -> bool:
    inspected = subprocess.run(
        ["docker", "image", "inspect", image], capture_output=True, timeout=60, check=False
    )
    return inspected.returncode == 0


def kind_unavailable_reason(kind: str, node_image: str) -> str | None:
    if not os.access(kind, os.X_OK):
        return f"no kind at {kind}: build it with hack/build-kind.sh (make kind)"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60, check=False).returncode != 0:
        return "no Docker daemon answers: hack/build-images.sh starts one"
    for image in (node_image, suite.OPERATOR_IMAGE, suite.TRAINER_IMAGE):
        if not _docker_has(image):
            return f"image {image} is not in Docker: build it with hack/build-images.sh / hack/build-kind.sh"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[suite.ExternalCluster]:
    kind = _print("--print-kind")
    node_image = os.environ.get("KIND_NODE_IMAGE") or _print("--print-node-image")
    reason = kind_unavailable_reason(kind, node_image)
    if reason:
        pytest.skip(reason)
    prepared = os.environ.get("DDP_E2E_KIND_KUBECONFIG")
    if prepared:
        # `make test` brought the cluster up beside the earlier tiers, with hack/kind-cluster.sh too.
        kubeconfig = Path(prepared)
        if not kubeconfig.is_file():
            raise AssertionError(f"DDP_E2E_KIND_KUBECONFIG={prepared} is not a file: the cluster is not up")
    else:
        kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
        started = time.monotonic()
        up = [
            str(KIND_CLUSTER_SCRIPT),
            "up",
            KIND_CLUSTER,
            str(kubeconfig),
            suite.OPERATOR_IMAGE,
            suite.TRAINER_IMAGE,
        ]
        result = subprocess.run(up, capture_output=True, text=True, timeout=1800, check=False)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(up)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        suite.TIMINGS.record("kind_cluster_up_s", time.monotonic() - started)
    try:
        yield suite.external_cluster(kubeconfig)
    finally:
        if os.environ.get("DDP_E2E_KEEP_CLUSTER"):
            _progress(f"keeping the cluster: kind delete cluster --name {KIND_CLUSTER}")
        else:
            subprocess.run(
                [str(KIND_CLUSTER_SCRIPT), "down", KIND_CLUSTER],
                capture_output=True,
                timeout=300,
                check=False,
            )


# ---- recovery in place (docs/restarts.md): on kind, a real kubelet and our images --------------------


def _kill_worker(cluster: suite.ExternalCluster, namespace: str, pod: str) -> int:
    """SIGKILL the pod's training worker, as the OOM killer or a crash in native code would: the PID its
    launcher logged when it started the round (`launcher event=started workers=RANK:PID`)."""
    logs = cluster.kubectl_run("logs", "-n", namespace, pod, "-c", "trainer").stdout
    started = [line for line in suite.status_lines(logs, "launcher") if line.get("event") == "started"]
    assert started, f"{pod} logged no started workers:\n{logs[-2000:]}"
    pid = int(started[-1]["workers"].split(",")[0].split(":")[1])
    kill = f"import os, signal; os.kill({pid}, signal.SIGKILL)"
    cluster.kubectl_run("exec", "-n", namespace, pod, "-c", "trainer", "--", "python3", "-c", kill)
    return pid


def _pod_uids(cluster: suite.ExternalCluster, namespace: str, job: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in suite.rank_pods(cluster, namespace, job)}


def _started_with_a_checkpoint(
    cluster: suite.ExternalCluster, namespace: str, job: str
) -> tuple[list[dict[str, Any]], suite.LogFollower]:
    pods = suite.wait_for(
        "both ranks Running", lambda: suite.running_ranks(cluster, namespace, job, 0, 2), timeout=600
    )
    rank0 = next(p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "0")
    follower = suite.LogFollower(cluster, namespace, rank0)
    suite.wait_for(
        "a checkpoint on the volume",
        lambda: suite.checkpoint_files(cluster, namespace, job, rank0),
        timeout=300,
    )
    return pods, follower


def _assert_recovered(status: dict[str, Any], logs: str, mode: str, cause: str) -> dict[str, Any]:
    """Succeeded with the example's accuracy, after one restart of ``mode`` that resumed where training
    stopped (no step redone) and whose cost the status shows."""
    assert status.get("restarts") == 1, status
    record = status.get("lastRestart") or {}
    assert (record.get("mode"), record.get("cause")) == (mode, cause), record
    phases = [float(record[key]) for key in ("stoppedSeconds", "reformedSeconds", "resumedSeconds")]
    assert 0 <= phases[0] <= phases[1] <= phases[2] < 300, record
    # Every survivor holds the state of the last step in memory: the group resumes there (docs/restarts.md).
    assert int(record.get("stepsRedone", -1)) == 0, record
    assert 0 < float(status.get("goodput", 0)) <= 1, status
    # The one restart's cost, summed by phase in the same write that recorded it (docs/restarts.md).
    lost = status.get("lostSeconds") or {}
    assert lost.get("restarts") == 1, status
    assert abs(float(lost["total"]) - phases[2]) < 0.05, (lost, record)
    assert abs(float(lost["stopping"]) - phases[0]) < 0.05, (lost, record)
    final = suite.status_lines(logs, "final")
    assert final and 0.5 < float(final[-1]["accuracy"]) <= 1.0, logs[-2000:]
    resumed = suite.status_lines(logs, "resumed")
    assert resumed and int(resumed[-1]["step"]) > 0, (
        f"rank 0 did not resume from a checkpoint:\n{logs[-2000:]}"
    )
    return record


@pytest.mark.parametrize(
    ("how", "extra_args"),
    [
        pytest.param("kill", (), id="worker-sigkilled"),
        pytest.param("exit", ("--inject-fault", "1:step=60:exit=137:once"), id="rank-exits-137"),
    ],
)
def test_a_process_failure_restarts_the_gang_in_place(
    cluster: suite.ExternalCluster,
    checkpoint_storage: str | None,  # noqa: F811 (the suite's fixtures)
    operator_release: str,  # noqa: F811
    restricted_namespace: str,  # noqa: F811
    how: str,
    extra_args: tuple[str, ...],
) -> None:
    namespace, job = restricted_namespace, f"inplace-{how}"
    manifest = suite.digits_job(
        job, "--throttle-ms", "60", "--checkpoint-every", "20", *extra_args, storage_class=checkpoint_storage
    )
    if how == "exit":
        # The ranks follow the topology: each launcher waits for the order key the operator writes on
        # its bound pod, which the kubelet shows through a downward API file after the container started.
        manifest["spec"]["scheduling"] = {"topology": {"preferred": HOSTNAME_LABEL}}
    cluster.apply_json(manifest, "-n", namespace)
    pods, rank0_log = _started_with_a_checkpoint(cluster, namespace, job)
    before = _pod_uids(cluster, namespace, job)
    if how == "kill":
        victim = next(p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "1")
        _kill_worker(cluster, namespace, victim)
    status = suite.wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
    assert _pod_uids(cluster, namespace, job) == before, "no pod was created or deleted"
    record = _assert_recovered(status, rank0_log.text(), "InPlace", "ExitCode")
    assert (record.get("rank"), record.get("exitCode")) == (1, 137), record
    suite.TIMINGS.record(f"in_place_{how}_resumed_s", float(record["resumedSeconds"]))
    if how == "exit":
        _assert_ranks_followed_the_keys(cluster, namespace, job, status, rank0_log.text())


def test_the_rendezvous_pods_loss_is_one_more_lost_pod(
    cluster: suite.ExternalCluster,
    checkpoint_storage: str | None,  # noqa: F811 (the suite's fixtures)
    operator_release: str,  # noqa: F811
    restricted_namespace: str,  # noqa: F811
) -> None:
    """No pod is special, the rendezvous pod included: deleted mid-training, it is replaced alone behind
    the same name while the ranks train on (no rank pod is recreated, no restart counted), and every
    pod's supervisor goes on with the new store. A worker killed after that restarts the group in place
    through it: the survivors keep their processes, nothing is redone, and the job succeeds."""
    namespace, job = restricted_namespace, "rdzv-lost"
    manifest = suite.digits_job(
        job,
        "--throttle-ms",
        "60",
        "--checkpoint-every",
        "20",
        "--epochs",
        "30",
        storage_class=checkpoint_storage,
    )
    cluster.apply_json(manifest, "-n", namespace)
    pods, rank0_log = _started_with_a_checkpoint(cluster, namespace, job)
    before = _pod_uids(cluster, namespace, job)
    ranks = sorted(before)
    step = int((suite.job_status(cluster, namespace, job).get("progress") or {}).get("step") or 0)
    cluster.kubectl_run("delete", "pod", f"{job}-rdzv-0", "-n", namespace, "--wait=false")
    replacement = f"{job}-rdzv-0r1"
    suite.wait_for(
        f"{replacement} running", lambda: _phase(cluster, namespace, replacement) == "Running", timeout=300
    )

    def relinked(pod: str) -> bool:
        logs = cluster.kubectl_run("logs", "-n", namespace, pod, "-c", "trainer").stdout
        return any(line.get("event") == "store-relinked" for line in suite.status_lines(logs, "launcher"))

    for pod in ranks:
        suite.wait_for(f"{pod}'s supervisor on the new store", lambda pod=pod: relinked(pod), timeout=120)
    # The group trained through the loss: its steps moved on, and no restart was counted for it.
    suite.wait_for("steps moving", lambda: _steps_move(cluster, namespace, job, step), timeout=60)
    status = suite.job_status(cluster, namespace, job)
    assert (status.get("restarts", 0), status.get("rendezvousPod")) == (0, replacement), status
    events = cluster.kubectl_run(
        "get", "events", "-n", namespace, "--field-selector", "reason=RendezvousReplaced", "-o", "name"
    ).stdout
    assert events.strip(), "no RendezvousReplaced Event"
    victim = next(p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "1")
    _kill_worker(cluster, namespace, victim)
    status = suite.wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
    assert _pod_uids(cluster, namespace, job) == before, "no rank pod was created or deleted"
    record = _assert_recovered(status, rank0_log.text(), "InPlace", "ExitCode")
    assert (record.get("rank"), record.get("exitCode")) == (1, 137), record
    # Rank 0's worker kept its process through the restart (its supervisor's second round kept it).
    rounds = [
        line for line in suite.status_lines(rank0_log.text(), "launcher") if line.get("event") == "started"
    ]
    assert len(rounds) == 2 and rounds[1].get("kept") == "0", rounds
    assert rounds[0]["workers"] == rounds[1]["workers"], rounds


def _phase(cluster: suite.ExternalCluster, namespace: str, pod: str) -> str | None:
    found = cluster.kubectl_run("get", "pod", pod, "-n", namespace, "-o", "json", check=False)
    return json.loads(found.stdout).get("status", {}).get("phase") if found.returncode == 0 else None


def _assert_ranks_followed_the_keys(
    cluster: suite.ExternalCluster, namespace: str, job: str, status: dict[str, Any], rank0_logs: str
) -> None:
    """Every pod got its order key, rank 0's launcher brought its own to the rendezvous (through the
    kubelet's file), and status.topology shows the one node with no ring link leaving it."""
    pods = suite.rank_pods(cluster, namespace, job)
    keys = {
        p["metadata"]["labels"]["ddp.dev/rank"]: (p["metadata"].get("annotations") or {}).get(
            ORDER_ANNOTATION
        )
        for p in pods
    }
    assert all(keys.values()) and len(keys) == 2, keys
    ordered = [line for line in suite.status_lines(rank0_logs, "launcher") if line.get("event") == "ordered"]
    assert ordered and ordered[0]["key"] == keys["0"], (ordered, keys)
    node = pods[0]["spec"]["nodeName"]
    assert status.get("topology") == {
        "key": HOSTNAME_LABEL,
        "path": "Affinity",
        "domains": [{"name": node, "ranks": "0-1"}],
        "ringCrossings": 0,
    }, status.get("topology")


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed-size", "elastic"])
def test_rank_0s_deleted_pod_is_replaced_alone_and_the_others_keep_theirs(
    cluster: suite.ExternalCluster,
    checkpoint_storage: str | None,  # noqa: F811 (the suite's fixtures)
    operator_release: str,  # noqa: F811
    restricted_namespace: str,  # noqa: F811
    elastic: bool,
) -> None:
    """No rank is special: the store is the attempt's rendezvous pod, which outlives rank 0's pod; the
    new rank 0 pod receives the survivors' state and mounts the checkpoint volume again. An elastic
    job's too (1..2 pods): its survivor trains nothing without pod 0 and waits for the new one."""
    _replaced_alone(
        cluster, checkpoint_storage, restricted_namespace, "delete", "PodDeleted", rank=0, elastic=elastic
    )


def test_a_pod_killed_with_its_launcher_is_replaced_alone(
    cluster: suite.ExternalCluster,
    checkpoint_storage: str | None,  # noqa: F811 (the suite's fixtures)
    operator_release: str,  # noqa: F811
    restricted_namespace: str,  # noqa: F811
) -> None:
    """Its container killed from the node, launcher and all: no word from the launcher, so the pod is
    lost like a deleted one (the exit code alone would read as the launcher giving up)."""
    _replaced_alone(cluster, checkpoint_storage, restricted_namespace, "kill", "ExitCode", rank=1)


def _replaced_alone(
    cluster: suite.ExternalCluster,
    storage_class: str | None,
    namespace: str,
    how: str,
    cause: str,
    rank: int,
    elastic: bool = False,
) -> None:
    """The pod of ``rank`` lost mid-run (``how``: deleted, or killed with its launcher): a replacement
    joins the survivor, who keeps its pod, and the job succeeds having redone no step."""
    job = f"replaced-{how}{'-elastic' if elastic else ''}"
    manifest = suite.digits_job(
        job, "--throttle-ms", "60", "--checkpoint-every", "20", storage_class=storage_class
    )
    if elastic:
        del manifest["spec"]["replicas"]
        manifest["spec"]["elastic"] = {"minReplicas": 1, "maxReplicas": 2}
    cluster.apply_json(manifest, "-n", namespace)
    _, rank0_log = _started_with_a_checkpoint(cluster, namespace, job)
    before = _pod_uids(cluster, namespace, job)
    lost, survivor = f"{job}-{rank}-0", f"{job}-{1 - rank}-0"
    if how == "delete":
        cluster.kubectl_run("delete", "pod", lost, "-n", namespace, "--wait=false")
    else:
        kind_faults.kill_container(KIND_CLUSTER, namespace, lost)
    if rank == 0:
        # The new rank 0 pod's log holds the resume and the final line: followed once its trainer runs.
        suite.wait_for(
            f"{lost}r1's trainer running", lambda: _trainer_running(cluster, namespace, f"{lost}r1")
        )
        rank0_log = suite.LogFollower(cluster, namespace, f"{lost}r1")
    status = suite.wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
    after = _pod_uids(cluster, namespace, job)
    assert after.get(survivor) == before[survivor], f"{survivor} keeps its pod"
    assert f"{lost}r1" in after and lost not in after, after
    assert status.get("attempt") == 0 and status.get("podReplacements") == 1, status
    record = _assert_recovered(status, rank0_log.text(), "PodReplaced", cause)
    assert record.get("rank") == rank, record
    if how == "kill":
        assert record.get("exitCode") == 137, record
    # The rendezvous pod went with its attempt once the job finished (docs/restarts.md).
    suite.wait_for(
        "the rendezvous pod deleted",
        lambda: (
            cluster.kubectl_run("get", "pod", f"{job}-rdzv-0", "-n", namespace, check=False).returncode != 0
        ),
        timeout=120,
    )
    kind = "_elastic" if elastic else ""
    suite.TIMINGS.record(f"pod_replaced_{how}_rank{rank}{kind}_resumed_s", float(record["resumedSeconds"]))


def test_standby_pods_take_a_frozen_pods_rank_then_a_deleted_ones(
    cluster: suite.ExternalCluster,
    checkpoint_storage: str | None,  # noqa: F811 (the suite's fixtures)
    operator_release: str,  # noqa: F811
    restricted_namespace: str,  # noqa: F811
) -> None:
    """runPolicy.standbyPods 1: once the job runs, a standby pod starts and waits with torch imported,
    requesting the operator's waiting CPU. Rank 1's pod frozen from the node (no stallTimeoutSeconds):
    the hang is found and the standby takes rank 1, gets the rank's CPU request back in place (the
    kubelet applies it to the running container), and is not itself taken for hung by the same stall;
    a second standby starts. Then the pod
    that now holds rank 1 is deleted: the second standby takes it. No new pod is ever created for the
    rank, rank 0 keeps its pod, and the job Succeeds with the example's accuracy having redone no step."""
    namespace, job = restricted_namespace, "standby"
    # Smaller requests: the standby is a third trainer pod on the 2-core node; more epochs: two faults.
    manifest = suite.digits_job(
        job, "--epochs", "30", "--throttle-ms", "60", "--checkpoint-every", "20",
        storage_class=checkpoint_storage, cpu="250m",
    )  # fmt: skip
    manifest["spec"].setdefault("runPolicy", {})["standbyPods"] = 1
    cluster.apply_json(manifest, "-n", namespace)
    _, rank0_log = _started_with_a_checkpoint(cluster, namespace, job)
    first, second = f"{job}-standby1-0", f"{job}-standby2-0"

    def log_of(pod: str) -> str:
        found = cluster.kubectl_run("logs", "-n", namespace, pod, "-c", "trainer", check=False)
        return found.stdout if found.returncode == 0 else ""

    suite.wait_for(
        "the standby waiting, ready", lambda: "launcher event=standby " in log_of(first), timeout=300
    )
    before = _pod_uids(cluster, namespace, job)
    assert first not in before, "a standby is no rank's pod until it takes one"
    # It waits with the operator's waiting CPU (the kubelet set its container's shares by it).
    assert _trainer_cpu(cluster, namespace, first) == ("10m", "10m")
    kind_faults.freeze_pod(KIND_CLUSTER, namespace, f"{job}-1-0")
    suite.wait_for(
        "the first standby given rank 1", lambda: "event=assigned pod=1 " in log_of(first), timeout=300
    )
    suite.wait_for(
        "a second standby waiting", lambda: "launcher event=standby " in log_of(second), timeout=300
    )
    # The first standby trains as rank 1 again before it is taken away.
    suite.wait_for(
        "rank 1 training on the first standby",
        lambda: "launcher event=started pod=1 " in log_of(first),
        timeout=300,
    )
    # Holding rank 1, it got the rank's CPU request back in place: in its spec, and applied by the
    # kubelet to the running container (which did not restart).
    suite.wait_for(
        "the first standby resized to rank 1's CPU",
        lambda: _trainer_cpu(cluster, namespace, first) == ("250m", "250m") or None,
        timeout=120,
    )
    assert _trainer_restarts(cluster, namespace, first) == 0
    cluster.kubectl_run("delete", "pod", first, "-n", namespace, "--wait=false")
    status = suite.wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
    after = _pod_uids(cluster, namespace, job)
    assert after.get(f"{job}-0-0") == before[f"{job}-0-0"], "rank 0 keeps its pod"
    assert second in after and not [name for name in after if name.startswith(f"{job}-1-0r")], after
    assert (status.get("restarts"), status.get("podReplacements")) == (2, 2), status
    record = status.get("lastRestart") or {}
    assert (record.get("mode"), record.get("cause"), record.get("rank")) == ("PodReplaced", "PodDeleted", 1)
    assert record.get("note") == f"rank 1's pod taken by standby pod {second}", record
    assert int(record.get("stepsRedone", -1)) == 0, record
    final = suite.status_lines(rank0_log.text(), "final")
    assert final and 0.5 < float(final[-1]["accuracy"]) <= 1.0, rank0_log.text()[-2000:]
    events = json.loads(cluster.kubectl_run("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    replaced = [e["message"] for e in events if e.get("reason") == "PodReplaced"]
    assert any("no synchronized step" in m for m in replaced if f"standby pod {first}" in m), replaced
    suite.TIMINGS.record("standby_took_rank1_resumed_s", float(record["resumedSeconds"]))


def _trainer_status(
    cluster: suite.ExternalCluster, namespace: str, pod: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The pod's trainer container: its spec and its status ({} for what is not there)."""
    found = cluster.kubectl_run("get", "pod", pod, "-n", namespace, "-o", "json", check=False)
    if found.returncode != 0:
        return {}, {}
    body = json.loads(found.stdout)
    spec = next((c for c in body["spec"]["containers"] if c["name"] == "trainer"), {})
    statuses = body.get("status", {}).get("containerStatuses") or []
    return spec, next((s for s in statuses if s.get("name") == "trainer"), {})


def _trainer_cpu(cluster: suite.ExternalCluster, namespace: str, pod: str) -> tuple[str | None, str | None]:
    """The trainer's CPU request in the pod's spec, and the one the kubelet reports applied."""
    spec, status = _trainer_status(cluster, namespace, pod)
    wanted = ((spec.get("resources") or {}).get("requests") or {}).get("cpu")
    applied = ((status.get("resources") or {}).get("requests") or {}).get("cpu")
    return wanted, applied


def _trainer_restarts(cluster: suite.ExternalCluster, namespace: str, pod: str) -> int | None:
    restarts = _trainer_status(cluster, namespace, pod)[1].get("restartCount")
    return restarts if isinstance(restarts, int) else None


def _trainer_running(cluster: suite.ExternalCluster, namespace: str, pod: str) -> bool:
    """The pod's trainer container has started (its log can be followed from its first line)."""
    found = cluster.kubectl_run("get", "pod", pod, "-n", namespace, "-o", "json", check=False)
    if found.returncode != 0:
        return False
    statuses = json.loads(found.stdout).get("status", {}).get("containerStatuses") or []
    return any(s.get("name") == "trainer" and "running" in (s.get("state") or {}) for s in statuses)


def test_a_frozen_pod_is_found_without_a_stall_timeout_and_replaced_alone(
    cluster: suite.ExternalCluster,
    checkpoint_storage: str | None,  # noqa: F811 (the suite's fixtures)
    operator_release: str,  # noqa: F811
    restricted_namespace: str,  # noqa: F811
) -> None:
    """Every process of rank 1's pod stopped from the node, in a job that sets no stallTimeoutSeconds:
    the operator's own stall limit (max(30 s, 10x the step time)) finds the gang stalled, its silent
    metrics single the pod out, and it is deleted at once (a stopped process takes no SIGTERM) and
    replaced alone; rank 0 keeps its pod and the job Succeeds having redone no step."""
    namespace, job = restricted_namespace, "frozen"
    manifest = suite.digits_job(
        job, "--throttle-ms", "60", "--checkpoint-every", "20", storage_class=checkpoint_storage
    )
    assert "stallTimeoutSeconds" not in (manifest["spec"].get("runPolicy") or {})
    cluster.apply_json(manifest, "-n", namespace)
    _, rank0_log = _started_with_a_checkpoint(cluster, namespace, job)
    before = _pod_uids(cluster, namespace, job)
    frozen = time.time()  # the operator and the kind node share this machine's clock
    assert kind_faults.freeze_pod(KIND_CLUSTER, namespace, f"{job}-1-0") >= 2, (
        "the launcher and at least its worker"
    )
    status = suite.wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
    after = _pod_uids(cluster, namespace, job)
    assert after.get(f"{job}-0-0") == before[f"{job}-0-0"], "rank 0 keeps its pod"
    assert f"{job}-1-0r1" in after and f"{job}-1-0" not in after, after
    assert status.get("attempt") == 0 and status.get("podReplacements") == 1, status
    record = _assert_recovered(status, rank0_log.text(), "PodReplaced", "Stalled")
    assert record.get("rank") == 1, record
    found = datetime.fromisoformat(str(record["failureTime"]).replace("Z", "+00:00")).timestamp()
    suite.TIMINGS.record("frozen_pod_found_s", found - frozen)
    suite.TIMINGS.record("frozen_pod_resumed_s", float(record["resumedSeconds"]))


# ---- stragglers (docs/restarts.md#stragglers): slowed from the node, replaced alone -------------------


# Runs RANKS ranks of the command after it as local processes of one container, each with the env
# contract of a pod of one rank, and prints their output once all have ended.
LOCAL_RANKS_SCRIPT = """
n=$1; shift
pids=""
for r in $(seq 0 $((n - 1))); do
  RANK=$r LOCAL_RANK=0 WORLD_SIZE=$n NPROC_PER_NODE=1 NNODES=$n NODE_RANK=$r "$@" >/tmp/rank-$r.log 2>&1 &
  pids="$pids $!"
done
code=0
for pid in $pids; do wait "$pid" || code=$?; done
cat /tmp/rank-*.log
exit $code
"""


def _uninterrupted_digests(manifest: dict[str, Any], ranks: int) -> dict[int, str]:
    """The parameters each rank of ``manifest``'s trainer ends with when nothing interrupts it: its
    command and env in the same image, run by Docker on this machine (CPU, gloo on loopback), no
    throttle (a sleep between steps changes no number), no checkpoint volume."""
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    env = [f"{item['name']}={item['value']}" for item in trainer.get("env", []) if "value" in item] + [
        "GLOO_SOCKET_IFNAME=lo",
        "MASTER_ADDR=127.0.0.1",
        "MASTER_PORT=29500",
    ]
    command = [*trainer["command"], "--throttle-ms", "0"]
    run = ["docker", "run", "--rm", "--network", "none", "--entrypoint", "sh"]
    run += [arg for pair in env for arg in ("-e", pair)]
    run += [str(trainer["image"]), "-c", LOCAL_RANKS_SCRIPT, "ranks", str(ranks), *command]
    result = subprocess.run(run, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, (
        f"the uninterrupted run failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-2000:]}"
    )
    return _digests(result.stdout)


def _digests(logs: str) -> dict[int, str]:
    """Rank -> the digest of its parameters, from the trainer's `params` lines."""
    return {int(line["rank"]): line["sha256"] for line in suite.status_lines(logs, "params")}


def _follow_once_running(cluster: suite.ExternalCluster, namespace: str, pod: str) -> suite.LogFollower:
    def running() -> bool:
        found = suite.get_json(cluster, "pod", pod, "-n", namespace)
        return found["status"].get("phase") == "Running"

    suite.wait_for(f"{pod} Running", running, timeout=300)
    return suite.LogFollower(cluster, namespace, pod)


def _straggler_named(
    cluster: suite.ExternalCluster, namespace: str, job: str, rank: int
) -> dict[str, Any] | None:
    named = suite.job_status(cluster, namespace, job).get("straggler") or {}
    return named if named.get("rank") == rank else None


def _replaced(cluster: suite.ExternalCluster, namespace: str, job: str, count: int) -> dict[str, Any] | None:
    status = suite.job_status(cluster, namespace, job)
    return status if int(status.get("stragglerReplacements") or 0) >= count else None


def test_a_pod_slowed_by_its_cpu_and_one_by_its_link_are_each_replaced_alone_and_the_job_succeeds(
    cluster: suite.ExternalCluster,
    checkpoint_storage: str | None,  # noqa: F811 (the suite's fixtures)
    operator_release: str,  # noqa: F811
    restricted_namespace: str,  # noqa: F811
) -> None:
    """`stragglerPolicy: Replace` at 3 ranks with the gang health check on, each slow pod slowed from its
    node, outside its own code. Rank 1's container gets 5% of a CPU (its CFS quota cut): rank 0 names it
    the straggler, and once it has been slow past slowdownPercent for sustainedSeconds its pod is replaced
    alone. Meanwhile rank 2's interface is rate-limited (a tbf qdisc in its network namespace), which no
    step's timing can pin on one rank (a ring waits for a slow link as a whole); the health check that the
    replacement's joining brings names it, and its pod is replaced at once. Neither spends a restart,
    rank 0 keeps its pod, no step is redone, and the job Succeeds with the example's accuracy. The node
    is kind's only one: each replacement lands back on it, in a new cgroup and network namespace."""
    namespace, job = restricted_namespace, "straggler-replace"
    # Enough work to train on after both replacements: ~100 s unslowed at 3 ranks here; the run before the
    # cut, about a minute at 5% of a CPU and one more on the limited link leave half of it.
    manifest = suite.digits_job(
        job, "--epochs", "90", "--throttle-ms", "20", storage_class=checkpoint_storage, cpu="300m"
    )
    manifest["spec"]["replicas"] = 3
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    trainer.setdefault("env", []).append({"name": "DDP_HEALTH_CHECK", "value": "on"})
    manifest["spec"]["runPolicy"] = {
        **(manifest["spec"].get("runPolicy") or {}),
        "stragglerPolicy": {"action": "Replace", "slowdownPercent": 300, "sustainedSeconds": 60},
    }
    cluster.apply_json(manifest, "-n", namespace)
    pods = suite.wait_for(
        "3 ranks Running", lambda: suite.running_ranks(cluster, namespace, job, 0, 3), timeout=600
    )
    before = _pod_uids(cluster, namespace, job)
    rank0 = next(p for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "0")
    rank0_log = suite.LogFollower(cluster, namespace, rank0["metadata"]["name"])
    node = rank0["spec"]["nodeName"]
    suite.wait_for(
        "rank 0's exchange under way",
        lambda: (text := suite.read_metrics(cluster, rank0)) and "ddp_straggler_rank" in text,
        timeout=300,
    )
    clean = suite.wait_for(
        "the job's rate in status",
        lambda: (suite.job_status(cluster, namespace, job).get("progress") or {}).get("samplesPerSecond"),
        timeout=120,
    )
    assert "straggler" not in suite.job_status(cluster, namespace, job), "named before any pod was slowed"

    slowed = time.monotonic()
    kind_faults.throttle_cpu(KIND_CLUSTER, namespace, f"{job}-1-0", percent=5)
    named = suite.wait_for("rank 1 named", lambda: _straggler_named(cluster, namespace, job, 1), timeout=300)
    assert named["pod"] == f"{job}-1-0" and named["node"] == node, named
    # Before rank 1's replacement joins: the check its joining brings measures this link.
    qdisc = kind_faults.limit_link(KIND_CLUSTER, namespace, f"{job}-2-0", "20mbit")
    limited = time.monotonic()
    assert "tbf" in qdisc, qdisc
    followers = {0: rank0_log}
    try:
        first = suite.wait_for("rank 1's pod replaced", lambda: _replaced(cluster, namespace, job, 1), 600)
        suite.TIMINGS.record("straggler_cpu_slowed_to_replaced_s", time.monotonic() - slowed)
        followers[1] = _follow_once_running(cluster, namespace, f"{job}-1-0r1")
        suite.wait_for("rank 2's pod replaced", lambda: _replaced(cluster, namespace, job, 2), 600)
        suite.TIMINGS.record("straggler_link_limited_to_replaced_s", time.monotonic() - limited)
        followers[2] = _follow_once_running(cluster, namespace, f"{job}-2-0r2")
        # The uninterrupted run of the same job, beside the rest of this one (both pods are replaced:
        # no straggler it could make is acted on).
        with ThreadPoolExecutor(1) as pool:
            reference = pool.submit(_uninterrupted_digests, manifest, 3)
            status = suite.wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
            expected = reference.result()
    except AssertionError as error:
        raise AssertionError(f"{error}\nrank 0:\n{suite.read_metrics(cluster, rank0)}\n"
                             f"{suite.diagnostics(cluster, namespace, job)}") from None  # fmt: skip
    assert (first.get("lastRestart") or {}).get("rank") == 1, first
    # The rate at the end against the rate before the slowdown: a figure for docs/benchmarks.md, not a
    # condition (the machine's load moves every rank).
    recovered = float((status.get("progress") or {}).get("samplesPerSecond") or 0)
    _progress(f"samples/s: {float(clean):.1f} before the slowdowns, {recovered:.1f} at the end")

    after = _pod_uids(cluster, namespace, job)
    assert after.get(f"{job}-0-0") == before[f"{job}-0-0"], "rank 0 keeps its pod"
    # A replacement's number counts the job's replacements (docs/restarts.md, "Attempts").
    assert set(after) == {f"{job}-0-0", f"{job}-1-0r1", f"{job}-2-0r2"}, after
    assert (status.get("attempt"), status.get("restarts", 0)) == (0, 0), "a straggler spends no restart"
    assert (status.get("podReplacements"), status.get("stragglerReplacements")) == (2, 2), status
    assert status.get("avoidedNodes") == [node], status
    record = status.get("lastRestart") or {}
    assert (record.get("mode"), record.get("cause"), record.get("rank")) == (
        "PodReplaced",
        "StragglerReplaced",
        2,
    )
    assert int(record.get("stepsRedone", -1)) == 0, record
    events = suite.get_json(
        cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={job}"
    )
    notices = sorted(
        (e for e in events["items"] if e["reason"] == "StragglerReplaced"), key=lambda e: e["firstTimestamp"]
    )
    assert len(notices) == 2, [e["message"] for e in notices]
    assert f"({job}-1-0 on node {node})" in notices[0]["message"], notices[0]
    assert "health check" in notices[1]["message"], notices[1]
    assert f"({job}-2-0 on node {node}" in notices[1]["message"], notices[1]
    logs = rank0_log.text()
    final = suite.status_lines(logs, "final")
    assert final and 0.5 < float(final[-1]["accuracy"]) <= 1.0, logs[-2000:]
    # Exact continuation: each rank, rank 0 kept and the two new ones, ends with the parameters of the
    # uninterrupted run, bit for bit (the data division did not change).
    assert set(expected) == {0, 1, 2} and len(set(expected.values())) == 1, expected
    texts = {rank: logs if rank == 0 else follower.text() for rank, follower in followers.items()}
    ended = {rank: _digests(text).get(rank) for rank, text in texts.items()}
    assert ended == expected, (ended, expected)
    # The first check (every pod new), the one rank 1's replacement brought (rank 2 slow), and the one
    # rank 2's replacement brought: its links now like the others'.
    checks = suite.status_lines(logs, "health")
    assert [c["slow_rank"] for c in checks] == ["-1", "2", "-1"], checks
    shown = (status.get("progress") or {}).get("healthCheck") or {}
    assert shown.get("time") and "slowRank" not in shown, shown


# ---- elastic jobs (docs/elastic.md): shrink in place when capacity is lost, grow back when it returns ----


def _elastic_job(name: str, storage_class: str | None) -> dict[str, Any]:
    """The digits example as a 2..3-pod elastic job, slow enough to live through two resizes; 3 ranks at
    200m fit beside the control plane and the operator on the 2-core kind node."""
    manifest = suite.digits_job(
        name, "--epochs", "40", "--throttle-ms", "150", "--checkpoint-every", "10",
        storage_class=storage_class, cpu="200m",
    )  # fmt: skip
    del manifest["spec"]["replicas"]
    manifest["spec"]["elastic"] = {"minReplicas": 2, "maxReplicas": 3, "replacementWaitSeconds": 10}
    return manifest


def _group_of(cluster: suite.ExternalCluster, namespace: str, job: str, pods: int) -> dict[str, Any] | None:
    """The job's status once rank 0 reports a group of ``pods`` pods."""
    status = suite.job_status(cluster, namespace, job)
    if status.get("phase") in ("Succeeded", "Failed"):
        raise AssertionError(f"{job} ended {status.get('phase')} before its group had {pods} pods: {status}")
    if (status.get("elastic") or {}).get("replicas") != pods or status.get("worldSize") != pods:
        return None
    return status


def _resumed_at(record: dict[str, Any]) -> float | None:
    """Unix seconds of rank 0's first step after the restart ``record`` describes, once it is known."""
    if "resumedSeconds" not in record or "failureTime" not in record:
        return None
    failed = datetime.fromisoformat(str(record["failureTime"]).replace("Z", "+00:00")).timestamp()
    return failed + float(record["resumedSeconds"])


def _resized_and_resumed(
    cluster: suite.ExternalCluster, namespace: str, job: str, before: int, after: int
) -> dict[str, Any] | None:
    record = suite.job_status(cluster, namespace, job).get("lastRestart") or {}
    resized = (record.get("replicasBefore"), record.get("replicasAfter")) == (before, after)
    return record if resized and _resumed_at(record) is not None else None


def _launcher_resizes(logs: str, max_pods: int) -> int:
    """The resizes rank 0's launcher made, from its `launcher event=reformed` lines (what the operator reads, at the
    source): a round whose grows count rose grew the group, one with fewer members than the round
    before shrank it. The first round (restarts 0) is not logged: it may hold fewer than ``max_pods``,
    and the next round then says it grew."""
    resizes, grows, members = 0, 0, max_pods
    rounds = [
        line
        for line in suite.status_lines(logs, "launcher")
        if line.get("event") == "reformed" and line.get("pod") == "0"
    ]
    for line in sorted(rounds, key=lambda fields: int(fields["restarts"])):
        now_grows, now_members = int(line["grows"]), int(line["members"])
        resizes += now_grows > grows or now_members < members
        grows, members = now_grows, now_members
    return resizes


@contextlib.contextmanager
def _explained(cluster: suite.ExternalCluster, namespace: str, job: str, release: str) -> Iterator[None]:
    """A failure carries the job's status, its Events and the operator's own lines about it: the kind
    cluster goes with the run, and a failure seen once in CI must say its cause there."""
    try:
        yield
    except (AssertionError, TimeoutError) as failure:
        status = suite.job_status(cluster, namespace, job)
        events = [
            f"{e.get('lastTimestamp') or e.get('eventTime')} {e['type']} {e['reason']} "
            f"{e.get('involvedObject', {}).get('name')}: {e.get('message', '')[:300]}"
            for e in suite.get_json(cluster, "events", "-n", namespace)["items"]
            if str(e.get("involvedObject", {}).get("name", "")).startswith(job)
        ]
        said = cluster.kubectl_run(
            "logs", "-n", "ddp-system", f"deploy/{release}-ddp-operator", "--tail=3000", check=False
        ).stdout
        mine = "\n".join(
            line for line in said.splitlines() if f"{namespace}/{job}" in line or "Event" in line
        )
        raise AssertionError(
            f"{failure}\nstatus: {json.dumps(status)}\nevents:\n"
            + "\n".join(events[-60:])
            + f"\noperator:\n{mine[-12000:]}"
        ) from failure


def _steps_move(cluster: suite.ExternalCluster, namespace: str, job: str, after: int) -> int | None:
    step = int((suite.job_status(cluster, namespace, job).get("progress") or {}).get("step") or 0)
    return step if step > after else None


def test_an_elastic_job_trains_on_fewer_pods_while_capacity_is_lost_and_grows_back(
    cluster: suite.ExternalCluster,
    checkpoint_storage: str | None,  # noqa: F811 (the suite's fixtures)
    operator_release: str,  # noqa: F811
    restricted_namespace: str,  # noqa: F811
) -> None:
    """3 pods (min 2, max 3); the node is cordoned and rank 2's pod deleted: its replacement cannot be
    placed, so ranks 0 and 1 re-form a group of 2 in place (their pods kept) and train on; uncordoned,
    the replacement starts and the group grows back to 3 in place; the job Succeeds with the example's
    accuracy."""
    namespace, job = restricted_namespace, "elastic"
    with _explained(cluster, namespace, job, operator_release):
        survivors = (f"{job}-0-0", f"{job}-1-0")
        cluster.apply_json(_elastic_job(job, checkpoint_storage), "-n", namespace)
        pods = suite.wait_for(
            "3 ranks Running", lambda: suite.running_ranks(cluster, namespace, job, 0, 3), timeout=600
        )
        rank0_log = suite.LogFollower(cluster, namespace, f"{job}-0-0")
        suite.wait_for(
            "a checkpoint", lambda: suite.checkpoint_files(cluster, namespace, job, survivors[0]), timeout=300
        )
        suite.wait_for("a group of 3 in status", lambda: _group_of(cluster, namespace, job, 3), timeout=120)
        before = _pod_uids(cluster, namespace, job)
        node = pods[0]["spec"]["nodeName"]
        cluster.kubectl_run("cordon", node)
        try:
            lost = time.time()  # the kind node shares this machine's clock
            cluster.kubectl_run("delete", "pod", f"{job}-2-0", "-n", namespace, "--wait=false")
            shrunk = suite.wait_for(
                "a group of 2", lambda: _group_of(cluster, namespace, job, 2), timeout=300
            )
            shrink = suite.wait_for(
                "the shrink's resume",
                lambda: _resized_and_resumed(cluster, namespace, job, 3, 2),
                timeout=120,
            )
            suite.TIMINGS.record("elastic_loss_to_training_on_2_s", (_resumed_at(shrink) or lost) - lost)
            step = int((shrunk.get("progress") or {}).get("step") or 0)
            suite.wait_for(
                "steps on the group of 2", lambda: _steps_move(cluster, namespace, job, step), timeout=120
            )
            now = _pod_uids(cluster, namespace, job)
            assert {k: now.get(k) for k in survivors} == {k: before[k] for k in survivors}, (
                "the survivors keep their pods"
            )
            assert shrunk.get("attempt") == 0, "no whole-gang restart"
            replacement = suite.get_json(cluster, "pod", f"{job}-2-0r1", "-n", namespace)
            assert replacement["status"].get("phase") == "Pending", "no capacity for it while cordoned"
        finally:
            cluster.kubectl_run("uncordon", node)
        back = time.time()
        suite.wait_for(
            "the group grown back to 3", lambda: _group_of(cluster, namespace, job, 3), timeout=300
        )
        grow = suite.wait_for(
            "the grow's resume", lambda: _resized_and_resumed(cluster, namespace, job, 2, 3), timeout=120
        )
        assert grow.get("cause") == "MemberJoined", grow
        suite.TIMINGS.record("elastic_capacity_to_training_on_3_s", (_resumed_at(grow) or back) - back)
        status = suite.wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
        assert status.get("attempt") == 0, "no whole-gang restart"
        after = _pod_uids(cluster, namespace, job)
        assert {k: after.get(k) for k in survivors} == {k: before[k] for k in survivors}, (
            "no survivor was recreated"
        )
        assert status.get("restarts") == 1, "the grow spent no restart"
        # The resizes rank 0's launcher made, from its rounds' sizes: 2 (the shrink, the grow), and one
        # more when the group first formed before its last pod came (a legitimate grow at the start on a
        # slow node). Its own count says the same, and status shows that count, however late it read.
        made = _launcher_resizes(rank0_log.text(), 3)
        counted = [
            int(line["resizes"])
            for line in suite.status_lines(rank0_log.text(), "launcher")
            if line.get("event") == "reformed" and line.get("pod") == "0"
        ]
        assert made >= 2 and counted and max(counted) == made, (made, counted)
        assert (status.get("elastic") or {}).get("resizes") == made
        reasons = [
            (e["type"], e["reason"])
            for e in suite.get_json(cluster, "events", "-n", namespace)["items"]
            if e.get("involvedObject", {}).get("name") == job
        ]
        assert ("Warning", "Resized") in reasons and ("Normal", "Resized") in reasons, reasons
        logs = rank0_log.text()
        final = suite.status_lines(logs, "final")
        assert final and 0.5 < float(final[-1]["accuracy"]) <= 1.0, logs[-2000:]


@pytest.fixture(scope="module")
def network_policy_enforcer(
    cluster: suite.ExternalCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """kube-router's firewall for the kind node, started here: a process of this machine in the node
    container's network namespace (`nsenter --net`), with this machine's iptables and ipset, reaching the
    apiserver at the node's own 127.0.0.1:6443 with a ServiceAccount token and read-only RBAC.

    Not a DaemonSet: that needs an image with iptables and ipset inside, which no registry can supply
    here and which would be one more debootstrap rootfs to build; the node shares this kernel, so a
    host process in its namespace programs the same tables a pod on the host network would."""
    if os.geteuid() != 0:
        pytest.skip("kube-router in the kind node's network namespace needs root (nsenter, iptables)")
    missing = netpol_enforcer.missing_prerequisites()
    if missing:
        pytest.skip("no NetworkPolicy enforcer for kind here: " + "; ".join(missing))
    binary = netpol_enforcer.ensure_binary(build=True)
    node = f"{KIND_CLUSTER}-control-plane"
    pid = subprocess.run(
        ["docker", "inspect", "--format", "{{.State.Pid}}", node], capture_output=True, text=True, check=True
    ).stdout.strip()
    cluster.apply_json(
        {"apiVersion": "v1", "kind": "List", "items": netpol_enforcer.service_account_objects()}
    )
    token = cluster.kubectl_run(
        "create",
        "token",
        netpol_enforcer.NAME,
        "-n",
        netpol_enforcer.SERVICE_ACCOUNT_NAMESPACE,
        "--duration=24h",
    ).stdout.strip()
    ca_data = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"][
        "certificate-authority-data"
    ]
    work = tmp_path_factory.mktemp("kube-router")
    kubeconfig = work / "kubeconfig"
    # The apiserver listens on every address of the node's namespace; its certificate names 127.0.0.1.
    write_json(kubeconfig, netpol_enforcer.token_kubeconfig("https://127.0.0.1:6443", ca_data, token))
    kubeconfig.chmod(0o600)
    enforcer = netpol_enforcer.start(
        binary,
        kubeconfig=kubeconfig,
        node_name=node,
        service_cidr=KIND_SERVICE_SUBNET,
        netns=Path(f"/proc/{pid}/ns/net"),
        log=work / "kube-router.log",
    )
    _progress(f"kube-router {netpol_enforcer.version()} enforcing in {node}'s network namespace (log {work})")
    try:
        described = f"kube-router {netpol_enforcer.version()} in {node}'s network namespace"
        suite.assert_network_policies_enforced(cluster, described)
        yield described
    finally:
        # Its rules go with the node; with DDP_E2E_KEEP_CLUSTER they stay, frozen at its last sync.
        stop_components([enforcer])
