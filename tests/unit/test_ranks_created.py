"""status.ranksCreated: "every rank's pod of the attempt was created once" is recorded when it happens,
and decides whether a missing pod is still to create or was lost (policies.creation.missing_ranks)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import at, job_spec, observe, pod
from tests.unit.test_reconcile import live_status

from ddp_operator.decision import Decision
from ddp_operator.reconcile import decide
from ddp_operator.spec import JobSpec

pytestmark = pytest.mark.unit


def run(job: JobSpec, status: dict[str, Any], pods: list[dict[str, Any]], now: float) -> Decision:
    return decide(job, status, observe(*pods), at(now))


def test_recorded_the_first_time_every_rank_pod_is_observed() -> None:
    job = job_spec(replicas=3)
    created = run(job, {}, [], now=0).report.status
    assert "ranksCreated" not in created, "asked for is not created: the status may be written first"
    partly = run(job, created, [pod(0, phase="Pending"), pod(1, phase="Pending")], now=1)
    assert "ranksCreated" not in partly.report.status and partly.create.ranks == (2,)
    every = run(job, partly.report.status, [pod(r, phase="Pending") for r in range(3)], now=2)
    assert every.report.status["ranksCreated"] == 0 and every.report.changed
    # Kept by the decisions that follow.
    later = run(job, every.report.status, [pod(r) for r in range(3)], now=3)
    assert later.report.status["ranksCreated"] == 0


def _after_a_replacement(**extra: Any) -> dict[str, Any]:
    """Rank 2 of 3 was replaced (r1), an in-place restart since overwrote lastRestart, and
    status.replicas lags (written while rank 2's first pod was gone and its replacement not yet seen)."""
    return live_status(
        replicas=2,
        podReplacements=1,
        lastRestart={"mode": "InPlace", "attempt": 0, "groupRestarts": 2, "failureTime": "x"},
        **extra,
    )


def test_a_missing_pod_after_every_rank_was_created_is_lost_while_replicas_lag() -> None:
    # Rank 2's replacement is gone too: a lost pod, replaced again under a new name.
    decision = run(job_spec(replicas=3), _after_a_replacement(ranksCreated=0), [pod(0), pod(1)], now=30)
    assert decision.create.ranks == ()
    assert decision.create.replacements == ((2, 2),)
    assert decision.report.status["lastRestart"]["cause"] == "PodDeleted"


def test_an_old_status_without_the_field_falls_back_to_the_inference() -> None:
    # Written by an operator before the field: status.replicas and lastRestart are all there is, and
    # they say "still to create" (the lag the field removes): rank 2's first name is asked for again.
    stale = run(job_spec(replicas=3), _after_a_replacement(), [pod(0), pod(1)], now=30)
    assert stale.create.ranks == (2,) and "ranksCreated" not in stale.report.status
    # Where they say every pod existed, the answer is recorded, and from then on the record decides.
    old = live_status(replicas=2)
    assert "ranksCreated" not in old
    recorded = run(job_spec(), old, [pod(0), pod(1)], now=30).report.status
    assert recorded["ranksCreated"] == 0
    lost = run(job_spec(), {**recorded, "replicas": 1}, [pod(0)], now=31)
    assert lost.create.ranks == () and lost.create.replacements == ((1, 1),)


@pytest.mark.parametrize(
    ("status", "pods", "ranks", "recorded"),
    [
        pytest.param({}, [pod(0), pod(2)], (1,), None, id="before-its-first-status-write"),
        pytest.param({}, [pod(0), pod(1), pod(2)], (), 0, id="every-pod-created-before-the-status-write"),
        pytest.param(
            live_status("Pending", attempt=1, replicas=0, ranksCreated=0),
            [pod(0, 1, phase="Pending")],
            (1, 2),
            0,
            id="mid-create-of-the-next-attempt",
        ),
        pytest.param(
            live_status("Pending", replicas=1),
            [pod(0, phase="Pending")],
            (1, 2),
            None,
            id="mid-create-under-an-old-status",
        ),
    ],
)
def test_an_operator_restarted_mid_create_creates_the_missing_pods(
    status: dict[str, Any], pods: list[dict[str, Any]], ranks: tuple[int, ...], recorded: int | None
) -> None:
    decision = run(job_spec(replicas=3), status, pods, now=5)
    assert decision.create.ranks == ranks
    assert decision.create.replacements == ()
    assert decision.report.status.get("ranksCreated") == recorded
    assert decision.report.status["phase"] == "Pending"
