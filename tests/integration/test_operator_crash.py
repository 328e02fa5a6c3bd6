"""The operator killed with SIGKILL in the middle of creating a 64-rank job, then started again.

The second operator must finish the job with exactly one pod per rank: creates are idempotent (a 409 on a
pod that is ours is success) and the attempt in status is written only after all its pods exist.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from tests.integration.operator_fixtures import kube, namespace
from tests.integration.operator_harness import Kube, OperatorProcess, ddpjob, pod_attempt, pod_rank, wait_for

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace"]  # fixtures, imported for pytest

RANKS = 64


def test_sigkill_while_creating_64_ranks_leaves_exactly_64_rank_pods(
    kube: Kube, namespace: str, tmp_path: Path
) -> None:
    log = tmp_path / "operator.log"
    # Two requests in flight make the creation long enough to be interrupted part-way.
    first = OperatorProcess(kube.kubeconfig, [namespace], log, extra=["--concurrency", "2"]).start()
    try:
        kube.apply(ddpjob("crash", replicas=RANKS), namespace)
        wait_for(
            "some rank pods to exist",
            lambda: len(kube.pods(namespace, "crash")) >= 4,
            timeout=60,
            interval=0.05,
        )
    finally:
        first.kill()
    created_before = len(kube.pods(namespace, "crash"))

    second = OperatorProcess(kube.kubeconfig, [namespace], log).start()
    try:
        wait_for("64 rank pods", lambda: len(kube.pods(namespace, "crash")) >= RANKS, timeout=120)
        wait_for("the job to record its attempt", lambda: kube.status(namespace, "crash").get("attempt") == 0)
        pods = kube.pods(namespace, "crash")
    finally:
        second.stop()
        print(second.log_tail(60))

    assert created_before < RANKS, "the first operator finished before it was killed; nothing was tested"
    ranks = Counter(pod_rank(p) for p in pods)
    assert len(pods) == RANKS
    assert sorted(ranks) == list(range(RANKS)) and set(ranks.values()) == {1}
    assert {pod_attempt(p) for p in pods} == {0}
