"""Standby pods on the real kube-scheduler (docs/restarts.md, "Standby pods"): a standby never blocks a
rank, and takes any rank, rank 0 included.

- On a full node a rank pod of default priority preempts the standby (the standby PriorityClass the chart
  installs: below the ranks, preempting nothing); the job whose standby it was trains on, its next
  standby waits Pending without holding anything, and runs once the room is free again.
- A job with a ReadWriteOnce checkpoint claim: its standby mounts the claim on rank 0's node, waits
  with the operator's waiting CPU, and takes rank 0 when rank 0's pod is lost, resized in place to the
  rank's CPU request; the next standby follows it onto that node.
- The standby class missing: the apiserver refuses the standby pod, the job trains on without one and
  says so in an Event.

Nothing here orders the scheduler's decisions: the tests make the world (nodes, pods, deletions) and poll
for the end state within bounds.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube, namespace, operator, wait_phase
from tests.integration.operator_harness import (
    Kube,
    OperatorProcess,
    checkpoint_volume,
    ddpjob,
    running_ranks,
    wait_for,
)
from tests.integration.topology_nodes import node_pool

from ddp_harness import LocalCluster
from ddp_operator import names

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace", "operator"]  # fixtures, imported for pytest


def pod_or_none(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    listed = kube.json("get", "pods", "-n", namespace, "--field-selector", f"metadata.name={name}")
    return listed["items"][0] if listed["items"] else None


def running(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    found = pod_or_none(kube, namespace, name)
    alive = found and not found["metadata"].get("deletionTimestamp")
    return found if alive and found.get("status", {}).get("phase") == "Running" else None


def trainer_cpu(pod: dict[str, Any]) -> str | None:
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == names.TRAINER_CONTAINER)
    cpu = ((trainer.get("resources") or {}).get("requests") or {}).get("cpu")
    return None if cpu is None else str(cpu)


def uids(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["uid"] for p in pods]


def scheduler_events(kube: Kube, namespace: str, pod: str, reason: str) -> list[dict[str, Any]]:
    items = kube.json("get", "events", "-n", namespace, "--field-selector", f"reason={reason}")["items"]
    return [e for e in items if e.get("involvedObject", {}).get("name") == pod]


@pytest.fixture
def one_node(local_cluster: LocalCluster) -> Iterator[Any]:
    """A node of its own with 3 GPUs: two 1-GPU ranks and one standby fill it."""
    with node_pool(local_cluster, blocks=1, racks_per_block=1, hosts_per_rack=1, gpus=3) as pool:
        yield pool


def test_a_rank_pod_preempts_the_standby_on_a_full_node_and_the_standby_comes_back_later(
    kube: Kube, namespace: str, operator: OperatorProcess, one_node: Any
) -> None:
    kube.apply(
        ddpjob("spare", replicas=2, gpus=1, run_policy={"standbyPods": 1}, pod_spec=one_node.pod_spec()),
        namespace,
    )
    ranks = running_ranks(kube, namespace, "spare", 2, attempt=0)
    first = wait_for("the standby running", lambda: running(kube, namespace, "spare-standby1-0"), timeout=90)
    assert first["spec"]["priorityClassName"] == names.DEFAULT_STANDBY_PRIORITY_CLASS
    assert first["spec"]["priority"] < min(p["spec"].get("priority", 0) for p in ranks)
    assert first["spec"]["preemptionPolicy"] == "Never"

    # The node is full: another job's rank (default priority) can only be placed by preempting the standby.
    kube.apply(ddpjob("other", replicas=1, gpus=1, pod_spec=one_node.pod_spec()), namespace)
    other = running_ranks(kube, namespace, "other", 1, attempt=0)
    assert other[0]["spec"]["nodeName"] == first["spec"]["nodeName"]
    wait_for(
        "the scheduler's Preempted event on the standby",
        lambda: scheduler_events(kube, namespace, "spare-standby1-0", "Preempted"),
        timeout=60,
    )

    def going() -> bool:
        found = pod_or_none(kube, namespace, "spare-standby1-0")
        return (
            found is None
            or found["metadata"]["uid"] != first["metadata"]["uid"]
            or bool(found["metadata"].get("deletionTimestamp"))
        )

    wait_for("the preempted standby deleted", going, timeout=60)

    # The job trains on with the pods it had; its next standby waits without a node and without
    # preempting anything.
    status = wait_phase(kube, namespace, "spare", "Running")
    assert status.get("restarts", 0) == 0
    assert uids(running_ranks(kube, namespace, "spare", 2, attempt=0)) == uids(ranks)

    def standbys() -> list[dict[str, Any]]:
        selector = f"{names.LABEL_ROLE}={names.ROLE_STANDBY},{names.LABEL_JOB_NAME}=spare"
        listed = kube.json("get", "pods", "-n", namespace, "-l", selector)["items"]
        return [p for p in listed if p["metadata"]["uid"] != first["metadata"]["uid"]]

    def pending_unschedulable() -> dict[str, Any] | None:
        for found in standbys():
            conditions = found.get("status", {}).get("conditions") or []
            refused = any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions
            )
            if refused and not found["spec"].get("nodeName"):
                return found
        return None

    nxt = wait_for("the next standby Pending, found no node", pending_unschedulable, timeout=90)
    assert running(kube, namespace, other[0]["metadata"]["name"]), "the other job's rank keeps its node"

    # The room comes back: the standby takes it.
    kube.end_pod(namespace, other[0]["metadata"]["name"], 0)
    wait_phase(kube, namespace, "other", "Succeeded")
    name = nxt["metadata"]["name"]
    wait_for("the next standby running", lambda: running(kube, namespace, name), timeout=90)
    wait_phase(kube, namespace, "spare", "Running")


def mounts_claim(pod: dict[str, Any], job: str) -> bool:
    claims = [v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["spec"].get("volumes", [])]
    return (
        names.pvc_name(job) in claims
        and pod["metadata"]["labels"].get(names.LABEL_CHECKPOINT_MOUNT) == "true"
    )


def test_a_standby_takes_rank_0_of_a_job_with_a_read_write_once_checkpoint(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    claim = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    volume = checkpoint_volume(kube, namespace, "ckpt", claim)
    try:
        job = ddpjob("ckpt", replicas=2, run_policy={"standbyPods": 1})
        job["spec"]["checkpoint"] = {"volumeClaimTemplate": claim}
        kube.apply(job, namespace)
        ranks = running_ranks(kube, namespace, "ckpt", 2, attempt=0)
        first = wait_for(
            "the standby running", lambda: running(kube, namespace, "ckpt-standby1-0"), timeout=90
        )
        rank0 = ranks[0]
        assert mounts_claim(first, "ckpt") and mounts_claim(rank0, "ckpt")
        assert not mounts_claim(ranks[1], "ckpt")
        assert first["spec"]["nodeName"] == rank0["spec"]["nodeName"], "one node holds the claim's attachment"
        # It waits with the operator's waiting CPU, its rank's request kept beside it.
        assert trainer_cpu(first) == names.DEFAULT_STANDBY_WAITING_CPU and trainer_cpu(rank0) == "100m"
        assert first["metadata"]["annotations"][names.ANNOTATION_RANK_CPU] == "100m"

        kube.run("delete", "pod", rank0["metadata"]["name"], "-n", namespace, "--wait=false")

        def taken() -> dict[str, Any] | None:
            found = pod_or_none(kube, namespace, "ckpt-standby1-0")
            annotations = (found or {}).get("metadata", {}).get("annotations") or {}
            return found if annotations.get(names.ANNOTATION_ASSIGNMENT) else None

        promoted = wait_for("the standby given rank 0", taken, timeout=90)
        assert promoted["metadata"]["annotations"][names.ANNOTATION_ASSIGNMENT].startswith("rank=0 ")
        assert promoted["metadata"]["labels"][names.LABEL_RANK] == "0"
        # The rank's CPU request is given back in place: the same pod (its UID), the rank's request.
        resized = wait_for(
            "the standby resized to its rank's CPU",
            lambda: (p := pod_or_none(kube, namespace, "ckpt-standby1-0")) and trainer_cpu(p) == "100m" and p,
            timeout=60,
        )
        assert resized["metadata"]["uid"] == first["metadata"]["uid"]
        second = wait_for(
            "the next standby running", lambda: running(kube, namespace, "ckpt-standby2-0"), timeout=90
        )
        assert second["spec"]["nodeName"] == promoted["spec"]["nodeName"]
        status = wait_phase(kube, namespace, "ckpt", "Running")
        assert (status["lastRestart"]["mode"], status["lastRestart"]["rank"]) == ("PodReplaced", 0)
        assert status["lastRestart"]["note"] == "rank 0's pod taken by standby pod ckpt-standby1-0"
        assert pod_or_none(kube, namespace, "ckpt-0-0r1") is None, "no new pod for rank 0"
    finally:
        kube.run("delete", "ddpjob", "ckpt", "-n", namespace, "--wait=false", check=False)
        kube.run("delete", "pv", volume, "--wait=false", check=False)


@pytest.fixture
def operator_without_the_class(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess(
        kube.kubeconfig,
        [namespace],
        tmp_path / "operator.log",
        ["--standby-priority-class", "ddp-no-such-standby-class"],
    ).start()
    yield process
    process.stop()
    print(f"--- operator log ({process.log_path}) ---\n{process.log_tail(80)}")


def test_a_standby_the_apiserver_refuses_leaves_the_job_training_and_says_so(
    kube: Kube, namespace: str, operator_without_the_class: OperatorProcess
) -> None:
    kube.apply(ddpjob("nospare", replicas=2, run_policy={"standbyPods": 1}), namespace)
    ranks = running_ranks(kube, namespace, "nospare", 2, attempt=0)

    def refused() -> list[dict[str, Any]]:
        return [e for e in kube.events_for(namespace, "nospare") if e["reason"] == "StandbyNotCreated"]

    [event] = wait_for("the StandbyNotCreated Event", refused, timeout=60)
    assert event["type"] == "Warning"
    assert "ddp-no-such-standby-class" in event["message"] and "trains on without it" in event["message"]
    status = wait_phase(kube, namespace, "nospare", "Running")
    assert status.get("restarts", 0) == 0 and not any(
        c.get("reason") == "PodCreateForbidden" for c in status["conditions"]
    )
    assert uids(running_ranks(kube, namespace, "nospare", 2, attempt=0)) == uids(ranks)
    assert pod_or_none(kube, namespace, "nospare-standby1-0") is None
