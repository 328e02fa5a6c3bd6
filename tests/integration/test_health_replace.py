"""The operator acts on the gang health check: under stragglerPolicy Replace, the pod of the rank whose
links the check found far below the group's median is replaced alone, at once, away from its node; under
Shrink (an elastic job) its replacement may not use that node at all, so with no other node free it
waits, unschedulable, while the group trains on, and is placed once a node frees up.

As in test_progress.py, kwok's pods never run: each rank pod's IP goes on the loopback device and a real
trainer (`python -m ddp_trainer`, DDP_HEALTH_CHECK=on) runs per rank with the env the operator gave that
pod, serving /metrics at the pod's own IP. Rank 2's sends are made late by the trainer's own fault
injection (``--inject-fault 2:health:slow=...``), so the check names it before the first step; the
operator reads that from rank 0's endpoint. Nothing is mocked and no order of events is staged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube
from tests.integration.operator_harness import (
    Kube,
    OperatorProcess,
    ddpjob,
    free_port,
    running_ranks,
    wait_for,
)
from tests.integration.test_elastic import all_nodes, cordon, cordoned, unschedulable
from tests.integration.test_faults import ONE_RANK_PER_NODE
from tests.integration.trainer_stand_ins import addresses_on_loopback, trainer_processes

pytestmark = pytest.mark.integration
__all__ = ["kube"]  # a fixture, imported for pytest

JOB = "checked"
REPLICAS = 3
SLOW_RANK = 2
# Long enough that the job still trains when the operator reads the check (each step sleeps 50 ms).
TRAINER_ARGS = ["--max-steps", "3000", "--throttle-ms", "50", "--progress-every", "50"]
HEALTH_ENV = {"DDP_HEALTH_CHECK": "on", "DDP_HEALTH_CHECK_BYTES": str(64 * 1024)}


@contextlib.contextmanager
def operated(kube: Kube, tmp_path: Path, prefix: str) -> Iterator[str]:
    """A namespace of its own and an operator that reads progress every 2 s; its log printed after."""
    if os.geteuid() != 0:
        pytest.skip("putting the pods' IPs on the loopback device needs root")
    namespace = kube.create_namespace(prefix)
    operator = OperatorProcess(
        kube.kubeconfig, [namespace], tmp_path / "operator.log", extra=["--progress-interval", "2"]
    ).start()
    try:
        yield namespace
    finally:
        operator.stop()
        print(f"--- operator log ---\n{operator.log_tail(80)}")
        kube.delete_namespace(namespace)


@pytest.fixture
def checked(kube: Kube, tmp_path: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    with operated(kube, tmp_path, "op-health") as namespace:
        job = ddpjob(JOB, REPLICAS, run_policy={"stragglerPolicy": {"action": "Replace"}})
        job["spec"]["metrics"] = {"port": free_port()}
        kube.apply(job, namespace)
        pods = running_ranks(kube, namespace, JOB, REPLICAS, attempt=0)
        argv = [*TRAINER_ARGS, "--inject-fault", f"{SLOW_RANK}:health:slow=200"]
        with (
            addresses_on_loopback([p["status"]["podIP"] for p in pods]),
            trainer_processes(pods, tmp_path, ["-m", "ddp_trainer", *argv], HEALTH_ENV),
        ):
            yield namespace, pods


def test_the_rank_the_health_check_found_slow_is_replaced_alone_at_once(
    kube: Kube, checked: tuple[str, list[dict[str, Any]]]
) -> None:
    namespace, pods = checked
    slow = pods[SLOW_RANK]
    events = wait_for(
        "a StragglerReplaced Event",
        lambda: [e for e in kube.events_for(namespace, JOB) if e["reason"] == "StragglerReplaced"],
        timeout=180,
    )
    assert len(events) == 1, [(e["message"], e.get("count"), e["metadata"]["name"]) for e in events]
    (event,) = events
    assert "health check" in event["message"] and slow["metadata"]["name"] in event["message"], event
    status = kube.status(namespace, JOB)
    assert status.get("restarts", 0) == 0, "a slow rank did not fail: no backoffLimit spent"
    assert status["stragglerReplacements"] == 1
    assert status["avoidedNodes"] == [slow["spec"]["nodeName"]]
    assert (
        status["lastRestart"]["cause"] == "StragglerReplaced" and status["lastRestart"]["rank"] == SLOW_RANK
    )
    replacement = wait_for(
        "the replacement pod",
        lambda: next(
            (
                p
                for p in kube.json("get", "pods", "-n", namespace)["items"]
                if p["metadata"]["name"] == f"{JOB}-{SLOW_RANK}-0r1"
            ),
            None,
        ),
    )
    terms = replacement["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert slow["spec"]["nodeName"] in str(terms), terms
    # Rank 0 still exports the check that named the replaced pod: it ended before the replacement
    # started, so later reads must not replace the new pod for it. Two more reads of progress:
    # (The check can end, and its rank be replaced, before the first step: no progress is shown yet.)
    seen = kube.status(namespace, JOB).get("progress", {}).get("observedTime")
    for _ in range(2):
        seen = wait_for(
            "another progress read",
            lambda last=seen: (
                (t := kube.status(namespace, JOB).get("progress", {}).get("observedTime")) != last and t
            ),
            timeout=60,
        )
    after = kube.status(namespace, JOB)
    assert after["stragglerReplacements"] == 1 and after.get("podReplacements") == 1, after
    # The check rank 0's pod last exported is shown with the job's progress.
    check = after["progress"].get("healthCheck") or {}
    assert check.get("time") and float(check.get("busBandwidthBytesPerSecond", 0)) > 0, after["progress"]


def test_under_shrink_the_slow_ranks_pod_waits_for_a_node_it_may_use_while_the_group_trains_on(
    kube: Kube, tmp_path: Path
) -> None:
    """An elastic 2..3-pod job, one rank per node on the cluster's 4 nodes, the fourth cordoned before
    the trainers start: the check names rank 2, its pod goes, and its replacement, which may not use the
    slow node, cannot be placed; the job stays Running on the other two (its minimum). Uncordoned, the
    fourth node takes it."""
    with operated(kube, tmp_path, "op-shrink") as namespace:
        job = ddpjob(
            JOB, REPLICAS, run_policy={"stragglerPolicy": {"action": "Shrink"}}, pod_spec=ONE_RANK_PER_NODE
        )
        del job["spec"]["replicas"]
        job["spec"]["elastic"] = {"minReplicas": 2, "maxReplicas": REPLICAS, "replacementWaitSeconds": 5}
        job["spec"]["metrics"] = {"port": free_port()}
        kube.apply(job, namespace)
        pods = running_ranks(kube, namespace, JOB, REPLICAS, attempt=0)
        slow_node = pods[SLOW_RANK]["spec"]["nodeName"]
        (free,) = all_nodes(kube) - {p["spec"]["nodeName"] for p in pods}
        argv = [*TRAINER_ARGS, "--inject-fault", f"{SLOW_RANK}:health:slow=200"]
        with (
            cordoned(kube) as nodes,
            addresses_on_loopback([p["status"]["podIP"] for p in pods]),
        ):
            cordon(kube, nodes, free)
            with trainer_processes(pods, tmp_path, ["-m", "ddp_trainer", *argv], HEALTH_ENV):
                events = wait_for(
                    "a StragglerReplaced Event",
                    lambda: [
                        e for e in kube.events_for(namespace, JOB) if e["reason"] == "StragglerReplaced"
                    ],
                    timeout=180,
                )
                assert len(events) == 1, [e["message"] for e in events]
                assert (
                    "health check" in events[0]["message"] and "trains on without it" in events[0]["message"]
                )
                waiting = wait_for(
                    "the replacement unschedulable",
                    lambda: unschedulable(kube, namespace, f"{JOB}-{SLOW_RANK}-0r1"),
                )
                required = waiting["spec"]["affinity"]["nodeAffinity"][
                    "requiredDuringSchedulingIgnoredDuringExecution"
                ]
                assert slow_node in str(required["nodeSelectorTerms"]), required
                status = kube.status(namespace, JOB)
                assert status["phase"] == "Running" and status.get("restarts", 0) == 0, status
                assert status["stragglerReplacements"] == 1 and status["avoidedNodes"] == [slow_node]
                kube.run("uncordon", free)
                placed = wait_for(
                    "the replacement placed on the freed node",
                    lambda: (
                        p
                        if (p := kube.json("get", "pod", f"{JOB}-{SLOW_RANK}-0r1", "-n", namespace))[
                            "spec"
                        ].get("nodeName")
                        else None
                    ),
                )
                assert placed["spec"]["nodeName"] == free, placed["spec"]
