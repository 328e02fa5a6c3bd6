"""The DDPJob state machine: from the job, its last status and its own pods to what to do next.

``decide`` is pure and cheap (no API calls, linear in the job's own pods) and answers a ``Decision``
(decision.py, which also says how the executor carries one out). This module holds the phases and the
order of the rules; what each rule asks is a policy (policies/), and the status a decision writes is
built in status.py.

The state lives in status. While the phase is Pending, Starting or Running, ``attempt`` is the
attempt whose pods should exist; during Restarting it is the attempt being torn down, and during
Suspended the last attempt that ran (absent when none did). The next attempt is created only once
no pod of another attempt is alive, so a rank never has two live pods and pod names never repeat.
Until every rank's pod of the attempt has been observed once (``status.ranksCreated`` records it), a
missing pod is (re)created, which is idempotent: that is how an operator killed mid-create finishes
the attempt, and why the status write may come before or after the creates. After that, a missing
pod was deleted under the job and fails its rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, Final, Literal

from ddp_operator import builders, kueue, names, ranks, standbys
from ddp_operator.decision import (
    DEFAULT_TIMING,
    REASON_CREATED,
    REASON_INVALID_SPEC,
    REASON_POD_CREATE_FORBIDDEN,
    REASON_POD_REPLACED,
    REASON_QUEUED,
    REASON_RECOVERED,
    REASON_RESIZED,
    REASON_RESTARTED_IN_PLACE,
    REASON_RESUMED,
    REASON_RUNNING,
    REASON_SCHEDULED,
    REASON_STRAGGLER,
    REASON_STRAGGLER_NOT_REPLACED,
    REASON_STRAGGLER_REPLACED,
    REASON_SUSPENDED,
    CreateRefusal,
    Creates,
    Decision,
    Deletes,
    PhaseEvent,
    Report,
    TimingRules,
    deletable,
    lost_now,
)
from ddp_operator.kueue import QueueObservation, queued_message
from ddp_operator.observe import PodObservation, format_time, int_field, parse_time, superseded
from ddp_operator.policies import (
    accounting,
    budget,
    creation,
    deadline,
    elastic,
    recovery,
    replacement,
    restart_events,
    stall,
    straggler,
    success,
    ttl,
)
from ddp_operator.policies import kueue as kueue_policy
from ddp_operator.policies.attempt import judge_attempt
from ddp_operator.policies.failure import (
    REASON_BACKOFF,
    REASON_STALLED,
    RankFailure,
    failure_of,
    judge_failures,
)
from ddp_operator.policies.kueue import KueueActions
from ddp_operator.progress.render import shown_straggler
from ddp_operator.progress.tracker import ProgressObservation, StragglerSighting, persistence_left
from ddp_operator.spec import JobSpec
from ddp_operator.status import (
    Counts,
    Transition,
    build_status,
    condition_ended_at,
    condition_message,
    condition_reason,
    condition_time,
    conditions,
    count_pods,
    failed_status,
    status_changed,
)

# Reasons that end a job whose pods must stop consuming resources whatever cleanPodPolicy says.
_STOP_REASONS: Final = frozenset(
    {deadline.REASON_DEADLINE, deadline.REASON_UNSCHEDULABLE, deadline.REASON_IMAGE_PULL}
    | {deadline.REASON_STARTUP_TIMEOUT, success.REASON_HUNG_AFTER_TRAINING}
    | {REASON_POD_CREATE_FORBIDDEN, REASON_INVALID_SPEC}
)
# While waiting for the old attempt's pods to go, look again this often even without pod events.
RESTART_POLL_SECONDS: Final = 5.0

_WARNING_PHASES: Final = frozenset({names.PHASE_RESTARTING, names.PHASE_FAILED})
# The Event of each notice policies.restart_events.restart_notice gives.
_RESTART_NOTICE_REASONS: Final = {
    "resized": REASON_RESIZED,
    "in-place": REASON_RESTARTED_IN_PLACE,
    "recovered": REASON_RECOVERED,
}


def _decision(
    job: JobSpec,
    old: Mapping[str, Any],
    change: Transition,
    now: datetime,
    *,
    notices: tuple[PhaseEvent, ...] = (),
    gang_restart: bool = False,
    restart_measured: tuple[str, float] | None = None,
    **actions: Any,
) -> Decision:
    """The Decision that moves status by ``change``; ``actions``: the other fields of the Decision."""
    status = build_status(job, old, change, now)
    event = None
    if change.phase != old.get("phase"):
        kind: Literal["Normal", "Warning"] = "Warning" if change.phase in _WARNING_PHASES else "Normal"
        event = PhaseEvent(type=kind, reason=change.reason, message=change.message)
    report = Report(status, status_changed(old, status), event, notices, gang_restart, restart_measured)
    return Decision(report=report, **actions)


def _creates(job: JobSpec, attempt: int, ranks: tuple[int, ...], restarts: int) -> Creates:
    """The ranks to create, and the Service, PVC and NetworkPolicy with them (none when no rank is)."""
    return Creates(
        attempt=attempt,
        ranks=ranks,
        restart_budget=budget.launcher_budget(job, restarts),
        service=bool(ranks),
        pvc=bool(ranks) and job.checkpoint is not None,
        network_policy=bool(ranks) and job.network_policy.enabled,
    )


def _min_wait(*waits: float | None) -> float | None:
    present = [max(0.0, w) for w in waits if w is not None]
    return min(present) if present else None


def _owned(job: JobSpec, pods: Sequence[PodObservation]) -> list[PodObservation]:
    """Pods of this job object: a pod owned by an earlier job of the same name is not ours to judge."""
    return [p for p in pods if not job.uid or p.owner_uid in (None, job.uid)]


def _ours(job: JobSpec, pods: Sequence[PodObservation]) -> list[PodObservation]:
    """This job object's rank pods (its rendezvous pods carry no rank)."""
    return [p for p in _owned(job, pods) if p.rank is not None and p.attempt is not None]


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
        delete=Deletes(pods=() if expired else deletable(doomed), job=expired),
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
        message = condition_message(old, names.PHASE_SUSPENDED) or message
    change = Transition(
        phase=names.PHASE_SUSPENDED,
        reason=REASON_SUSPENDED,
        message=message,
        counts=count_pods(pods),
        attempt=attempt if isinstance(attempt, int) else None,
        restarts=int_field(old.get("restarts"), 0),
    )
    return _decision(
        job,
        old,
        change,
        now,
        delete=Deletes(pods=deletable(pods)),
        kueue=kueue_policy.suspend(job.kueue is not None, pods),
    )


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
            delete=Deletes(pods=deletable([*stale, *respec]), lost_pods=lost_now(stale)),
            kueue=release,
            requeue_after=RESTART_POLL_SECONDS,
        )
    present = {p.rank for p in current}
    create = tuple(r for r in range(job.replicas) if r not in present)
    resumed = old.get("phase") == names.PHASE_SUSPENDED
    restarting = old.get("phase") == names.PHASE_RESTARTING
    start_time = old.get("startTime") if restarting and old.get("startTime") else format_time(now)
    verb = "resumed: created" if resumed else "created"
    change = Transition(
        phase=names.PHASE_PENDING,
        reason=REASON_RESUMED if resumed else REASON_CREATED,
        message=f"{verb} {job.replicas} rank pod(s) of attempt {target} (world size {job.world_size})",
        counts=count_pods(current),
        attempt=target,
        restarts=int_field(old.get("restarts"), 0),
        start_time=start_time,
        # Every rank's pod observed already (an operator stopped before this status was written).
        ranks_created=None if create else target,
    )
    return _decision(
        job,
        old,
        change,
        now,
        create=_creates(job, target, create, change.restarts),
        delete=Deletes(pods=deletable(stale), lost_pods=lost_now(stale)),
    )


# --- a live attempt: an ordered list of rules, like the policy table in docs/restarts.md -------------


@dataclass(frozen=True)
class _LiveAttempt:
    """What the rules of a live attempt (Pending, Starting, Running) read, gathered once: each derived
    fact is a cached_property, computed the first time a rule asks."""

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
    accounting: accounting.RestartAccounting = accounting.NOTHING_NEW
    goodput: float | None = None
    # status.ranksCreated after this decision: this attempt once every rank's pod has been observed.
    ranks_created: int | None = None

    @cached_property
    def counts(self) -> Counts:
        return count_pods(self.current)

    @cached_property
    def kueue_gated(self) -> int:
        """Rank pods of this attempt Kueue still gates: the group is not admitted (yet, or again)."""
        return sum(1 for p in self.current if p.kueue_gated and not p.deleting)

    @cached_property
    def all_running(self) -> bool:
        return len(self.current) == self.job.replicas and all(
            p.running or p.trainer_succeeded for p in self.current
        )

    @cached_property
    def running(self) -> list[PodObservation]:
        return [p for p in self.current if (p.running or p.trainer_succeeded) and not p.deleting]

    @cached_property
    def can_train(self) -> bool:
        """Every rank's pod runs; an elastic job's group once enough run (policies.elastic)."""
        if self.job.elastic is None:
            return self.all_running
        return elastic.can_train(self.job.elastic, self.running)

    @cached_property
    def group_replicas(self) -> int | None:
        """An elastic job's pods in the training group, as rank 0's launcher last said."""
        if self.job.elastic is None or self.progress is None:
            return None
        return elastic.group_replicas(self.progress.restart)

    @cached_property
    def resizes(self) -> tuple[int | None, bool]:
        """status.elastic.resizes after this read, and whether the group resized (policies.elastic)."""
        if self.job.elastic is None or self.progress is None:
            return None, False
        return elastic.resizes(self.progress.restart, self.old.get("elastic"))

    @cached_property
    def active_left(self) -> float | None:
        return deadline.seconds_left(
            parse_time(self.old.get("startTime")), self.job.run_policy.active_deadline_seconds, self.now
        )

    @cached_property
    def shown_progress(self) -> Mapping[str, Any] | None:
        """status.progress: the newest read of this attempt, else what status already shows of it."""
        if self.progress is not None and self.progress.status:
            return self.progress.status
        old = self.old.get("progress")
        return old if isinstance(old, Mapping) and self.old.get("attempt") == self.attempt else None

    @cached_property
    def sighting(self) -> StragglerSighting | None:
        return self.progress.straggler if self.progress is not None else None

    @cached_property
    def straggler_left(self) -> float | None:
        """Seconds until the slowest rank has been slow for the straggler window; 0: it has."""
        return persistence_left(self.sighting, self.rules.straggler_window_seconds, self.now)

    def pod_of(self, rank: int | None) -> PodObservation | None:
        """The pod that hosts global rank ``rank`` now (ranks.pod_of_rank), None without one."""
        if rank is None or self.progress is None:
            return None
        read, elastic_job = self.progress.rank_pods, self.job.elastic is not None
        return ranks.pod_of_rank(rank, read, self.current, self.job.nproc_per_node, elastic_job)

    @cached_property
    def straggler_pod(self) -> PodObservation | None:
        return self.pod_of(self.sighting.rank if self.sighting is not None else None)

    @cached_property
    def straggler_verdict(self) -> straggler.StragglerVerdict:
        """runPolicy.stragglerPolicy on the straggler and the last health check (policies.straggler)."""
        policy, replaced = self.job.run_policy.straggler, straggler.replaced_so_far(self.old)
        check = self.progress.health if self.progress is not None else None
        check_pod = self.pod_of(check.slow_rank if check is not None else None)
        return straggler.verdict(
            policy,
            self.sighting,
            self.straggler_pod,
            self.now,
            replaced,
            check,
            check_pod,
            rank0=recovery.rendezvous_apart(self.job),
            shrinkable=elastic.can_shrink(self.job.elastic, self.running),
        )

    @cached_property
    def stall_clock(self) -> tuple[int | None, datetime | None]:
        """The stall limit and its clock's start (policies.stall.clock), plus an elastic allowance."""
        if self.progress is None:
            return None, None
        # A pod's start (or a replacement's creation, or a standby given its rank) changes the group:
        # the clock starts again there.
        started = [p.assigned_at or p.started_at or p.created_at for p in self.current]
        spec, progress = self.job.elastic, self.progress
        return stall.clock(
            self.job.run_policy.stall_timeout_seconds, progress.step_seconds, progress.step_changed_at,
            progress.group_changed_at, *started,
            allowance=0 if spec is None else elastic.stall_allowance(spec, self.current),
        )  # fmt: skip

    @cached_property
    def stall_left(self) -> float | None:
        """Seconds until no new synchronized step for the stall limit is a stall; None: not watched."""
        progress = self.progress
        if progress is None or progress.finished:
            return None  # a finished group cannot stall
        # A fixed-size job's pod not running (a replacement still starting) is the startup deadline's to
        # judge. An elastic group trains on the pods that run: one that cannot be placed is outside the
        # round and holds nothing up, so the round is watched while it can train.
        if not (self.can_train if self.job.elastic is not None else all(p.running for p in self.current)):
            return None
        limit, since = self.stall_clock
        return stall.seconds_left(limit, progress.step, since, self.now)

    @cached_property
    def stall_verdict_left(self) -> float | None:
        """Seconds until the stall is judged (policies.stall.verdict_left); None: not watched."""
        read_at = self.progress.rank_steps_read_at if self.progress is not None else None
        return stall.verdict_left(self.stall_left, read_at, self.now)

    @cached_property
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

    @cached_property
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
        admitted = self.now if queued_now else condition_ended_at(self.old, names.PHASE_QUEUED)
        if since is not None and admitted is not None and admitted > since:
            since = admitted
        return deadline.seconds_left(since, self.job.run_policy.startup_deadline_seconds, self.now)

    @cached_property
    def below_min_left(self) -> float | None:
        """An elastic job below minReplicas: seconds left of startupDeadlineSeconds, counted from the
        loss that took it there (docs/elastic.md); None while it can train, or for a fixed-size job."""
        if self.job.elastic is None or self.can_train:
            return None
        since = elastic.below_min_since(
            self.old.get("lastRestart"), self.attempt, condition_time(self.old, names.PHASE_RUNNING)
        )
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
    attempt = int_field(old.get("attempt"), 0)
    replaced = superseded(pods)
    stale = [p for p in pods if p.attempt != attempt or (p.rank or 0) >= job.replicas or p in replaced]
    current = [p for p in pods if p not in stale]
    created = creation.ranks_created(job, old, attempt, current)
    to_create, missing = creation.missing_ranks(job, current, created, now)
    failures = [f for f in (failure_of(p, now) for p in current) if f is not None]
    progress = observed if observed is not None and observed.attempt == attempt else None
    read = (
        accounting.account_read(
            old.get("lastRestart"), attempt, progress.restart, progress.step, progress.step_changed_at
        )
        if progress is not None
        else accounting.NOTHING_NEW
    )
    report = progress.restart if progress is not None else None
    return _LiveAttempt(
        job=job,
        old=old,
        now=now,
        pods=pods,
        current=current,
        stale=stale,
        attempt=attempt,
        restarts=int_field(old.get("restarts"), 0) + read.added,
        to_create=to_create,
        failures=[*failures, *missing],
        rules=rules,
        progress=progress,
        queue=queue if job.kueue is not None else None,
        accounting=read,
        goodput=accounting.goodput(
            report.kept_step_seconds if report is not None else None, parse_time(old.get("startTime")), now
        ),
        ranks_created=attempt if created else None,
    )


def _finish(live: _LiveAttempt, phase: str, reason: str, message: str) -> Decision:
    """The attempt ends the job: Succeeded or Failed, with the cleanup that comes with it."""
    change = Transition(
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
        ranks_created=live.ranks_created,
    )
    cleanup = _cleanup(live.job, build_status(live.job, live.old, change, live.now), live.pods, live.now)
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
    preemptions = int_field(live.old.get("preemptions"), 0)
    in_place = live.job.run_policy.restart_mode == recovery.MODE_IN_PLACE
    note = (
        recovery.fallback_note(live.failures, rank0=recovery.rendezvous_apart(live.job)) if in_place else ""
    )
    record = accounting.new_record(
        cause=reason,
        mode=accounting.MODE_WHOLE_GANG,
        attempt=live.attempt,
        failure_time=datetime.fromtimestamp(failure.finish_key, UTC) if failure else live.now,
        rank=failure.rank if failure else None,
        exit_code=failure.exit_code if failure else None,
        note=note,
    )
    change = Transition(
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
        ranks_created=live.ranks_created,
    )
    return _decision(
        live.job,
        live.old,
        change,
        live.now,
        gang_restart=True,
        delete=Deletes(pods=deletable([p for p in live.pods if p.name not in hung]), hung_pods=hung),
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
        finish_grace_left=success.finish_grace_left(live.current, live.now),
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
    is hung; retried like a lost peer. Under InPlace, pods whose metrics stopped answering (frozen,
    wedged) are lost pods: replaced alone unless rank 0's is among them (policies.recovery)."""
    left = live.stall_verdict_left
    if left is None or left > 0 or live.progress is None:
        return None
    limit = live.stall_clock[0] or 0
    # Each pod of the round by its first global rank (ranks.py: an elastic round's own numbering).
    by_rank = ranks.first_ranks(
        live.progress.rank_pods, live.current, live.job.nproc_per_node, live.job.elastic is not None
    )
    nodes = {rank: p.node for rank, p in by_rank.items()}
    stalled, detail = stall.stalled(limit, live.progress.step, live.progress.rank_steps, nodes, live.now)
    silent = [by_rank[r] for r in stall.silent_ranks(live.progress.rank_steps, nodes)]
    verdict = judge_failures(
        live.job.restart_policy, live.job.run_policy.backoff_limit, live.restarts, [stalled], live.attempt
    )
    if not verdict.retry:
        return _finish(live, names.PHASE_FAILED, verdict.reason, f"{detail}; {verdict.message}")
    alone = recovery.replaceable_hung(
        live.job.run_policy.restart_mode,
        [p.rank for p in silent],
        queued=live.job.kueue is not None,
        rank0=recovery.rendezvous_apart(live.job),
    )
    if alone is not None:
        # The pods that stopped answering take no SIGTERM: deleted at once, their ranks replaced alone.
        hung = Deletes(hung_pods=tuple(p.name for p in silent))
        return _replace_alone(live, alone, stalled, REASON_STALLED, detail, hung)
    message = f"{detail}; {verdict.message}"
    return _restart(live, REASON_STALLED, message, failure=stalled, hung=tuple(p.name for p in silent))


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


def _straggler(live: _LiveAttempt) -> tuple[Mapping[str, Any] | None, tuple[PhaseEvent, ...]]:
    """status.straggler (progress.render.shown_straggler), and its Warning when the rank is new."""
    before = live.old.get("straggler")
    window = live.rules.straggler_window_seconds
    sighting = live.sighting
    if sighting is not None and not straggler.measured(sighting, live.straggler_pod):
        sighting = None  # the windows of the pod it replaced: a replacement is not named for them
    named, notice = shown_straggler(sighting, live.straggler_left, live.straggler_pod, before, window)
    notices: tuple[PhaseEvent, ...] = ()
    if notice is not None:
        notices = (PhaseEvent(type="Warning", reason=REASON_STRAGGLER, message=notice),)
    shown, held = straggler.with_note(named, before, live.straggler_verdict.held)
    if held is not None:
        notices += (PhaseEvent(type="Warning", reason=REASON_STRAGGLER_NOT_REPLACED, message=held),)
    return shown, notices


def _rule_straggler(live: _LiveAttempt) -> Decision | None:
    """runPolicy.stragglerPolicy Replace: the straggler's pod, slow for long enough, is replaced alone
    away from its node, without spending backoffLimit (policies.straggler)."""
    pod, what = live.straggler_verdict.replace, live.straggler_verdict.text
    if pod is None or pod.rank is None:
        return None
    slow = RankFailure(rank=pod.rank, finish_key=live.now.timestamp())
    deletes = Deletes(pods=(pod.name,))
    return _replace_alone(
        live, (pod.rank,), slow, REASON_STRAGGLER_REPLACED, what, deletes, slow_node=pod.node
    )


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
        message = condition_message(live.old, phase) or message
    straggler, notices = _straggler(live)
    change = Transition(
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
        resizes=live.resizes[0],
        ranks_created=live.ranks_created,
    )
    return _decision(
        job,
        live.old,
        change,
        live.now,
        delete=Deletes(pods=deletable(live.stale), lost_pods=lost_now(live.stale)),
        kueue=_release_replaced(live, [p for p in live.stale if p.attempt == attempt]),
        create=_creates(job, attempt, live.to_create, live.restarts),
        notices=notices + _restart_notices(live),
        restart_measured=live.accounting.measured,
        requeue_after=_min_wait(
            live.active_left,
            live.startup_left,
            live.decision_window_left,
            live.stall_verdict_left,
            success.finish_grace_left(live.current, live.now),
            live.straggler_left,
            live.straggler_verdict.left,
            # While queued, what Kueue says changes without a pod event: look again now and then.
            kueue.QUEUED_POLL_SECONDS if phase == names.PHASE_QUEUED else None,
        ),
    )


def _running_message(live: _LiveAttempt) -> str:
    job, attempt = live.job, live.attempt
    if job.elastic is None:
        return f"all {job.replicas} rank(s) of attempt {attempt} are running (world size {job.world_size})"
    return elastic.running_message(job.elastic, len(live.running), job.replicas, attempt)


def _restart_notices(live: _LiveAttempt) -> tuple[PhaseEvent, ...]:
    """The Event of what this read says of restarts (policies.restart_events.restart_notice), if any."""
    notice = restart_events.restart_notice(
        live.accounting, live.restarts, live.job.run_policy.backoff_limit, resized=live.resizes[1]
    )
    if notice is None:
        return ()
    kind: Literal["Normal", "Warning"] = "Warning" if notice.warning else "Normal"
    return (PhaseEvent(type=kind, reason=_RESTART_NOTICE_REASONS[notice.kind], message=notice.text),)


def _rule_replace_lost(live: _LiveAttempt) -> Decision | None:
    """InPlace: a lost pod (deleted, evicted, its node gone) is replaced alone (rank 0's too, unless
    policies.recovery.rendezvous_apart says no); its peers restart in place and wait for the new pod on
    the rendezvous's next round."""
    mode, rank0 = live.job.run_policy.restart_mode, recovery.rendezvous_apart(live.job)
    ranks = recovery.replaceable_ranks(mode, live.failures, rank0=rank0, replicas=live.job.replicas)
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
    return _replace_alone(
        live,
        ranks,
        verdict.failure,
        verdict.reason,
        verdict.failure.describe(),
        Deletes(pods=deletable([p for p in lost if p.terminal]), lost_pods=lost_now(lost)),
        _release_replaced(live, lost),
    )


# A pod replaced alone: lost, or a straggler's (runPolicy.stragglerPolicy Replace).
_REPLACED_REASONS: Final = {False: REASON_POD_REPLACED, True: REASON_STRAGGLER_REPLACED}


def _replace_alone(
    live: _LiveAttempt,
    ranks: Sequence[int],
    failure: RankFailure,
    cause: str,
    what: str,
    delete: Deletes,
    kueue_actions: KueueActions = kueue_policy.NONE,
    *,
    slow_node: str | None = None,
) -> Decision:
    """New pods for ``ranks`` alone (policies.replacement.replace_pods); the survivors restart in place and
    wait for them on the rendezvous's next round. ``what``: what happened, for the Event. ``slow_node``:
    a straggler's replacement (policies.straggler): nothing failed, so no backoffLimit is spent, and the
    job avoids that node from now on."""
    plan = replacement.replace_pods(
        live.job,
        ranks,
        failure,
        cause,
        live.attempt,
        live.restarts,
        live.old.get("lastRestart"),
        live.accounting.record,
        live.old.get("podReplacements"),
        (p.replacement for p in live.pods),
        charged=slow_node is None,
    )
    budget = (
        f"restart {plan.restarts} of {live.job.run_policy.backoff_limit}"
        if slow_node is None
        else "no restart spent"
    )
    message = (
        f"{what} in attempt {live.attempt}: replaced by "
        + ", ".join(names.pod_name(live.job.name, rank, live.attempt, n) for rank, n in plan.replacements)
        + f"; the other ranks restart in place ({budget})"
    )
    slow_status = {} if slow_node is None else straggler.status_after(live.old, slow_node)
    change = Transition(
        phase=str(live.old.get("phase") or names.PHASE_RUNNING),
        reason=str(condition_reason(live.old) or REASON_RUNNING),
        message=condition_message(live.old, str(live.old.get("phase"))) or message,
        counts=live.counts,
        attempt=live.attempt,
        restarts=plan.restarts,
        start_time=live.old.get("startTime") or format_time(live.now),
        progress=live.shown_progress,
        last_restart=plan.record,
        goodput=live.goodput,
        pod_replacements=plan.pod_replacements,
        ranks_created=live.ranks_created,
        **slow_status,
    )
    return _decision(
        live.job,
        live.old,
        change,
        live.now,
        create=Creates(
            attempt=live.attempt, replacements=plan.replacements, restart_budget=plan.restart_budget
        ),
        delete=delete,
        kueue=kueue_actions,
        notices=(
            PhaseEvent(type="Warning", reason=_REPLACED_REASONS[slow_node is not None], message=message),
        ),
        requeue_after=_min_wait(live.active_left, live.stall_verdict_left),
    )


def _release_replaced(live: _LiveAttempt, pods: Sequence[PodObservation]) -> KueueActions:
    """Replaced pods of a Kueue group go once they have ended: Kueue's finalizer would keep them."""
    if live.job.kueue is None:
        return kueue_policy.NONE
    return kueue_policy.release_stale(pods, live.now, live.rules.unconfirmed_deletion_seconds)


def _rule_in_place_budget(live: _LiveAttempt) -> Decision | None:
    """The launchers restarted the gang in place more often than backoffLimit allows: the job fails."""
    limit = live.job.run_policy.backoff_limit
    if not live.accounting.added or budget.restarts_left(limit, live.restarts) >= 0:
        return None
    record = live.accounting.record or {}
    message = (
        f"{restart_events.describe(record, live.restarts, limit)}; backoffLimit {limit} exceeded "
        f"after {live.restarts} restart(s)"
    )
    return _finish(live, names.PHASE_FAILED, REASON_BACKOFF, message)


def _rule_restart_stuck(live: _LiveAttempt) -> Decision | None:
    """Restarting longer than startupDeadlineSeconds: the next attempt could not even be created."""
    limit = live.job.run_policy.startup_deadline_seconds
    since = condition_time(live.old, names.PHASE_RESTARTING)
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
    since = condition_time(old, names.PHASE_RESTARTING)
    stuck_left = deadline.seconds_left(since, job.run_policy.startup_deadline_seconds, now)
    requeue = _min_wait(started.requeue_after, live.active_left, stuck_left)
    return replace(started, requeue_after=requeue)


# In order: the first rule that ends the attempt wins; the last always answers.
_LIVE_RULES: Final = (
    _rule_replace_lost,
    _rule_judged,
    _rule_in_place_budget,
    _rule_active_deadline,
    _rule_startup_deadline,
    _rule_root_image_refused,
    _rule_stalled,
    _rule_straggler,
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
    read_at = stall.read_due(live.stall_left, live.now)  # the read a stall is judged on
    return replace(decision, judged_in=live.decision_window_left, read_every_pod_at=read_at)


def decide(
    job: JobSpec,
    status: Mapping[str, Any],
    pods: Sequence[PodObservation],
    now: datetime,
    refusal: CreateRefusal | None = None,
    rules: TimingRules = DEFAULT_TIMING,
    observed: ProgressObservation | None = None,
    queue: QueueObservation | None = None,
    standby_held_until: datetime | None = None,
) -> Decision:
    """The next step for one job.

    ``pods``: observations of the job's own pods; ``now``: timezone-aware; ``refusal``: a child the
    apiserver refused for good since the last decision; ``rules``: how long to wait for late reports;
    ``observed``: what the operator read of the training from rank 0's metrics; ``queue``: what
    Kueue says of the job's group while it is queued; ``standby_held_until``: the apiserver refused a
    standby pod, and no other is created before then.
    """
    old: Mapping[str, Any] = status or {}
    decision = _decide(job, old, _ours(job, pods), now, refusal, rules, observed, queue)
    # The standby pods (no rank's until one takes a lost pod's, so not in _ours): policies.standby.
    decision = standbys.with_standbys(job, decision, _owned(job, pods), now, standby_held_until)
    # The rendezvous pods (no rank's, so not in _ours) go with the attempt they served.
    doomed = recovery.stores_to_delete(
        _owned(job, pods), decision.phase, decision.report.status.get("attempt")
    )
    return replace(decision, delete=replace(decision.delete, pods=decision.delete.pods + doomed))


def _decide(
    job: JobSpec,
    old: Mapping[str, Any],
    ours: Sequence[PodObservation],
    now: datetime,
    refusal: CreateRefusal | None,
    rules: TimingRules,
    observed: ProgressObservation | None,
    queue: QueueObservation | None,
) -> Decision:
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
    if phase in names.LIVE_PHASES and isinstance(attempt, int):
        return _live(job, old, ours, now, rules, observed, queue)
    # A new job, or one whose first creation was interrupted: finish creating its newest attempt.
    newest = max((p.attempt for p in ours if p.attempt is not None), default=0)
    return _start_attempt(job, old, ours, now, newest, rules)


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
        "conditions": conditions(
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
