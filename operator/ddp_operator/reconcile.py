"""The DDPJob state machine: from the job, its last status and its own pods to what to do next.

``decide`` is pure and cheap (no API calls, linear in the job's own pods). A handler executes a
``Decision``, treating "not found" on delete and "already exists" (of our own object) on create as
success:

- patch ``status`` when ``status_changed`` (before or after the creates: both orders are safe, see
  below), and post ``event`` when there is one (one per phase change, nothing else);
- delete ``delete_pods``;
- create the Service if ``create_service``, the NetworkPolicy if ``create_network_policy`` and the
  checkpoint PVC if ``create_pvc``, then the pods of
  ``create_ranks`` (attempt ``create_attempt``) concurrently; a child the apiserver refuses for good
  (403 on a pod, 400/422 on any child) is not retried: the executor hands it to the next ``decide`` as
  a ``CreateRefusal``, which fails the job;
- delete the DDPJob when ``delete_job`` (TTL);
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
from datetime import datetime
from typing import Any, Final, Literal

from ddp_operator import builders, kueue, names
from ddp_operator.kueue import QueueObservation, queued_message
from ddp_operator.observe import PodObservation, format_time, parse_time
from ddp_operator.policies import deadline, success, ttl
from ddp_operator.policies.attempt import judge_attempt
from ddp_operator.policies.failure import (
    REASON_POD_DELETED,
    REASON_STALLED,
    RankFailure,
    judge_failures,
)
from ddp_operator.progress import ProgressObservation, straggler_status
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
    straggler_window_seconds: float = 60.0


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
class Decision:
    status: dict[str, Any]
    status_changed: bool
    create_attempt: int = 0
    create_ranks: tuple[int, ...] = ()
    delete_pods: tuple[str, ...] = ()
    # Kueue (docs/scheduling.md): pods of old attempts whose Kueue finalizer the operator removes, because
    # Kueue would count them in the group and delete the next attempt's pods as excess; of those, the
    # ones whose deletion no kubelet confirms, deleted at once (grace 0) so they stop counting; and the
    # pod annotated retriable-in-group "false" when the job failed for good, so Kueue frees the quota.
    release_pods: tuple[str, ...] = ()
    force_delete_pods: tuple[str, ...] = ()
    mark_unretriable: tuple[str, ...] = ()
    # Delete the group's Kueue Workload (a suspended job gives its quota back; resuming queues again).
    release_kueue_group: bool = False
    create_service: bool = False
    create_pvc: bool = False
    create_network_policy: bool = False
    delete_job: bool = False
    # True when this decision starts a gang restart (for the operator's restart counter).
    gang_restart: bool = False
    event: PhaseEvent | None = None
    # Events that are not phase changes (a straggler appeared), posted once each.
    notices: tuple[PhaseEvent, ...] = ()
    requeue_after: float | None = None

    @property
    def attempt(self) -> int:
        """The attempt of ``create_ranks`` (another name for ``create_attempt``)."""
        return self.create_attempt

    @property
    def phase(self) -> str:
        return str(self.status.get("phase", ""))


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
    return status


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
)


def _decision(
    job: JobSpec, old: Mapping[str, Any], change: _Transition, now: datetime, **actions: Any
) -> Decision:
    status = _status(job, old, change, now)
    changed = any(status.get(key) != old.get(key) for key in _STATUS_KEYS)
    event = None
    if change.phase != old.get("phase"):
        kind: Literal["Normal", "Warning"] = "Warning" if change.phase in _WARNING_PHASES else "Normal"
        event = PhaseEvent(type=kind, reason=change.reason, message=change.message)
    return Decision(status=status, status_changed=changed, event=event, **actions)


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
        status=status,
        status_changed=old.get("observedGeneration") != job.generation,
        delete_pods=() if expired else _deletable(doomed),
        mark_unretriable=_kueue_give_up(job, phase, pods),
        delete_job=expired,
        requeue_after=None if expired else left,
    )


def _kueue_give_up(job: JobSpec, phase: str, pods: Sequence[PodObservation]) -> tuple[str, ...]:
    """A failed job's Kueue group: one pod says retriable-in-group "false", so Kueue ends the group and
    frees its quota once no pod of it is active (otherwise Kueue waits for replacements forever)."""
    if job.kueue is None or phase != names.PHASE_FAILED:
        return ()
    managed = [p for p in pods if p.kueue_group is not None and p.kueue_finalizer]
    if not managed or any(p.kueue_unretriable for p in pods):
        return ()
    return (min(p.name for p in managed),)


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
    # Kueue keeps a group's quota while its pods are gone, waiting for replacements: a suspended job
    # gives it back by ending the group (Kueue's Workload), and queues again when resumed.
    held = job.kueue is not None and any(p.kueue_finalizer for p in pods)
    return _decision(job, old, change, now, delete_pods=_deletable(pods), release_kueue_group=held)


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
    ]
    release, force = _kueue_release(stale, now, rules)
    # Kueue counts an old pod it still holds (Succeeded, or deleted on a node that never confirmed) in
    # the group and would delete the new attempt's pods as excess: wait until it stops counting.
    blocking += [p for p in stale if p.kueue_counts_active and p not in blocking]
    wanted_hash = builders.spec_hash(job)
    # The spec changed while this attempt was being created (before its phase locked the spec): pods
    # built from the old version go, and the attempt waits until their names are free again.
    respec = [p for p in current if p.spec_hash is not None and p.spec_hash != wanted_hash]
    if respec or blocking:
        # Still tearing down: the status stays as it is (Restarting, Suspended, or nothing yet).
        return Decision(
            status=dict(old),
            status_changed=False,
            delete_pods=_deletable([*stale, *respec]),
            release_pods=release,
            force_delete_pods=force,
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
        create_attempt=target,
        create_ranks=create,
        delete_pods=_deletable(stale),
        create_service=bool(create),
        create_pvc=bool(create) and job.checkpoint is not None,
        create_network_policy=bool(create) and job.network_policy.enabled,
    )


def _kueue_release(
    stale: Sequence[PodObservation], now: datetime, rules: TimingRules
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Old pods Kueue still counts in the group: their finalizer goes once they are terminal or their
    deletion is overdue; an overdue one is also deleted at once (grace 0), as no kubelet will confirm
    it (the pod GC does the same for a node that is gone)."""
    held = [p for p in stale if p.kueue_counts_active and p.deleting]
    overdue = [
        p
        for p in held
        if p.deletion_deadline is not None
        and (now - p.deletion_deadline).total_seconds() >= rules.unconfirmed_deletion_seconds
    ]
    release = sorted(p.name for p in held if p.kueue_finalizer and (p.terminal or p in overdue))
    return tuple(release), tuple(sorted(p.name for p in overdue))


def _failure_of(pod: PodObservation, now: datetime) -> RankFailure | None:
    assert pod.rank is not None
    if pod.trainer_succeeded:
        return None
    disruption = pod.disruption
    if disruption is None and pod.deleting and not pod.terminal:
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
    if _int(old.get("replicas"), 0) < job.replicas:
        return missing, []
    return (), [
        RankFailure(rank=r, finish_key=now.timestamp(), disruption=REASON_POD_DELETED) for r in missing
    ]


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
        if sighting is None:
            return None
        return max(0.0, self.rules.straggler_window_seconds - (self.now - sighting.since).total_seconds())

    @property
    def stall_left(self) -> float | None:
        """Seconds until no new synchronized step for stallTimeoutSeconds is a stall; None: not watched."""
        limit = self.job.run_policy.stall_timeout_seconds
        if limit is None or self.progress is None or self.progress.step <= 0:
            return None  # a stall needs training to have started
        return limit - (self.now - self.progress.step_changed_at).total_seconds()

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
        from when the job left the Queued phase if that was later (docs/scheduling.md).
        """
        if self.old.get("phase") == names.PHASE_RUNNING or self.all_running or self.kueue_gated:
            return None
        created = [p.created_at for p in self.current if p.created_at is not None]
        since = min(created) if created else None
        # Leaving the queue now (the status still says Queued), or when the Queued condition turned False.
        queued_now = self.old.get("phase") == names.PHASE_QUEUED
        admitted = self.now if queued_now else _condition_ended_at(self.old, names.PHASE_QUEUED)
        if since is not None and admitted is not None and admitted > since:
            since = admitted
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
    stale = [p for p in pods if p.attempt != attempt or (p.rank or 0) >= job.replicas]
    current = [p for p in pods if p not in stale]
    to_create, missing = _missing_ranks(job, old, current, now)
    failures = [f for f in (_failure_of(p, now) for p in current) if f is not None]
    return _LiveAttempt(
        job=job,
        old=old,
        now=now,
        pods=pods,
        current=current,
        stale=stale,
        attempt=attempt,
        restarts=_int(old.get("restarts"), 0),
        to_create=to_create,
        failures=[*failures, *missing],
        rules=rules,
        progress=observed if observed is not None and observed.attempt == attempt else None,
        queue=queue if job.kueue is not None else None,
    )


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
    )
    cleanup = _cleanup(live.job, _status(live.job, live.old, change, live.now), live.pods, live.now)
    return _decision(
        live.job,
        live.old,
        change,
        live.now,
        create_attempt=live.attempt,
        delete_pods=cleanup.delete_pods,
        mark_unretriable=cleanup.mark_unretriable,
        delete_job=cleanup.delete_job,
        requeue_after=cleanup.requeue_after,
    )


def _restart(live: _LiveAttempt, reason: str, message: str, counted: bool = True) -> Decision:
    """Tear the gang down; the next attempt is created once none of its pods is alive.

    ``counted``: the retry spends backoffLimit (status.restarts); a preemption does not
    (status.preemptions).
    """
    preemptions = _int(live.old.get("preemptions"), 0)
    change = _Transition(
        phase=names.PHASE_RESTARTING,
        reason=reason,
        message=message,
        counts=live.counts,
        attempt=live.attempt,
        restarts=live.restarts + (1 if counted else 0),
        preemptions=preemptions if counted else preemptions + 1,
        start_time=live.old.get("startTime"),
    )
    return _decision(
        live.job,
        live.old,
        change,
        live.now,
        gang_restart=True,
        delete_pods=_deletable(live.pods),
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
    )
    if verdict.outcome == "retry":
        return _restart(live, verdict.reason, verdict.message, verdict.counted)
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
    return _finish(live, names.PHASE_FAILED, reason, message)


def _rule_stalled(live: _LiveAttempt) -> Decision | None:
    """No synchronized step for stallTimeoutSeconds: the gang is hung; retried like a lost peer."""
    left = live.stall_left
    if left is None or left > 0 or live.progress is None:
        return None
    limit = live.job.run_policy.stall_timeout_seconds
    steps = live.progress.rank_steps
    per_pod = live.job.nproc_per_node
    # Keyed by each pod's first global rank, as the scraper reads every pod's endpoint.
    nodes = {p.rank * per_pod: p.node for p in live.current if p.rank is not None}
    # A pod whose endpoint did not answer while the others did (a SIGSTOPped or wedged process) is the
    # likeliest culprit: it comes first.
    silent = sorted(r for r in nodes if r not in steps) if steps else []
    behind = (silent + sorted(steps, key=lambda rank: (steps[rank], rank)))[:3]
    where = ", ".join(
        f"rank {r} ({f'step {steps[r]}' if r in steps else 'its metrics did not answer'}) "
        f"on node {nodes.get(r) or 'unknown'}"
        for r in behind
    )
    stalled = RankFailure(
        rank=behind[0] if behind else 0, finish_key=live.now.timestamp(), disruption=REASON_STALLED
    )
    verdict = judge_failures(
        live.job.restart_policy, live.job.run_policy.backoff_limit, live.restarts, [stalled], live.attempt
    )
    detail = f"no synchronized step for {limit}s after step {live.progress.step}"
    if where:
        detail += f"; furthest behind: {where}"
    message = f"{detail}; {verdict.message}"
    if verdict.retry:
        return _restart(live, REASON_STALLED, message)
    return _finish(live, names.PHASE_FAILED, verdict.reason, message)


def _shown_straggler(live: _LiveAttempt) -> tuple[dict[str, Any] | None, tuple[PhaseEvent, ...]]:
    """status.straggler once a rank has been slowest for the window, and an Event when it is new."""
    sighting = live.progress.straggler if live.progress is not None else None
    if sighting is None or live.straggler_left:
        return None, ()
    pod = next((p for p in live.current if p.rank == sighting.rank), None)
    shown = straggler_status(sighting, pod.name if pod else "", pod.node if pod else "")
    previous = live.old.get("straggler")
    if isinstance(previous, Mapping) and previous.get("rank") == sighting.rank:
        return shown, ()
    notice = PhaseEvent(
        type="Warning",
        reason=REASON_STRAGGLER,
        message=(
            f"rank {sighting.rank} ({shown['pod']} on node {shown['node'] or 'unknown'}) has been "
            f"{sighting.slowdown:.2f}x slower than the median rank for "
            f"{live.rules.straggler_window_seconds:.0f}s"
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
    if live.all_running or live.old.get("phase") == names.PHASE_RUNNING:
        phase, reason = names.PHASE_RUNNING, REASON_RUNNING
        message = f"all {job.replicas} rank(s) of attempt {attempt} are running (world size {job.world_size})"
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
    )
    create = live.to_create
    return _decision(
        job,
        live.old,
        change,
        live.now,
        delete_pods=_deletable(live.stale),
        create_attempt=attempt,
        create_ranks=create,
        create_service=bool(create),
        create_pvc=bool(create) and job.checkpoint is not None,
        create_network_policy=bool(create) and job.network_policy.enabled,
        notices=notices,
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
    _rule_judged,
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
            return decision
    return _rule_progress(live)


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
        status=failed,
        status_changed=True,
        create_attempt=refusal.attempt,
        event=PhaseEvent(type="Warning", reason=reason, message=text),
        requeue_after=0.0,
    )


def decide_invalid_spec(status: Mapping[str, Any], generation: int, message: str, now: datetime) -> Decision:
    """A manifest the CRD let through but the operator cannot run (e.g. written under an older CRD)."""
    old: Mapping[str, Any] = status or {}
    if old.get("phase") == names.PHASE_FAILED:
        return Decision(status=dict(old), status_changed=False)
    failed = {
        **failed_status({}, REASON_INVALID_SPEC, message, now),
        "conditions": _conditions(
            old.get("conditions") or [], names.PHASE_FAILED, REASON_INVALID_SPEC, message, format_time(now)
        ),
        "observedGeneration": generation,
    }
    return Decision(
        status=failed,
        status_changed=True,
        event=PhaseEvent(type="Warning", reason=REASON_INVALID_SPEC, message=message),
    )
