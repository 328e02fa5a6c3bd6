"""The DDPJob state machine: from the job, its last status and its own pods to what to do next.

``decide`` is pure and cheap (no API calls, linear in the job's own pods). A handler executes a
``Decision``, treating "not found" on delete and "already exists" (of our own object) on create as
success:

- patch ``report.status`` when ``report.changed`` (before or after the creates: both orders are safe,
  see below), and post ``report.event`` when there is one (one per phase change, nothing else) and
  each of ``report.notices``;
- delete ``delete.pods``, and carry out ``kueue`` (policies/kueue.py);
- create the Service if ``create.service``, the NetworkPolicy if ``create.network_policy`` and the
  checkpoint PVC if ``create.pvc``, then the pods of ``create.ranks`` (attempt ``create.attempt``)
  concurrently; a child the apiserver refuses for good (403 on a pod, 400/422 on any child) is not
  retried: the executor hands it to the next ``decide`` as a ``CreateRefusal``, which fails the job;
- delete the DDPJob when ``delete.job`` (TTL);
- call ``decide`` again after ``requeue_after`` seconds when it is set (deadlines, TTL, restarts).

The state lives in status. While the phase is Pending, Starting or Running, ``attempt`` is the
attempt whose pods should exist; during Restarting it is the attempt being torn down, and during
Suspended the last attempt that ran (absent when none did). The next attempt is created only once
no pod of another attempt is alive, so a rank never has two live pods and pod names never repeat.
Until every rank's pod has been observed once (``status.replicas`` reached the job's replicas), a
missing pod is (re)created, which is idempotent: that is how an operator killed mid-create finishes
the attempt. After that, a missing pod was deleted under the job and fails its rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Final, Literal

from ddp_operator import builders, kueue, names
from ddp_operator.kueue import QueueObservation, queued_message
from ddp_operator.observe import PodObservation, format_time, parse_time
from ddp_operator.policies import deadline, recovery, stall, success, ttl
from ddp_operator.policies import kueue as kueue_policy
from ddp_operator.policies.attempt import judge_attempt
from ddp_operator.policies.failure import (
    REASON_BACKOFF,
    REASON_POD_DELETED,
    REASON_STALLED,
    RankFailure,
    judge_failures,
)
from ddp_operator.policies.kueue import KueueActions
from ddp_operator.progress.render import describe_slow_rank, straggler_status
from ddp_operator.progress.tracker import STRAGGLER_WINDOW_SECONDS, ProgressObservation, persistence_left
from ddp_operator.spec import JobSpec

REASON_CREATED: Final = "Created"
REASON_RESUMED: Final = "Resumed"
REASON_SCHEDULED: Final = "Scheduled"
REASON_RUNNING: Final = "Running"
REASON_SUSPENDED: Final = "Suspended"
REASON_POD_CREATE_FORBIDDEN: Final = "PodCreateForbidden"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_STRAGGLER: Final = "Straggler"
REASON_QUEUED: Final = "Queued"
# Events of a restart that kept the pods (docs/restarts.md), and of any restart once its cost is known.
REASON_RESTARTED_IN_PLACE: Final = "RestartedInPlace"
# An elastic job's group changed size in place (docs/elastic.md).
REASON_RESIZED: Final = "Resized"
REASON_POD_REPLACED: Final = "PodReplaced"
REASON_RECOVERED: Final = "Recovered"
# Reasons that fail a job which must stop consuming resources whatever cleanPodPolicy says.
_STOP_REASONS: Final = frozenset(
    {
        deadline.REASON_DEADLINE,
        deadline.REASON_UNSCHEDULABLE,
        deadline.REASON_IMAGE_PULL,
        deadline.REASON_STARTUP_TIMEOUT,
        REASON_POD_CREATE_FORBIDDEN,
        REASON_INVALID_SPEC,
    }
)
# While waiting for the old attempt's pods to go, look again this often even without pod events.
RESTART_POLL_SECONDS: Final = 5.0


@dataclass(frozen=True)
class TimingRules:
    """How long the operator waits for reports that a real cluster delivers late or never.

    ``decision_window_seconds``: after the first failure of an attempt is seen, the attempt is judged
    once every rank has reported its end or this long has passed, whichever comes first, so a crash
    reported after its peers' collateral failures still decides (docs/restarts.md). The default covers
    kubelet status reports delayed by a busy node or apiserver; a gang whose ranks all exit at once
    (the usual case: the trainer turns a lost peer into exit 170 within seconds) never waits for it.

    ``unconfirmed_deletion_seconds``: a pod of an old attempt still Terminating this long after its
    grace period ended is on a node that cannot confirm (unreachable, dead); the next attempt starts
    without it (its name, DNS and Service membership are the old attempt's, never the new one's).
    """

    decision_window_seconds: float = 10.0
    unconfirmed_deletion_seconds: float = 30.0
    # A rank named slowest for this long (above the scraper's threshold) is reported as the straggler.
    straggler_window_seconds: float = STRAGGLER_WINDOW_SECONDS


DEFAULT_TIMING: Final = TimingRules()

_LIVE_PHASES: Final = frozenset(
    {names.PHASE_QUEUED, names.PHASE_PENDING, names.PHASE_STARTING, names.PHASE_RUNNING}
)
_WARNING_PHASES: Final = frozenset({names.PHASE_RESTARTING, names.PHASE_FAILED})


@dataclass(frozen=True)
class PhaseEvent:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Report:
    """What the job shows: its new status, and the Events that go with it."""

    status: dict[str, Any]
    changed: bool  # whether ``status`` differs from the old status (a write is due)
    event: PhaseEvent | None = None  # the phase change, when there is one
    # Events that are not phase changes (a straggler appeared), posted once each.
    notices: tuple[PhaseEvent, ...] = ()
    # This status starts a gang restart (for the operator's restart counter).
    gang_restart: bool = False
    # A restart whose cost is now known: (recovery mode, seconds from the failure to training again).
    restart_measured: tuple[str, float] | None = None


@dataclass(frozen=True)
class Creates:
    """The rank pods ``ranks`` of attempt ``attempt``, and the job-level children they need."""

    attempt: int = 0
    ranks: tuple[int, ...] = ()
    # Pods that replace lost ones of their rank alone: (rank, n) for the rank's n-th replacement.
    replacements: tuple[tuple[int, int], ...] = ()
    # Gang restarts the new pods' launchers may still make in place (DDP_RESTART_BUDGET).
    restart_budget: int = 0
    service: bool = False
    pvc: bool = False
    network_policy: bool = False


@dataclass(frozen=True)
class Deletes:
    pods: tuple[str, ...] = ()
    # Deleted at once (grace 0): their node stopped reporting, no kubelet is left to honour a grace period.
    lost_pods: tuple[str, ...] = ()
    # Pods of a hung gang whose processes stopped answering: they take no SIGTERM, so no grace period.
    hung_pods: tuple[str, ...] = ()
    job: bool = False  # the DDPJob itself: its TTL after finishing expired


@dataclass(frozen=True)
class Decision:
    """What to do next for one job, grouped by what the executor touches."""

    report: Report
    create: Creates = Creates()
    delete: Deletes = Deletes()
    kueue: KueueActions = kueue_policy.NONE
    requeue_after: float | None = None
    # Seconds until the failures seen in the live attempt are judged (TimingRules' decision window;
    # 0: judged now); None: no failure waits. Only the operator's debug line shows it.
    judged_in: float | None = None

    @property
    def phase(self) -> str:
        return str(self.report.status.get("phase", ""))


@dataclass(frozen=True)
class _Counts:
    replicas: int = 0
    ready: int = 0
    succeeded: int = 0
    failed: int = 0


@dataclass(frozen=True)
class _Transition:
    phase: str
    reason: str
    message: str
    counts: _Counts = field(default_factory=_Counts)
    attempt: int | None = None
    restarts: int = 0
    # Retries that did not spend backoffLimit (preemptions); None: as the old status says.
    preemptions: int | None = None
    start_time: str | None = None
    completion_time: str | None = None
    # What the operator read of the training (status.progress, status.straggler), when shown.
    progress: Mapping[str, Any] | None = None
    straggler: Mapping[str, Any] | None = None
    # status.lastRestart, status.goodput, status.podReplacements; None: as the old status says.
    last_restart: Mapping[str, Any] | None = None
    goodput: float | None = None
    pod_replacements: int | None = None
    # An elastic job's pods in the group as rank 0 last said, and the resizes so far; None: as the old
    # status says.
    group_replicas: int | None = None
    resizes: int | None = None


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _counts(pods: Sequence[PodObservation]) -> _Counts:
    return _Counts(
        replicas=len(pods),
        ready=sum(1 for p in pods if p.ready and not p.deleting and not p.terminal),
        succeeded=sum(1 for p in pods if p.trainer_succeeded),
        failed=sum(1 for p in pods if p.trainer_failed),
    )


def _conditions(
    old: Sequence[Mapping[str, Any]], phase: str, reason: str, message: str, now: str
) -> list[Any]:
    """Each condition type is True exactly while the phase has its name; times change only on a flip."""
    result: list[dict[str, Any]] = []
    seen = False
    for condition in old:
        updated = dict(condition)
        kind = condition.get("type")
        was_true = condition.get("status") == "True"
        if kind == phase:
            seen = True
            updated.update(status="True", reason=reason, message=message)
            if not was_true:
                updated["lastTransitionTime"] = now
        elif was_true:
            updated.update(status="False", reason=reason, message=message, lastTransitionTime=now)
        result.append(updated)
    if not seen and phase in names.CONDITION_TYPES:
        result.append(
            {"type": phase, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
        )
    return result


def _status(job: JobSpec, old: Mapping[str, Any], change: _Transition, now: datetime) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": change.phase,
        "conditions": _conditions(
            old.get("conditions") or [], change.phase, change.reason, change.message, format_time(now)
        ),
        "observedGeneration": job.generation,
        "replicas": change.counts.replicas,
        "readyReplicas": change.counts.ready,
        # For the Ready printer column, which can only show one field: "<ready ranks>/<ranks>".
        "ready": f"{change.counts.ready}/{job.replicas}",
        "succeededReplicas": change.counts.succeeded,
        "failedReplicas": change.counts.failed,
        "restarts": change.restarts,
        "worldSize": job.world_size,
    }
    if change.attempt is not None:
        status["attempt"] = change.attempt
    preemptions = change.preemptions if change.preemptions is not None else _int(old.get("preemptions"), 0)
    if preemptions:
        status["preemptions"] = preemptions
    if change.start_time is not None:
        status["startTime"] = change.start_time
    if change.completion_time is not None:
        status["completionTime"] = change.completion_time
    if change.progress:
        status["progress"] = dict(change.progress)
    if change.straggler:
        status["straggler"] = dict(change.straggler)
    last_restart = change.last_restart if change.last_restart is not None else old.get("lastRestart")
    if isinstance(last_restart, Mapping):
        status["lastRestart"] = dict(last_restart)
    if change.goodput is not None:
        status["goodput"] = f"{change.goodput:.3f}"
    elif old.get("goodput") is not None:
        status["goodput"] = old["goodput"]
    replaced = change.pod_replacements if change.pod_replacements is not None else old.get("podReplacements")
    if isinstance(replaced, int) and replaced:
        status["podReplacements"] = replaced
    if job.elastic is not None:
        status["elastic"] = _elastic_status(job, old, change)
        status["worldSize"] = status["elastic"]["replicas"] * job.nproc_per_node
    return status


def _elastic_status(job: JobSpec, old: Mapping[str, Any], change: _Transition) -> dict[str, int]:
    """status.elastic: the group's pods now (what the job asks for until rank 0 says), bounds, resizes."""
    assert job.elastic is not None
    shown = old.get("elastic")
    previous: Mapping[str, Any] = shown if isinstance(shown, Mapping) else {}
    group = change.group_replicas or _int(previous.get("replicas"), job.replicas)
    resizes = change.resizes if change.resizes is not None else _int(previous.get("resizes"), 0)
    return {
        "replicas": group,
        "minReplicas": job.elastic.min_replicas,
        "maxReplicas": job.elastic.max_replicas,
        "resizes": resizes,
    }


_STATUS_KEYS: Final = (
    "phase",
    "conditions",
    "observedGeneration",
    "replicas",
    "readyReplicas",
    "ready",
    "succeededReplicas",
    "failedReplicas",
    "restarts",
    "preemptions",
    "attempt",
    "worldSize",
    "startTime",
    "completionTime",
    "progress",
    "straggler",
    "lastRestart",
    "goodput",
    "podReplacements",
    "elastic",
)


def _decision(
    job: JobSpec,
    old: Mapping[str, Any],
    change: _Transition,
    now: datetime,
    *,
    notices: tuple[PhaseEvent, ...] = (),
    gang_restart: bool = False,
    restart_measured: tuple[str, float] | None = None,
    **actions: Any,
) -> Decision:
    """The Decision that moves status by ``change``; ``actions``: the other fields of the Decision."""
    status = _status(job, old, change, now)
    changed = any(status.get(key) != old.get(key) for key in _STATUS_KEYS)
    event = None
    if change.phase != old.get("phase"):
        kind: Literal["Normal", "Warning"] = "Warning" if change.phase in _WARNING_PHASES else "Normal"
        event = PhaseEvent(type=kind, reason=change.reason, message=change.message)
    report = Report(status, changed, event, notices, gang_restart, restart_measured)
    return Decision(report=report, **actions)


def _creates(job: JobSpec, attempt: int, ranks: tuple[int, ...], restarts: int) -> Creates:
    """The ranks to create, and the Service, PVC and NetworkPolicy with them (none when no rank is)."""
    return Creates(
        attempt=attempt,
        ranks=ranks,
        restart_budget=builders.remaining_restart_budget(job, restarts),
        service=bool(ranks),
        pvc=bool(ranks) and job.checkpoint is not None,
        network_policy=bool(ranks) and job.network_policy.enabled,
    )


def _min_wait(*waits: float | None) -> float | None:
    present = [max(0.0, w) for w in waits if w is not None]
    return min(present) if present else None


def _ours(job: JobSpec, pods: Sequence[PodObservation]) -> list[PodObservation]:
    """Pods of this job object: a pod owned by an earlier job of the same name is not ours to judge."""
    return [
        p
        for p in pods
        if p.rank is not None and p.attempt is not None and (not job.uid or p.owner_uid in (None, job.uid))
    ]


def _deletable(pods: Sequence[PodObservation]) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in pods if not p.deleting))


def _lost(pods: Sequence[PodObservation]) -> tuple[str, ...]:
    """Pods the taint manager deleted off a node that stopped being Ready: gone at once (grace 0)."""
    return tuple(sorted(p.name for p in pods if p.node_lost and p.deleting and not p.terminal))


def _superseded(pods: Sequence[PodObservation]) -> list[PodObservation]:
    """Pods a newer pod of the same rank and attempt replaced (docs/restarts.md)."""
    newest: dict[tuple[int | None, int | None], int] = {}
    for p in pods:
        key = (p.attempt, p.rank)
        newest[key] = max(newest.get(key, 0), p.replacement)
    return [p for p in pods if p.replacement < newest[(p.attempt, p.rank)]]


def _cleanup(job: JobSpec, old: Mapping[str, Any], pods: Sequence[PodObservation], now: datetime) -> Decision:
    """A finished job (Succeeded or Failed): clean up pods per cleanPodPolicy, then wait for the TTL."""
    phase = str(old.get("phase"))
    reason = ""
    for condition in old.get("conditions") or []:
        if condition.get("type") == phase:
            reason = str(condition.get("reason", ""))
    policy = job.run_policy.clean_pod_policy
    if policy == "All":
        doomed = list(pods)
    elif reason in _STOP_REASONS:
        doomed = [p for p in pods if not p.terminal]
    elif policy == "Running":
        # A real kubelet reports the trainer terminated before it turns the pod's phase terminal (it
        # first tears the sandbox down): such a pod is no longer running, and deleting it would lose the
        # logs of a rank that finished.
        doomed = [p for p in pods if not p.terminal and not p.terminated]
    else:
        doomed = []
    completion = parse_time(old.get("completionTime"))
    left = ttl.ttl_seconds_left(completion, job.run_policy.ttl_seconds_after_finished, now)
    expired = left is not None and left <= 0
    status = dict(old)
    status["observedGeneration"] = job.generation
    return Decision(
        report=Report(status, changed=old.get("observedGeneration") != job.generation),
        delete=Deletes(pods=() if expired else _deletable(doomed), job=expired),
        kueue=kueue_policy.give_up(job.kueue is not None, phase, pods),
        requeue_after=None if expired else left,
    )


def _suspend(job: JobSpec, old: Mapping[str, Any], pods: Sequence[PodObservation], now: datetime) -> Decision:
    attempt = old.get("attempt")
    if not isinstance(attempt, int) and pods:
        # Suspended while the first attempt was being created: resuming must not reuse its pod names.
        attempt = max(p.attempt or 0 for p in pods)
    alive = [p for p in pods if not p.terminal]
    message = f"suspended: {len(alive)} live rank pod(s) deleted" if alive else "suspended"
    if old.get("phase") == names.PHASE_SUSPENDED:
        message = _condition_message(old, names.PHASE_SUSPENDED) or message
    change = _Transition(
        phase=names.PHASE_SUSPENDED,
        reason=REASON_SUSPENDED,
        message=message,
        counts=_counts(pods),
        attempt=attempt if isinstance(attempt, int) else None,
        restarts=_int(old.get("restarts"), 0),
    )
    return _decision(
        job,
        old,
        change,
        now,
        delete=Deletes(pods=_deletable(pods)),
        kueue=kueue_policy.suspend(job.kueue is not None, pods),
    )


def _condition_message(old: Mapping[str, Any], kind: str) -> str | None:
    for condition in old.get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return str(condition.get("message", ""))
    return None


def _start_attempt(
    job: JobSpec,
    old: Mapping[str, Any],
    pods: Sequence[PodObservation],
    now: datetime,
    target: int,
    rules: TimingRules = DEFAULT_TIMING,
) -> Decision:
    """Create attempt ``target`` once no pod of another attempt is alive; delete those pods meanwhile.

    A pod whose deletion no kubelet confirms (a lost node) does not hold the next attempt back.
    """
    stale = [p for p in pods if p.attempt != target or (p.rank or 0) >= job.replicas]
    current = [p for p in pods if p not in stale]
    # A deleted pod that never had a node runs nothing (it waits only for a finalizer, Kueue's for one).
    blocking = [
        p
        for p in stale
        if not p.terminal
        and not (p.deleting and not p.node)
        and not p.deletion_unconfirmed(now, rules.unconfirmed_deletion_seconds)
        and not p.node_lost
    ]
    release = kueue_policy.release_stale(stale, now, rules.unconfirmed_deletion_seconds)
    blocking += [p for p in kueue_policy.still_counted(stale) if p not in blocking]
    wanted_hash = builders.spec_hash(job)
    # The spec changed while this attempt was being created (before its phase locked the spec): pods
    # built from the old version go, and the attempt waits until their names are free again.
    respec = [p for p in current if p.spec_hash is not None and p.spec_hash != wanted_hash]
    if respec or blocking:
        # Still tearing down: the status stays as it is (Restarting, Suspended, or nothing yet).
        return Decision(
            report=Report(dict(old), changed=False),
            delete=Deletes(pods=_deletable([*stale, *respec]), lost_pods=_lost(stale)),
            kueue=release,
            requeue_after=RESTART_POLL_SECONDS,
        )
    present = {p.rank for p in current}
    create = tuple(r for r in range(job.replicas) if r not in present)
    resumed = old.get("phase") == names.PHASE_SUSPENDED
    restarting = old.get("phase") == names.PHASE_RESTARTING
    start_time = old.get("startTime") if restarting and old.get("startTime") else format_time(now)
    verb = "resumed: created" if resumed else "created"
    change = _Transition(
        phase=names.PHASE_PENDING,
        reason=REASON_RESUMED if resumed else REASON_CREATED,
        message=f"{verb} {job.replicas} rank pod(s) of attempt {target} (world size {job.world_size})",
        counts=_counts(current),
        attempt=target,
        restarts=_int(old.get("restarts"), 0),
        start_time=start_time,
    )
    return _decision(
        job,
        old,
        change,
        now,
        create=_creates(job, target, create, change.restarts),
        delete=Deletes(pods=_deletable(stale), lost_pods=_lost(stale)),
    )


def _failure_of(pod: PodObservation, now: datetime) -> RankFailure | None:
    assert pod.rank is not None
    if pod.trainer_succeeded:
        return None
    disruption = pod.disruption
    if disruption is None and pod.deleting and not _ended_before_deleted(pod):
        # Deleted under the job: the exit code that follows (143 after the kubelet's SIGTERM) is the
        # deletion's doing, not the process's.
        disruption = REASON_POD_DELETED
    if disruption is None and not pod.trainer_failed:
        return None
    when = pod.finished_at or pod.deleted_at or now
    return RankFailure(
        rank=pod.rank,
        finish_key=when.timestamp(),
        exit_code=pod.exit_code,
        container_reason=pod.reason,
        disruption=disruption,
        disruption_message=pod.disruption_message,
        by_queue=pod.evicted_by_queue,
    )


def _ended_before_deleted(pod: PodObservation) -> bool:
    """The trainer had ended before the pod's deletion was asked for (a finished pod cleaned up)."""
    if not pod.terminal:
        return False
    if pod.finished_at is None or pod.deleted_at is None:
        return True
    return pod.finished_at < pod.deleted_at


def _missing_ranks(
    job: JobSpec, old: Mapping[str, Any], current: Sequence[PodObservation], now: datetime
) -> tuple[tuple[int, ...], list[RankFailure]]:
    """Ranks of the current attempt without a pod: still to create, or deleted under the job.

    Until every rank's pod has been observed once (status.replicas reached the job's replicas), a
    missing pod may never have been created (an operator stopped mid-create) or not yet be in the
    watch cache; creating it again is idempotent. After that, a missing pod was deleted (node loss,
    a user) and fails its rank like any other disruption.
    """
    present = {p.rank for p in current}
    missing = tuple(r for r in range(job.replicas) if r not in present)
    if not missing:
        return (), []
    if _int(old.get("replicas"), 0) < job.replicas and not _replaced_in(old, current):
        return missing, []
    return (), [
        RankFailure(rank=r, finish_key=now.timestamp(), disruption=REASON_POD_DELETED) for r in missing
    ]


def _replaced_in(old: Mapping[str, Any], current: Sequence[PodObservation]) -> bool:
    """A pod of this attempt was replaced: every rank's pod existed once (a replacement needs that), so
    a missing pod now was lost, never one still to create (status.replicas may lag behind: it counts the
    pods that exist, and a lost pod can go before its replacement is seen)."""
    last = old.get("lastRestart")
    replaced_here = (
        isinstance(last, Mapping)
        and last.get("mode") == recovery.MODE_POD_REPLACED
        and last.get("attempt") == old.get("attempt")
    )
    return replaced_here or any(p.replacement for p in current)


# --- a live attempt: an ordered list of rules, like the policy table in docs/restarts.md -------------


@dataclass(frozen=True)
class _LiveAttempt:
    """What the rules of a live attempt (Pending, Starting, Running) read, gathered once."""

    job: JobSpec
    old: Mapping[str, Any]
    now: datetime
    pods: Sequence[PodObservation]  # every pod of this job object
    current: Sequence[PodObservation]  # the pods of the attempt in status
    stale: Sequence[PodObservation]  # pods of other attempts, or of ranks beyond replicas
    attempt: int
    restarts: int
    to_create: tuple[int, ...]
    failures: Sequence[RankFailure]
    rules: TimingRules = DEFAULT_TIMING
    progress: ProgressObservation | None = None  # of this attempt only
    queue: QueueObservation | None = None  # Kueue's view of the job's group, when read
    # In-place restarts rank 0 reported since the last decision (already in ``restarts``), and the
    # new status.lastRestart they make; the job's goodput from the same read.
    accounting: recovery.RestartAccounting = recovery.NOTHING_NEW
    goodput: float | None = None

    @property
    def counts(self) -> _Counts:
        return _counts(self.current)

    @property
    def kueue_gated(self) -> int:
        """Rank pods of this attempt Kueue still gates: the group is not admitted (yet, or again)."""
        return sum(1 for p in self.current if p.kueue_gated and not p.deleting)

    @property
    def all_running(self) -> bool:
        return len(self.current) == self.job.replicas and all(
            p.running or p.trainer_succeeded for p in self.current
        )

    @property
    def running(self) -> list[PodObservation]:
        return [p for p in self.current if (p.running or p.trainer_succeeded) and not p.deleting]

    @property
    def can_train(self) -> bool:
        """Every rank's pod runs; an elastic job's group trains once minReplicas pods run, rank 0's
        (the rendezvous' host) among them."""
        if self.job.elastic is None:
            return self.all_running
        running = self.running
        return len(running) >= self.job.min_replicas and any(p.rank == 0 for p in running)

    @property
    def group_replicas(self) -> int | None:
        """An elastic job's pods in the training group, as rank 0's launcher last said."""
        report = self.progress.restart if self.progress is not None else None
        return report.group_nodes if report is not None and self.job.elastic is not None else None

    @property
    def resizes(self) -> int | None:
        """status.elastic.resizes after this read: one more when it brings a restart that resized."""
        record = self.accounting.record
        if self.job.elastic is None or record is None or recovery.resize(record) is None:
            return None
        last = self.old.get("lastRestart")
        if isinstance(last, Mapping) and recovery.resize(last) is not None and _same_round(last, record):
            return None  # the same resize, its seconds filled in
        previous = self.old.get("elastic")
        return _int(previous.get("resizes") if isinstance(previous, Mapping) else None, 0) + 1

    @property
    def active_left(self) -> float | None:
        return deadline.seconds_left(
            parse_time(self.old.get("startTime")), self.job.run_policy.active_deadline_seconds, self.now
        )

    @property
    def shown_progress(self) -> Mapping[str, Any] | None:
        """status.progress: the newest read of this attempt, else what status already shows of it."""
        if self.progress is not None and self.progress.status:
            return self.progress.status
        old = self.old.get("progress")
        return old if isinstance(old, Mapping) and self.old.get("attempt") == self.attempt else None

    @property
    def straggler_left(self) -> float | None:
        """Seconds until the slowest rank has been slow for the straggler window; 0: it has."""
        sighting = self.progress.straggler if self.progress is not None else None
        return persistence_left(sighting, self.rules.straggler_window_seconds, self.now)

    @property
    def stall_limit(self) -> int | None:
        """stallTimeoutSeconds, or the limit the attempt's observed pace gives (policies.stall.limit)."""
        pace = self.progress.step_seconds if self.progress is not None else None
        return stall.limit(self.job.run_policy.stall_timeout_seconds, pace)

    @property
    def stall_left(self) -> float | None:
        """Seconds until no new synchronized step for the stall limit is a stall; None: not watched."""
        progress = self.progress
        # A pod of the attempt not running (a replacement still starting, a group below its size) is
        # the startup deadline's to judge, and a finished group cannot stall.
        if progress is None or progress.finished or not all(p.running for p in self.current):
            return None
        started = [p.started_at or p.created_at for p in self.current]
        since = stall.clock_start(
            progress.step_changed_at, progress.group_changed_at, *(t for t in started if t is not None)
        )
        return stall.seconds_left(self.stall_limit, progress.step, since, self.now)

    @property
    def decision_window_left(self) -> float | None:
        """Seconds until a failed attempt is judged; 0: now; None: nothing failed.

        Judged at once when every rank reported its end (or its pod is gone); otherwise once the
        window has passed since the first failure was seen.
        """
        if not self.failures:
            return None
        ended = [p for p in self.current if p.ended_badly]
        if not ended:
            return 0.0  # only pods that vanished (deleted under the job): nothing is left to report
        if all(p.reported_end for p in self.current):
            return 0.0  # every rank that still has a pod has told its story
        seen = [p.failure_seen_at or p.finished_at or p.deleted_at or self.now for p in ended]
        first_seen = min(seen)
        left = self.rules.decision_window_seconds - (self.now - first_seen).total_seconds()
        return max(left, 0.0)

    @property
    def startup_left(self) -> float | None:
        """Seconds left to start every rank; None once the attempt ran or without a startup deadline.

        Time spent queued by Kueue does not count: the deadline runs from the attempt's first pod, or
        from when the job left the Queued phase if that was later (docs/scheduling.md). An elastic job
        that ran is held to it again while its group cannot train (fewer than minReplicas pods run).
        """
        if self.kueue_gated:
            return None
        if self.old.get("phase") == names.PHASE_RUNNING:
            return self.below_min_left
        if self.can_train:
            return None
        created = [p.created_at for p in self.current if p.created_at is not None]
        since = min(created) if created else None
        # Leaving the queue now (the status still says Queued), or when the Queued condition turned False.
        queued_now = self.old.get("phase") == names.PHASE_QUEUED
        admitted = self.now if queued_now else _condition_ended_at(self.old, names.PHASE_QUEUED)
        if since is not None and admitted is not None and admitted > since:
            since = admitted
        return deadline.seconds_left(since, self.job.run_policy.startup_deadline_seconds, self.now)

    @property
    def below_min_left(self) -> float | None:
        """An elastic job below minReplicas: seconds left of startupDeadlineSeconds, counted from the
        loss that took it there (docs/elastic.md); None while it can train, or for a fixed-size job."""
        if self.job.elastic is None or self.can_train:
            return None
        last = self.old.get("lastRestart")
        since = None
        if isinstance(last, Mapping) and last.get("attempt") == self.attempt:
            since = parse_time(last.get("failureTime"))
        since = since or _condition_time(self.old, names.PHASE_RUNNING)
        return deadline.seconds_left(since, self.job.run_policy.startup_deadline_seconds, self.now)


def _live_attempt(
    job: JobSpec,
    old: Mapping[str, Any],
    pods: Sequence[PodObservation],
    now: datetime,
    rules: TimingRules = DEFAULT_TIMING,
    observed: ProgressObservation | None = None,
    queue: QueueObservation | None = None,
) -> _LiveAttempt:
    attempt = _int(old.get("attempt"), 0)
    superseded = _superseded(pods)
    stale = [p for p in pods if p.attempt != attempt or (p.rank or 0) >= job.replicas or p in superseded]
    current = [p for p in pods if p not in stale]
    to_create, missing = _missing_ranks(job, old, current, now)
    failures = [f for f in (_failure_of(p, now) for p in current) if f is not None]
    progress = observed if observed is not None and observed.attempt == attempt else None
    accounting = _restart_accounting(old, attempt, progress)
    report = progress.restart if progress is not None else None
    return _LiveAttempt(
        job=job,
        old=old,
        now=now,
        pods=pods,
        current=current,
        stale=stale,
        attempt=attempt,
        restarts=_int(old.get("restarts"), 0) + accounting.added,
        to_create=to_create,
        failures=[*failures, *missing],
        rules=rules,
        progress=progress,
        queue=queue if job.kueue is not None else None,
        accounting=accounting,
        goodput=recovery.goodput(
            report.kept_step_seconds if report is not None else None, parse_time(old.get("startTime")), now
        ),
    )


def _restart_accounting(
    old: Mapping[str, Any], attempt: int, progress: ProgressObservation | None
) -> recovery.RestartAccounting:
    """What rank 0's latest read says of restarts: in-place ones to count, or a restart's cost to record."""
    last = old.get("lastRestart")
    last = last if isinstance(last, Mapping) else None
    if progress is None:
        return recovery.RestartAccounting()
    accounting = recovery.account(last, attempt, progress.restart)
    if accounting.record is None and progress.step > 0:
        # A whole gang's first step after its resume: rank 0's time of it, else when the operator
        # first saw this attempt's steps move.
        resumed = progress.restart.any_resumed_at if progress.restart is not None else None
        first = datetime.fromtimestamp(resumed, UTC) if resumed is not None else progress.step_changed_at
        accounting = recovery.fill_whole_gang(last, attempt, first)
    return accounting


def _finish(live: _LiveAttempt, phase: str, reason: str, message: str) -> Decision:
    """The attempt ends the job: Succeeded or Failed, with the cleanup that comes with it."""
    change = _Transition(
        phase=phase,
        reason=reason,
        message=message,
        # A finished job has no ready ranks: what is left is being cleaned up or has ended.
        counts=replace(live.counts, ready=0),
        attempt=live.attempt,
        restarts=live.restarts,
        start_time=live.old.get("startTime") or format_time(live.now),
        completion_time=format_time(live.now),
        # The last progress read stays: how far the job got.
        progress=live.shown_progress,
        last_restart=live.accounting.record,
        goodput=live.goodput,
    )
    cleanup = _cleanup(live.job, _status(live.job, live.old, change, live.now), live.pods, live.now)
    return _decision(
        live.job,
        live.old,
        change,
        live.now,
        create=Creates(attempt=live.attempt),
        delete=cleanup.delete,
        kueue=cleanup.kueue,
        requeue_after=cleanup.requeue_after,
    )


def _restart(
    live: _LiveAttempt,
    reason: str,
    message: str,
    counted: bool = True,
    failure: RankFailure | None = None,
    hung: tuple[str, ...] = (),
) -> Decision:
    """Tear the gang down; the next attempt is created once none of its pods is alive.

    ``counted``: the retry spends backoffLimit (status.restarts); a preemption does not
    (status.preemptions). ``failure``: the one that decided, for status.lastRestart. ``hung``: pods
    whose processes stopped answering, deleted without a grace period they cannot use.
    """
    preemptions = _int(live.old.get("preemptions"), 0)
    in_place = live.job.run_policy.restart_mode == recovery.MODE_IN_PLACE
    note = recovery.fallback_note(live.failures) if in_place else ""
    record = recovery.new_record(
        cause=reason,
        mode=recovery.MODE_WHOLE_GANG,
        attempt=live.attempt,
        failure_time=datetime.fromtimestamp(failure.finish_key, UTC) if failure else live.now,
        rank=failure.rank if failure else None,
        exit_code=failure.exit_code if failure else None,
        note=note,
    )
    change = _Transition(
        phase=names.PHASE_RESTARTING,
        reason=reason,
        message=message,
        counts=live.counts,
        attempt=live.attempt,
        restarts=live.restarts + (1 if counted else 0),
        preemptions=preemptions if counted else preemptions + 1,
        start_time=live.old.get("startTime"),
        last_restart=record,
        goodput=live.goodput,
    )
    return _decision(
        live.job,
        live.old,
        change,
        live.now,
        gang_restart=True,
        delete=Deletes(pods=_deletable([p for p in live.pods if p.name not in hung]), hung_pods=hung),
        requeue_after=0.0 if all(p.terminal for p in live.pods) else RESTART_POLL_SECONDS,
    )


def _rule_judged(live: _LiveAttempt) -> Decision | None:
    """A failure restarts the gang or fails the job; every rank exited 0: the job succeeded.

    A failure is judged only once the decision window closed: the first failure seen is not always
    the first that happened.
    """
    if live.decision_window_left:
        return None
    verdict = judge_attempt(
        live.job.restart_policy,
        live.job.run_policy.backoff_limit,
        live.restarts,
        live.attempt,
        live.job.replicas,
        live.failures,
        success.succeeded_ranks(live.current),
        elastic_min=live.job.elastic.min_replicas if live.job.elastic is not None else None,
        running_ranks=frozenset(p.rank for p in live.current if p.rank is not None and p.running),
    )
    if verdict.outcome == "retry":
        return _restart(live, verdict.reason, verdict.message, verdict.counted, verdict.failure)
    if verdict.outcome == "failed":
        return _finish(live, names.PHASE_FAILED, verdict.reason, verdict.message)
    if verdict.outcome == "succeeded":
        return _finish(live, names.PHASE_SUCCEEDED, verdict.reason, verdict.message)
    return None


def _rule_active_deadline(live: _LiveAttempt) -> Decision | None:
    limit = live.job.run_policy.active_deadline_seconds
    left = live.active_left
    if limit is None or left is None or left > 0:
        return None
    return _finish(
        live, names.PHASE_FAILED, deadline.REASON_DEADLINE, deadline.active_deadline_message(limit)
    )


def _rule_startup_deadline(live: _LiveAttempt) -> Decision | None:
    limit = live.job.run_policy.startup_deadline_seconds
    left = live.startup_left
    if limit is None or left is None or left > 0:
        return None
    reason, message = deadline.classify_startup(live.current, live.job.replicas, limit)
    if live.below_min_left is not None and live.job.elastic is not None:
        message = (
            f"fewer than spec.elastic.minReplicas ({live.job.elastic.min_replicas}) pods run, so the group "
            f"cannot train: {message}"
        )
    return _finish(live, names.PHASE_FAILED, reason, message)


def _rule_stalled(live: _LiveAttempt) -> Decision | None:
    """No synchronized step for the stall limit (stallTimeoutSeconds, or the job's own pace): the gang
    is hung; retried like a lost peer."""
    left = live.stall_left
    if left is None or left > 0 or live.progress is None:
        return None
    limit = live.stall_limit or 0
    # Keyed by each pod's first global rank, as the scraper reads every pod's endpoint.
    by_rank = {p.rank * live.job.nproc_per_node: p for p in live.current if p.rank is not None}
    nodes = {rank: p.node for rank, p in by_rank.items()}
    stalled, detail = stall.stalled(limit, live.progress.step, live.progress.rank_steps, nodes, live.now)
    hung = tuple(by_rank[r].name for r in stall.silent_ranks(live.progress.rank_steps, nodes))
    verdict = judge_failures(
        live.job.restart_policy, live.job.run_policy.backoff_limit, live.restarts, [stalled], live.attempt
    )
    message = f"{detail}; {verdict.message}"
    if verdict.retry:
        return _restart(live, REASON_STALLED, message, failure=stalled, hung=hung)
    return _finish(live, names.PHASE_FAILED, verdict.reason, message)


def _shown_straggler(live: _LiveAttempt) -> tuple[dict[str, Any] | None, tuple[PhaseEvent, ...]]:
    """status.straggler once a rank has been slow for the window, and an Event when it is new."""
    sighting = live.progress.straggler if live.progress is not None else None
    if sighting is None or live.straggler_left:
        return None, ()
    # The rank is global: its pod is the one of its node rank (docs/api.md's env contract).
    pod_rank = sighting.rank // max(live.job.nproc_per_node, 1)
    pod = next((p for p in live.current if p.rank == pod_rank), None)
    shown = straggler_status(sighting, pod.name if pod else "", pod.node if pod else "")
    previous = live.old.get("straggler")
    if isinstance(previous, Mapping) and previous.get("rank") == sighting.rank:
        return shown, ()
    notice = PhaseEvent(
        type="Warning",
        reason=REASON_STRAGGLER,
        message=(
            f"{describe_slow_rank(sighting.rank, sighting.slowdown, sighting.phase)} "
            f"({shown['pod']} on node {shown['node'] or 'unknown'}), for "
            f"{live.rules.straggler_window_seconds:.0f}s: the other ranks wait for it in every step"
        ),
    )
    return shown, (notice,)


def _rule_root_image_refused(live: _LiveAttempt) -> Decision | None:
    """A rank the kubelet will never start (runAsNonRoot, a root image): fail now, naming the fix."""
    refused = next((p for p in sorted(live.current, key=lambda p: p.rank or 0) if p.refuses_root_image), None)
    if refused is None:
        return None
    message = (
        f"rank {refused.rank}'s trainer cannot start: {refused.waiting_message}; rank pods run with "
        "securityContext.runAsNonRoot (the operator's default): use an image whose USER is a numeric "
        "non-root id, or set spec.template.spec.securityContext.runAsUser"
    )
    return _finish(live, names.PHASE_FAILED, REASON_INVALID_SPEC, message)


def _rule_progress(live: _LiveAttempt) -> Decision:
    """Nothing ended the attempt: Pending, Starting or Running, and the ranks still to create."""
    job, attempt, current = live.job, live.attempt, live.current
    if live.can_train or live.old.get("phase") == names.PHASE_RUNNING:
        phase, reason = names.PHASE_RUNNING, REASON_RUNNING
        message = _running_message(live)
    elif live.kueue_gated and job.kueue is not None:
        phase, reason = names.PHASE_QUEUED, REASON_QUEUED
        message = queued_message(live.kueue_gated, job.replicas, attempt, live.queue, job.kueue.queue_name)
    elif len(current) == job.replicas and all(p.scheduled or p.running for p in current):
        phase, reason = names.PHASE_STARTING, REASON_SCHEDULED
        message = f"all {job.replicas} rank pod(s) of attempt {attempt} are scheduled"
    else:
        phase, reason = names.PHASE_PENDING, REASON_CREATED
        scheduled = sum(1 for p in current if p.scheduled)
        message = f"{scheduled} of {job.replicas} rank pod(s) of attempt {attempt} scheduled"
    if phase == live.old.get("phase") and phase != names.PHASE_QUEUED:
        # Same phase: keep the message of the transition, so conditions do not churn per pod event.
        # (Queued follows what Kueue says, which the executor reads at most every few seconds.)
        message = _condition_message(live.old, phase) or message
    straggler, notices = _shown_straggler(live)
    change = _Transition(
        phase=phase,
        reason=reason,
        message=message,
        counts=live.counts,
        attempt=attempt,
        restarts=live.restarts,
        start_time=live.old.get("startTime") or format_time(live.now),
        progress=live.shown_progress,
        straggler=straggler,
        last_restart=live.accounting.record,
        goodput=live.goodput,
        group_replicas=live.group_replicas,
        resizes=live.resizes,
    )
    return _decision(
        job,
        live.old,
        change,
        live.now,
        delete=Deletes(pods=_deletable(live.stale), lost_pods=_lost(live.stale)),
        kueue=_release_replaced(live, [p for p in live.stale if p.attempt == attempt]),
        create=_creates(job, attempt, live.to_create, live.restarts),
        notices=notices + _restart_notices(live),
        restart_measured=live.accounting.measured,
        requeue_after=_min_wait(
            live.active_left,
            live.startup_left,
            live.decision_window_left,
            live.stall_left,
            live.straggler_left,
            # While queued, what Kueue says changes without a pod event: look again now and then.
            kueue.QUEUED_POLL_SECONDS if phase == names.PHASE_QUEUED else None,
        ),
    )


def _running_message(live: _LiveAttempt) -> str:
    job, attempt = live.job, live.attempt
    if job.elastic is None:
        return f"all {job.replicas} rank(s) of attempt {attempt} are running (world size {job.world_size})"
    return (
        f"{len(live.running)} of {job.replicas} rank pod(s) of attempt {attempt} are running (elastic: "
        f"trains on {job.elastic.min_replicas} to {job.elastic.max_replicas} pods)"
    )


def _same_round(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("attempt") == b.get("attempt") and a.get("groupRestarts") == b.get("groupRestarts")


def _restart_notices(live: _LiveAttempt) -> tuple[PhaseEvent, ...]:
    """An in-place restart the launchers made (Warning), an elastic group's resize (Warning when it
    shrank, Normal when it grew), and any restart's cost once known (Normal)."""
    record = live.accounting.record
    if record is None:
        return ()
    text = recovery.describe(record, live.restarts, live.job.run_policy.backoff_limit)
    notices: list[PhaseEvent] = []
    sizes = recovery.resize(record)
    if live.resizes is not None and sizes is not None:
        kind: Literal["Normal", "Warning"] = "Normal" if sizes[1] > sizes[0] else "Warning"
        notices.append(PhaseEvent(type=kind, reason=REASON_RESIZED, message=text))
    elif live.accounting.added:
        notices.append(PhaseEvent(type="Warning", reason=REASON_RESTARTED_IN_PLACE, message=text))
    elif live.accounting.measured is not None:
        notices.append(PhaseEvent(type="Normal", reason=REASON_RECOVERED, message=text))
    return tuple(notices)


def _rule_replace_lost(live: _LiveAttempt) -> Decision | None:
    """InPlace: a lost pod (deleted, evicted, its node gone) other than rank 0's is replaced alone; its
    peers restart in place and wait for the new pod on the rendezvous's next round."""
    ranks = recovery.replaceable_ranks(live.job.run_policy.restart_mode, live.failures)
    if ranks is None:
        return None
    verdict = judge_failures(
        live.job.restart_policy, live.job.run_policy.backoff_limit, live.restarts, live.failures, live.attempt
    )
    if not verdict.retry:
        return None  # the judge fails the job, with the same verdict
    lost = [p for p in live.pods if p.attempt == live.attempt and p.rank in ranks]
    counted = kueue_policy.still_counted(lost) if live.job.kueue is not None else []
    if counted:
        # Kueue still counts the lost pod in the group and would delete its replacement as excess:
        # release it first (its finalizer goes once it ended), then replace (docs/scheduling.md).
        return Decision(
            report=Report(dict(live.old), changed=False),
            kueue=kueue_policy.release_stale(counted, live.now, live.rules.unconfirmed_deletion_seconds),
            requeue_after=RESTART_POLL_SECONDS,
        )
    used = max([_int(live.old.get("podReplacements"), 0), *(p.replacement for p in live.pods)])
    replacements = tuple((rank, used + 1 + i) for i, rank in enumerate(ranks))
    last = live.old.get("lastRestart")
    accounted = (
        _int(last.get("groupRestarts"), 0)
        if isinstance(last, Mapping) and last.get("attempt") == live.attempt
        else 0
    )
    failure = verdict.failure
    record = recovery.new_record(
        cause=verdict.reason,
        mode=recovery.MODE_POD_REPLACED,
        attempt=live.attempt,
        failure_time=datetime.fromtimestamp(failure.finish_key, UTC),
        rank=failure.rank,
        group_restarts=max(
            accounted, live.accounting.record.get("groupRestarts", 0) if live.accounting.record else 0
        )
        + 1,
    )
    restarts = live.restarts + 1
    message = (
        f"{failure.describe()} in attempt {live.attempt}: replaced by "
        + ", ".join(names.pod_name(live.job.name, rank, live.attempt, n) for rank, n in replacements)
        + f"; the other ranks restart in place (restart {restarts} of {live.job.run_policy.backoff_limit})"
    )
    change = _Transition(
        phase=str(live.old.get("phase") or names.PHASE_RUNNING),
        reason=str(_condition_reason(live.old) or REASON_RUNNING),
        message=_condition_message(live.old, str(live.old.get("phase"))) or message,
        counts=live.counts,
        attempt=live.attempt,
        restarts=restarts,
        start_time=live.old.get("startTime") or format_time(live.now),
        progress=live.shown_progress,
        last_restart=record,
        goodput=live.goodput,
        pod_replacements=used + len(replacements),
    )
    return _decision(
        live.job,
        live.old,
        change,
        live.now,
        create=Creates(
            attempt=live.attempt,
            replacements=replacements,
            restart_budget=builders.remaining_restart_budget(live.job, restarts - accounted - 1),
        ),
        delete=Deletes(pods=_deletable([p for p in lost if p.terminal]), lost_pods=_lost(lost)),
        kueue=_release_replaced(live, lost),
        notices=(PhaseEvent(type="Warning", reason=REASON_POD_REPLACED, message=message),),
        requeue_after=_min_wait(live.active_left, live.stall_left),
    )


def _release_replaced(live: _LiveAttempt, pods: Sequence[PodObservation]) -> KueueActions:
    """Replaced pods of a Kueue group go once they have ended: Kueue's finalizer would keep them."""
    if live.job.kueue is None:
        return kueue_policy.NONE
    return kueue_policy.release_stale(pods, live.now, live.rules.unconfirmed_deletion_seconds)


def _rule_in_place_budget(live: _LiveAttempt) -> Decision | None:
    """The launchers restarted the gang in place more often than backoffLimit allows: the job fails."""
    limit = live.job.run_policy.backoff_limit
    if not live.accounting.added or live.restarts <= limit:
        return None
    record = live.accounting.record or {}
    message = (
        f"{recovery.describe(record, live.restarts, limit)}; backoffLimit {limit} exceeded "
        f"after {live.restarts} restart(s)"
    )
    return _finish(live, names.PHASE_FAILED, REASON_BACKOFF, message)


def _condition_reason(old: Mapping[str, Any]) -> str | None:
    phase = old.get("phase")
    for condition in old.get("conditions") or []:
        if condition.get("type") == phase and condition.get("status") == "True":
            return str(condition.get("reason", ""))
    return None


def _rule_restart_stuck(live: _LiveAttempt) -> Decision | None:
    """Restarting longer than startupDeadlineSeconds: the next attempt could not even be created."""
    limit = live.job.run_policy.startup_deadline_seconds
    since = _condition_time(live.old, names.PHASE_RESTARTING)
    left = deadline.seconds_left(since, limit, live.now)
    if limit is None or left is None or left > 0:
        return None
    waiting = sorted(p.name for p in live.pods if not p.terminal)
    message = (
        f"attempt {live.attempt + 1} could not start within startupDeadlineSeconds ({limit}s): "
        f"{len(waiting)} pod(s) of earlier attempts still terminating ({', '.join(waiting[:5])})"
    )
    return _finish(live, names.PHASE_FAILED, deadline.REASON_STARTUP_TIMEOUT, message)


def _restarting(
    job: JobSpec, old: Mapping[str, Any], pods: Sequence[PodObservation], now: datetime, rules: TimingRules
) -> Decision:
    """Between attempts the deadlines still hold; otherwise start the next attempt when it may."""
    live = _live_attempt(job, old, pods, now, rules)
    for rule in (_rule_active_deadline, _rule_restart_stuck):
        decision = rule(live)
        if decision is not None:
            return decision
    started = _start_attempt(job, old, pods, now, live.attempt + 1, rules)
    since = _condition_time(old, names.PHASE_RESTARTING)
    stuck_left = deadline.seconds_left(since, job.run_policy.startup_deadline_seconds, now)
    requeue = _min_wait(started.requeue_after, live.active_left, stuck_left)
    return replace(started, requeue_after=requeue)


def _condition_ended_at(old: Mapping[str, Any], kind: str) -> datetime | None:
    """When the condition ``kind`` last turned False (the job left that phase), None if it is not False."""
    for condition in old.get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "False":
            return parse_time(condition.get("lastTransitionTime"))
    return None


def _condition_time(old: Mapping[str, Any], kind: str) -> datetime | None:
    for condition in old.get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return parse_time(condition.get("lastTransitionTime"))
    return None


# In order: the first rule that ends the attempt wins; the last always answers.
_LIVE_RULES: Final = (
    _rule_replace_lost,
    _rule_judged,
    _rule_in_place_budget,
    _rule_active_deadline,
    _rule_startup_deadline,
    _rule_root_image_refused,
    _rule_stalled,
)


def _live(
    job: JobSpec,
    old: Mapping[str, Any],
    pods: Sequence[PodObservation],
    now: datetime,
    rules: TimingRules,
    observed: ProgressObservation | None,
    queue: QueueObservation | None = None,
) -> Decision:
    live = _live_attempt(job, old, pods, now, rules, observed, queue)
    for rule in _LIVE_RULES:
        decision = rule(live)
        if decision is not None:
            break
    else:
        decision = _rule_progress(live)
    return replace(decision, judged_in=live.decision_window_left)


def decide(
    job: JobSpec,
    status: Mapping[str, Any],
    pods: Sequence[PodObservation],
    now: datetime,
    refusal: CreateRefusal | None = None,
    rules: TimingRules = DEFAULT_TIMING,
    observed: ProgressObservation | None = None,
    queue: QueueObservation | None = None,
) -> Decision:
    """The next step for one job.

    ``pods``: observations of the job's own pods; ``now``: timezone-aware; ``refusal``: a child the
    apiserver refused for good since the last decision; ``rules``: how long to wait for late reports;
    ``observed``: what the operator read of the training from rank 0's metrics; ``queue``: what
    Kueue says of the job's group while it is queued.
    """
    old: Mapping[str, Any] = status or {}
    ours = _ours(job, pods)
    phase = old.get("phase")
    if phase in names.FINISHED_PHASES:
        return _cleanup(job, old, ours, now)
    if refusal is not None:
        return _refused(job, old, refusal, now)
    if job.run_policy.suspend:
        return _suspend(job, old, ours, now)
    attempt = old.get("attempt")
    if phase == names.PHASE_RESTARTING and isinstance(attempt, int):
        return _restarting(job, old, ours, now, rules)
    if phase == names.PHASE_SUSPENDED:
        target = attempt + 1 if isinstance(attempt, int) else 0
        return _start_attempt(job, old, ours, now, target, rules)
    if phase in _LIVE_PHASES and isinstance(attempt, int):
        return _live(job, old, ours, now, rules, observed, queue)
    # A new job, or one whose first creation was interrupted: finish creating its newest attempt.
    newest = max((p.attempt for p in ours if p.attempt is not None), default=0)
    return _start_attempt(job, old, ours, now, newest, rules)


def failed_status(status: Mapping[str, Any], reason: str, message: str, now: datetime) -> dict[str, Any]:
    """``status`` moved to Failed for a reason found outside ``decide`` (a refused create, an invalid spec)."""
    old: Mapping[str, Any] = status or {}
    result = dict(old)
    timestamp = format_time(now)
    result.update(
        phase=names.PHASE_FAILED,
        conditions=_conditions(old.get("conditions") or [], names.PHASE_FAILED, reason, message, timestamp),
        restarts=_int(old.get("restarts"), 0),
        startTime=old.get("startTime") or timestamp,
        completionTime=timestamp,
    )
    return result


@dataclass(frozen=True)
class CreateRefusal:
    """The apiserver refused a child for good: a fact the executor saw, decided on by the next ``decide``.

    Retrying cannot help: the same spec builds the same object. ``forbidden``: a 403 on a rank pod (Pod
    Security admission, a ResourceQuota); otherwise a 400/422 whose message names the invalid field.
    """

    forbidden: bool
    child: str  # which child, e.g. "rank 0's pod", "the Service"
    attempt: int
    message: str
    # A refusal the operator itself found (the cluster lacks what the spec asks for): this reason, and
    # ``message`` as it is.
    reason: str | None = None


def _refused(job: JobSpec, old: Mapping[str, Any], refusal: CreateRefusal, now: datetime) -> Decision:
    """Failed with the apiserver's message; the attempt's pods that were created go at the next ``decide``."""
    if refusal.reason is not None:
        reason, text = refusal.reason, refusal.message
    elif refusal.forbidden:
        reason = REASON_POD_CREATE_FORBIDDEN
        text = f"creating {refusal.child} of attempt {refusal.attempt} was forbidden: {refusal.message}"
    else:
        reason = REASON_INVALID_SPEC
        text = (
            f"the apiserver refused {refusal.child} of attempt {refusal.attempt} as invalid: {refusal.message}; "
            "fix spec.template (or spec.checkpoint) and create the job again"
        )
    failed = failed_status(old, reason, text, now)
    failed.update(observedGeneration=job.generation, attempt=refusal.attempt, worldSize=job.world_size)
    return Decision(
        report=Report(failed, changed=True, event=PhaseEvent(type="Warning", reason=reason, message=text)),
        create=Creates(attempt=refusal.attempt),
        requeue_after=0.0,
    )


def decide_invalid_spec(status: Mapping[str, Any], generation: int, message: str, now: datetime) -> Decision:
    """A manifest the CRD let through but the operator cannot run (e.g. written under an older CRD)."""
    old: Mapping[str, Any] = status or {}
    if old.get("phase") == names.PHASE_FAILED:
        return Decision(report=Report(dict(old), changed=False))
    failed = {
        **failed_status({}, REASON_INVALID_SPEC, message, now),
        "conditions": _conditions(
            old.get("conditions") or [], names.PHASE_FAILED, REASON_INVALID_SPEC, message, format_time(now)
        ),
        "observedGeneration": generation,
    }
    return Decision(
        report=Report(
            failed,
            changed=True,
            event=PhaseEvent(type="Warning", reason=REASON_INVALID_SPEC, message=message),
        )
    )
