"""Recovery modes on a real control plane (docs/restarts.md): a lost pod replaced alone, the whole gang
when rank 0's pod (the rendezvous host) is lost, the one backoffLimit budget, a second loss while the
first replacement starts, and a node that stops reporting, whose pod is replaced without waiting for a
grace period no kubelet will honour.

kwok's pods never run a process, so what the launchers do in place is the trainer and e2e tiers'; here
the operator is judged on what it sees of pods, under the fault tier's timing (every node reports late
with jitter, a lost node reports nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube, namespace, wait_phase
from tests.integration.operator_harness import (
    Kube,
    OperatorProcess,
    ddpjob,
    pod_attempt,
    pod_rank,
    running_ranks,
    wait_for,
)
from tests.integration.test_faults import ONE_RANK_PER_NODE, QUICK_EVICTION, operators, start_operator

from ddp_harness import LocalCluster
from ddp_operator import names

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace", "operators"]  # fixtures, imported for pytest

# Evicted 2 s after its node turns unreachable, but with the default 120 s grace period: a replacement
# that waited for it would wait two minutes.
SLOW_GRACE_QUICK_EVICTION: dict[str, Any] = {**QUICK_EVICTION, "terminationGracePeriodSeconds": 120}


def uids(pods: list[dict[str, Any]]) -> dict[int, str]:
    return {pod_rank(p): p["metadata"]["uid"] for p in pods}


def running_members(kube: Kube, namespace: str, job: str, replicas: int) -> dict[int, dict[str, Any]] | None:
    """One Running, not-deleted pod per rank of the current attempt, or None."""
    live = [
        p
        for p in kube.live_pods(namespace, job)
        if p.get("status", {}).get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]
    by_rank = {pod_rank(p): p for p in live}
    if len(by_rank) != replicas or len(live) != replicas:
        return None
    return by_rank


def delete_pod(kube: Kube, namespace: str, name: str) -> None:
    kube.run("delete", "pod", name, "-n", namespace, "--wait=false")


def started(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess], job: dict[str, Any]
) -> list[dict[str, Any]]:
    """An operator, and ``job`` Running with every rank of attempt 0: its pods, by rank."""
    start_operator(kube, namespace, tmp_path, operators, "-v")
    kube.apply(job, namespace)
    spec = job["spec"]
    name, replicas = job["metadata"]["name"], spec.get("replicas") or spec["elastic"]["maxReplicas"]
    pods = running_ranks(kube, namespace, name, replicas, attempt=0)
    wait_phase(kube, namespace, name, "Running")
    return pods


def replaced(
    kube: Kube, namespace: str, job: str, replicas: int, rank: int, by: str
) -> dict[int, dict[str, Any]]:
    """Wait until ``rank`` runs as the pod ``by`` beside the others; every rank's Running pod."""

    def probe() -> dict[int, dict[str, Any]] | None:
        members = running_members(kube, namespace, job, replicas)
        return members if members and members[rank]["metadata"]["name"] == by else None

    return wait_for(f"rank {rank} replaced by {by}", probe, timeout=90)


def test_a_deleted_rank_pod_is_replaced_alone(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    before = uids(started(kube, namespace, tmp_path, operators, ddpjob("alone", replicas=3)))
    delete_pod(kube, namespace, "alone-1-0")
    members = replaced(kube, namespace, "alone", 3, 1, by="alone-1-0r1")
    assert {r: p["metadata"]["uid"] for r, p in members.items() if r != 1} == {0: before[0], 2: before[2]}, (
        "the survivors keep their pods"
    )
    assert all(pod_attempt(p) == 0 for p in members.values())
    status = wait_phase(kube, namespace, "alone", "Running")
    assert (status["attempt"], status["restarts"], status["podReplacements"]) == (0, 1, 1)
    record = status["lastRestart"]
    assert (record["mode"], record["cause"], record["rank"]) == ("PodReplaced", "PodDeleted", 1)
    reasons = [e["reason"] for e in kube.events_for(namespace, "alone")]
    assert "PodReplaced" in reasons
    assert not any(c["type"] == "Restarting" for c in status["conditions"]), "the job never left Running"

    # The Service publishes exactly the group's pods: the replacement in, the deleted pod out, and the
    # attempt's rendezvous pod, where every launcher meets.
    def published() -> set[str] | None:
        slices = kube.json(
            "get", "endpointslices", "-n", namespace, "-l", "kubernetes.io/service-name=alone"
        )["items"]
        targets = {e.get("targetRef", {}).get("name") for s in slices for e in s.get("endpoints") or []}
        return targets if targets == {"alone-0-0", "alone-1-0r1", "alone-2-0", "alone-rdzv-0"} else None

    wait_for("the Service to publish the current group", published, timeout=60)


@pytest.mark.parametrize(
    ("launcher_killed", "mode"),
    [
        # The kubelet reports the container ended by SIGKILL with no word from its launcher: killed from
        # outside (the pod's memory limit, a kill of the container), nothing in it restarts in place.
        pytest.param(True, "PodReplaced", id="killed-with-its-launcher"),
        # The same exit code passed on by the launcher (it gave up): the attempt's judge decides.
        pytest.param(False, "WholeGang", id="the-launcher-gave-up"),
    ],
)
def test_a_pod_killed_with_its_launcher_is_replaced_alone(
    kube: Kube,
    namespace: str,
    tmp_path: Path,
    operators: list[OperatorProcess],
    launcher_killed: bool,
    mode: str,
) -> None:
    before = uids(started(kube, namespace, tmp_path, operators, ddpjob("killed", replicas=3)))
    kube.end_pod(namespace, "killed-2-0", 137, launcher_killed=launcher_killed)
    if launcher_killed:
        members = replaced(kube, namespace, "killed", 3, 2, by="killed-2-0r1")
        assert {r: p["metadata"]["uid"] for r, p in members.items() if r != 2} == {0: before[0], 1: before[1]}
    else:
        running_ranks(kube, namespace, "killed", 3, attempt=1)
    status = wait_phase(kube, namespace, "killed", "Running")
    record = status["lastRestart"]
    assert (record["mode"], record["cause"], record["rank"], status["restarts"]) == (mode, "ExitCode", 2, 1)


@pytest.mark.parametrize("elastic", [False, True], ids=["fixed-size", "elastic"])
def test_losing_rank_0s_pod_replaces_it_alone_and_the_rendezvous_pod_stays(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess], elastic: bool
) -> None:
    """No rank is special: the store is the attempt's rendezvous pod, which outlives rank 0's pod. An
    elastic job's too: its survivors wait for the new pod 0 (docs/elastic.md)."""
    job = ddpjob("host", replicas=2)
    if elastic:
        del job["spec"]["replicas"]
        job["spec"]["elastic"] = {"minReplicas": 1, "maxReplicas": 2}
    before = uids(started(kube, namespace, tmp_path, operators, job))
    store = kube.json("get", "pod", "host-rdzv-0", "-n", namespace)["metadata"]["uid"]
    delete_pod(kube, namespace, "host-0-0")
    members = replaced(kube, namespace, "host", 2, 0, by="host-0-0r1")
    assert members[1]["metadata"]["uid"] == before[1], "the survivor keeps its pod"
    status = wait_phase(kube, namespace, "host", "Running")
    assert (status["attempt"], status["restarts"], status["podReplacements"]) == (0, 1, 1)
    record = status["lastRestart"]
    assert (record["mode"], record["cause"], record["rank"]) == ("PodReplaced", "PodDeleted", 0)
    assert "note" not in record
    assert kube.json("get", "pod", "host-rdzv-0", "-n", namespace)["metadata"]["uid"] == store, (
        "the rendezvous pod outlives rank 0's"
    )


def running_pod(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    found = kube.run("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    pod: dict[str, Any] | None = json.loads(found.stdout) if found.returncode == 0 else None
    return pod if pod and pod.get("status", {}).get("phase") == "Running" else None


@pytest.mark.parametrize("how", ["deleted", "node-lost"])
def test_a_lost_rendezvous_pod_is_replaced_alone_and_the_ranks_keep_their_pods(
    kube: Kube,
    local_cluster: LocalCluster,
    namespace: str,
    tmp_path: Path,
    operators: list[OperatorProcess],
    how: str,
) -> None:
    """No pod is special, the rendezvous pod included (docs/restarts.md): deleted, or on a node that
    stops reporting (its deletion never confirmed), it is replaced alone under a new name behind the
    same hostname; no rank pod on another node is touched, no restart is counted, and the Event says so."""
    job = ddpjob("rdzv", replicas=2, pod_spec={**QUICK_EVICTION, **ONE_RANK_PER_NODE})
    before = uids(started(kube, namespace, tmp_path, operators, job))
    store = kube.json("get", "pod", "rdzv-rdzv-0", "-n", namespace)
    node = store["spec"]["nodeName"]
    if how == "deleted":
        delete_pod(kube, namespace, "rdzv-rdzv-0")
    else:
        local_cluster.lose_node(node)
    try:
        new = wait_for(
            "rdzv-rdzv-0r1 running", lambda: running_pod(kube, namespace, "rdzv-rdzv-0r1"), timeout=90
        )
        assert new["spec"]["hostname"] == "rdzv-rdzv" and new["spec"]["subdomain"] == "rdzv"
        assert new["metadata"]["labels"][names.LABEL_ATTEMPT] == "0"
        kept = {
            rank: uid
            for rank, uid in before.items()
            if kube.json("get", "pod", f"rdzv-{rank}-0", "-n", namespace)["spec"]["nodeName"] != node
        }
        assert kept, "a rank pod runs on another node than the store's"
        now = {pod_rank(p): p["metadata"]["uid"] for p in kube.live_pods(namespace, "rdzv")}
        assert {rank: now.get(rank) for rank in kept} == kept, "the ranks elsewhere keep their pods"
        status = wait_phase(kube, namespace, "rdzv", "Running")
        assert (status["attempt"], status.get("restarts", 0), status["rendezvousPod"]) == (
            0,
            0,
            "rdzv-rdzv-0r1",
        )
        replaced_events = [
            e for e in kube.events_for(namespace, "rdzv") if e["reason"] == "RendezvousReplaced"
        ]
        assert len(replaced_events) == 1 and "rdzv-rdzv-0 was lost" in replaced_events[0]["message"]
    finally:
        if how == "node-lost":
            local_cluster.restore_node(node)


def test_the_rendezvous_pod_goes_with_its_attempt(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    """A whole-gang restart meets in a new store; a finished job keeps none, whatever cleanPodPolicy."""
    job = ddpjob("stores", replicas=2, run_policy={"cleanPodPolicy": "None"})
    started(kube, namespace, tmp_path, operators, job)
    kube.end_pod(namespace, "stores-1-0", 143)  # its launcher gave up: the whole gang
    running_ranks(kube, namespace, "stores", 2, attempt=1)

    def stores() -> list[str]:
        listed = kube.json("get", "pods", "-n", namespace, "-l", f"{names.LABEL_RENDEZVOUS_OF}=stores")
        return sorted(
            p["metadata"]["name"] for p in listed["items"] if not p["metadata"].get("deletionTimestamp")
        )

    wait_for("only attempt 1's rendezvous pod", lambda: stores() == ["stores-rdzv-1"], timeout=60)
    for rank in (0, 1):
        kube.end_pod(namespace, f"stores-{rank}-1", 0)
    wait_phase(kube, namespace, "stores", "Succeeded")
    wait_for("no rendezvous pod", lambda: stores() == [], timeout=60)
    assert len(kube.live_pods(namespace, "stores")) == 2, "cleanPodPolicy None keeps the rank pods"


def test_replacements_spend_backoff_limit(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    started(
        kube, namespace, tmp_path, operators, ddpjob("budget", replicas=2, run_policy={"backoffLimit": 1})
    )
    delete_pod(kube, namespace, "budget-1-0")
    replaced(kube, namespace, "budget", 2, 1, by="budget-1-0r1")
    env = next(
        c["env"] for c in kube.json("get", "pod", "budget-1-0r1", "-n", namespace)["spec"]["containers"]
    )
    assert {e["name"]: e.get("value") for e in env}["DDP_RESTART_BUDGET"] == "1", (
        "the replacement's launcher may spend what its group may: backoffLimit minus the restarts before it"
    )
    delete_pod(kube, namespace, "budget-1-0r1")
    try:
        status = wait_phase(kube, namespace, "budget", "Failed")
    except AssertionError:
        for p in kube.pods(namespace, "budget"):
            print(
                "POD",
                p["metadata"]["name"],
                p["metadata"].get("deletionTimestamp"),
                p["status"].get("phase"),
                p["metadata"]["labels"],
            )
        raise
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded", failed
    assert status["restarts"] == 1


def test_a_second_loss_while_the_first_replacement_starts(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    started(kube, namespace, tmp_path, operators, ddpjob("twice", replicas=3, run_policy={"backoffLimit": 5}))
    delete_pod(kube, namespace, "twice-1-0")
    # Not waiting for the first replacement to run: the next loss lands while it starts.
    wait_for(
        "a replacement for rank 1",
        lambda: (
            kube.json("get", "pods", "-n", namespace, "-l", f"{names.LABEL_REPLACEMENT}")["items"] or None
        ),
    )
    delete_pod(kube, namespace, "twice-2-0")
    members = wait_for(
        "one Running pod per rank", lambda: running_members(kube, namespace, "twice", 3), timeout=90
    )
    assert members[0]["metadata"]["name"] == "twice-0-0"
    assert {members[1]["metadata"]["name"], members[2]["metadata"]["name"]} == {"twice-1-0r1", "twice-2-0r2"}
    status = wait_phase(kube, namespace, "twice", "Running")
    assert (status["attempt"], status["restarts"], status["podReplacements"]) == (0, 2, 2)
    names_seen = [p["metadata"]["name"] for p in kube.pods(namespace, "twice")]
    assert len(names_seen) == len(set(names_seen))


def test_a_lost_nodes_pod_is_replaced_without_waiting_for_its_grace_period(
    kube: Kube, local_cluster: LocalCluster, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    start_operator(kube, namespace, tmp_path, operators)
    kube.apply(
        ddpjob("node", replicas=2, pod_spec={**SLOW_GRACE_QUICK_EVICTION, **ONE_RANK_PER_NODE}), namespace
    )
    first = running_ranks(kube, namespace, "node", 2, attempt=0)
    wait_phase(kube, namespace, "node", "Running")
    victim = next(p for p in first if pod_rank(p) == 1)
    node = victim["spec"]["nodeName"]
    local_cluster.lose_node(node)
    try:
        members = replaced(kube, namespace, "node", 2, 1, by="node-1-0r1")
        assert members[1]["spec"]["nodeName"] != node
        assert members[0]["metadata"]["uid"] == first[0]["metadata"]["uid"]
        # Force-deleted: the lost node's pod no longer exists, though its 120 s grace period has not run out
        # and its kubelet confirmed nothing.
        gone = kube.run(
            "get", "pod", victim["metadata"]["name"], "-n", namespace, "--ignore-not-found", "-o", "name"
        )
        assert gone.stdout.strip() == ""
        status = wait_phase(kube, namespace, "node", "Running")
        assert status["lastRestart"]["mode"] == "PodReplaced"
        assert status["lastRestart"]["cause"] == "Evicted"
    finally:
        local_cluster.restore_node(node)


def pod_or_none(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    listed = kube.json("get", "pods", "-n", namespace, "--field-selector", f"metadata.name={name}")
    return listed["items"][0] if listed["items"] else None


def test_a_standby_pod_takes_the_lost_pods_rank_and_another_is_started(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    """runPolicy.standbyPods: once the job runs, a standby pod with no rank is started; a lost pod's
    rank goes to it (its labels and its assignment annotation), no new pod is created for the rank,
    another standby is started, and all standbys go when the job ends (docs/restarts.md)."""
    before = uids(
        started(
            kube, namespace, tmp_path, operators, ddpjob("spare", replicas=2, run_policy={"standbyPods": 1})
        )
    )

    def running(name: str) -> dict[str, Any] | None:
        found = pod_or_none(kube, namespace, name)
        return found if found and found.get("status", {}).get("phase") == "Running" else None

    first = wait_for("the standby pod running", lambda: running("spare-standby1-0"), timeout=90)
    labels = first["metadata"]["labels"]
    assert names.LABEL_RANK not in labels and labels[names.LABEL_ROLE] == names.ROLE_STANDBY
    delete_pod(kube, namespace, "spare-1-0")

    def taken() -> dict[str, Any] | None:
        found = pod_or_none(kube, namespace, "spare-standby1-0")
        annotations = (found or {}).get("metadata", {}).get("annotations") or {}
        return found if annotations.get(names.ANNOTATION_ASSIGNMENT) else None

    promoted = wait_for("the standby given rank 1", taken, timeout=90)
    assert promoted["metadata"]["annotations"][names.ANNOTATION_ASSIGNMENT] == "rank=1 budget=3"
    labels = promoted["metadata"]["labels"]
    assert (labels[names.LABEL_RANK], labels[names.LABEL_REPLACEMENT]) == ("1", "1")
    assert names.LABEL_ROLE not in labels
    assert names.ANNOTATION_ASSIGNED_AT in promoted["metadata"]["annotations"]
    wait_for("a new standby pod running", lambda: running("spare-standby2-0"), timeout=90)
    status = wait_phase(kube, namespace, "spare", "Running")
    assert (status["restarts"], status["podReplacements"]) == (1, 1)
    record = status["lastRestart"]
    assert (record["mode"], record["rank"]) == ("PodReplaced", 1)
    assert record["note"] == "rank 1's pod taken by standby pod spare-standby1-0"
    assert pod_or_none(kube, namespace, "spare-1-0r1") is None, "no new pod for the rank"
    assert kube.json("get", "pod", "spare-0-0", "-n", namespace)["metadata"]["uid"] == before[0]
    events = kube.json("get", "events", "-n", namespace, "--field-selector", "reason=PodReplaced")["items"]
    assert any("standby pod spare-standby1-0" in e["message"] for e in events), events
    for pod in ("spare-0-0", "spare-standby1-0"):
        kube.end_pod(namespace, pod, 0)
    wait_phase(kube, namespace, "spare", "Succeeded")

    def standbys_left() -> bool:
        listed = kube.json("get", "pods", "-n", namespace, "-l", f"{names.LABEL_ROLE}={names.ROLE_STANDBY}")
        return not [p for p in listed["items"] if not p["metadata"].get("deletionTimestamp")]

    wait_for("no standby pod left", standbys_left, timeout=60)
