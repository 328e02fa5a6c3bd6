"""What a person watches during `ddpjob run`: the live progress line and the end-of-run summary.

Pure: the scraper hands in parsed samples and the time; nothing here reads a clock or a socket. Percent
done, the time left and the straggler come from the operator's own pure functions (``ddp_operator.
progress``), so `ddpjob run` and a DDPJob's status say the same.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Final

from ddp_operator import progress, promtext

STEPS = "ddp_sync_steps_total"
SAMPLES = "ddp_samples_total"
ALLREDUCE_BYTES = "ddp_allreduce_bytes_total"
ALLREDUCE_DURATION = "ddp_allreduce_duration_seconds"
LOSS = "ddp_loss"
OVERLAP = "ddp_comm_overlap_ratio"
COMPUTE = "ddp_compute_seconds"
# The operator's default --straggler-threshold: slower than this x the median rank is a straggler.
STRAGGLER_THRESHOLD: Final = 1.5
# The tracker's clock is monotonic seconds; the operator's functions take datetimes.
_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class PodMetrics:
    """One pod's endpoint (all its local ranks) reduced to what the line and the table show."""

    steps: float | None = None
    samples: float | None = None
    allreduce_bytes: float | None = None
    allreduce_buckets: Mapping[float, float] = field(default_factory=dict)
    loss: float | None = None
    overlap: float | None = None
    # The run's total steps (0: unknown) and the slowest local rank's compute time per step.
    target_steps: float | None = None
    compute_seconds: float | None = None
    # Rank 0's pod only: the slowest rank of the last exchange and its slowdown against the median.
    straggler_rank: int | None = None
    straggler_slowdown: float | None = None

    @property
    def allreduce_p50(self) -> float | None:
        return promtext.quantile(0.5, self.allreduce_buckets)


def _mean(values: Iterable[float]) -> float | None:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else None


def pod_metrics(samples: Sequence[promtext.Sample]) -> PodMetrics:
    """Reduce one scrape: ranks step together, so steps is the furthest rank; the rest add up."""
    steps = promtext.by_rank(samples, STEPS)
    rank_zero = progress.reduce_scrape(samples, _EPOCH)
    compute = [v for v in promtext.by_rank(samples, COMPUTE).values() if math.isfinite(v) and v > 0]
    return PodMetrics(
        steps=max(steps.values()) if steps else None,
        samples=promtext.total(samples, SAMPLES),
        allreduce_bytes=promtext.total(samples, ALLREDUCE_BYTES),
        allreduce_buckets=promtext.histogram_buckets(samples, ALLREDUCE_DURATION),
        loss=_mean(promtext.by_rank(samples, LOSS).values()),
        overlap=_mean(promtext.by_rank(samples, OVERLAP).values()),
        target_steps=rank_zero.target_steps,
        compute_seconds=max(compute) if compute else None,
        straggler_rank=rank_zero.straggler_rank,
        straggler_slowdown=rank_zero.straggler_slowdown,
    )


def _sum_buckets(pods: Iterable[PodMetrics]) -> dict[float, float]:
    combined: dict[float, float] = {}
    for pod in pods:
        for bound, count in pod.allreduce_buckets.items():
            combined[bound] = combined.get(bound, 0.0) + count
    return combined


@dataclass(frozen=True)
class ProgressView:
    step: float | None
    loss: float | None
    samples_per_second: float | None
    allreduce_p50: float | None
    overlap: float | None
    pods_reporting: int
    pods_total: int
    target_steps: int | None = None
    percent_complete: int | None = None
    seconds_remaining: int | None = None
    straggler: progress.StragglerSighting | None = None


class ProgressTracker:
    """Keeps a short window of whole-job scrapes so rates and the p50 describe the recent past."""

    def __init__(self, pods_total: int, window_seconds: float = 10.0) -> None:
        self.pods_total = pods_total
        self.window_seconds = window_seconds
        # (time, samples of all pods, allreduce buckets of all pods, the furthest step, the total)
        self._history: deque[tuple[float, float, dict[float, float], float | None, float | None]] = deque()
        self.latest: dict[int, PodMetrics] = {}
        # The slowest rank as rank 0 names it, and since when (shown once it lasted the window).
        self._straggler: progress.StragglerSighting | None = None

    def record(self, now: float, pods: Mapping[int, PodMetrics]) -> None:
        """Record one scrape round; pods that did not answer keep their last known numbers."""
        self.latest.update(pods)
        total_samples = sum(p.samples or 0.0 for p in self.latest.values())
        steps = [p.steps for p in self.latest.values() if p.steps is not None]
        targets = [p.target_steps for p in self.latest.values() if p.target_steps]
        self._straggler = _follow(self._straggler, self.latest.get(0), now)
        self._history.append(
            (
                now,
                total_samples,
                _sum_buckets(self.latest.values()),
                max(steps) if steps else None,
                max(targets) if targets else None,
            )
        )
        while len(self._history) > 2 and now - self._history[0][0] > self.window_seconds:
            self._history.popleft()

    def view(self) -> ProgressView:
        pods = list(self.latest.values())
        steps = [p.steps for p in pods if p.steps is not None]
        rate: float | None = None
        p50: float | None = None
        done: dict[str, object] = {}
        if self._history:
            newest_time, newest_samples, newest_buckets, newest_step, target = self._history[-1]
            oldest_time, oldest_samples, oldest_buckets, _, _ = self._history[0]
            # The step rate from the oldest round that saw a step (none before training started).
            stepped = next((h for h in self._history if h[3] is not None), self._history[-1])
            done = _completion(newest_time, newest_step, stepped[0], stepped[3], target)
            if newest_time > oldest_time and newest_samples >= oldest_samples:
                rate = (newest_samples - oldest_samples) / (newest_time - oldest_time)
            recent = promtext.subtract(newest_buckets, oldest_buckets)
            # Nothing reduced in the window (or a restart reset the counters): show the whole run.
            p50 = promtext.quantile(0.5, recent) if max(recent.values(), default=0) > 0 else None
            if p50 is None:
                p50 = promtext.quantile(0.5, newest_buckets)
        return ProgressView(
            step=max(steps) if steps else None,
            loss=_mean(p.loss for p in pods if p.loss is not None),
            samples_per_second=rate,
            allreduce_p50=p50,
            overlap=_mean(p.overlap for p in pods if p.overlap is not None),
            pods_reporting=len(pods),
            pods_total=self.pods_total,
            target_steps=_optional_int(done.get("target")),
            percent_complete=_optional_int(done.get("percentComplete")),
            seconds_remaining=_optional_int(done.get("estimatedSecondsRemaining")),
            straggler=self._persistent_straggler(),
        )

    def _persistent_straggler(self) -> progress.StragglerSighting | None:
        sighting = self._straggler
        if sighting is None or not self._history:
            return None
        lasted = (self._history[-1][0] - (sighting.since - _EPOCH).total_seconds()) >= self.window_seconds
        return sighting if lasted else None

    def reset(self) -> None:
        """A new attempt: counters restart from zero in new processes."""
        self._history.clear()
        self.latest.clear()
        self._straggler = None


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) else None


def _completion(
    newest_time: float,
    newest_step: float | None,
    oldest_time: float,
    oldest_step: float | None,
    target: float | None,
) -> dict[str, object]:
    """Percent done and seconds left, as the DDPJob's status.progress computes them."""
    if newest_step is None or not target:
        return {}

    def scrape(when: float, step: float | None) -> progress.RankZeroScrape:
        return progress.RankZeroScrape(
            taken_at=_EPOCH + timedelta(seconds=when), steps=step, target_steps=target
        )

    older = scrape(oldest_time, oldest_step) if oldest_time < newest_time else None
    shown = progress.progress_status(scrape(newest_time, newest_step), older, pods=1, world_size=1) or {}
    return {**shown, "target": int(target)}


def _follow(
    previous: progress.StragglerSighting | None, rank_zero: PodMetrics | None, now: float
) -> progress.StragglerSighting | None:
    """The slowest rank as rank 0 named it, when slower than the operator's threshold, and since when."""
    if rank_zero is None:
        return None
    scrape = progress.RankZeroScrape(
        taken_at=_EPOCH + timedelta(seconds=now),
        straggler_rank=rank_zero.straggler_rank,
        straggler_slowdown=rank_zero.straggler_slowdown,
    )
    return progress.follow_straggler(previous, scrape, STRAGGLER_THRESHOLD)


def _straggler(rank_zero: PodMetrics | None) -> progress.StragglerSighting | None:
    return _follow(None, rank_zero, 0.0)


def format_duration(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def format_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1e-3:
        return f"{value * 1e6:.0f}us"
    if value < 1.0:
        return f"{value * 1e3:.1f}ms"
    return f"{value:.2f}s"


def format_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(amount) < 1024 or unit == "TiB":
            return f"{amount:.0f}{unit}" if unit == "B" else f"{amount:.1f}{unit}"
        amount /= 1024
    return f"{amount:.1f}TiB"  # pragma: no cover - the loop always returns


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_line(view: ProgressView, attempt: int) -> str:
    step = _number(view.step, ".0f")
    if view.target_steps:
        step += f"/{view.target_steps}"
        if view.percent_complete is not None:
            step += f" ({view.percent_complete}%, ETA {format_duration(view.seconds_remaining)})"
    straggler = ""
    if view.straggler is not None:
        straggler = f" | straggler rank {view.straggler.rank} ({view.straggler.slowdown:.2f}x)"
    return (
        f"attempt {attempt} | step {step} | loss {_number(view.loss, '.4f')}"
        f" | {_number(view.samples_per_second, ',.0f')} samples/s"
        f" | allreduce p50 {format_seconds(view.allreduce_p50)}"
        f" | overlap {'-' if view.overlap is None else format(view.overlap, '.0%')}"
        f"{straggler}"
        f" | metrics {view.pods_reporting}/{view.pods_total} pods"
    )


@dataclass(frozen=True)
class RankResult:
    """How one pod of one attempt ended, with the last numbers its endpoint reported."""

    attempt: int
    rank: int
    pod_name: str
    exit_code: int | None
    metrics: PodMetrics | None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "-"
    if code > 128:
        import signal

        try:
            return f"{code} ({signal.Signals(code - 128).name})"
        except ValueError:
            return str(code)
    return str(code)


def straggler_note(results: Sequence[RankResult]) -> str | None:
    """The last attempt's straggler as rank 0 last named it, for the summary (None: none)."""
    if not results:
        return None
    last = max(r.attempt for r in results)
    rank_zero = next((r.metrics for r in results if r.attempt == last and r.rank == 0), None)
    sighting = _straggler(rank_zero)
    if sighting is None:
        return None
    return (
        f"straggler: rank {sighting.rank}, {sighting.slowdown:.2f}x the median rank's compute time per step "
        "(rank 0's last exchange)"
    )


def render_summary(
    results: Sequence[RankResult], outcome: str, attempts: int, extra: Sequence[str] = ()
) -> str:
    header = ("attempt", "rank", "pod", "exit", "steps", "samples", "allreduce", "p50", "compute", "loss")
    rows: list[tuple[str, ...]] = [header]
    for result in results:
        m = result.metrics or PodMetrics()
        rows.append(
            (
                str(result.attempt),
                str(result.rank),
                result.pod_name,
                _describe_exit(result.exit_code),
                _number(m.steps, ".0f"),
                _number(m.samples, ".0f"),
                format_bytes(m.allreduce_bytes),
                format_seconds(m.allreduce_p50),
                format_seconds(m.compute_seconds),
                _number(m.loss, ".4f"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"attempts: {attempts} (restarts: {max(attempts - 1, 0)})")
    lines.extend(extra)
    lines.append(f"outcome: {outcome}")
    return "\n".join(lines)
