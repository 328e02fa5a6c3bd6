"""The launchers' own restarts in place (docs/restarts.md): counted against backoffLimit like any other.

The launchers restart a failed worker on their own within the budget they were given
(policies/budget.py); rank 0's reads bring each restart to status.restarts (policies/accounting.py).
Once those reads say more restarts were made than backoffLimit allows, the job fails.
"""

from __future__ import annotations

from typing import Final

from ddp_operator import names
from ddp_operator.decision import REASON_BACKOFF
from ddp_operator.policies.budget import restarts_left
from ddp_operator.policies.restart_events import describe
from ddp_operator.policies.rule import Attempt, Finish, Outcome, Rule, never, no_facts


def _over_budget(live: Attempt, facts: None) -> Outcome | None:
    """The launchers restarted the gang in place more often than backoffLimit allows: the job fails."""
    limit = live.job.run_policy.backoff_limit
    if not live.accounting.added or restarts_left(limit, live.restarts) >= 0:
        return None
    record = live.accounting.record or {}
    message = f"{describe(record, live.restarts, limit)}; backoffLimit {limit} exceeded after {live.restarts} restart(s)"
    return Finish(names.PHASE_FAILED, REASON_BACKOFF, message)


RULES: Final = (Rule("in_place_budget", 30, no_facts, _over_budget, never),)
