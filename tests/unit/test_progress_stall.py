"""A stalled gang (policies.stall): when the clock runs out, which ranks are named, and what decide()
does with it. `ddpjob run` uses the same policy: tests/unit/test_local_run_policy.py and, with real
ranks, tests/trainer/test_local_run.py."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import RUNNING_STATUS, at, job_spec, observe, pod, with_run_policy

from ddp_operator.policies import recovery, stall
from ddp_operator.policies.accounting import GroupRestartReport
from ddp_operator.progress.exposition import PodScrape, reduce_text
from ddp_operator.progress.tracker import ProgressObservation, ProgressTracker, stepped_at
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


def observed(step: int, changed: float, rank_steps: dict[int, int], read_at: float) -> ProgressObservation:
    """Training at ``step`` since ``changed``; every pod read at ``read_at``, ``rank_steps`` answering."""
    return ProgressObservation(
        attempt=0,
        step=step,
        step_changed_at=at(changed),
        rank_steps=rank_steps,
        rank_steps_read_at=at(read_at),
    )


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
        job,
        RUNNING_STATUS,
        observe(pod(0), pod(1)),
        at(now),
        observed=observed(120, 100, {0: 120, 1: 119}, read_at=157),
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


@pytest.mark.parametrize(
    ("configured", "step_seconds", "expected"),
    [
        pytest.param(45, 0.2, 45, id="stallTimeoutSeconds-is-an-override"),
        pytest.param(45, None, 45, id="stallTimeoutSeconds-before-any-step"),
        pytest.param(None, 0.2, 30, id="fast-steps-the-floor"),
        pytest.param(None, 12.5, 125, id="slow-steps-ten-of-them"),
        pytest.param(None, None, None, id="no-pace-observed-not-watched"),
    ],
)
def test_the_stall_limit_follows_the_jobs_pace_without_configuration(
    configured: int | None, step_seconds: float | None, expected: int | None
) -> None:
    assert stall.limit(configured, step_seconds) == expected


@pytest.mark.parametrize(
    ("configured", "step_at", "changes", "allowance", "expected"),
    [
        # The newest event is a step: the pace's limit from it, whatever changed before.
        pytest.param(None, 100, (90,), 0, (30, 100), id="a-step-after-the-change"),
        # A pod started, or the group re-formed, after the last step: the new round's processes start
        # and receive the state before it can step, so the unset limit is at least the start floor.
        pytest.param(None, 100, (105,), 0, (stall.START_FLOOR_SECONDS, 105), id="a-pod-started-since"),
        pytest.param(None, 100, (90, 108), 0, (stall.START_FLOOR_SECONDS, 108), id="re-formed-since"),
        # The job set stallTimeoutSeconds: the user's override holds after a change too.
        pytest.param(45, 100, (105,), 0, (45, 105), id="an-explicit-limit-is-kept"),
        # An elastic group waiting for a pod: its allowance on top of either.
        pytest.param(None, 100, (105,), 10, (stall.START_FLOOR_SECONDS + 10, 105), id="allowance-added"),
        pytest.param(None, 100, (), 10, (40, 100), id="allowance-on-the-pace"),
        # No step yet: the clock starts at the change, and nothing is watched before a pace is known.
        pytest.param(None, None, (105,), 0, (None, 105), id="no-pace-not-watched"),
    ],
)
def test_the_stall_clock_allows_a_new_round_its_start(
    configured: int | None,
    step_at: float | None,
    changes: tuple[float, ...],
    allowance: int,
    expected: tuple[int | None, float],
) -> None:
    pace = 0.2 if step_at is not None else None
    limit, since = stall.clock(
        configured, pace, at(step_at) if step_at is not None else None, *map(at, changes), allowance=allowance
    )
    assert (limit, since) == (expected[0], at(expected[1]))


def test_the_pace_is_the_steps_the_reads_saw_made_and_a_hang_does_not_change_it() -> None:
    tracker = ProgressTracker(pods=2, world_size=2)
    assert tracker.step_seconds is None
    for now, step in [(0, 0), (10, 5), (20, 15)]:
        tracker.record(at(now), {0: PodScrape(steps=step)})
    assert tracker.step_seconds == pytest.approx(1.0)
    tracker.record(at(90), {0: PodScrape(steps=15)})  # no new step for 70 s: hung
    assert tracker.step_seconds == pytest.approx(1.0)
    tracker.reset()
    assert tracker.step_seconds is None


def test_a_group_that_hangs_before_two_reads_saw_steps_is_watched_by_rank_0s_own_step_times() -> None:
    """The first read already shows step 36, and the group hangs before the next: the reads saw no step
    made, so the pace is rank 0's pod's own timing of its steps (ddp_step_duration_seconds), and the
    hang is found at the floor instead of never."""
    series = (
        'ddp_sync_steps_total{rank="0"} 36\n'
        'ddp_step_duration_seconds_sum{rank="0"} 7.2\n'
        'ddp_step_duration_seconds_count{rank="0"} 36\n'
    )
    tracker = ProgressTracker(pods=2, world_size=2)
    tracker.record(at(30), {0: reduce_text(series)})
    assert tracker.step_seconds == pytest.approx(0.2)
    tracker.record(at(45), {0: reduce_text(series)})
    limit, since = stall.clock(None, tracker.step_seconds, tracker.step_changed_at)
    assert (limit, since) == (stall.HANG_FLOOR_SECONDS, at(30))
    # Without the histogram (a trainer that does not time its steps) the pace stays unknown.
    bare = ProgressTracker(pods=2, world_size=2)
    bare.record(at(30), {0: reduce_text('ddp_sync_steps_total{rank="0"} 36\n')})
    assert bare.step_seconds is None


@pytest.mark.parametrize(
    ("now", "phase"),
    [
        pytest.param(129, "Running", id="inside-ten-steps-of-the-pace"),
        pytest.param(131, "Restarting", id="a-hang-found-without-stallTimeoutSeconds"),
    ],
)
def test_decide_finds_a_hang_without_a_stall_timeout(now: float, phase: str) -> None:
    job = job_spec(**with_run_policy(backoffLimit=3))
    assert job.run_policy.stall_timeout_seconds is None
    progress = ProgressObservation(
        # Every pod answers, none is singled out: the whole gang restarts.
        attempt=0,
        step=120,
        step_changed_at=at(100),
        rank_steps={0: 120, 1: 120},
        rank_steps_read_at=at(127),
        step_seconds=3.0,
    )
    decision = decide(job, RUNNING_STATUS, observe(pod(0), pod(1)), at(now), observed=progress)
    assert decision.report.status["phase"] == phase
    if phase == "Restarting":
        (condition,) = [c for c in decision.report.status["conditions"] if c["type"] == phase]
        assert condition["reason"] == "Stalled"
        assert "no synchronized step for 30s after step 120" in condition["message"]


def test_the_stall_clock_starts_again_when_the_group_restarts_and_stops_when_training_is_over() -> None:
    tracker = ProgressTracker(pods=2, world_size=2)
    tracker.record(at(0), {0: PodScrape(steps=5, target_steps=40, restart=GroupRestartReport(restarts=0))})
    tracker.record(at(10), {0: PodScrape(steps=15, target_steps=40, restart=GroupRestartReport(restarts=0))})
    assert tracker.group_changed_at is None and not tracker.finished
    tracker.record(at(50), {0: PodScrape(steps=15, target_steps=40, restart=GroupRestartReport(restarts=1))})
    assert tracker.group_changed_at == at(50)
    assert stall.clock_start(tracker.step_changed_at, tracker.group_changed_at) == at(50)
    tracker.record(at(60), {0: PodScrape(steps=40, target_steps=40, restart=GroupRestartReport(restarts=1))})
    assert tracker.finished


@pytest.mark.parametrize(
    ("pods", "progress", "watched"),
    [
        pytest.param((pod(0), pod(1)), {}, True, id="every-pod-running"),
        pytest.param((pod(0), pod(1, phase="Pending")), {}, False, id="a-pod-still-starting"),
        pytest.param((pod(0), pod(1, created=125)), {}, False, id="a-replacement-started-lately"),
        pytest.param((pod(0), pod(1)), {"group_changed_at": at(120)}, False, id="the-group-re-formed-lately"),
        pytest.param((pod(0), pod(1)), {"finished": True}, False, id="training-over"),
    ],
)
def test_no_hang_is_declared_while_the_group_is_changing_or_done(
    pods: tuple[dict[str, Any], ...], progress: dict[str, Any], watched: bool
) -> None:
    job = job_spec(**with_run_policy(backoffLimit=3))
    observation = ProgressObservation(
        attempt=0,
        step=120,
        step_changed_at=at(100),
        rank_steps={0: 120, 1: 120},
        rank_steps_read_at=at(127),
        step_seconds=3.0,
        **progress,
    )
    decision = decide(job, RUNNING_STATUS, observe(*pods), at(140), observed=observation)
    assert (decision.report.status["phase"] == "Restarting") is watched


@pytest.mark.parametrize(
    ("mode", "rank_steps", "phase", "replaced"),
    [
        # Rank 1's pod stopped answering (frozen, wedged): a lost pod, replaced alone; rank 0 keeps its.
        pytest.param("InPlace", {0: 120}, "Running", ((1, 1),), id="in-place-replaces-the-hung-pod-alone"),
        pytest.param("Recreate", {0: 120}, "Restarting", (), id="recreate-restarts-the-gang"),
        # The store is the rendezvous pod's: rank 0's hung pod is replaced alone like any other.
        pytest.param("InPlace", {1: 120}, "Running", ((0, 1),), id="rank-0-hung-replaced-alone"),
    ],
)
def test_a_hung_pod_that_stopped_answering_is_deleted_without_a_grace_period(
    mode: str, rank_steps: dict[int, int], phase: str, replaced: tuple[tuple[int, int], ...]
) -> None:
    job = job_spec(**with_run_policy(stallTimeoutSeconds=60, backoffLimit=3, restartMode=mode))
    decision = decide(
        job,
        RUNNING_STATUS,
        observe(pod(0), pod(1)),
        at(161),
        observed=observed(120, 100, rank_steps, read_at=157),
    )
    assert decision.report.status["phase"] == phase
    hung = "mnist-1-0" if 1 not in rank_steps else "mnist-0-0"
    # Its endpoint did not answer: it takes no SIGTERM, so no grace period.
    assert decision.delete.hung_pods == (hung,)
    assert decision.create.replacements == replaced
    if replaced:
        assert decision.delete.pods == (), "the survivor keeps its pod"
        record = decision.report.status["lastRestart"]
        assert (record["mode"], record["cause"], decision.report.status["restarts"]) == (
            "PodReplaced",
            "Stalled",
            1,
        )
    else:
        assert set(decision.delete.pods) == {"mnist-0-0", "mnist-1-0"} - {hung}


@pytest.mark.parametrize(
    ("mode", "silent", "queued", "expected"),
    [
        pytest.param("InPlace", [2, 1], False, (1, 2), id="hung-pods-replaced-alone"),
        pytest.param("InPlace", [], False, None, id="nobody-singled-out"),
        pytest.param("InPlace", [0, 1], False, None, id="rank-0-among-them-where-it-is-special"),
        pytest.param("InPlace", [1], True, None, id="a-kueue-group"),
        pytest.param("Recreate", [1], False, None, id="recreate"),
    ],
)
def test_which_hung_pods_are_replaced_alone(
    mode: str, silent: list[int], queued: bool, expected: tuple[int, ...] | None
) -> None:
    assert recovery.replaceable_hung(mode, silent, queued=queued) == expected


@pytest.mark.parametrize(
    ("last_sync", "before", "expected"),
    [
        pytest.param(at(4).timestamp(), at(0), at(4), id="the-ranks-time-between-the-reads"),
        pytest.param(at(-3).timestamp(), at(0), at(15), id="a-node-clock-behind-is-not-trusted"),
        pytest.param(at(20).timestamp(), at(0), at(15), id="a-node-clock-ahead-is-not-trusted"),
        pytest.param(None, at(0), at(15), id="no-time-exported"),
        pytest.param(at(4).timestamp(), None, at(15), id="the-first-read"),
    ],
)
def test_when_a_step_was_made(last_sync: float | None, before: Any, expected: Any) -> None:
    assert stepped_at(last_sync, at(15), before) == expected


def test_a_hang_is_timed_from_the_last_step_not_from_the_read_that_showed_it() -> None:
    """Reads every 15 s; the group makes its last step at 16 s and hangs. The read at 30 s shows it, and
    its stall clock starts at 16 s (the ranks' time of it), so the hang is due at 46 s, not at 60 s."""
    tracker = ProgressTracker(pods=2, world_size=2)
    tracker.record(at(0), {0: PodScrape(steps=10, last_sync=at(0).timestamp())})
    tracker.record(at(15), {0: PodScrape(steps=25, last_sync=at(15).timestamp())})
    tracker.record(at(30), {0: PodScrape(steps=26, last_sync=at(16).timestamp())})
    tracker.record(at(45), {0: PodScrape(steps=26, last_sync=at(16).timestamp())})
    limit, since = stall.clock(None, tracker.step_seconds, tracker.step_changed_at)
    assert (limit, since) == (stall.HANG_FLOOR_SECONDS, at(16))


@pytest.mark.parametrize(
    ("left", "read_at", "expected"),
    [
        pytest.param(2.0, 97.0, 2.0, id="before-the-deadline-on-a-late-read"),
        pytest.param(-1.0, 97.0, -1.0, id="due-and-read-late-enough-judged-now"),
        pytest.param(-1.0, 96.5, 14.0, id="due-but-read-too-early-waits-for-the-next-read"),
        pytest.param(-1.0, None, 14.0, id="due-and-never-read-waits"),
        pytest.param(-16.0, 80.0, -1.0, id="no-late-read-in-the-grace-judged-on-the-old-one"),
        pytest.param(None, 97.0, None, id="not-watched"),
    ],
)
def test_a_stall_is_judged_on_a_read_of_every_pod_that_started_just_before_it_fell_due(
    left: float | None, read_at: float | None, expected: float | None
) -> None:
    """The deadline is at 100 s on every row (``left`` seconds from now); a read of every pod that
    started at 97 s or later (its silent pods timed out by 100 s) is the one the verdict waits for."""
    now = at(100 - (left or 0))
    assert stall.read_due(left, now) == (None if left is None else at(97))
    assert stall.verdict_left(left, None if read_at is None else at(read_at), now) == expected


def test_a_pod_frozen_after_the_half_limit_read_is_named_by_the_read_at_the_deadline() -> None:
    """Limit 60 s from step 120 at 100 s: the read of every pod at 130 s (half the limit) still had both
    answering; rank 1's pod froze after it. Judged on that read, no pod would be singled out and the
    whole gang would go; the verdict waits for the read asked for at 157 s, which finds rank 1 silent."""
    job = job_spec(**with_run_policy(stallTimeoutSeconds=60, backoffLimit=3))
    pods = observe(pod(0), pod(1))
    early = decide(
        job, RUNNING_STATUS, pods, at(161), observed=observed(120, 100, {0: 120, 1: 119}, read_at=130)
    )
    assert early.report.status["phase"] == "Running" and not early.delete.pods and not early.delete.hung_pods
    assert early.read_every_pod_at == at(157)
    assert early.requeue_after == pytest.approx(stall.READ_GRACE_SECONDS - 1)
    late = decide(job, RUNNING_STATUS, pods, at(161), observed=observed(120, 100, {0: 120}, read_at=157))
    assert (late.report.status["phase"], late.delete.hung_pods) == ("Running", ("mnist-1-0",))
    assert late.create.replacements == ((1, 1),)
    # No read came by the grace's end (no endpoint could be read): judged on the last read, not never.
    never = decide(
        job, RUNNING_STATUS, pods, at(176), observed=observed(120, 100, {0: 120, 1: 119}, read_at=130)
    )
    assert never.report.status["phase"] == "Restarting"
