"""decide()'s last step for a job's standby pods (runPolicy.standbyPods): the plan of
policies.standby applied to the Decision the phase machine made. Pure, like reconcile.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime

from ddp_operator.decision import (
    REASON_STANDBY_NOT_CREATED,
    REASON_STANDBY_NOT_RESIZED,
    REASON_STANDBY_YIELDED,
    Decision,
    PhaseEvent,
)
from ddp_operator.observe import PodObservation
from ddp_operator.policies import standby
from ddp_operator.spec import JobSpec


def with_standbys(
    job: JobSpec,
    decision: Decision,
    pods: Sequence[PodObservation],
    now: datetime | None = None,
    held_until: datetime | None = None,
) -> Decision:
    """``decision`` with the standbys' part (policies.standby): the lost ranks a standby takes
    instead of a new pod (the restart's Event and record name it), the standbys to start and those
    to delete. ``held_until``: no standby is created before then (the apiserver refused one)."""
    attempt = decision.report.status.get("attempt")
    create = decision.create
    held = held_until is not None and now is not None and now < held_until
    plan = standby.plan(
        job, decision.phase, attempt, create.replacements, create.restart_budget, pods, held=held
    )
    if held and held_until is not None and now is not None:
        # Look again when the hold ends: nothing else may happen to the job until then.
        wait = (held_until - now).total_seconds()
        current = decision.requeue_after
        decision = replace(decision, requeue_after=wait if current is None else min(current, wait))
    if not plan.changes:
        return decision
    report = decision.report
    if plan.promotions:
        # The Event and status.lastRestart name the standby pod where _replace_alone named a new pod.
        status = dict(report.status)
        status["lastRestart"] = standby.noted(status.get("lastRestart"), plan.promotions)
        notices = tuple(
            replace(n, message=standby.named(n.message, job.name, create.attempt, plan.promotions))
            for n in report.notices
        )
        report = replace(report, status=status, notices=notices)
    events = decision.events
    if plan.yielded is not None:
        message = standby.yield_message(job.name, plan.yielded)
        events += (PhaseEvent(type="Warning", reason=REASON_STANDBY_YIELDED, message=message),)
    return replace(
        decision,
        report=report,
        create=replace(
            create,
            attempt=attempt if isinstance(attempt, int) else create.attempt,
            replacements=plan.replacements,
            promotions=plan.promotions,
            standbys=plan.create,
            resizes=plan.resize,
        ),
        delete=replace(decision.delete, pods=decision.delete.pods + plan.delete),
        events=events,
    )


def refused(pod: str, message: str) -> PhaseEvent:
    """The Event of a standby pod the apiserver refused (the executor posts it, once per message)."""
    return PhaseEvent(
        type="Warning",
        reason=REASON_STANDBY_NOT_CREATED,
        message=standby.refusal_message(pod, message, standby.REFUSAL_RETRY_SECONDS),
    )


def not_resized(pod: str, cpu: str, message: str) -> PhaseEvent:
    """The Event of a standby holding a rank whose CPU request the apiserver would not give back."""
    return PhaseEvent(
        type="Warning",
        reason=REASON_STANDBY_NOT_RESIZED,
        message=standby.not_resized_message(pod, cpu, message),
    )
