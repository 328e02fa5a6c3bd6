"""One pod's /metrics reduced to what progress reads: the one reduction of a scrape.

The operator and `ddpjob run` both hand the text they fetched to an :class:`ExpositionReader` (or
:func:`reduce_text`). It is parsed by prometheus-client's own parser, which walks each line in Python
character by character: about 7 us a line, against about 1.5 us for the hand-written parser it
replaced. So the parser sees only what progress needs:

- only the lines of the series in ``series.READ``: a trainer pod exports about 110 lines, rank 0's
  one more per rank of the job, and progress reads about 30 (``str.startswith``, in C, picks them;
  the ``# HELP``/``# TYPE`` comments go too, as the reduction works on sample names);
- only the lines that changed since the same endpoint's previous read: a job whose numbers stand
  still costs no parsing at all.

The cost against the parser it replaced is in docs/benchmarks.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from ddp_operator.policies.accounting import GroupRestartReport
from ddp_operator.progress import histogram, series

if TYPE_CHECKING:
    from prometheus_client.samples import Sample

# A read series' name ends where its labels or its value begin.
_READ_PREFIXES: Final = tuple(f"{name}{end}" for name in sorted(series.READ) for end in ("{", " "))


@dataclass(frozen=True)
class HealthCheck:
    """The gang health check's last result as rank 0's pod exports it (docs/trainer.md, "Health check"):
    when the check ended (unix seconds), the rank whose links were far below the group's median (None:
    none), the slowest link's first rank when far below the median of links (None: none), the
    all-reduce bus bandwidth (bytes/s) and how long the check took."""

    checked_at: float
    slow_rank: int | None = None
    slow_link: int | None = None
    bus_bandwidth: float | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class PodScrape:
    """One pod's endpoint (all its local ranks): ranks step together, so ``steps`` is the furthest
    rank's; counters and histogram buckets add up; gauges per rank are averaged (loss, overlap) or
    taken at their highest (the slowest rank's compute time, rank 0's straggler gauges; the
    straggler's phase is the one rank 0 sets to 1)."""

    steps: float | None = None
    # Each local rank's steps, by its global rank (the ``rank`` label).
    rank_steps: Mapping[int, int] = field(default_factory=dict)
    samples: float | None = None
    target_steps: float | None = None
    loss: float | None = None
    overlap: float | None = None
    compute_seconds: float | None = None
    allreduce_bytes: float | None = None
    service_seconds: float | None = None
    allreduce_buckets: histogram.Buckets = field(default_factory=dict)
    last_sync: float | None = None
    # The mean seconds of a step as the slowest local rank timed its own (ddp_step_duration_seconds).
    step_seconds: float | None = None
    straggler_rank: int | None = None
    straggler_slowdown: float | None = None
    # The phase it lost its time in: data, compute or communication.
    straggler_phase: str | None = None
    eval_accuracy: float | None = None
    # The group's restarts and the kept step time (rank 0's pod; None from a trainer without them).
    restart: GroupRestartReport | None = None
    # The last health check's slow rank (None: no check ran, or it found none).
    health: HealthCheck | None = None

    @property
    def allreduce_p50(self) -> float | None:
        return histogram.quantile(0.5, self.allreduce_buckets)


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _max(values: Iterable[float]) -> float | None:
    finite = _finite(values)
    return max(finite) if finite else None


def _mean(values: Iterable[float]) -> float | None:
    finite = _finite(values)
    return sum(finite) / len(finite) if finite else None


def _sum(values: Iterable[float]) -> float | None:
    listed = list(values)
    return sum(listed) if listed else None


def _mean_step(sums: Mapping[str, float], counts: Mapping[str, float]) -> float | None:
    """The slowest local rank's mean step time from its step-duration histogram."""
    return _max(sums[r] / counts[r] for r in sums if counts.get(r, 0) > 0)


def read_lines(text: str) -> list[str]:
    """The lines of ``text`` that hold a sample of a series progress reads."""
    return [line for line in text.split("\n") if line.startswith(_READ_PREFIXES)]


def reduce_samples(samples: Iterable[Sample]) -> PodScrape:
    by_rank: dict[str, dict[str, float]] = {name: {} for name in series.READ}
    buckets: dict[float, float] = {}
    info: dict[str, str] = {}
    phase: str | None = None
    for sample in samples:
        value = float(sample.value)
        if sample.name == series.ALLREDUCE_DURATION_BUCKET:
            if "le" in sample.labels:
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + value
        elif sample.name == series.RESTART_INFO:
            if value == 1:
                info = dict(sample.labels)
        elif sample.name == series.STRAGGLER_PHASE:
            if value == 1:
                phase = sample.labels.get("phase") or None
        elif sample.name in by_rank:
            by_rank[sample.name][sample.labels.get("rank", "")] = value
    steps = by_rank[series.STEPS]
    straggler = _max(by_rank[series.STRAGGLER_RANK].values())
    return PodScrape(
        steps=_max(steps.values()),
        rank_steps={int(r): int(v) for r, v in steps.items() if r.isdigit() and math.isfinite(v)},
        samples=_sum(by_rank[series.SAMPLES].values()),
        target_steps=_max(by_rank[series.TARGET_STEPS].values()),
        loss=_mean(by_rank[series.LOSS].values()),
        overlap=_mean(by_rank[series.OVERLAP].values()),
        compute_seconds=_max(v for v in by_rank[series.COMPUTE].values() if v > 0),
        allreduce_bytes=_sum(by_rank[series.ALLREDUCE_BYTES].values()),
        service_seconds=_sum(by_rank[series.ALLREDUCE_SERVICE_SECONDS].values()),
        allreduce_buckets=buckets,
        last_sync=_max(by_rank[series.LAST_SYNC].values()),
        step_seconds=_mean_step(by_rank[series.STEP_DURATION_SUM], by_rank[series.STEP_DURATION_COUNT]),
        straggler_rank=int(straggler) if straggler is not None and straggler >= 0 else None,
        straggler_slowdown=_max(by_rank[series.STRAGGLER_SLOWDOWN].values()),
        straggler_phase=phase,
        eval_accuracy=_max(by_rank[series.EVAL_ACCURACY].values()),
        restart=_restart_report(by_rank, info),
        health=_health(by_rank),
    )


def _health(by_rank: Mapping[str, Mapping[str, float]]) -> HealthCheck | None:
    """The last check's result; None when no check has run (its series are absent while it is off)."""
    checked = _max(by_rank[series.HEALTH_CHECKED_AT].values())
    if checked is None:
        return None
    slow, link = (
        _max(by_rank[series.HEALTH_SLOW_RANK].values()),
        _max(by_rank[series.HEALTH_SLOW_LINK].values()),
    )
    return HealthCheck(
        checked_at=checked,
        slow_rank=int(slow) if slow is not None and slow >= 0 else None,
        slow_link=int(link) if link is not None and link >= 0 else None,
        bus_bandwidth=_max(by_rank[series.HEALTH_BUS_BANDWIDTH].values()),
        seconds=_max(by_rank[series.HEALTH_SECONDS].values()),
    )


def _optional_int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _latest(by_rank: Mapping[str, Mapping[str, float]], name: str) -> float | None:
    """The highest of a series' values on the endpoint; for a series that has a deprecated name
    (``series.DEPRECATED``), that name's when the series is absent: an older trainer image exports
    only the deprecated one."""
    value = _max(by_rank[name].values())
    if value is None and name in series.DEPRECATED:
        value = _max(by_rank[series.DEPRECATED[name]].values())
    return value


def _restart_report(
    by_rank: Mapping[str, Mapping[str, float]], info: Mapping[str, str]
) -> GroupRestartReport | None:
    """Rank 0's pod's account of its group's restarts (docs/metrics.md); None when it exports none."""

    def latest(name: str) -> float | None:
        return _latest(by_rank, name)

    def count(name: str) -> int | None:
        value = latest(name)
        return int(value) if value is not None else None

    restarts, kept, resumed = (
        latest(series.GROUP_RESTARTS),
        latest(series.KEPT_STEP_SECONDS),
        latest(series.RESUMED),
    )
    if restarts is None and kept is None and resumed is None:
        return None
    redone = latest(series.RESTART_STEPS_REDONE)
    return GroupRestartReport(
        restarts=int(restarts or 0),
        grows=count(series.GROUP_GROWS) or 0,
        resizes=count(series.GROUP_RESIZES),
        group_members=count(series.GROUP_MEMBERS),
        members_before=count(series.RESTART_MEMBERS_BEFORE),
        members_after=count(series.RESTART_MEMBERS_AFTER),
        failure_at=latest(series.RESTART_FAILURE),
        stopped_at=latest(series.RESTART_STOPPED),
        reformed_at=latest(series.RESTART_REFORMED),
        resumed_at=latest(series.RESTART_RESUMED),
        steps_redone=int(redone) if redone is not None else None,
        cause=info.get("cause") or None,
        failed_rank=_optional_int(info.get("failed_rank")),
        exit_code=_optional_int(info.get("exit_code")),
        kept_step_seconds=kept,
        any_resumed_at=resumed,
    )


def _parse(lines: Sequence[str]) -> list[Sample]:
    """The samples of sample lines, one each (the text format puts one sample on a line), in order."""
    # Imported here: `ddpjob --help` and its subcommands' parsers load without the extras installed.
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for family in text_string_to_metric_families("\n".join(lines)) for s in family.samples]
    if len(samples) != len(lines):
        raise ValueError(f"{len(lines)} sample lines parsed into {len(samples)} samples")
    return samples


class ExpositionReader:
    """Reads one endpoint's successive expositions; a line unchanged since the previous one is not
    parsed again. One per endpoint and attempt: it keeps the previous read's lines."""

    def __init__(self) -> None:
        self._previous: dict[str, Sample] = {}
        self._last: tuple[str, PodScrape] | None = None

    def reduce(self, text: str) -> PodScrape:
        """Parse and reduce; ValueError for a malformed line of a read series."""
        if self._last is not None and self._last[0] == text:
            return self._last[1]
        lines = read_lines(text)
        known = {line: sample for line in lines if (sample := self._previous.get(line)) is not None}
        new = [line for line in lines if line not in known]
        parsed = {**known, **dict(zip(new, _parse(new), strict=True))} if new else known
        self._previous = parsed
        scrape = reduce_samples(parsed.values())
        self._last = (text, scrape)
        return scrape


def reduce_text(text: str) -> PodScrape:
    """Parse and reduce one exposition; ValueError for a malformed line of a read series."""
    return ExpositionReader().reduce(text)
