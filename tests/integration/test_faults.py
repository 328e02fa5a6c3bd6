"""The fault tier: the operator on a control plane that behaves like a real cluster, never a gentle one.

Every fake node's kubelet reports late with jitter (the harness's default ReportLatency), a lost node's
kubelet reports nothing (its deleted pods stay Terminating), the apiserver is killed and restarted under
a running attempt (watches break and resume or expire with 410), and operators are SIGKILLed in every
phase or run two at a time. The operator is never paused and no report is batched for it: each test
only produces the world's events and then asserts the end state: the job's phase and reason, and
exactly the pods the job should have.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube, namespace, wait_phase
from tests.integration.operator_harness import (
    Kube,
    OperatorProcess,
    condition,
    ddpjob,
    pod_attempt,
    pod_rank,
    running_ranks,
    wait_for,
)

from ddp_harness import NODE_LOST_ANNOTATION, LocalCluster
from ddp_operator import names

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace"]  # fixtures, imported for pytest

# Short leader-election timings, so a standby's takeover fits a test (the defaults are 15/10/2 s).
FAST_LEASE = ["--lease-duration", "6", "--renew-deadline", "4", "--retry-period", "1"]
# Pods that give up quickly on a lost node: evicted 2 s after it turns unreachable, 2 s of grace.
QUICK_EVICTION: dict[str, Any] = {
    "terminationGracePeriodSeconds": 2,
    "tolerations": [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 2}
        for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")
    ],
}
# One rank per node, so losing a node loses one rank.
ONE_RANK_PER_NODE: dict[str, Any] = {
    "affinity": {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {
                        "matchExpressions": [{"key": names.LABEL_JOB_NAME, "operator": "Exists"}]
                    },
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
}


@pytest.fixture
def operators(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[list[OperatorProcess]]:
    """Operator processes a test starts; all stopped at the end, their log tails shown."""
    started: list[OperatorProcess] = []
    yield started
    for index, process in enumerate(started):
        process.stop()
        print(f"--- operator {index} log ({process.log_path}) ---\n{process.log_tail(60)}")


def start_operator(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess], *extra: str
) -> OperatorProcess:
    log = tmp_path / f"operator-{len(operators)}.log"
    process = OperatorProcess(kube.kubeconfig, [namespace], log, extra=[*FAST_LEASE, *extra]).start()
    operators.append(process)
    return process


def leads(process: OperatorProcess) -> bool:
    return "leads; starting the controller" in process.log_path.read_text(errors="replace")


def exactly_one_pod_per_rank(pods: list[dict[str, Any]], replicas: int, attempt: int) -> None:
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp") and pod_attempt(p) == attempt]
    ranks = Counter(pod_rank(p) for p in live)
    assert sorted(ranks) == list(range(replicas)) and set(ranks.values()) == {1}, sorted(
        p["metadata"]["name"] for p in pods
    )


# ---- a lost node ------------------------------------------------------------------------------------


def test_a_lost_nodes_pod_is_force_deleted_and_does_not_block_the_restart(
    kube: Kube, local_cluster: LocalCluster, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    start_operator(kube, namespace, tmp_path, operators, "--unconfirmed-deletion", "3")
    # The whole-gang path (test_recovery.py has the lost node's pod replaced alone).
    job = ddpjob(
        "lost",
        replicas=2,
        pod_spec={**QUICK_EVICTION, **ONE_RANK_PER_NODE},
        run_policy={"restartMode": "Recreate"},
    )
    kube.apply(job, namespace)
    first = running_ranks(kube, namespace, "lost", 2, attempt=0)
    victim = next(p for p in first if pod_rank(p) == 1)
    node = victim["spec"]["nodeName"]
    local_cluster.lose_node(node)
    try:
        second = running_ranks(kube, namespace, "lost", 2, attempt=1)
        # The taint manager deleted the old rank-1 pod off its unreachable node, whose kubelet will never
        # confirm it: the operator force-deleted it instead of waiting (docs/restarts.md).
        gone = kube.run(
            "get", "pod", victim["metadata"]["name"], "-n", namespace, "--ignore-not-found", "-o", "name"
        )
        assert gone.stdout.strip() == "", "the lost node's pod should be force-deleted"
        assert all(p["spec"]["nodeName"] != node for p in second)
        status = wait_phase(kube, namespace, "lost", "Running")
        assert (status["attempt"], status["restarts"]) == (1, 1)
        reasons = [e["reason"] for e in kube.events_for(namespace, "lost") if e["type"] == "Warning"]
        assert reasons and reasons[0] in ("Evicted", "PodDeleted"), reasons

        # No rank of attempt 1 can resolve or reach the stuck pod: the Service publishes attempt 1 only.
        service = kube.json("get", "service", "lost", "-n", namespace)
        job_uid = kube.json("get", "ddpjob", "lost", "-n", namespace)["metadata"]["uid"]
        assert service["spec"]["selector"][names.LABEL_ATTEMPT] == "1"
        assert service["spec"]["selector"][names.LABEL_JOB_UID] == job_uid

        def published() -> set[str] | None:
            slices = kube.json(
                "get",
                "endpointslices",
                "-n",
                namespace,
                "-l",
                f"kubernetes.io/service-name={service['metadata']['name']}",
            )["items"]
            targets = {e.get("targetRef", {}).get("name") for s in slices for e in s.get("endpoints") or []}
            wanted = {p["metadata"]["name"] for p in second}
            return targets if targets == wanted else None

        wait_for("the Service's endpoints to be exactly attempt 1's pods", published)
        exactly_one_pod_per_rank(kube.pods(namespace, "lost"), 2, attempt=1)
    finally:
        local_cluster.restore_node(node)
    wait_for(
        "only attempt 1's pods once the node is back",
        lambda: all(pod_attempt(p) == 1 for p in kube.pods(namespace, "lost")),
        timeout=90,
    )


# ---- the operator SIGKILLed in every phase --------------------------------------------------------


def _unlose_pods(kube: Kube, namespace: str, job: str) -> None:
    for pod in kube.pods(namespace, job):
        kube.run("annotate", "pod", pod["metadata"]["name"], "-n", namespace, f"{NODE_LOST_ANNOTATION}-")


@pytest.mark.parametrize("phase", ["Pending", "Starting", "Running", "Restarting"])
def test_an_operator_killed_in_any_phase_is_replaced_by_one_that_finishes_the_job(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess], phase: str
) -> None:
    # A short grace period: an unconfirmed deletion is recognised seconds after it, not minutes.
    pod_spec: dict[str, Any] = {"terminationGracePeriodSeconds": 2}
    annotations: dict[str, str] = {}
    run_policy: dict[str, Any] = {}
    extra: list[str] = []
    if phase == "Pending":
        # Nothing can schedule the pods: the job stays Pending until its startup deadline fails it.
        pod_spec["nodeSelector"] = {"ddp.dev/no-such-node": "true"}
        run_policy = {"startupDeadlineSeconds": 20}
    elif phase == "Starting":
        # Scheduled pods whose node never reports them started (until the test lets it).
        annotations = {NODE_LOST_ANNOTATION: "true"}
    elif phase == "Restarting":
        # The failed attempt's other pod sits on a silent node: the first operator waits for it.
        extra = ["--unconfirmed-deletion", "600"]
    job = ddpjob(f"kill-{phase.lower()}", replicas=3, run_policy=run_policy, pod_spec=pod_spec)
    if annotations:
        job["spec"]["template"]["metadata"] = {"annotations": annotations}
    name = job["metadata"]["name"]
    first = start_operator(kube, namespace, tmp_path, operators, *extra)
    kube.apply(job, namespace)
    if phase == "Running":
        running_ranks(kube, namespace, name, 3, attempt=0)
    if phase == "Restarting":
        pods = running_ranks(kube, namespace, name, 3, attempt=0)
        silent = pods[2]["metadata"]["name"]
        kube.run("annotate", "pod", silent, "-n", namespace, f"{NODE_LOST_ANNOTATION}=true")
        kube.end_pod(namespace, pods[0]["metadata"]["name"], 137)
    wait_phase(kube, namespace, name, phase)
    first.kill()

    start_operator(kube, namespace, tmp_path, operators, "--unconfirmed-deletion", "3")
    if phase == "Pending":
        status = wait_phase(kube, namespace, name, "Failed")
        failed = condition(status, "Failed")
        assert failed is not None and failed["reason"] == "Unschedulable", failed
        wait_for("the unschedulable pods to go", lambda: not kube.live_pods(namespace, name))
        return
    if phase == "Starting":
        _unlose_pods(kube, namespace, name)
    attempt = 1 if phase == "Restarting" else 0
    pods = running_ranks(kube, namespace, name, 3, attempt=attempt)
    exactly_one_pod_per_rank(kube.pods(namespace, name), 3, attempt)
    for pod in pods:
        kube.end_pod(namespace, pod["metadata"]["name"], 0)
    status = wait_phase(kube, namespace, name, "Succeeded")
    assert (status["attempt"], status["restarts"]) == (attempt, attempt)
    if phase == "Restarting":
        _unlose_pods(kube, namespace, name)


# ---- two operators ---------------------------------------------------------------------------------


def test_of_two_operators_one_acts_and_the_other_finishes_when_it_is_killed_mid_creation(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    ranks = 64
    # Two requests in flight make the leader's creation long enough to be interrupted part-way.
    one = start_operator(kube, namespace, tmp_path, operators, "--concurrency", "2")
    wait_for("the first operator to lead", lambda: leads(one))
    two = start_operator(kube, namespace, tmp_path, operators, "--concurrency", "2")
    kube.apply(ddpjob("pair", replicas=ranks), namespace)
    wait_for("some rank pods", lambda: len(kube.pods(namespace, "pair")) >= 4, timeout=60, interval=0.05)
    assert not leads(two), "the second operator acted while the first held the Lease"
    assert "ddpjob_pods_created_total 0.0" in two.metrics()
    one.kill()
    created_before = len(kube.pods(namespace, "pair"))

    wait_for("the standby to take over", lambda: leads(two), timeout=60)
    wait_for(f"{ranks} rank pods", lambda: len(kube.pods(namespace, "pair")) >= ranks, timeout=120)
    wait_for("the job to record its attempt", lambda: kube.status(namespace, "pair").get("attempt") == 0)
    assert created_before < ranks, "the leader finished before it was killed; nothing was tested"
    pods = kube.pods(namespace, "pair")
    assert len(pods) == ranks
    exactly_one_pod_per_rank(pods, ranks, attempt=0)


# ---- the apiserver restarted under a running attempt ------------------------------------------------


def test_an_apiserver_restart_mid_attempt_loses_no_event_and_duplicates_no_pod(
    kube: Kube, local_cluster: LocalCluster, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    operator = start_operator(kube, namespace, tmp_path, operators)
    kube.apply(ddpjob("restart", replicas=4), namespace)
    first = running_ranks(kube, namespace, "restart", 4, attempt=0)
    wait_phase(kube, namespace, "restart", "Running")
    # Writes elsewhere move the cluster's resourceVersion past the pod watch's last event; etcd then
    # compacts its history (the apiserver does so every 5 minutes), so the version the operator's pod
    # watch resumes from after the restart is gone: 410, and the informer lists again.
    for index in range(5):
        kube.run("create", "configmap", f"bump-{index}", "-n", namespace, f"--from-literal=i={index}")
    local_cluster.compact_etcd()
    local_cluster.restart_component("kube-apiserver")
    # While the operator's watches reconnect, a rank fails: the operator must still see it once.
    kube.end_pod(namespace, first[3]["metadata"]["name"], 137)
    second = running_ranks(kube, namespace, "restart", 4, attempt=1)
    status = wait_phase(kube, namespace, "restart", "Running")
    assert (status["attempt"], status["restarts"]) == (1, 1)
    exactly_one_pod_per_rank(kube.pods(namespace, "restart"), 4, attempt=1)
    for pod in second:
        kube.end_pod(namespace, pod["metadata"]["name"], 0)
    wait_phase(kube, namespace, "restart", "Succeeded")
    log = operator.log_path.read_text(errors="replace")
    print(json.dumps([line for line in log.splitlines() if "pod watch" in line][-5:], indent=1))
    assert "expired (410); listing again" in log, "the pod watch never had to list again"
