"""Training progress from rank 0's metrics (progress.py) and what decide() does with it: status.progress,
Stalled restarts, status.straggler."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import at, job_spec, observe, pod, with_run_policy

from ddp_operator import progress, promtext
from ddp_operator.reconcile import decide

pytestmark = pytest.mark.unit


def scrape(
    seconds: float,
    steps: float,
    samples: float,
    *,
    target: float = 0,
    straggler: tuple[int, float] | None = None,
) -> progress.RankZeroScrape:
    lines = [
        f'ddp_sync_steps_total{{rank="0"}} {steps}',
        f'ddp_samples_total{{rank="0"}} {samples}',
        f'ddp_target_steps{{rank="0"}} {target}',
        'ddp_loss{rank="0"} 0.25',
        f'ddp_allreduce_bytes_total{{rank="0"}} {steps * 1e6}',
        f'ddp_allreduce_service_seconds_total{{rank="0"}} {steps * 0.01}',
        'ddp_allreduce_duration_seconds_bucket{rank="0",le="0.001"} 0',
        f'ddp_allreduce_duration_seconds_bucket{{rank="0",le="0.01"}} {steps}',
        f'ddp_allreduce_duration_seconds_bucket{{rank="0",le="+Inf"}} {steps}',
        f'ddp_allreduce_duration_seconds_count{{rank="0"}} {steps}',
        f'ddp_last_sync_timestamp_seconds{{rank="0"}} {at(seconds).timestamp()}',
    ]
    if straggler is not None:
        lines += [
            f'ddp_straggler_rank{{rank="0"}} {straggler[0]}',
            f'ddp_straggler_slowdown{{rank="0"}} {straggler[1]}',
        ]
    return progress.reduce_scrape(promtext.parse("\n".join(lines) + "\n"), at(seconds))


def test_progress_from_two_scrapes_of_rank_zero() -> None:
    shown = progress.progress_status(
        scrape(20, 300, 9600, target=1000), scrape(10, 200, 6400), pods=4, world_size=8
    )
    assert shown is not None
    assert shown["step"] == 300
    assert shown["samplesPerSecond"] == "1280"  # (9600 - 6400) / 10 s on rank 0's pod, times 4 pods
    assert shown["loss"] == "0.25"
    assert shown["percentComplete"] == 30
    assert shown["estimatedSecondsRemaining"] == 70  # 700 steps left at 10 steps/s
    assert shown["busBandwidthBytesPerSecond"] == "175000000"  # 1e8 B/s x 2 x 7/8
    assert 0.001 < float(str(shown["allreduceP50Seconds"])) <= 0.01
    assert shown["lastSyncTime"] == "2025-01-01T12:00:20Z"


@pytest.mark.parametrize(
    ("newest", "older", "absent"),
    [
        pytest.param(scrape(5, 0, 0), None, "everything", id="before-the-first-step"),
        pytest.param(
            scrape(20, 300, 100), scrape(10, 200, 6400), "samplesPerSecond", id="counters-went-back"
        ),
        pytest.param(scrape(20, 300, 9600), None, "percentComplete", id="total-unknown"),
    ],
)
def test_what_progress_cannot_know_it_does_not_show(
    newest: progress.RankZeroScrape, older: progress.RankZeroScrape | None, absent: str
) -> None:
    shown = progress.progress_status(newest, older, pods=2, world_size=2)
    if absent == "everything":
        assert shown is None
    else:
        assert shown is not None and absent not in shown


def observed(step: int, changed: float, **extra: Any) -> progress.ProgressObservation:
    return progress.ProgressObservation(attempt=0, step=step, step_changed_at=at(changed), **extra)


RUNNING = {
    "phase": "Running",
    "attempt": 0,
    "replicas": 2,
    "startTime": "2025-01-01T12:00:00Z",
    "conditions": [],
}


@pytest.mark.parametrize(
    ("timeout", "step", "changed", "now", "phase", "rank_steps", "named"),
    [
        pytest.param(60, 120, 100, 159, "Running", {0: 120, 1: 119}, "", id="inside-the-timeout"),
        pytest.param(
            60,
            120,
            100,
            161,
            "Restarting",
            {0: 120, 1: 119},
            "rank 1 (step 119)",
            id="no-step-for-the-timeout",
        ),
        pytest.param(
            60,
            120,
            100,
            161,
            "Restarting",
            {0: 120},
            "rank 1 (its metrics did not answer)",
            id="a-silent-rank-comes-first",
        ),
        pytest.param(60, 0, 0, 500, "Running", {}, "", id="training-never-started"),
        pytest.param(None, 120, 100, 500, "Running", {}, "", id="no-stall-timeout"),
    ],
)
def test_a_stall_restarts_the_gang_once_training_started(
    timeout: int | None,
    step: int,
    changed: float,
    now: float,
    phase: str,
    rank_steps: dict[int, int],
    named: str,
) -> None:
    job = job_spec(**with_run_policy(stallTimeoutSeconds=timeout)) if timeout else job_spec()
    seen = observed(step, changed, rank_steps=rank_steps)
    decision = decide(job, RUNNING, observe(pod(0), pod(1)), at(now), observed=seen)
    assert decision.status["phase"] == phase
    if phase == "Restarting":
        (restarting,) = [c for c in decision.status["conditions"] if c["type"] == "Restarting"]
        assert restarting["reason"] == "Stalled"
        assert f"furthest behind: {named}" in restarting["message"]
        assert decision.status["restarts"] == 1 and set(decision.delete_pods) == {"mnist-0-0", "mnist-1-0"}
    elif timeout and step:
        assert decision.requeue_after == pytest.approx(changed + timeout - now)


def test_progress_is_shown_while_running_and_kept_when_the_job_finishes() -> None:
    shown = {"step": 120, "observedTime": "2025-01-01T12:01:00Z"}
    running = decide(
        job_spec(), RUNNING, observe(pod(0), pod(1)), at(61), observed=observed(120, 50, status=shown)
    )
    assert running.status["progress"] == shown and running.status_changed
    done = decide(job_spec(), running.status, observe(pod(0, exit_code=0), pod(1, exit_code=0)), at(70))
    assert done.status["phase"] == "Succeeded" and done.status["progress"] == shown
    other_attempt = progress.ProgressObservation(
        attempt=3, step=5, step_changed_at=at(60), status={"step": 5}
    )
    assert (
        "progress"
        not in decide(job_spec(), RUNNING, observe(pod(0), pod(1)), at(61), observed=other_attempt).status
    )


def test_a_persistent_straggler_is_named_in_status_with_one_event() -> None:
    since = at(100)
    sighting = progress.StragglerSighting(rank=1, slowdown=2.0, since=since)
    early = decide(
        job_spec(), RUNNING, observe(pod(0), pod(1)), at(130), observed=observed(50, 125, straggler=sighting)
    )
    assert "straggler" not in early.status and early.requeue_after == pytest.approx(30)
    named = decide(
        job_spec(), RUNNING, observe(pod(0), pod(1)), at(161), observed=observed(60, 160, straggler=sighting)
    )
    assert named.status["straggler"] == {"rank": 1, "pod": "mnist-1-0", "node": "node-1", "slowdown": "2.00"}
    assert [n.reason for n in named.notices] == ["Straggler"]
    again = decide(
        job_spec(),
        named.status,
        observe(pod(0), pod(1)),
        at(175),
        observed=observed(70, 174, straggler=sighting),
    )
    assert again.notices == () and again.status["straggler"]["rank"] == 1


def test_the_straggler_sighting_follows_one_rank() -> None:
    first = progress.follow_straggler(None, scrape(10, 5, 5, straggler=(2, 1.8)), threshold=1.5)
    assert first is not None and first.since == at(10)
    same = progress.follow_straggler(first, scrape(20, 6, 6, straggler=(2, 1.9)), threshold=1.5)
    assert same is not None and same.since == at(10)
    other = progress.follow_straggler(same, scrape(30, 7, 7, straggler=(3, 1.9)), threshold=1.5)
    assert other is not None and (other.rank, other.since) == (3, at(30))
    assert progress.follow_straggler(other, scrape(40, 8, 8, straggler=(3, 1.2)), threshold=1.5) is None
