"""A small parser for the Prometheus text exposition format, and histogram arithmetic.

Only what `ddpjob run` needs to read the trainer's /metrics: samples with labels, counters summed
across series, and quantiles from cumulative histogram buckets (the same interpolation as PromQL's
``histogram_quantile``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


class ParseError(ValueError):
    pass


def _parse_value(text: str) -> float:
    lowered = text.lower()
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    if lowered == "nan":
        return math.nan
    return float(text)


def _parse_labels(text: str, start: int) -> tuple[dict[str, str], int]:
    """Parse ``{a="x",b="y"}`` starting just after ``{``; return labels and the index after ``}``."""
    labels: dict[str, str] = {}
    i = start
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        if i >= len(text):
            raise ParseError("unterminated label set")
        if text[i] == "}":
            return labels, i + 1
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= len(text) or text[eq + 1] != '"':
            raise ParseError(f"bad label at {text[i:]!r}")
        name = text[i:eq].strip()
        i = eq + 2
        value: list[str] = []
        while True:
            if i >= len(text):
                raise ParseError("unterminated label value")
            char = text[i]
            if char == "\\" and i + 1 < len(text):
                nxt = text[i + 1]
                value.append({"n": "\n", "\\": "\\", '"': '"'}.get(nxt, "\\" + nxt))
                i += 2
                continue
            if char == '"':
                i += 1
                break
            value.append(char)
            i += 1
        labels[name] = "".join(value)


def parse(text: str) -> list[Sample]:
    """Parse an exposition; comment lines and blank lines are skipped, a malformed line raises."""
    samples: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            labels, end = _parse_labels(line, brace + 1)
            rest = line[end:].split()
        else:
            parts = line.split()
            name, labels, rest = parts[0], {}, parts[1:]
        if not rest:
            raise ParseError(f"no value in {line!r}")
        try:
            value = _parse_value(rest[0])
        except ValueError as exc:
            raise ParseError(f"bad value in {line!r}") from exc
        samples.append(Sample(name=name, labels=labels, value=value))
    return samples


def total(samples: Iterable[Sample], name: str) -> float | None:
    """Sum of every series called ``name`` (a counter across ranks); None when there is none."""
    values = [s.value for s in samples if s.name == name]
    return sum(values) if values else None


def by_rank(samples: Iterable[Sample], name: str) -> dict[str, float]:
    """The value of ``name`` per ``rank`` label (a gauge per rank)."""
    return {s.labels.get("rank", ""): s.value for s in samples if s.name == name}


Buckets = Mapping[float, float]
"""Cumulative counts by upper bound (``le``), as exported, summed across series."""


def histogram_buckets(samples: Iterable[Sample], name: str) -> dict[float, float]:
    buckets: dict[float, float] = {}
    for s in samples:
        if s.name == f"{name}_bucket" and "le" in s.labels:
            bound = _parse_value(s.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + s.value
    return buckets


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
    ordered: Sequence[tuple[float, float]] = sorted(buckets.items())
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
