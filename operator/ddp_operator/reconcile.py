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
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Final, Literal

from ddp_operator import builders, names, standbys
from ddp_operator.decision import (
    DEFAULT_TIMING,
    REASON_CREATED,
    REASON_DEADLINE,
    REASON_HUNG_AFTER_TRAINING,
    REASON_IMAGE_PULL,
    REASON_INVALID_SPEC,
    REASON_POD_CREATE_FORBIDDEN,
    REASON_POD_REPLACED,
    REASON_QUEUED,
    REASON_RESUMED,
    REASON_RUNNING,
    REASON_SCHEDULED,
    REASON_STARTUP_TIMEOUT,
    REASON_STRAGGLER_REPLACED,
    REASON_SUSPENDED,
    REASON_UNSCHEDULABLE,
    RESTART_POLL_SECONDS,
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
    creation,
    elastic,
    placement,
    recovery,
    registry,
    rendezvous,
    replacement,
    restart_events,
    stall,
    straggler,
    ttl,
)
from ddp_operator.policies import attempt as attempt_policy
from ddp_operator.policies import kueue as kueue_policy
from ddp_operator.policies.budget import launcher_budget
from ddp_operator.policies.failure import failure_of
from ddp_operator.policies.placement import NodeLabels
from ddp_operator.policies.rule import (
    LIVE,
    RESTARTING,
    Attempt,
    Finish,
    Hold,
    Outcome,
    Phase,
    ReplaceAlone,
    Restart,
)
from ddp_operator.progress.tracker import ProgressObservation
from ddp_operator.spec import JobSpec
from ddp_operator.status import (
    Transition,
    build_status,
    condition_message,
    condition_reason,
    conditions,
    count_pods,
    failed_status,
    status_changed,
)

# Reasons that end a job whose pods must stop consuming resources whatever cleanPodPolicy says.
_STOP_REASONS: Final = frozenset(
    {REASON_DEADLINE, REASON_UNSCHEDULABLE, REASON_IMAGE_PULL}
    | {REASON_STARTUP_TIMEOUT, REASON_HUNG_AFTER_TRAINING}
    | {REASON_POD_CREATE_FORBIDDEN, REASON_INVALID_SPEC}
)

_WARNING_PHASES: Final = frozenset({names.PHASE_RESTARTING, names.PHASE_FAILED})


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
        restart_budget=launcher_budget(job, restarts),
        service=bool(ranks),
        pvc=bool(ranks) and job.checkpoint is not None,
        network_policy=bool(ranks) and job.network_policy.enabled,
    )


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


# --- a live attempt: the rules of policies/registry.py in their order, then the phase the pods show ---


def _observe(
    job: JobSpec,
    old: Mapping[str, Any],
    pods: Sequence[PodObservation],
    now: datetime,
    timing: TimingRules = DEFAULT_TIMING,
    observed: ProgressObservation | None = None,
    queue: QueueObservation | None = None,
) -> Attempt:
    """The observation every rule of the attempt in status reads (policies/rule.py)."""
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
    running = [p for p in current if (p.running or p.trainer_succeeded) and not p.deleting]
    if job.elastic is None:
        can_train = len(current) == job.replicas and all(p.running or p.trainer_succeeded for p in current)
    else:
        can_train = elastic.can_train(job.elastic, running)
    return Attempt(
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
        running=running,
        can_train=can_train,
        kueue_gated=sum(1 for p in current if p.kueue_gated and not p.deleting),
        timing=timing,
        progress=progress,
        queue=queue if job.kueue is not None else None,
        accounting=read,
        goodput=accounting.goodput(
            report.kept_step_seconds if report is not None else None, parse_time(old.get("startTime")), now
        ),
        ranks_created=attempt if created else None,
    )


def _shown_progress(live: Attempt) -> Mapping[str, Any] | None:
    """status.progress: the newest read of this attempt, else what status already shows of it."""
    if live.progress is not None and live.progress.status:
        return live.progress.status
    old = live.old.get("progress")
    return old if isinstance(old, Mapping) and live.old.get("attempt") == live.attempt else None


def _transition(live: Attempt, phase: str, reason: str, message: str, **changed: Any) -> Transition:
    """The one status change of a live attempt's decision: what every outcome writes, from the
    observation, and ``changed``: the fields this outcome writes otherwise (status.Transition's)."""
    shared = Transition(
        phase=phase,
        reason=reason,
        message=message,
        counts=count_pods(live.current),
        attempt=live.attempt,
        restarts=live.restarts,
        start_time=live.old.get("startTime") or format_time(live.now),
        progress=_shown_progress(live),
        last_restart=live.accounting.record,
        goodput=live.goodput,
        ranks_created=live.ranks_created,
    )
    return replace(shared, **changed)


def _finish(live: Attempt, outcome: Finish) -> Decision:
    """The attempt ends the job: Succeeded or Failed, with the cleanup that comes with it."""
    change = _transition(
        live,
        outcome.phase,
        outcome.reason,
        outcome.message,
        # A finished job has no ready ranks: what is left is being cleaned up or has ended. The last
        # progress read stays: how far the job got.
        counts=replace(count_pods(live.current), ready=0),
        completion_time=format_time(live.now),
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


def _restart(live: Attempt, outcome: Restart) -> Decision:
    """Tear the gang down; the next attempt is created once none of its pods is alive. A retry spends
    backoffLimit (status.restarts) unless it is a preemption (status.preemptions)."""
    failure = outcome.failure
    preemptions = int_field(live.old.get("preemptions"), 0)
    in_place = live.job.run_policy.restart_mode == accounting.MODE_IN_PLACE
    note = (
        recovery.fallback_note(live.failures, rank0=recovery.rendezvous_apart(live.job)) if in_place else ""
    )
    record = accounting.new_record(
        cause=outcome.reason,
        mode=accounting.MODE_WHOLE_GANG,
        attempt=live.attempt,
        failure_time=datetime.fromtimestamp(failure.finish_key, UTC) if failure else live.now,
        rank=failure.rank if failure else None,
        exit_code=failure.exit_code if failure else None,
        note=note,
    )
    change = _transition(
        live,
        names.PHASE_RESTARTING,
        outcome.reason,
        outcome.message,
        restarts=live.restarts + (1 if outcome.counted else 0),
        preemptions=preemptions if outcome.counted else preemptions + 1,
        start_time=live.old.get("startTime"),
        progress=None,
        last_restart=record,
    )
    hung = outcome.hung
    return _decision(
        live.job,
        live.old,
        change,
        live.now,
        gang_restart=True,
        delete=Deletes(pods=deletable([p for p in live.pods if p.name not in hung]), hung_pods=hung),
        requeue_after=0.0 if all(p.terminal for p in live.pods) else RESTART_POLL_SECONDS,
    )


# A pod replaced alone: lost, or a straggler's (runPolicy.stragglerPolicy Replace).
_REPLACED_REASONS: Final = {False: REASON_POD_REPLACED, True: REASON_STRAGGLER_REPLACED}


def _replace_alone(live: Attempt, outcome: ReplaceAlone) -> Decision:
    """New pods for the outcome's ranks alone (policies.replacement.replace_pods); the survivors restart
    in place and wait for them on the rendezvous's next round. A straggler's replacement spends no
    backoffLimit (nothing failed), and the job avoids its node from now on (policies.straggler)."""
    slow_node = outcome.slow_node
    plan = replacement.replace_pods(
        live.job,
        outcome.ranks,
        outcome.failure,
        outcome.cause,
        live.attempt,
        live.restarts,
        live.old.get("lastRestart"),
        live.accounting.record,
        live.old.get("podReplacements"),
        (p.replacement for p in live.pods),
        charged=slow_node is None,
    )
    limit = live.job.run_policy.backoff_limit
    spent = f"restart {plan.restarts} of {limit}" if slow_node is None else "no restart spent"
    message = (
        f"{outcome.what} in attempt {live.attempt}: replaced by "
        + ", ".join(names.pod_name(live.job.name, rank, live.attempt, n) for rank, n in plan.replacements)
        + f"; the other ranks restart in place ({spent})"
    )
    slow_status = {} if slow_node is None else straggler.status_after(live.old, slow_node)
    change = _transition(
        live,
        str(live.old.get("phase") or names.PHASE_RUNNING),
        str(condition_reason(live.old) or REASON_RUNNING),
        condition_message(live.old, str(live.old.get("phase"))) or message,
        restarts=plan.restarts,
        last_restart=plan.record,
        pod_replacements=plan.pod_replacements,
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
        delete=outcome.delete,
        kueue=outcome.kueue,
        notices=(
            PhaseEvent(type="Warning", reason=_REPLACED_REASONS[slow_node is not None], message=message),
        ),
    )


def _hold(live: Attempt, outcome: Hold) -> Decision:
    """Nothing changes but what goes to Kueue first; looked at again after the outcome's wait."""
    return Decision(
        report=Report(dict(live.old), changed=False), kueue=outcome.kueue, requeue_after=outcome.look_after
    )


def _progress(live: Attempt) -> Decision:
    """No rule decided: Pending, Queued, Starting or Running, and the ranks still to create."""
    job, attempt, current = live.job, live.attempt, live.current
    if live.can_train or live.old.get("phase") == names.PHASE_RUNNING:
        phase, reason = names.PHASE_RUNNING, REASON_RUNNING
        message = _running_message(live)
    elif live.facts(kueue_policy.queued) and job.kueue is not None:
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
    shown_straggler, notices = straggler.report(live)
    resizes, resized = _resizes(live)
    change = _transition(
        live,
        phase,
        reason,
        message,
        straggler=shown_straggler,
        group_replicas=(
            elastic.group_replicas(live.progress.restart)
            if job.elastic is not None and live.progress is not None
            else None
        ),
        resizes=resizes,
    )
    limit = job.run_policy.backoff_limit
    return _decision(
        job,
        live.old,
        change,
        live.now,
        delete=Deletes(pods=deletable(live.stale), lost_pods=lost_now(live.stale)),
        kueue=kueue_policy.release_replaced(
            job.kueue is not None,
            [p for p in live.stale if p.attempt == attempt],
            live.now,
            live.timing.unconfirmed_deletion_seconds,
        ),
        create=_creates(job, attempt, live.to_create, live.restarts),
        notices=notices
        + restart_events.notice_events(live.accounting, live.restarts, limit, resized=resized),
        restart_measured=live.accounting.measured,
    )


def _resizes(live: Attempt) -> tuple[int | None, bool]:
    """status.elastic.resizes after this read, and whether the group resized (policies.elastic)."""
    if live.job.elastic is None or live.progress is None:
        return None, False
    return elastic.resizes(live.progress.restart, live.old.get("elastic"))


def _running_message(live: Attempt) -> str:
    job, attempt = live.job, live.attempt
    if job.elastic is None:
        return f"all {job.replicas} rank(s) of attempt {attempt} are running (world size {job.world_size})"
    return elastic.running_message(job.elastic, len(live.running), job.replicas, attempt)


def _outcome(live: Attempt, phase: Phase) -> Outcome | None:
    """The first outcome of the rules asked in ``phase``, in the registry's order."""
    for rule in registry.rules(phase):
        outcome = rule.outcome(live)
        if outcome is not None:
            return outcome
    return None


def _next_look(live: Attempt, phase: Phase, *waits: float | None) -> float | None:
    """The earliest of ``waits`` and of every rule's next look (none below 0); None: nothing is due."""
    looks = [*waits, *(rule.look(live) for rule in registry.rules(phase))]
    present = [max(0.0, w) for w in looks if w is not None]
    return min(present) if present else None


def _live(
    job: JobSpec,
    old: Mapping[str, Any],
    pods: Sequence[PodObservation],
    now: datetime,
    timing: TimingRules,
    observed: ProgressObservation | None,
    queue: QueueObservation | None = None,
) -> Decision:
    live = _observe(job, old, pods, now, timing, observed, queue)
    outcome = _outcome(live, LIVE)
    if isinstance(outcome, Finish):
        decision = _finish(live, outcome)
    elif isinstance(outcome, Restart):
        decision = _restart(live, outcome)
    else:
        # The attempt goes on: looked at again when the first rule needs to.
        if isinstance(outcome, ReplaceAlone):
            decision = _replace_alone(live, outcome)
        elif isinstance(outcome, Hold):
            decision = _hold(live, outcome)
        else:
            decision = _progress(live)
        decision = replace(decision, requeue_after=_next_look(live, LIVE, decision.requeue_after))
    judged_in = live.facts(attempt_policy.judging).window_left
    read_at = stall.read_due(live.facts(stall.watch).left, live.now)  # the read a stall is judged on
    return replace(decision, judged_in=judged_in, read_every_pod_at=read_at)


def _restarting(
    job: JobSpec, old: Mapping[str, Any], pods: Sequence[PodObservation], now: datetime, timing: TimingRules
) -> Decision:
    """Between attempts the rules asked while Restarting still hold (the deadlines); otherwise start the
    next attempt when it may."""
    live = _observe(job, old, pods, now, timing)
    outcome = _outcome(live, RESTARTING)
    if isinstance(outcome, Finish):
        return _finish(live, outcome)
    started = _start_attempt(job, old, pods, now, live.attempt + 1, timing)
    return replace(started, requeue_after=_next_look(live, RESTARTING, started.requeue_after))


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
    nodes: NodeLabels | None = None,
) -> Decision:
    """The next step for one job.

    ``pods``: observations of the job's own pods; ``now``: timezone-aware; ``refusal``: a child the
    apiserver refused for good since the last decision; ``rules``: how long to wait for late reports;
    ``observed``: what the operator read of the training from rank 0's metrics; ``queue``: what
    Kueue says of the job's group while it is queued; ``standby_held_until``: the apiserver refused a
    standby pod, and no other is created before then; ``nodes``: the labels of the nodes the attempt's
    pods are bound to (a job that asks for a topology: policies.placement).
    """
    old: Mapping[str, Any] = status or {}
    decision = _decide(job, old, pods, now, refusal, rules, observed, queue, nodes or {})
    # The standby pods (no rank's until one takes a lost pod's, so not in _ours): policies.standby.
    decision = standbys.with_standbys(job, decision, _owned(job, pods), now, standby_held_until)
    # The rendezvous pods (no rank's, so not in _ours): the live attempt's, a lost one replaced alone.
    return rendezvous.with_rendezvous(job, decision, old, _owned(job, pods))


def _decide(
    job: JobSpec,
    old: Mapping[str, Any],
    pods: Sequence[PodObservation],
    now: datetime,
    refusal: CreateRefusal | None,
    rules: TimingRules,
    observed: ProgressObservation | None,
    queue: QueueObservation | None,
    nodes: NodeLabels,
) -> Decision:
    """The phase's decision for the job's rank pods, with where they landed (policies.placement) and
    the Kueue groups an earlier job of the same name left (policies.kueue.orphaned_groups)."""
    ours = _ours(job, pods)
    decision = _by_phase(job, old, ours, now, refusal, rules, observed, queue)
    decision = placement.with_placement(job, decision, ours, nodes)
    orphans = kueue_policy.orphaned_groups(pods, job.uid) if job.uid else ()
    if not orphans:
        return decision
    return replace(decision, kueue=replace(decision.kueue, release_orphaned=orphans))


def decide_deleted(pods: Sequence[PodObservation]) -> Decision:
    """A job key no job holds (the job was deleted, or its event has not come yet): nothing but the
    Kueue groups its pods are left in (policies.kueue.orphaned_groups; the executor checks that no job
    of the owner's UID exists before it deletes a group's Workload)."""
    return Decision(report=Report({}, changed=False), kueue=kueue_policy.orphans(pods, None))


def _by_phase(
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
