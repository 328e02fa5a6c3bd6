"""decide()'s last step for a job's standby pods (runPolicy.standbyPods): the plan of
policies.standby applied to the Decision the phase machine made. Pure, like reconcile.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ddp_operator.decision import Decision
from ddp_operator.observe import PodObservation
from ddp_operator.policies import standby
from ddp_operator.spec import JobSpec


def with_standbys(job: JobSpec, decision: Decision, pods: Sequence[PodObservation]) -> Decision:
    """``decision`` with the standbys' part (policies.standby): the lost ranks a standby takes
    instead of a new pod (the restart's Event and record name it), the standbys to start and those
    to delete."""
    attempt = decision.report.status.get("attempt")
    create = decision.create
    plan = standby.plan(job, decision.phase, attempt, create.replacements, create.restart_budget, pods)
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
    return replace(
        decision,
        report=report,
        create=replace(
            create,
            attempt=attempt if isinstance(attempt, int) else create.attempt,
            replacements=plan.replacements,
            promotions=plan.promotions,
            standbys=plan.create,
        ),
        delete=replace(decision.delete, pods=decision.delete.pods + plan.delete),
    )
