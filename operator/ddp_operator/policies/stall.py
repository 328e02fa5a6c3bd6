"""A stalled gang: no new synchronized step for ``runPolicy.stallTimeoutSeconds`` once training started.

Shared by the operator (``reconcile._rule_stalled``) and `ddpjob run` (its attempt loop): the same
clock, the same ranks named, and the same failure handed to the failure policy, where a stall is
retried like a lost peer and counts against backoffLimit (docs/restarts.md). The step and the time a
read first showed it come from the progress tracker (``ddp_operator.progress.tracker``).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from ddp_operator.policies.failure import REASON_STALLED, RankFailure

# The ranks named in the message: enough to point at the culprit without listing a whole job.
NAMED_RANKS = 3


def seconds_left(
    limit: int | None, step: int, step_changed_at: datetime | None, now: datetime
) -> float | None:
    """Seconds until no new step for ``limit`` is a stall (<= 0: it is); None: not watched."""
    if limit is None or step <= 0 or step_changed_at is None:
        return None  # a stall needs training to have started
    return limit - (now - step_changed_at).total_seconds()


def suspected(limit: int | None, step: int, step_changed_at: datetime | None, now: datetime) -> bool:
    """No new step for half the limit: time to read every rank's step, to name the ranks behind."""
    left = seconds_left(limit, step, step_changed_at, now)
    return left is not None and limit is not None and left <= limit / 2


def stalled(
    limit: int, step: int, rank_steps: Mapping[int, int], nodes: Mapping[int, str | None], now: datetime
) -> tuple[RankFailure, str]:
    """The failure of a stalled attempt and what to say about it.

    ``rank_steps``: every rank's step as its pod's endpoint answered; ``nodes``: each pod's first
    global rank and its node. A pod whose endpoint did not answer while the others did (a SIGSTOPped
    or wedged process) is the likeliest culprit: it comes first, then the ranks furthest behind.
    """
    silent = sorted(r for r in nodes if r not in rank_steps) if rank_steps else []
    behind = (silent + sorted(rank_steps, key=lambda rank: (rank_steps[rank], rank)))[:NAMED_RANKS]
    where = ", ".join(
        f"rank {r} ({f'step {rank_steps[r]}' if r in rank_steps else 'its metrics did not answer'}) "
        f"on node {nodes.get(r) or 'unknown'}"
        for r in behind
    )
    failure = RankFailure(
        rank=behind[0] if behind else 0, finish_key=now.timestamp(), disruption=REASON_STALLED
    )
    detail = f"no synchronized step for {limit}s after step {step}"
    if where:
        detail += f"; furthest behind: {where}"
    return failure, detail
