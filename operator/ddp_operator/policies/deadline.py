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
from datetime import datetime
from typing import Final

from ddp_operator.observe import IMAGE_PULL_FAILURES, PodObservation

REASON_DEADLINE: Final = "DeadlineExceeded"
REASON_UNSCHEDULABLE: Final = "Unschedulable"
REASON_IMAGE_PULL: Final = "ImagePullFailed"
REASON_STARTUP_TIMEOUT: Final = "StartupTimeout"


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
