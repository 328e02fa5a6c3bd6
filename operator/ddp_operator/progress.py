"""Training progress of a job from rank 0's metrics: what `status.progress` and `status.straggler` say.

Pure: the scraper hands in parsed scrapes of rank 0's pod and the times they were taken; nothing here
reads a clock or a socket. Rank 0's pod holds the job-wide view: its own counters (every rank takes
the same steps with the same batch size, so the job's rate is rank 0 pod's rate times the pods), and
the per-rank compute times the ranks exchange every few steps, from which the trainer names the
slowest rank (`ddp_straggler_rank`, `ddp_straggler_slowdown`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from ddp_operator import promtext
from ddp_operator.observe import format_time

STEPS = "ddp_sync_steps_total"
SAMPLES = "ddp_samples_total"
TARGET_STEPS = "ddp_target_steps"
LOSS = "ddp_loss"
PAYLOAD_BYTES = "ddp_allreduce_bytes_total"
SERVICE_SECONDS = "ddp_allreduce_service_seconds_total"
ALLREDUCE_DURATION = "ddp_allreduce_duration_seconds"
LAST_SYNC = "ddp_last_sync_timestamp_seconds"
STRAGGLER_RANK = "ddp_straggler_rank"
STRAGGLER_SLOWDOWN = "ddp_straggler_slowdown"


@dataclass(frozen=True)
class RankZeroScrape:
    """One scrape of rank 0's pod, reduced to what progress needs; ``taken_at`` is the operator's clock."""

    taken_at: datetime
    steps: float | None = None
    samples: float | None = None
    target_steps: float | None = None
    loss: float | None = None
    payload_bytes: float | None = None
    service_seconds: float | None = None
    allreduce_buckets: Mapping[float, float] = field(default_factory=dict)
    last_sync: float | None = None
    straggler_rank: int | None = None
    straggler_slowdown: float | None = None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _max(values: Mapping[str, float]) -> float | None:
    finite = [v for v in values.values() if math.isfinite(v)]
    return max(finite) if finite else None


def reduce_scrape(samples: Sequence[promtext.Sample], taken_at: datetime) -> RankZeroScrape:
    """Rank 0's pod (all its local ranks) as one scrape."""
    straggler = _max(promtext.by_rank(samples, STRAGGLER_RANK))
    losses = [v for v in promtext.by_rank(samples, LOSS).values() if math.isfinite(v)]
    return RankZeroScrape(
        taken_at=taken_at,
        steps=_max(promtext.by_rank(samples, STEPS)),
        samples=promtext.total(samples, SAMPLES),
        target_steps=_max(promtext.by_rank(samples, TARGET_STEPS)),
        loss=sum(losses) / len(losses) if losses else None,
        payload_bytes=promtext.total(samples, PAYLOAD_BYTES),
        service_seconds=promtext.total(samples, SERVICE_SECONDS),
        allreduce_buckets=promtext.histogram_buckets(samples, ALLREDUCE_DURATION),
        last_sync=_max(promtext.by_rank(samples, LAST_SYNC)),
        straggler_rank=int(straggler) if straggler is not None and straggler >= 0 else None,
        straggler_slowdown=_max(promtext.by_rank(samples, STRAGGLER_SLOWDOWN)),
    )


def _rate(newer: float | None, older: float | None, seconds: float) -> float | None:
    if newer is None or older is None or seconds <= 0 or newer < older:
        return None  # a counter that went back belongs to a new process: no rate across it
    return (newer - older) / seconds


def _number(value: float) -> str:
    """A float for status: the API conventions keep floats out of schemas, so a short decimal string."""
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def progress_status(
    newest: RankZeroScrape, older: RankZeroScrape | None, pods: int, world_size: int
) -> dict[str, object] | None:
    """``status.progress`` from the newest scrape and an older one of the same attempt (for rates).

    None before the first synchronized step: a job that has not trained has no progress to show.
    """
    if newest.steps is None or newest.steps <= 0:
        return None
    progress: dict[str, object] = {"step": int(newest.steps), "observedTime": format_time(newest.taken_at)}
    seconds = (newest.taken_at - older.taken_at).total_seconds() if older is not None else 0.0
    pod_rate = _rate(newest.samples, older.samples if older else None, seconds)
    if pod_rate is not None:
        progress["samplesPerSecond"] = _number(pod_rate * pods)
    if (loss := _finite(newest.loss)) is not None:
        progress["loss"] = _number(loss)
    buckets = newest.allreduce_buckets
    if older is not None:
        recent = promtext.subtract(newest.allreduce_buckets, older.allreduce_buckets)
        if max(recent.values(), default=0) > 0:
            buckets = recent
    if (p50 := promtext.quantile(0.5, buckets)) is not None:
        progress["allreduceP50Seconds"] = _number(p50)
    payload = _rate(newest.payload_bytes, older.payload_bytes if older else None, 1.0)
    service = _rate(newest.service_seconds, older.service_seconds if older else None, 1.0)
    if payload is not None and service and world_size > 1:
        progress["busBandwidthBytesPerSecond"] = _number(
            payload / service * 2 * (world_size - 1) / world_size
        )
    if newest.last_sync is not None and newest.last_sync > 0:
        progress["lastSyncTime"] = format_time(datetime.fromtimestamp(newest.last_sync, UTC))
    target = newest.target_steps
    if target is not None and target > 0:
        progress["percentComplete"] = min(100, int(100 * newest.steps / target))
        step_rate = _rate(newest.steps, older.steps if older else None, seconds)
        if step_rate:
            progress["estimatedSecondsRemaining"] = max(0, round((target - newest.steps) / step_rate))
    return progress


@dataclass(frozen=True)
class StragglerSighting:
    """The slowest rank as rank 0 named it, since when the operator has seen it persistently slow."""

    rank: int
    slowdown: float
    since: datetime


def follow_straggler(
    previous: StragglerSighting | None, scrape: RankZeroScrape, threshold: float
) -> StragglerSighting | None:
    """Track one rank slower than ``threshold`` x the median across scrapes (a new rank starts anew)."""
    rank, slowdown = scrape.straggler_rank, _finite(scrape.straggler_slowdown)
    if rank is None or slowdown is None or slowdown < threshold:
        return None
    if previous is not None and previous.rank == rank:
        return StragglerSighting(rank, slowdown, previous.since)
    return StragglerSighting(rank, slowdown, scrape.taken_at)


def straggler_status(sighting: StragglerSighting, pod: str, node: str) -> dict[str, object]:
    return {"rank": sighting.rank, "pod": pod, "node": node, "slowdown": f"{sighting.slowdown:.2f}"}


@dataclass(frozen=True)
class ProgressObservation:
    """What the operator has seen of one attempt's training, as ``decide`` reads it.

    ``step_changed_at``: when a scrape first showed the current step (the operator's clock, so a stall
    is measured without trusting a node's clock). ``rank_steps``: every rank's step, read only while a
    stall is suspected, to name the ranks furthest behind.
    """

    attempt: int
    step: int
    step_changed_at: datetime
    status: Mapping[str, object] | None = None
    straggler: StragglerSighting | None = None
    rank_steps: Mapping[int, int] = field(default_factory=dict)
