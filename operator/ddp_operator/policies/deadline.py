"""Deadlines: the whole job's (activeDeadlineSeconds) and one attempt's start (startupDeadlineSeconds).

``activeDeadlineSeconds`` counts from status.startTime, which is set when a run starts (the first
attempt, or the first attempt after a resume), so restarts count against it and suspended time does
not. ``startupDeadlineSeconds`` counts from the creation of the current attempt's first pod until all
of its ranks run; when it passes, the job fails with the reason that explains the wait: a rank the
scheduler cannot place (Unschedulable), an image that cannot be pulled (ImagePullFailed), or neither
(StartupTimeout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from ddp_operator import names
from ddp_operator.decision import (
    REASON_DEADLINE,
    REASON_IMAGE_PULL,
    REASON_STARTUP_TIMEOUT,
    REASON_UNSCHEDULABLE,
)
from ddp_operator.observe import IMAGE_PULL_FAILURES, PodObservation, parse_time
from ddp_operator.policies import elastic
from ddp_operator.policies.rule import LIVE, RESTARTING, Attempt, Finish, Outcome, Rule
from ddp_operator.status import condition_ended_at, condition_time


def seconds_left(since: datetime | None, limit_seconds: int | None, now: datetime) -> float | None:
    """Seconds until a deadline of ``limit_seconds`` counted from ``since`` (<= 0: passed); None: no deadline."""
    if since is None or limit_seconds is None:
        return None
    return limit_seconds - (now - since).total_seconds()


def active_deadline_message(limit_seconds: int) -> str:
    return f"the job ran longer than runPolicy.activeDeadlineSeconds ({limit_seconds}s)"


def classify_startup(pods: Sequence[PodObservation], replicas: int, limit_seconds: int) -> tuple[str, str]:
    """The reason and message for an attempt whose ranks were not all running in time."""
    ranked = sorted((p for p in pods if p.rank is not None), key=lambda p: p.rank or 0)
    for pod in ranked:
        if pod.unschedulable_message is not None:
            return REASON_UNSCHEDULABLE, (
                f"rank {pod.rank} could not be scheduled within startupDeadlineSeconds ({limit_seconds}s): "
                f"{pod.unschedulable_message}"
            )
    for pod in ranked:
        if pod.waiting_reason is not None and pod.waiting_reason in IMAGE_PULL_FAILURES:
            detail = f": {pod.waiting_message}" if pod.waiting_message else ""
            return REASON_IMAGE_PULL, (
                f"rank {pod.rank} could not pull its image within startupDeadlineSeconds ({limit_seconds}s) "
                f"({pod.waiting_reason}){detail}"
            )
    running = sum(1 for p in ranked if p.running)
    waiting = (
        ", ".join(f"rank {p.rank}: {p.waiting_reason or p.phase}" for p in ranked if not p.running)
        or "pods missing"
    )
    return REASON_STARTUP_TIMEOUT, (
        f"{running} of {replicas} rank(s) running after startupDeadlineSeconds ({limit_seconds}s); {waiting}"
    )


# ---- the rules -------------------------------------------------------------------------------------


def active_left(live: Attempt) -> float | None:
    """Seconds left of activeDeadlineSeconds (counted from status.startTime); None: no deadline."""
    start = parse_time(live.old.get("startTime"))
    return seconds_left(start, live.job.run_policy.active_deadline_seconds, live.now)


def _active_deadline(live: Attempt, left: float | None) -> Outcome | None:
    limit = live.job.run_policy.active_deadline_seconds
    if limit is None or left is None or left > 0:
        return None
    return Finish(names.PHASE_FAILED, REASON_DEADLINE, active_deadline_message(limit))


@dataclass(frozen=True)
class Startup:
    """Seconds left of startupDeadlineSeconds (None: not counting), and those of an elastic group below
    its minimum (None: it is not below, or the job is not elastic)."""

    left: float | None
    below_min_left: float | None


def startup(live: Attempt) -> Startup:
    """Time spent queued by Kueue does not count: the deadline runs from the attempt's first pod, or
    from when the job left the Queued phase if that was later (docs/scheduling.md). An elastic job that
    ran is held to it again while its group cannot train (fewer than minReplicas pods run), counted from
    the loss that took it there (docs/elastic.md)."""
    limit = live.job.run_policy.startup_deadline_seconds
    below_min = None
    if live.job.elastic is not None and not live.can_train:
        since = elastic.below_min_since(
            live.old.get("lastRestart"), live.attempt, condition_time(live.old, names.PHASE_RUNNING)
        )
        below_min = seconds_left(since, limit, live.now)
    if live.kueue_gated:
        return Startup(None, below_min)
    if live.old.get("phase") == names.PHASE_RUNNING:
        return Startup(below_min, below_min)
    if live.can_train:
        return Startup(None, below_min)
    created = [p.created_at for p in live.current if p.created_at is not None]
    first = min(created) if created else None
    # Leaving the queue now (the status still says Queued), or when the Queued condition turned False.
    queued_now = live.old.get("phase") == names.PHASE_QUEUED
    admitted = live.now if queued_now else condition_ended_at(live.old, names.PHASE_QUEUED)
    if first is not None and admitted is not None and admitted > first:
        first = admitted
    return Startup(seconds_left(first, limit, live.now), below_min)


def _startup_deadline(live: Attempt, facts: Startup) -> Outcome | None:
    limit = live.job.run_policy.startup_deadline_seconds
    if limit is None or facts.left is None or facts.left > 0:
        return None
    reason, message = classify_startup(live.current, live.job.replicas, limit)
    if facts.below_min_left is not None and live.job.elastic is not None:
        message = (
            f"fewer than spec.elastic.minReplicas ({live.job.elastic.min_replicas}) pods run, so the group "
            f"cannot train: {message}"
        )
    return Finish(names.PHASE_FAILED, reason, message)


def stuck_left(live: Attempt) -> float | None:
    """Seconds a restart may still take to create the next attempt (startupDeadlineSeconds, counted
    from when the job turned Restarting)."""
    since = condition_time(live.old, names.PHASE_RESTARTING)
    return seconds_left(since, live.job.run_policy.startup_deadline_seconds, live.now)


def _restart_stuck(live: Attempt, left: float | None) -> Outcome | None:
    """Restarting longer than startupDeadlineSeconds: the next attempt could not even be created."""
    limit = live.job.run_policy.startup_deadline_seconds
    if limit is None or left is None or left > 0:
        return None
    waiting = sorted(p.name for p in live.pods if not p.terminal)
    message = (
        f"attempt {live.attempt + 1} could not start within startupDeadlineSeconds ({limit}s): "
        f"{len(waiting)} pod(s) of earlier attempts still terminating ({', '.join(waiting[:5])})"
    )
    return Finish(names.PHASE_FAILED, REASON_STARTUP_TIMEOUT, message)


def _left(live: Attempt, left: float | None) -> float | None:
    return left


RULES: Final = (
    Rule("active_deadline", 40, active_left, _active_deadline, _left, frozenset({LIVE, RESTARTING})),
    Rule("restart_stuck", 45, stuck_left, _restart_stuck, _left, frozenset({RESTARTING})),
    Rule("startup_deadline", 50, startup, _startup_deadline, lambda live, facts: facts.left),
)
