"""Elastic DDPJobs on a real control plane (docs/elastic.md): a lost pod whose replacement cannot be
placed leaves the job Running on its survivors, the group grows back when capacity returns, a second
loss while the group is shrunk, and a group below minReplicas held to the startup deadline.

kwok's pods never run a process, so the resize itself (the launchers' rendezvous rounds) is the trainer
and e2e tiers'; here the operator is judged on what it does with pods and status under the fault tier's
timing (every node reports late with jitter). Capacity is taken away the way an administrator does:
the node is cordoned (``kubectl cordon``), so the scheduler reports the replacement Unschedulable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube, namespace, wait_phase
from tests.integration.operator_harness import Kube, OperatorProcess, ddpjob, pod_attempt, pod_rank, wait_for
from tests.integration.test_faults import ONE_RANK_PER_NODE, operators, start_operator
from tests.integration.test_recovery import delete_pod, uids

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace", "operators"]  # fixtures, imported for pytest


def elastic_job(name: str, minimum: int, maximum: int, **run_policy: Any) -> dict[str, Any]:
    job = ddpjob(name, maximum, run_policy={"backoffLimit": 4, **run_policy}, pod_spec=ONE_RANK_PER_NODE)
    del job["spec"]["replicas"]
    job["spec"]["elastic"] = {"minReplicas": minimum, "maxReplicas": maximum, "replacementWaitSeconds": 5}
    return job


@contextlib.contextmanager
def cordoned(kube: Kube) -> Iterator[set[str]]:
    """Nodes cordoned during the block (add names to the set); every one uncordoned after it."""
    nodes: set[str] = set()
    try:
        yield nodes
    finally:
        for node in nodes:
            kube.run("uncordon", node, check=False)


def cordon(kube: Kube, nodes: set[str], *names: str) -> None:
    for node in names:
        kube.run("cordon", node)
        nodes.add(node)


def all_nodes(kube: Kube) -> set[str]:
    return {n["metadata"]["name"] for n in kube.json("get", "nodes")["items"]}


def running_by_rank(kube: Kube, namespace: str, job: str) -> dict[int, dict[str, Any]]:
    return {
        pod_rank(p): p
        for p in kube.live_pods(namespace, job)
        if p.get("status", {}).get("phase") == "Running" and pod_attempt(p) == 0
    }


def start(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess], job: dict[str, Any]
) -> dict[int, dict[str, Any]]:
    start_operator(kube, namespace, tmp_path, operators, "-v")  # -v: its decisions, read by the tests
    kube.apply(job, namespace)
    name, replicas = job["metadata"]["name"], job["spec"]["elastic"]["maxReplicas"]
    pods = wait_for(
        f"{replicas} Running pods of {name}",
        lambda: found if len(found := running_by_rank(kube, namespace, name)) == replicas else None,
        timeout=90,
    )
    wait_phase(kube, namespace, name, "Running")
    return pods


def unschedulable(kube: Kube, namespace: str, pod: str) -> dict[str, Any] | None:
    """The pod, once the scheduler said it cannot place it."""
    found = kube.json("get", "pods", "-n", namespace, "--field-selector", f"metadata.name={pod}")["items"]
    for item in found:
        for condition in item.get("status", {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
                return item  # type: ignore[no-any-return]
    return None


def assert_still_running_on(
    kube: Kube,
    namespace: str,
    job: str,
    survivors: dict[int, str],
    operator: OperatorProcess,
    since: int,
    losses: int,
) -> dict[str, Any]:
    """Once the operator has settled the ``losses`` since byte ``since`` of its log, the job is Running
    in attempt 0 and the survivors kept their pods.

    Settled: a decision that counts the losses, holds no failure for the decision window and set no
    timer, so nothing changes without a new event (what a fixed wait past the window stood for).
    """
    operator.wait_decision(
        namespace,
        job,
        f"{losses} loss(es) counted, no failure held for the decision window, no timer",
        lambda d: d.restarts >= losses and d.judged_in is None and d.requeue_after is None,
        since=since,
    )
    status = wait_phase(kube, namespace, job, "Running")
    assert status["attempt"] == 0, "no whole-gang restart"
    now = uids(list(running_by_rank(kube, namespace, job).values()))
    assert {rank: now.get(rank) for rank in survivors} == survivors, "the survivors keep their pods"
    return status


def test_a_replacement_that_cannot_be_placed_leaves_the_job_running_until_capacity_returns(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    pods = start(kube, namespace, tmp_path, operators, elastic_job("shrink", 2, 3))
    before = uids(list(pods.values()))
    used = {p["spec"]["nodeName"] for p in pods.values()}
    with cordoned(kube) as nodes:
        cordon(kube, nodes, *(all_nodes(kube) - used), pods[2]["spec"]["nodeName"])
        since = operators[0].log_offset()
        delete_pod(kube, namespace, "shrink-2-0")
        wait_for(
            "the replacement Unschedulable",
            lambda: unschedulable(kube, namespace, "shrink-2-0r1"),
            timeout=60,
        )
        survivors = {0: before[0], 1: before[1]}
        status = assert_still_running_on(kube, namespace, "shrink", survivors, operators[0], since, losses=1)
        assert (status["restarts"], status["podReplacements"]) == (1, 1)
        assert status["elastic"]["minReplicas"] == 2 and status["elastic"]["maxReplicas"] == 3
        assert status["lastRestart"]["mode"] == "PodReplaced"
        assert unschedulable(kube, namespace, "shrink-2-0r1") is not None, "still no capacity"
    # Capacity is back: the replacement runs beside the survivors, in the same attempt.
    members = wait_for(
        "the replacement Running",
        lambda: (
            m
            if (m := running_by_rank(kube, namespace, "shrink")).get(2, {}).get("metadata", {}).get("name")
            == "shrink-2-0r1"
            and len(m) == 3
            else None
        ),
        timeout=90,
    )
    assert {r: members[r]["metadata"]["uid"] for r in (0, 1)} == {0: before[0], 1: before[1]}
    status = wait_phase(kube, namespace, "shrink", "Running")
    assert (status["attempt"], status["restarts"]) == (0, 1), "growing back spends no restart"


def test_a_second_loss_while_the_group_is_shrunk(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    """A resize during a restart: rank 3's replacement waits for capacity when rank 2's pod is lost too;
    the job goes on with ranks 0 and 1 (minReplicas 2), then takes both replacements back."""
    pods = start(kube, namespace, tmp_path, operators, elastic_job("twice", 2, 4))
    before = uids(list(pods.values()))
    with cordoned(kube) as nodes:
        cordon(kube, nodes, pods[3]["spec"]["nodeName"])
        since = operators[0].log_offset()
        delete_pod(kube, namespace, "twice-3-0")
        wait_for("rank 3's replacement", lambda: unschedulable(kube, namespace, "twice-3-0r1"), timeout=60)
        cordon(kube, nodes, pods[2]["spec"]["nodeName"])
        delete_pod(kube, namespace, "twice-2-0")
        wait_for("rank 2's replacement", lambda: unschedulable(kube, namespace, "twice-2-0r2"), timeout=60)
        survivors = {0: before[0], 1: before[1]}
        status = assert_still_running_on(kube, namespace, "twice", survivors, operators[0], since, losses=2)
        assert (status["restarts"], status["podReplacements"]) == (2, 2)
    wait_for(
        "both replacements Running",
        lambda: m if len(m := running_by_rank(kube, namespace, "twice")) == 4 else None,
        timeout=90,
    )
    status = wait_phase(kube, namespace, "twice", "Running")
    assert (status["attempt"], status["restarts"]) == (0, 2)


def test_below_min_replicas_the_startup_deadline_ends_the_wait(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    pods = start(kube, namespace, tmp_path, operators, elastic_job("below", 2, 3, startupDeadlineSeconds=15))
    with cordoned(kube) as nodes:
        cordon(kube, nodes, *(all_nodes(kube) - {pods[0]["spec"]["nodeName"]}))
        delete_pod(kube, namespace, "below-1-0")
        delete_pod(kube, namespace, "below-2-0")
        status = wait_phase(kube, namespace, "below", "Failed", timeout=120)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "Unschedulable", failed
    assert "fewer than spec.elastic.minReplicas (2) pods run" in failed["message"]
    assert status["attempt"] == 0, "it waited for its replacements; it did not recreate the gang"
