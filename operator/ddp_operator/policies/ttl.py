"""ttlSecondsAfterFinished: a finished job (with its children) is deleted this long after completionTime."""

from __future__ import annotations

from datetime import datetime

from ddp_operator.policies.deadline import seconds_left


def ttl_seconds_left(
    completion_time: datetime | None, ttl_seconds: int | None, now: datetime
) -> float | None:
    """Seconds until the job is due for deletion (<= 0: due now); None when it is never deleted by TTL."""
    return seconds_left(completion_time, ttl_seconds, now)


def ttl_expired(completion_time: datetime | None, ttl_seconds: int | None, now: datetime) -> bool:
    left = ttl_seconds_left(completion_time, ttl_seconds, now)
    return left is not None and left <= 0
