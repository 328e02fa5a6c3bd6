"""Training progress from rank 0's metrics as the operator reads it (ddp_operator.progress) and what
decide() does with it: status.progress, status.straggler. Stalls: tests/unit/test_progress_stall.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from tests.unit.kube_factories import RUNNING_STATUS, at, job_spec, observe, pod

from ddp_operator.policies.accounting import GroupRestartReport
from ddp_operator.progress import render, tracker
from ddp_operator.progress.exposition import PodScrape, reduce_text
from ddp_operator.reconcile import decide

pytestmark = pytest.mark.unit


def rank_zero(
    seconds: float,
    steps: float,
    samples: float,
    *,
    target: float = 0,
    straggler: tuple[int, float] | None = None,
    phase: str = "compute",
) -> PodScrape:
    """Rank 0's pod as the trainer exports it at ``seconds`` (at()'s clock)."""
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
            *(
                f'ddp_straggler_phase{{phase="{name}",rank="0"}} {1.0 if name == phase else 0.0}'
                for name in ("data", "compute", "communication")
            ),
        ]
    return reduce_text("\n".join(lines) + "\n")


def shown(
    reads: list[tuple[float, PodScrape]], pods: int = 4, world_size: int = 8
) -> dict[str, object] | None:
    """status.progress after the operator's reads of rank 0's pod, at (seconds, scrape)."""
    followed = tracker.ProgressTracker(pods, world_size)
    for seconds, scrape in reads:
        followed.record(at(seconds), {0: scrape})
    return render.status_progress(followed.view())


def test_progress_from_two_reads_of_rank_zero() -> None:
    status = shown([(10, rank_zero(10, 200, 6400)), (20, rank_zero(20, 300, 9600, target=1000))])
    assert status is not None
    assert status["step"] == 300
    assert status["samplesPerSecond"] == "1280"  # (9600 - 6400) / 10 s on rank 0's pod, times 4 pods
    assert status["loss"] == "0.25"
    assert status["percentComplete"] == 30
    assert status["estimatedSecondsRemaining"] == 70  # 700 steps left at 10 steps/s
    assert status["busBandwidthBytesPerSecond"] == "175000000"  # 1e8 B/s x 2 x 7/8
    assert 0.001 < float(str(status["allreduceP50Seconds"])) <= 0.01
    assert status["lastSyncTime"] == "2025-01-01T12:00:20Z"
    assert status["observedTime"] == "2025-01-01T12:00:20Z"


@pytest.mark.parametrize(
    ("reads", "absent"),
    [
        pytest.param([(5, rank_zero(5, 0, 0))], "everything", id="before-the-first-step"),
        pytest.param(
            [(10, rank_zero(10, 200, 6400)), (20, rank_zero(20, 300, 100))],
            "samplesPerSecond",
            id="counters-went-back",
        ),
        pytest.param([(20, rank_zero(20, 300, 9600))], "percentComplete", id="total-unknown"),
        pytest.param(
            [(20, rank_zero(20, 300, 9600, target=1000))], "estimatedSecondsRemaining", id="one-read-no-rate"
        ),
    ],
)
def test_what_progress_cannot_know_it_does_not_show(
    reads: list[tuple[float, PodScrape]], absent: str
) -> None:
    status = shown(reads, pods=2, world_size=2)
    if absent == "everything":
        assert status is None
    else:
        assert status is not None and absent not in status


def test_the_rate_is_between_the_last_two_reads_at_the_operators_interval() -> None:
    # Reads 15 s apart (the default --progress-interval) are further apart than the rate window.
    reads = [(0, rank_zero(0, 0, 0)), (15, rank_zero(15, 100, 1500)), (30, rank_zero(30, 400, 6000))]
    status = shown(reads, pods=1, world_size=2)
    assert status is not None and status["samplesPerSecond"] == "300"  # (6000 - 1500) / 15 s


def observed(step: int, changed: float, **extra: Any) -> tracker.ProgressObservation:
    return tracker.ProgressObservation(attempt=0, step=step, step_changed_at=at(changed), **extra)


def test_progress_is_shown_while_running_and_kept_when_the_job_finishes() -> None:
    status = {"step": 120, "observedTime": "2025-01-01T12:01:00Z"}
    running = decide(
        job_spec(), RUNNING_STATUS, observe(pod(0), pod(1)), at(61), observed=observed(120, 50, status=status)
    )
    assert running.report.status["progress"] == status and running.report.changed
    done = decide(
        job_spec(), running.report.status, observe(pod(0, exit_code=0), pod(1, exit_code=0)), at(70)
    )
    assert done.report.status["phase"] == "Succeeded" and done.report.status["progress"] == status


def test_progress_of_another_attempt_is_not_shown() -> None:
    other_attempt = tracker.ProgressObservation(attempt=3, step=5, step_changed_at=at(60), status={"step": 5})
    decision = decide(job_spec(), RUNNING_STATUS, observe(pod(0), pod(1)), at(61), observed=other_attempt)
    assert "progress" not in decision.report.status


def test_a_persistent_straggler_is_named_in_status_with_one_event() -> None:
    window = tracker.STRAGGLER_WINDOW_SECONDS
    sighting = tracker.StragglerSighting(rank=1, slowdown=2.0, since=at(100), phase="communication")
    early = decide(
        job_spec(),
        RUNNING_STATUS,
        observe(pod(0), pod(1)),
        at(110),
        observed=observed(50, 105, straggler=sighting),
    )
    assert "straggler" not in early.report.status and early.requeue_after == pytest.approx(window - 10)
    later = 100 + window + 1
    named = decide(
        job_spec(),
        RUNNING_STATUS,
        observe(pod(0), pod(1)),
        at(later),
        observed=observed(60, later, straggler=sighting),
    )
    assert named.report.status["straggler"] == {
        "rank": 1,
        "pod": "mnist-1-0",
        "node": "node-1",
        "slowdown": "2.00",
        "phase": "communication",
    }
    assert [n.reason for n in named.report.notices] == ["Straggler"]
    assert named.report.notices[0].message == (
        "rank 1 makes the job's step 2.00x as long as it would be without it, losing its time in "
        f"communication (mnist-1-0 on node node-1), for {window:.0f}s: the other ranks wait for it in "
        "every step"
    )
    again = decide(
        job_spec(),
        named.report.status,
        observe(pod(0), pod(1)),
        at(later + 14),
        observed=observed(70, later + 13, straggler=sighting),
    )
    assert again.report.notices == () and again.report.status["straggler"]["rank"] == 1


def test_a_straggler_of_a_pod_with_several_ranks_is_shown_with_that_pod() -> None:
    # 2 pods x 2 processes: global rank 3 is pod 1's second process.
    sighting = tracker.StragglerSighting(rank=3, slowdown=1.8, since=at(0), phase="data")
    later = tracker.STRAGGLER_WINDOW_SECONDS + 1
    named = decide(
        job_spec(nprocPerNode=2),
        {**RUNNING_STATUS, "worldSize": 4},
        observe(pod(0), pod(1)),
        at(later),
        observed=observed(60, later, straggler=sighting),
    )
    assert named.report.status["straggler"] == {
        "rank": 3,
        "pod": "mnist-1-0",
        "node": "node-1",
        "slowdown": "1.80",
        "phase": "data",
    }


def test_a_trainer_that_names_no_phase_shows_none() -> None:
    sighting = tracker.StragglerSighting(rank=1, slowdown=2.0, since=at(0))
    assert "phase" not in render.straggler_status(sighting, "mnist-1-0", "node-1")


# Reads of rank 0 at 10, 20, 30, 40 s naming (rank, slowdown) -> (rank, since) of the sighting after each.
FOLLOWING = {
    "one rank stays slow": ([(2, 1.8), (2, 1.9)], [(2, 10), (2, 10)]),
    "another rank starts anew": ([(2, 1.8), (3, 1.9)], [(2, 10), (3, 20)]),
    "below the threshold ends it": ([(2, 1.8), (2, 1.2), (2, 1.8)], [(2, 10), None, (2, 30)]),
    "at the threshold counts": ([(2, tracker.STRAGGLER_THRESHOLD)], [(2, 10)]),
}


def test_the_sighting_keeps_the_phase_rank_zero_last_named() -> None:
    followed = tracker.ProgressTracker(4, 4)
    for seconds, phase in ((10.0, "compute"), (20.0, "communication")):
        followed.record(at(seconds), {0: rank_zero(seconds, seconds, 0, straggler=(2, 2.5), phase=phase)})
    assert followed.straggler == tracker.StragglerSighting(2, 2.5, at(10), "communication")


@pytest.mark.parametrize("case", FOLLOWING, ids=list(FOLLOWING))
def test_the_straggler_sighting_follows_one_rank(case: str) -> None:
    named, expected = FOLLOWING[case]
    followed = tracker.ProgressTracker(4, 4)
    seen = []
    for index, straggler in enumerate(named):
        seconds = 10.0 * (index + 1)
        followed.record(at(seconds), {0: rank_zero(seconds, index + 1, 0, straggler=straggler)})
        sighting = followed.straggler
        seen.append(None if sighting is None else (sighting.rank, sighting.since))
    assert seen == [None if e is None else (e[0], at(e[1])) for e in expected]


@pytest.mark.parametrize(
    ("group_members", "samples_per_second"),
    [
        pytest.param(None, "1280", id="no-group-reported-every-pod"),
        pytest.param(4, "1280", id="the-whole-group"),
        pytest.param(2, "640", id="an-elastic-group-shrunk-to-two-of-four-pods"),
    ],
)
def test_samples_per_second_counts_the_pods_training_now(
    group_members: int | None, samples_per_second: str
) -> None:
    followed = tracker.ProgressTracker(4, 4)
    for seconds, scrape in [(10, rank_zero(10, 200, 6400)), (20, rank_zero(20, 300, 9600))]:
        report = (
            None if group_members is None else GroupRestartReport(restarts=1, group_members=group_members)
        )
        followed.record(at(seconds), {0: replace(scrape, restart=report)})
    status = render.status_progress(followed.view())
    assert status is not None and status["samplesPerSecond"] == samples_per_second


def test_a_re_formed_group_starts_the_sighting_anew() -> None:
    # Rank 2 named at 10 and 20 s; the group re-forms (a replacement joined) before the read at 30 s:
    # the new round's windows are its members' own, so the sighting counts from that read.
    before = tracker.follow_straggler(None, rank_zero(10, 10, 0, straggler=(2, 2.5)), at(10), 1.5)
    kept = tracker.follow_straggler(before, rank_zero(20, 20, 0, straggler=(2, 2.5)), at(20), 1.5)
    anew = tracker.follow_straggler(kept, rank_zero(30, 30, 0, straggler=(2, 2.5)), at(30), 1.5, at(25))
    assert (kept and kept.since, anew and anew.since, anew and anew.group_since) == (at(10), at(30), at(25))


HEALTH_SERIES = {
    "none-ran": ([], None),
    "all-links-fine": (
        [
            'ddp_health_check_timestamp_seconds{rank="0"} 1735732800.5',
            'ddp_health_busbw_bytes_per_second{rank="0"} 123456789.0',
            'ddp_health_check_seconds{rank="0"} 0.68',
            'ddp_health_slow_rank{rank="0"} -1',
            'ddp_health_slow_link{rank="0"} -1',
        ],
        {"time": "2025-01-01T12:00:00Z", "busBandwidthBytesPerSecond": "123456789", "seconds": "0.68"},
    ),
    "a-slow-rank-and-link": (
        [
            'ddp_health_check_timestamp_seconds{rank="0"} 1735732800.5',
            'ddp_health_busbw_bytes_per_second{rank="0"} 2.5e6',
            'ddp_health_slow_rank{rank="0"} 2',
            'ddp_health_slow_link{rank="0"} 1',
        ],
        {
            "time": "2025-01-01T12:00:00Z",
            "busBandwidthBytesPerSecond": "2500000",
            "slowRank": 2,
            "slowLink": 1,
        },
    ),
}


@pytest.mark.parametrize("case", list(HEALTH_SERIES))
def test_the_last_health_check_is_shown_in_progress(case: str) -> None:
    """status.progress.healthCheck: rank 0's last gang health check as its pod exports it (a check that
    found nothing is shown too: its bandwidth is what a user compares jobs by); none without a check."""
    lines, expected = HEALTH_SERIES[case]
    base = 'ddp_sync_steps_total{rank="0"} 10\n'
    health = reduce_text(base + "".join(f"{line}\n" for line in lines)).health
    followed = tracker.ProgressTracker(2, 2)
    followed.record(at(0), {0: rank_zero(0, 10, 640)})
    progress = render.status_progress(followed.view(), health)
    assert progress is not None and progress.get("healthCheck") == expected
