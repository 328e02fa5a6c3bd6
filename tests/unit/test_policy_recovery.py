"""policies/recovery.py and policies/accounting.py: which failures a replaced pod mends, and how a restart's
record is kept."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from ddp_operator.policies import accounting, recovery, restart_events
from ddp_operator.policies.failure import RankFailure

pytestmark = pytest.mark.unit

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def lost(rank: int, reason: str = "PodDeleted", by_queue: bool = False) -> RankFailure:
    return RankFailure(rank=rank, finish_key=T0.timestamp(), disruption=reason, by_queue=by_queue)


def exited(rank: int, code: int) -> RankFailure:
    return RankFailure(rank=rank, finish_key=T0.timestamp(), exit_code=code)


@pytest.mark.parametrize(
    ("mode", "failures", "expected"),
    [
        pytest.param("InPlace", [lost(2)], (2,), id="one-pod-deleted"),
        pytest.param("InPlace", [lost(3, "Evicted"), lost(1)], (1, 3), id="two-pods-lost"),
        pytest.param("InPlace", [lost(1, "Preempted")], (1,), id="scheduler-preemption"),
        pytest.param("InPlace", [lost(0)], None, id="rank-0-holds-the-rendezvous"),
        pytest.param("InPlace", [lost(1), lost(0)], None, id="rank-0-among-the-lost"),
        pytest.param("InPlace", [lost(1, "Preempted", by_queue=True)], None, id="kueue-eviction"),
        pytest.param("InPlace", [exited(1, 170)], None, id="a-launcher-gave-up"),
        pytest.param("InPlace", [lost(1), exited(2, 137)], None, id="lost-and-a-launcher-gave-up"),
        pytest.param(
            "InPlace",
            [RankFailure(rank=1, finish_key=T0.timestamp(), exit_code=143, disruption="PodDeleted")],
            (1,),
            id="deleted-and-its-sigterm-exit",
        ),
        pytest.param("InPlace", [lost(1, "Stalled")], None, id="stall"),
        pytest.param("Recreate", [lost(1)], None, id="recreate-mode"),
        pytest.param("InPlace", [], None, id="nothing-failed"),
    ],
)
def test_replaceable_ranks(mode: str, failures: list[RankFailure], expected: tuple[int, ...] | None) -> None:
    assert recovery.replaceable_ranks(mode, failures) == expected


def test_fallback_note_names_rank_0() -> None:
    assert "rank 0" in recovery.fallback_note([lost(0)])
    assert recovery.fallback_note([exited(1, 170)]) == ""


def report(restarts: int, offset: float = 0.0, **fields: Any) -> accounting.GroupRestartReport:
    base = T0.timestamp() + offset
    values: dict[str, Any] = {
        "failure_at": base,
        "stopped_at": base + 0.5,
        "reformed_at": base + 2.0,
        "resumed_at": base + 6.0,
        "steps_redone": 7,
        "cause": "ExitCode",
        "failed_rank": 1,
        "exit_code": 137,
    }
    values.update(fields)
    return accounting.GroupRestartReport(restarts=restarts, **values)


def test_an_in_place_restart_is_counted_and_measured() -> None:
    result = accounting.account(None, 0, report(1))
    assert result.added == 1
    assert result.record is not None
    assert result.record["mode"] == accounting.MODE_IN_PLACE
    assert result.record["rank"] == 1 and result.record["exitCode"] == 137
    assert (
        result.record["stoppedSeconds"],
        result.record["reformedSeconds"],
        result.record["resumedSeconds"],
    ) == ("0.50", "2.00", "6.00")
    assert result.record["stepsRedone"] == 7
    assert result.measured == (accounting.MODE_IN_PLACE, 6.0)


def test_a_round_already_accounted_is_not_counted_again() -> None:
    first = accounting.account(None, 0, report(1))
    assert first.record is not None
    again = accounting.account(first.record, 0, report(1))
    assert again.added == 0 and again.record is None and again.measured is None


def test_two_restarts_between_reads_count_twice() -> None:
    first = accounting.account(None, 0, report(1))
    later = accounting.account(first.record, 0, report(3, offset=60))
    assert later.added == 2
    assert later.record is not None and later.record["groupRestarts"] == 3


def test_a_new_attempt_starts_counting_again() -> None:
    first = accounting.account(None, 0, report(2))
    assert first.record is not None
    assert accounting.account(first.record, 1, report(1)).added == 1


def test_a_replaced_pods_round_fills_its_record_without_counting() -> None:
    failure = T0
    record = accounting.new_record(
        cause="PodDeleted",
        mode=accounting.MODE_POD_REPLACED,
        attempt=0,
        failure_time=failure,
        rank=2,
        group_restarts=1,
    )
    # The survivors saw their peer go 1.5 s after the operator saw the deletion.
    pending = accounting.account(record, 0, report(0))
    assert pending.added == 0 and pending.record is None
    filled = accounting.account(record, 0, report(1, offset=1.5))
    assert filled.added == 0
    assert filled.record is not None and filled.record["mode"] == accounting.MODE_POD_REPLACED
    assert filled.record["resumedSeconds"] == "7.50"  # from the operator's failure time, not the survivors'
    assert filled.measured == (accounting.MODE_POD_REPLACED, 7.5)
    assert accounting.account(filled.record, 0, report(1, offset=1.5)).record is None


def test_a_round_without_its_story_waits_for_the_next_read() -> None:
    assert (
        accounting.account(None, 0, report(1, failure_at=None, reformed_at=None))
        == accounting.RestartAccounting()
    )


def test_whole_gang_is_measured_to_the_next_attempts_first_step() -> None:
    record = accounting.new_record(
        cause="ExitCode", mode=accounting.MODE_WHOLE_GANG, attempt=0, failure_time=T0, rank=1
    )
    result = accounting.fill_whole_gang(record, 1, T0 + timedelta(seconds=15.25))
    assert result.measured == (accounting.MODE_WHOLE_GANG, 15.25)
    assert result.record is not None
    assert accounting.fill_whole_gang(result.record, 1, T0 + timedelta(seconds=30)).record is None
    assert accounting.fill_whole_gang(record, 2, T0 + timedelta(seconds=30)).record is None


@pytest.mark.parametrize(
    ("kept", "wall", "expected"),
    [
        pytest.param(90.0, 100.0, 0.9, id="ninety-percent"),
        pytest.param(None, 100.0, None, id="unknown"),
        pytest.param(120.0, 100.0, 1.0, id="clock-skew-capped"),
        pytest.param(10.0, 0.0, None, id="no-wall-time-yet"),
    ],
)
def test_goodput(kept: float | None, wall: float, expected: float | None) -> None:
    assert accounting.goodput(kept, T0, T0 + timedelta(seconds=wall)) == expected


def _measured(mode: str = "InPlace", at: str = "12:00:00", rounds: int = 1, **seconds: str) -> dict[str, Any]:
    return {
        "mode": mode,
        "attempt": 0,
        "groupRestarts": rounds,
        "failureTime": f"2026-12-01T{at}Z",
        **seconds,
    }


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        pytest.param(
            _measured(stoppedSeconds="0.50", reformedSeconds="2.00", resumedSeconds="3.25"),
            {"stopping": 0.5, "reforming": 1.5, "resuming": 1.25, "recreating": 0.0},
            id="every-phase",
        ),
        pytest.param(
            _measured(reformedSeconds="2.00", resumedSeconds="3.00"),
            {"stopping": 0.0, "reforming": 2.0, "resuming": 1.0, "recreating": 0.0},
            id="no-stop-reported-counts-in-the-re-form",
        ),
        pytest.param(
            _measured(stoppedSeconds="1.00", resumedSeconds="3.00"),
            {"stopping": 1.0, "reforming": 0.0, "resuming": 2.0, "recreating": 0.0},
            id="no-re-form-reported-counts-in-the-resume",
        ),
        pytest.param(
            _measured("WholeGang", resumedSeconds="17.20"),
            {"stopping": 0.0, "reforming": 0.0, "resuming": 0.0, "recreating": 17.2},
            id="whole-gang-one-span",
        ),
        pytest.param(
            _measured(stoppedSeconds="4.00", reformedSeconds="9.00", resumedSeconds="3.00"),
            {"stopping": 3.0, "reforming": 0.0, "resuming": 0.0, "recreating": 0.0},
            id="phases-past-the-resume-are-capped",
        ),
        pytest.param(_measured(stoppedSeconds="0.50"), None, id="not-measured-yet"),
    ],
)
def test_restart_phases(record: dict[str, Any], expected: dict[str, float] | None) -> None:
    assert accounting.restart_phases(record) == expected


FIRST = _measured(stoppedSeconds="0.50", reformedSeconds="2.00", resumedSeconds="3.00")
FIRST_TOTALS = {
    "stopping": "0.50",
    "reforming": "1.50",
    "resuming": "1.00",
    "recreating": "0.00",
    "total": "3.00",
    "restarts": 1,
}


@pytest.mark.parametrize(
    ("total", "old_record", "new_record", "expected"),
    [
        pytest.param(None, None, None, None, id="no-restart"),
        pytest.param(None, None, FIRST, FIRST_TOTALS, id="first-measured"),
        pytest.param(
            None, _measured(stoppedSeconds="0.50"), FIRST, FIRST_TOTALS, id="measured-in-a-later-write"
        ),
        pytest.param(FIRST_TOTALS, FIRST, FIRST, FIRST_TOTALS, id="added-once"),
        pytest.param(
            FIRST_TOTALS,
            FIRST,
            {**FIRST, "stepsRedone": 0},
            FIRST_TOTALS,
            id="a-later-field-of-the-same-restart-adds-nothing",
        ),
        pytest.param(None, None, _measured(stoppedSeconds="0.50"), None, id="cost-not-known-yet"),
        pytest.param(
            FIRST_TOTALS,
            FIRST,
            _measured("WholeGang", at="12:01:00", resumedSeconds="10.00"),
            {**FIRST_TOTALS, "recreating": "10.00", "total": "13.00", "restarts": 2},
            id="a-second-restart-adds-up",
        ),
        pytest.param(
            FIRST_TOTALS,
            FIRST,
            _measured(
                at="12:00:00", rounds=2, stoppedSeconds="1.00", reformedSeconds="2.00", resumedSeconds="2.50"
            ),
            {
                "stopping": "1.50",
                "reforming": "2.50",
                "resuming": "1.50",
                "recreating": "0.00",
                "total": "5.50",
                "restarts": 2,
            },
            id="the-next-round-at-the-same-second-is-another-restart",
        ),
        pytest.param(FIRST_TOTALS, FIRST, None, FIRST_TOTALS, id="totals-kept-without-a-record"),
    ],
)
def test_lost_seconds(total: Any, old_record: Any, new_record: Any, expected: dict[str, Any] | None) -> None:
    assert accounting.lost_seconds(total, old_record, new_record) == expected


def test_describe_names_cause_mode_and_phases() -> None:
    result = accounting.account(None, 0, report(1))
    assert result.record is not None
    text = restart_events.describe(result.record, 1, 3)
    assert "rank 1" in text and "exit code 137" in text and "in place" in text
    assert "training again after 6.00s" in text and "7 step(s) redone" in text
