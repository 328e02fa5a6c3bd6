"""What each restart cost: ``status.lastRestart`` kept from rank 0's reads, ``status.lostSeconds`` and the
job's goodput. Shared by the operator and `ddpjob run`.

Each restart is recorded in ``status.lastRestart``: cause, mode (how it was recovered, policies/recovery.py
chooses), the seconds from the failure to the survivors stopped, to the group re-formed and to the first
training step after the resume, and the steps done again. The launchers restart in place on their own;
the operator learns of it from rank 0's metrics (``ddp_group_restarts_total`` and the
``ddp_last_restart_*`` gauges) and counts it in ``status.restarts``. The job's goodput is the share of
its wall time spent in steps that were kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from ddp_operator.observe import int_field

# The recovery modes a record names (docs/restarts.md; policies/recovery.py says which mends what).
MODE_IN_PLACE: Final = "InPlace"
MODE_POD_REPLACED: Final = "PodReplaced"
MODE_WHOLE_GANG: Final = "WholeGang"
RECOVERY_MODES: Final = (MODE_IN_PLACE, MODE_POD_REPLACED, MODE_WHOLE_GANG)


@dataclass(frozen=True)
class GroupRestartReport:
    """What rank 0's pod says of its group's in-place restarts in this attempt (docs/metrics.md).

    Times are unix seconds as the pods' clocks read them (the failed pod's for ``failure_at``, rank 0's
    for the rest); None until the group has restarted.
    """

    restarts: int  # ddp_group_restarts_total: rounds after the attempt's first
    # ddp_group_grows_total: of those, the rounds that only grew an elastic group (no failure: not
    # counted against backoffLimit).
    grows: int = 0
    # ddp_group_resizes_total: of those, the rounds that changed the group's size (None: not exported)
    resizes: int | None = None
    group_members: int | None = None  # ddp_group_members: the group's members (pods) now
    members_before: int | None = None  # the group's members before the last restart
    members_after: int | None = None  # and after it
    failure_at: float | None = None
    stopped_at: float | None = None
    reformed_at: float | None = None
    resumed_at: float | None = None
    steps_redone: int | None = None
    cause: str | None = None
    failed_rank: int | None = None
    exit_code: int | None = None
    kept_step_seconds: float | None = None  # seconds of the steps the current state includes
    # Rank 0's first step after its latest resume from a checkpoint, whatever brought it back.
    any_resumed_at: float | None = None


@dataclass(frozen=True)
class RestartAccounting:
    """What a scrape adds: restarts to count, the new ``status.lastRestart``, and a finished measure."""

    added: int = 0
    record: Mapping[str, Any] | None = None
    # (mode, seconds from the failure to the first training step after the resume), once known.
    measured: tuple[str, float] | None = None


NOTHING_NEW: Final = RestartAccounting()


def format_micro_time(value: datetime) -> str:
    """RFC 3339 with microseconds (the API's MicroTime form): a restart's phases last fractions of a second."""
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _failure_seconds(record: Mapping[str, Any]) -> float | None:
    text = str(record.get("failureTime", ""))
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _seconds(later: float | None, earlier: float | None) -> float | None:
    if later is None or earlier is None:
        return None
    return round(max(0.0, later - earlier), 3)


def new_record(
    *,
    cause: str,
    mode: str,
    attempt: int,
    failure_time: datetime,
    rank: int | None = None,
    exit_code: int | None = None,
    group_restarts: int = 0,
    note: str = "",
) -> dict[str, Any]:
    """``status.lastRestart`` when a restart starts; its seconds are filled as the group reports them
    (decimal strings, like every fraction in the status, as the API conventions prefer to floats).

    ``group_restarts``: the value of rank 0's ``ddp_group_restarts_total`` that this restart brings
    (a replaced pod's survivors re-form once more), so that round is not counted twice.
    """
    record: dict[str, Any] = {
        "cause": cause,
        "mode": mode,
        "attempt": attempt,
        "groupRestarts": group_restarts,
        "failureTime": format_micro_time(failure_time),
    }
    if rank is not None:
        record["rank"] = rank
    if exit_code is not None:
        record["exitCode"] = exit_code
    if note:
        record["note"] = note
    return record


def _fill(record: dict[str, Any], report: GroupRestartReport) -> tuple[str, float] | None:
    """Copy the report's phases into the record; the (mode, seconds) measure when it completes now."""
    failure = _failure_seconds(record)
    had_resumed = "resumedSeconds" in record
    for key, at in (
        ("stoppedSeconds", report.stopped_at),
        ("reformedSeconds", report.reformed_at),
        ("resumedSeconds", report.resumed_at),
    ):
        seconds = _seconds(at, failure)
        if seconds is not None:
            record[key] = f"{seconds:.2f}"
    if report.steps_redone is not None:
        record["stepsRedone"] = report.steps_redone
    if report.members_before is not None and report.members_after is not None:
        record["replicasBefore"], record["replicasAfter"] = report.members_before, report.members_after
    if not had_resumed and "resumedSeconds" in record:
        return str(record["mode"]), float(_seconds(report.resumed_at, failure) or 0.0)
    return None


def account(
    last: Mapping[str, Any] | None, attempt: int, report: GroupRestartReport | None
) -> RestartAccounting:
    """Fold a read of rank 0's restart series into ``status.lastRestart``.

    Rounds beyond what the last record accounts for are in-place restarts the launchers made on their
    own: counted, and recorded from the report (its failure time is the failed worker's). A report of
    the round the record already accounts for (a replaced pod's) fills the record's seconds.
    """
    if report is None:
        return RestartAccounting()
    same_attempt = isinstance(last, Mapping) and last.get("attempt") == attempt
    accounted = int(last.get("groupRestarts", 0)) if same_attempt and last is not None else 0
    grows_accounted = int(last.get("groupGrows", 0)) if same_attempt and last is not None else 0
    if report.restarts > accounted:
        failure_at = report.failure_at if report.failure_at is not None else report.reformed_at
        if failure_at is None:
            return RestartAccounting()  # the round is known but not yet its story: count it next read
        record = new_record(
            cause=report.cause or "ExitCode",
            mode=MODE_IN_PLACE,
            attempt=attempt,
            failure_time=datetime.fromtimestamp(failure_at, UTC),
            rank=report.failed_rank,
            exit_code=report.exit_code,
            group_restarts=report.restarts,
        )
        if report.grows:
            record["groupGrows"] = report.grows
        measured = _fill(record, report)
        # Rounds that only grew an elastic group are no failure: they do not count against backoffLimit.
        added = max(0, (report.restarts - accounted) - max(0, report.grows - grows_accounted))
        return RestartAccounting(added=added, record=record, measured=measured)
    if same_attempt and last is not None and report.restarts == accounted and accounted > 0:
        record = dict(last)
        measured = _fill(record, report)
        if record != dict(last):
            return RestartAccounting(record=record, measured=measured)
    return RestartAccounting()


def account_read(
    last: object, attempt: int, report: GroupRestartReport | None, step: int, steps_moved_at: datetime
) -> RestartAccounting:
    """What one read of rank 0's pod says of restarts: in-place ones to count (``account``), or a
    whole-gang restart's cost to record (``fill_whole_gang``) once the attempt's steps move.

    ``last``: ``status.lastRestart``; ``step``: the attempt's step as read; ``steps_moved_at``: when
    the operator first saw that step, the whole gang's first step when rank 0 does not say its own.
    """
    previous = last if isinstance(last, Mapping) else None
    accounting = account(previous, attempt, report)
    if accounting.record is None and step > 0:
        resumed = report.any_resumed_at if report is not None else None
        first = datetime.fromtimestamp(resumed, UTC) if resumed is not None else steps_moved_at
        accounting = fill_whole_gang(previous, attempt, first)
    return accounting


def same_round(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two records of one restart: the same attempt and the same round of its group."""
    return a.get("attempt") == b.get("attempt") and a.get("groupRestarts") == b.get("groupRestarts")


def fill_whole_gang(
    last: Mapping[str, Any] | None, attempt: int, first_sync: datetime | None
) -> RestartAccounting:
    """A whole-gang restart: from the failure to the new attempt's first training step after its resume
    (its pods, interpreters, rendezvous and checkpoint load all included). ``first_sync``: rank 0's own
    time of it (``ddp_resumed_timestamp_seconds``), else when the operator first saw the steps move."""
    if not isinstance(last, Mapping) or last.get("mode") != MODE_WHOLE_GANG or first_sync is None:
        return RestartAccounting()
    if last.get("attempt") != attempt - 1 or "resumedSeconds" in last:
        return RestartAccounting()
    record = dict(last)
    seconds = _seconds(first_sync.timestamp(), _failure_seconds(record))
    if seconds is None:
        return RestartAccounting()
    record["resumedSeconds"] = f"{seconds:.2f}"
    return RestartAccounting(record=record, measured=(MODE_WHOLE_GANG, seconds))


# status.lostSeconds: where the restarts' time went, by phase (docs/restarts.md, "Every restart measured").
LOST_PHASES: Final = ("stopping", "reforming", "resuming", "recreating")


def _record_seconds(record: Mapping[str, Any], key: str) -> float | None:
    try:
        return float(record[key]) if key in record else None
    except (TypeError, ValueError):
        return None


def _same_restart(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return (
        same_round(a, b) and a.get("failureTime") == b.get("failureTime") and a.get("mode") == b.get("mode")
    )


def restart_phases(record: Mapping[str, Any]) -> dict[str, float] | None:
    """A measured restart's seconds by phase (``LOST_PHASES``): stopping (the failure to every survivor's
    workers stopped), reforming (to the new rendezvous round: a replacement pod's start is in it),
    resuming (to rank 0's first kept step: the state hand-off and the step). A whole gang's restart is
    one span, recreating. A phase the group did not report is counted in the next one. None until the
    restart's cost is known (``resumedSeconds``)."""
    resumed = _record_seconds(record, "resumedSeconds")
    if resumed is None:
        return None
    phases = dict.fromkeys(LOST_PHASES, 0.0)
    if record.get("mode") == MODE_WHOLE_GANG:
        phases["recreating"] = resumed
        return phases
    stopped = min(_record_seconds(record, "stoppedSeconds") or 0.0, resumed)
    reformed = min(max(_record_seconds(record, "reformedSeconds") or stopped, stopped), resumed)
    phases.update(stopping=stopped, reforming=reformed - stopped, resuming=resumed - reformed)
    return phases


def lost_seconds(total: object, old_record: object, new_record: object) -> dict[str, Any] | None:
    """``status.lostSeconds``: the old totals, plus the new ``status.lastRestart``'s phases the first time
    its cost is known. The record and the totals are written in one status write, so a restart is added
    exactly once whoever writes, and a read never sees one without the other."""
    old = total if isinstance(total, Mapping) else {}
    if not isinstance(new_record, Mapping):
        return dict(old) or None
    if (
        isinstance(old_record, Mapping)
        and _same_restart(old_record, new_record)
        and "resumedSeconds" in old_record
    ):
        return dict(old) or None  # counted when it was measured
    phases = restart_phases(new_record)
    if phases is None:
        return dict(old) or None
    sums = {key: (_record_seconds(old, key) or 0.0) + phases[key] for key in LOST_PHASES}
    result: dict[str, Any] = {key: f"{value:.2f}" for key, value in sums.items()}
    result["total"] = f"{sum(sums.values()):.2f}"
    result["restarts"] = int_field(old.get("restarts"), 0) + 1
    return result


def goodput(kept_step_seconds: float | None, start: datetime | None, now: datetime) -> float | None:
    """The share of the job's wall time spent in steps it kept (restarts, redone steps, start-up and
    checkpoint loads are the rest); None until both are known."""
    if kept_step_seconds is None or start is None:
        return None
    wall = (now - start).total_seconds()
    if wall <= 0:
        return None
    return round(min(1.0, max(0.0, kept_step_seconds / wall)), 4)


# rank 0's launcher's cause of a round no worker failed for: a pod joined (a replacement, or capacity back).
CAUSE_MEMBER_JOINED: Final = "MemberJoined"


def resize(record: Mapping[str, Any]) -> tuple[int, int] | None:
    """(pods before, pods after) when the restart changed the group's size (elastic jobs), else None."""
    before, after = record.get("replicasBefore"), record.get("replicasAfter")
    if not isinstance(before, int) or not isinstance(after, int) or before == after:
        return None
    return before, after
