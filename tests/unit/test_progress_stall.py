"""A stalled gang (policies.stall): when the clock runs out, which ranks are named, and what decide()
does with it. `ddpjob run` uses the same policy: tests/unit/test_local_run_policy.py and, with real
ranks, tests/trainer/test_local_run.py."""

from __future__ import annotations

import pytest
from tests.unit.kube_factories import RUNNING_STATUS, at, job_spec, observe, pod, with_run_policy

from ddp_operator.policies import stall
from ddp_operator.progress.tracker import ProgressObservation
from ddp_operator.reconcile import decide

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("limit", "step", "now", "left", "suspected"),
    [
        pytest.param(60, 120, 129, 31, False, id="early"),
        pytest.param(60, 120, 130, 30, True, id="half-the-limit-reads-every-rank"),
        pytest.param(60, 120, 160, 0, True, id="the-limit-is-a-stall"),
        pytest.param(60, 0, 500, None, False, id="training-never-started"),
        pytest.param(None, 120, 500, None, False, id="no-stall-timeout"),
    ],
)
def test_the_stall_clock_runs_from_the_last_new_step(
    limit: int | None, step: int, now: float, left: float | None, suspected: bool
) -> None:
    assert stall.seconds_left(limit, step, at(100), at(now)) == left
    assert stall.suspected(limit, step, at(100), at(now)) is suspected


@pytest.mark.parametrize(
    ("rank_steps", "named"),
    [
        pytest.param(
            {0: 120, 2: 119, 4: 120},
            "rank 2 (step 119) on node n2, rank 0 (step 120) on node n0",
            id="behind",
        ),
        pytest.param(
            {0: 120, 4: 120}, "rank 2 (its metrics did not answer) on node n2, rank 0", id="silent-first"
        ),
        pytest.param({}, "", id="nothing-read"),
    ],
)
def test_a_stall_names_the_silent_ranks_then_the_ranks_behind(rank_steps: dict[int, int], named: str) -> None:
    nodes: dict[int, str | None] = {0: "n0", 2: "n2", 4: "n4"}  # 3 pods of 2 processes each
    failure, detail = stall.stalled(60, 120, rank_steps, nodes, at(200))
    assert detail.startswith("no synchronized step for 60s after step 120")
    assert failure.reason == "Stalled" and failure.finish_key == at(200).timestamp()
    if named:
        assert f"furthest behind: {named}" in detail
        assert failure.rank == 2
    else:
        assert "furthest behind" not in detail and failure.rank == 0


def observed(step: int, changed: float, rank_steps: dict[int, int]) -> ProgressObservation:
    return ProgressObservation(attempt=0, step=step, step_changed_at=at(changed), rank_steps=rank_steps)


@pytest.mark.parametrize(
    ("backoff_limit", "now", "phase", "reason"),
    [
        pytest.param(3, 159, "Running", "", id="inside-the-timeout"),
        pytest.param(3, 161, "Restarting", "Stalled", id="restarts-the-gang"),
        pytest.param(0, 161, "Failed", "BackoffLimitExceeded", id="counts-against-backoffLimit"),
    ],
)
def test_decide_restarts_a_stalled_gang(backoff_limit: int, now: float, phase: str, reason: str) -> None:
    job = job_spec(**with_run_policy(stallTimeoutSeconds=60, backoffLimit=backoff_limit))
    decision = decide(
        job, RUNNING_STATUS, observe(pod(0), pod(1)), at(now), observed=observed(120, 100, {0: 120, 1: 119})
    )
    assert decision.report.status["phase"] == phase
    if phase == "Running":
        assert decision.requeue_after == pytest.approx(160 - now)
        return
    (condition,) = [c for c in decision.report.status["conditions"] if c["type"] == phase]
    assert condition["reason"] == reason
    assert (
        "no synchronized step for 60s after step 120; furthest behind: rank 1 (step 119)"
        in condition["message"]
    )
    if phase == "Restarting":
        assert decision.report.status["restarts"] == 1 and set(decision.delete.pods) == {
            "mnist-0-0",
            "mnist-1-0",
        }
