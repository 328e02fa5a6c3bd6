"""Arithmetic on a histogram's cumulative buckets, as scraped: PromQL's quantile, and differences."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

Buckets = Mapping[float, float]
"""Cumulative counts by upper bound (``le``)."""


def add(histograms: Iterable[Buckets]) -> dict[float, float]:
    """The buckets of several series of one histogram (ranks, pods) as one."""
    total: dict[float, float] = {}
    for buckets in histograms:
        for bound, count in buckets.items():
            total[bound] = total.get(bound, 0.0) + count
    return total


def subtract(newer: Buckets, older: Buckets) -> dict[float, float]:
    """Buckets of the observations made between two scrapes of the same histogram."""
    return {bound: count - older.get(bound, 0.0) for bound, count in newer.items()}


def quantile(q: float, buckets: Buckets) -> float | None:
    """Estimate the q-quantile like PromQL's histogram_quantile; None without observations.

    Linear interpolation inside the bucket that holds the rank; the lowest bucket starts at 0, and
    a rank that falls in the +Inf bucket answers the highest finite bound.
    """
    if not buckets:
        return None
    ordered = sorted(buckets.items())
    count = ordered[-1][1]
    if count <= 0 or math.isnan(count):
        return None
    rank = q * count
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in ordered:
        if cumulative >= rank:
            if math.isinf(bound):
                return lower_bound
            in_bucket = cumulative - lower_count
            if in_bucket <= 0:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / in_bucket
        lower_bound, lower_count = bound, cumulative
    return lower_bound
