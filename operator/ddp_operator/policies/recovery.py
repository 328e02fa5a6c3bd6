"""How a retried failure is recovered, and what each restart cost: shared by the operator and `ddpjob run`.

Three recovery modes (docs/restarts.md):

- **in place**: a worker process failed and nothing else was lost. Every pod's launcher restarts its
  workers on a new round of the job's rendezvous; no pod is deleted or created. The launchers do
  this on their own, within the gang-wide budget the operator gave them (``DDP_RESTART_BUDGET``); the
  operator learns of it from rank 0's metrics (``ddp_group_restarts_total`` and the
  ``ddp_last_restart_*`` gauges) and counts it in ``status.restarts``.
- **one pod replaced**: a pod was lost (deleted, evicted, its node gone): the operator creates a new pod
  for that rank only, and the survivors restart in place and wait for it on the next round. The c10d
  store lives in the attempt's rendezvous pod (``rendezvous_apart``), so rank 0's pod is replaced alone
  like any other, an elastic job's too (its survivors wait for the new pod 0 instead of training
  without it: only pod 0 mounts the checkpoint volume).
- **whole gang**: every pod deleted and the next attempt created. A launcher gave up (its budget
  spent, or the rendezvous pod gone), Kueue evicted the group, a stall no pod was singled out for, or
  ``runPolicy.restartMode: Recreate``.

Each restart is recorded in ``status.lastRestart``: cause, mode, the seconds from the failure to the
survivors stopped, to the group re-formed and to the first training step after the resume, and the
steps done again. The job's goodput is the share of its wall time spent in steps that were kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

from ddp_operator import names
from ddp_operator.observe import PodObservation, int_field
from ddp_operator.policies.failure import REASON_EVICTED, REASON_POD_DELETED, REASON_PREEMPTED, RankFailure
from ddp_operator.spec import JobSpec

MODE_IN_PLACE: Final = "InPlace"
MODE_POD_REPLACED: Final = "PodReplaced"
MODE_WHOLE_GANG: Final = "WholeGang"
RECOVERY_MODES: Final = (MODE_IN_PLACE, MODE_POD_REPLACED, MODE_WHOLE_GANG)

# A pod that went away with its process (not a process that failed inside a live pod): the only kind
# of failure one new pod can mend.
LOST_POD_REASONS: Final = frozenset({REASON_POD_DELETED, REASON_EVICTED, REASON_PREEMPTED})
# The rank whose pod is special where the store is not apart (``rendezvous_apart``): without a
# rendezvous pod, rank 0's launcher hosts the c10d store, and losing it loses the group's meeting point.
RENDEZVOUS_RANK: Final = 0


def rendezvous_apart(job: JobSpec) -> bool:
    """The job's c10d store lives in a rendezvous pod of its own, not in rank 0's launcher: every job
    whose pods restart in place and that has more than one pod (names.rendezvous_pod_name). Then rank
    0's lost pod is replaced alone like any other, an elastic job's too: its survivors do not train in
    a round without pod 0 (its first worker would be global rank 0 without the checkpoint volume) but
    wait in it for the new pod 0 (docs/elastic.md)."""
    return job.run_policy.restart_mode == MODE_IN_PLACE and job.replicas > 1


def replaceable_ranks(
    restart_mode: str, failures: Sequence[RankFailure], *, rank0: bool = False, replicas: int = 0
) -> tuple[int, ...] | None:
    """The ranks whose lost pods are replaced alone, or None when the attempt takes the whole-gang path.

    Every failure must be a lost pod: deleted, evicted or preempted (its process may have exited, by
    the SIGTERM of the deletion), or killed from outside with its launcher (``launcher_killed``: no
    launcher is left in it to restart anything). A process that exited by its launcher's decision in a
    pod that stays means the launcher gave up (a permanent code, or the gang's budget spent), which the
    attempt's judge decides. A Kueue eviction takes the whole group away. ``rank0``: rank 0's pod may be
    replaced alone too (``rendezvous_apart``). When every one of the ``replicas`` pods is lost, no
    survivor holds the state: the whole gang restarts, from the disk.
    """
    if restart_mode != MODE_IN_PLACE or not failures:
        return None
    for failure in failures:
        if not is_lost_pod(failure) or failure.by_queue:
            return None
        if failure.rank == RENDEZVOUS_RANK and not rank0:
            return None
    ranks = tuple(sorted({f.rank for f in failures}))
    return None if replicas and len(ranks) >= replicas else ranks


def replaceable_hung(
    restart_mode: str, silent: Sequence[int | None], *, queued: bool, rank0: bool = False
) -> tuple[int, ...] | None:
    """The ranks of a stalled attempt's pods to replace alone: those whose metrics stopped answering
    while the others' did (frozen or wedged pods, deleted without a grace period), rank 0's among them
    only where ``rank0`` (``rendezvous_apart``); None: the whole gang restarts (Recreate, no pod singled
    out, or a Kueue group, which would count the hung pod until its deletion is confirmed)."""
    if restart_mode != MODE_IN_PLACE or queued or not silent or any(r is None for r in silent):
        return None
    ranks = tuple(sorted({r for r in silent if r is not None}))
    return None if RENDEZVOUS_RANK in ranks and not rank0 else ranks


def is_lost_pod(failure: RankFailure) -> bool:
    """The failure took the pod away (or left it with no launcher): no process of it restarts in place."""
    return failure.disruption in LOST_POD_REASONS or failure.launcher_killed


def fallback_note(failures: Sequence[RankFailure], *, rank0: bool = False) -> str:
    """Why a lost pod recreates the whole gang under InPlace, for the restart's record and message."""
    if not rank0 and any(f.rank == RENDEZVOUS_RANK and is_lost_pod(f) for f in failures):
        return "rank 0's pod was lost, and it hosted the job's store (the job has no rendezvous pod): the whole gang is recreated"
    return ""


def stores_to_delete(pods: Sequence[PodObservation], phase: str | None, attempt: object) -> tuple[str, ...]:
    """Rendezvous pods (``pods``: the job's own) that have no live attempt to serve: an earlier
    attempt's, and every one once the job restarts its gang, is suspended or has finished (a store holds
    nothing a finished job needs, whatever cleanPodPolicy keeps)."""
    live = phase in names.LIVE_PHASES and isinstance(attempt, int)
    return tuple(
        sorted(
            p.name for p in pods if p.rendezvous and not p.deleting and not (live and p.attempt == attempt)
        )
    )


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


def launcher_budget(job: JobSpec, restarts: int, group_rounds: int = 0) -> int:
    """``DDP_RESTART_BUDGET``: the gang restarts a new pod's launcher may still make in place.

    The launchers hold it against their group's own count of rounds in the attempt (kept in the
    rendezvous store, the same on every pod), so it is backoffLimit less the restarts spent outside
    those rounds: ``restarts`` (``status.restarts`` once the pod is created) less ``group_rounds``
    (the rounds of this attempt's group that ``restarts`` includes and the group's count holds too).
    A new attempt's pods start a group that has counted nothing (0); a pod that replaces a lost one
    joins a group that has made the rounds on record plus the one its joining brings. 0 under
    ``restartPolicy: Never``; never below 0.
    """
    if job.restart_policy == "Never":
        return 0
    return max(0, job.run_policy.backoff_limit - (restarts - group_rounds))


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


def describe_lost(lost: Mapping[str, Any]) -> str:
    """``status.lostSeconds`` in one line: the total over the restarts summed, then each phase that cost
    anything (`ddpjob describe`, `ddpjob run`'s closing line)."""
    phases = ", ".join(f"{key} {lost[key]}s" for key in LOST_PHASES if _positive(lost.get(key)))
    return f"{lost.get('total', '0')}s to {lost.get('restarts', 0)} restart(s)" + (
        f": {phases}" if phases else ""
    )


def _positive(value: object) -> bool:
    try:
        return float(str(value)) > 0
    except ValueError:
        return False


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


def describe(record: Mapping[str, Any], restarts: int, backoff_limit: int) -> str:
    """One line for the restart's Event: what failed, how it was recovered, and what it cost."""
    mode = {
        MODE_IN_PLACE: "restarted in place",
        MODE_POD_REPLACED: "replaced the lost pod alone; the others restarted in place",
        MODE_WHOLE_GANG: "recreated the whole gang",
    }.get(str(record.get("mode")), str(record.get("mode")))
    what = str(record.get("cause", "a failure"))
    if "rank" in record:
        what += f" of rank {record['rank']}"
    if "exitCode" in record:
        what += f" (exit code {record['exitCode']})"
    sizes = resize(record)
    if sizes is not None and sizes[1] > sizes[0] and record.get("cause") == CAUSE_MEMBER_JOINED:
        parts = [f"pods joined: the group grew from {sizes[0]} to {sizes[1]} pods in place (not a failure)"]
    else:
        parts = [f"{what}: {mode} (restart {restarts} of {backoff_limit})"]
        if sizes is not None:
            parts.append(
                f"the group {'grew' if sizes[1] > sizes[0] else 'shrank'} from {sizes[0]} to {sizes[1]} pods"
            )
    phases = [
        f"{label} {record[key]}s"
        for key, label in (
            ("stoppedSeconds", "survivors stopped after"),
            ("reformedSeconds", "group re-formed after"),
            ("resumedSeconds", "training again after"),
        )
        if key in record
    ]
    if phases:
        parts.append(", ".join(phases))
    if "stepsRedone" in record:
        parts.append(f"{record['stepsRedone']} step(s) redone")
    if record.get("note"):
        parts.append(str(record["note"]))
    return "; ".join(parts)


@dataclass(frozen=True)
class PodReplacement:
    """The bookkeeping of replacing lost pods alone (``replace_pods``)."""

    # (rank, n): each rank's new pod, its n-th replacement (the ``r<n>`` of its name).
    replacements: tuple[tuple[int, int], ...]
    record: dict[str, Any]  # the new status.lastRestart (mode PodReplaced)
    restarts: int  # status.restarts with this restart
    pod_replacements: int  # status.podReplacements with these pods
    restart_budget: int  # the new pods' DDP_RESTART_BUDGET


def replace_pods(
    job: JobSpec,
    ranks: Sequence[int],
    failure: RankFailure,
    cause: str,
    attempt: int,
    restarts: int,
    last: object,
    read: Mapping[str, Any] | None,
    replaced: object,
    numbers: Iterable[int],
    *,
    charged: bool = True,
) -> PodReplacement:
    """Replace the lost pods of ``ranks`` alone: one restart against backoffLimit (none when not
    ``charged``: a straggler's pod, which did not fail), after which the survivors re-form once more.

    ``failure`` and ``cause``: what decided it; ``restarts``: status.restarts before it; ``last``:
    status.lastRestart; ``read``: the record this read of rank 0 brings (None: none); ``replaced``:
    status.podReplacements; ``numbers``: every pod's replacement number (with ``replaced``, a new pod
    never takes a name used before). The record accounts for the round the replacement brings (``groupRestarts`` one past the
    rounds known), so rank 0's report of that round is not counted again.
    """
    used = max([int_field(replaced, 0), *numbers])
    replacements = tuple((rank, used + 1 + i) for i, rank in enumerate(ranks))
    same_attempt = isinstance(last, Mapping) and last.get("attempt") == attempt
    accounted = int_field(last.get("groupRestarts"), 0) if isinstance(last, Mapping) and same_attempt else 0
    known = max(accounted, read.get("groupRestarts", 0) if read else 0)
    record = new_record(
        cause=cause,
        mode=MODE_POD_REPLACED,
        attempt=attempt,
        failure_time=datetime.fromtimestamp(failure.finish_key, UTC),
        rank=failure.rank,
        exit_code=failure.exit_code,
        group_restarts=known + 1,
    )
    # The grows known so far stay accounted: a later read must not take them for failures to count.
    grows = max(
        int_field(last.get("groupGrows"), 0) if isinstance(last, Mapping) and same_attempt else 0,
        int_field(read.get("groupGrows"), 0) if read else 0,
    )
    if grows:
        record["groupGrows"] = grows
    after = restarts + 1 if charged else restarts
    return PodReplacement(
        replacements=replacements,
        record=record,
        restarts=after,
        pod_replacements=used + len(replacements),
        restart_budget=launcher_budget(job, after, accounted + 1),
    )


@dataclass(frozen=True)
class RestartNotice:
    """What a read's restart record tells: a resize, an in-place restart or a recovery, and its text."""

    kind: Literal["resized", "in-place", "recovered"]
    warning: bool
    text: str


def restart_notice(
    accounting: RestartAccounting, restarts: int, backoff_limit: int, *, resized: bool
) -> RestartNotice | None:
    """An elastic group's resize (``resized``: status counts it; a warning when the group shrank), else
    an in-place restart the launchers made (a warning), else a restart whose cost is now known."""
    record = accounting.record
    if record is None:
        return None
    text = describe(record, restarts, backoff_limit)
    sizes = resize(record)
    if resized and sizes is not None:
        return RestartNotice("resized", warning=sizes[1] <= sizes[0], text=text)
    if accounting.added:
        return RestartNotice("in-place", warning=True, text=text)
    if accounting.measured is not None:
        return RestartNotice("recovered", warning=False, text=text)
    return None
