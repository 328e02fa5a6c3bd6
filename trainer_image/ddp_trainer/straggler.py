"""Naming the slowest rank from the compute times the ranks exchange (pure; no torch).

Every ``exchange_every`` steps each rank contributes the mean of its own compute time per step over
the window (forward + backward up to its first gradient bucket being ready: no waiting on peers is in
it), and rank 0 names the slowest rank and how much slower it is than the median rank. A slow rank
makes every peer wait in the allreduce, so the step time of all ranks is the same; only a time that
excludes the wait tells who is slow.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

NO_STRAGGLER: Final = -1


@dataclass(frozen=True)
class Straggler:
    """The slowest rank of one exchange and its compute time over the median rank's."""

    rank: int
    slowdown: float


def slowest(compute_seconds: Sequence[float]) -> Straggler | None:
    """The slowest rank, or None while the picture is incomplete.

    ``compute_seconds[r]`` is rank r's mean compute time per step over the window; 0 (or less, or NaN)
    means the rank had no sample in it (no step measured yet), and then nobody is named: a partial
    picture could call a rank slow against ranks that were never measured.
    """
    if len(compute_seconds) < 2 or any(not (math.isfinite(t) and t > 0) for t in compute_seconds):
        return None
    median = statistics.median(compute_seconds)
    rank = max(range(len(compute_seconds)), key=lambda r: (compute_seconds[r], -r))
    return Straggler(rank=rank, slowdown=compute_seconds[rank] / median)


def parse_stall_timeout(text: str | None) -> float | None:
    """``DDP_STALL_TIMEOUT_SECONDS``: None when unset or empty, else a positive number of seconds."""
    if text is None or not text.strip():
        return None
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive number of seconds, got {text!r}")
    return value
