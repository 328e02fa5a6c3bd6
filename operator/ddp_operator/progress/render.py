"""How progress is shown: a DDPJob's ``status.progress`` and ``status.straggler``, and `ddpjob run`'s
live line and end-of-run summary. Pure: each takes what the tracker saw."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from ddp_operator.observe import PodObservation, format_time
from ddp_operator.progress.exposition import HealthCheck, PodScrape
from ddp_operator.progress.tracker import ProgressView, StragglerSighting, persistence_left, slow_rank


def _decimal(value: float) -> str:
    """A float for status: the API conventions keep floats out of schemas, so a short decimal string."""
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"


def _decimals(**values: float | None) -> dict[str, object]:
    """The known ``values`` (None: not measured, left out of status), each as a short decimal."""
    return {name: _decimal(value) for name, value in values.items() if value is not None}


def _known(**values: object) -> dict[str, object]:
    """The known ``values`` as they are (None: left out of status)."""
    return {name: value for name, value in values.items() if value is not None}


def status_progress(view: ProgressView, health: HealthCheck | None = None) -> dict[str, object] | None:
    """``status.progress``, with rank 0's last gang health check (``health``) when one ran; None before
    the first synchronized step (a job that has not trained has no progress to show)."""
    if view.step is None or view.step <= 0 or view.observed_at is None:
        return None
    return {
        "step": view.step,
        "observedTime": format_time(view.observed_at),
        **_decimals(
            samplesPerSecond=view.samples_per_second,
            loss=view.loss,
            allreduceP50Seconds=view.allreduce_p50,
            busBandwidthBytesPerSecond=view.bus_bandwidth,
        ),
        **_known(
            lastSyncTime=format_time(view.last_sync) if view.last_sync is not None else None,
            percentComplete=view.percent_complete,
            estimatedSecondsRemaining=view.seconds_remaining,
            healthCheck=health_status(health) if health is not None else None,
        ),
    }


def health_status(health: HealthCheck) -> dict[str, object]:
    """``status.progress.healthCheck``: when the last gang health check ended, what it measured and the
    rank (or link) it found far below the group's median, if any."""
    return {
        "time": format_time(datetime.fromtimestamp(health.checked_at, UTC)),
        **_decimals(busBandwidthBytesPerSecond=health.bus_bandwidth, seconds=health.seconds),
        **_known(slowRank=health.slow_rank, slowLink=health.slow_link),
    }


def straggler_status(sighting: StragglerSighting, pod: str, node: str) -> dict[str, object]:
    """``status.straggler``: the rank, its pod and node, the slowdown, and the phase when known."""
    shown: dict[str, object] = {
        "rank": sighting.rank,
        "pod": pod,
        "node": node,
        "slowdown": f"{sighting.slowdown:.2f}",
    }
    if sighting.phase:
        shown["phase"] = sighting.phase
    return shown


def describe_slow_rank(rank: int, slowdown: float, phase: str | None) -> str:
    """A straggler in words, one for the Event, `ddpjob run`'s summary and docs alike."""
    lost = f", losing its time in {phase}" if phase else ""
    return f"rank {rank} makes the job's step {slowdown:.2f}x as long as it would be without it{lost}"


def shown_straggler(
    sighting: StragglerSighting | None,
    left: float | None,
    pod: PodObservation | None,
    shown_before: object,
    window_seconds: float,
) -> tuple[dict[str, object] | None, str | None]:
    """``status.straggler`` once a rank has been slow for the straggler window (``left``: the seconds
    still to go; 0 or None: it has), and the text of the Warning that names it when the old
    ``status.straggler`` (``shown_before``) did not show that rank (None otherwise). ``pod``: the pod
    that hosts the rank (ranks.pod_of_rank), None when unknown."""
    if sighting is None or left:
        return None, None
    shown = straggler_status(sighting, pod.name if pod else "", pod.node if pod else "")
    if isinstance(shown_before, Mapping) and shown_before.get("rank") == sighting.rank:
        return shown, None
    return shown, (
        f"{describe_slow_rank(sighting.rank, sighting.slowdown, sighting.phase)} "
        f"({shown['pod']} on node {shown['node'] or 'unknown'}), for "
        f"{window_seconds:.0f}s: the other ranks wait for it in every step"
    )


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


def render_line(view: ProgressView, attempt: int, straggler_window: float) -> str:
    """`ddpjob run`'s live line; the straggler once it has been slow for ``straggler_window``."""
    step = _number(view.step, "d")
    if view.step is not None and view.target_steps:
        step += f"/{view.target_steps}"
        if view.percent_complete is not None:
            step += f" ({view.percent_complete}%, ETA {format_duration(view.seconds_remaining)})"
    straggler = ""
    sighting, now = view.straggler, view.observed_at
    if sighting is not None and now is not None and persistence_left(sighting, straggler_window, now) == 0:
        phase = f", {sighting.phase}" if sighting.phase else ""
        straggler = f" | straggler rank {sighting.rank} ({sighting.slowdown:.2f}x{phase})"
    return (
        f"attempt {attempt} | step {step} | loss {_number(view.loss, '.4f')}"
        f" | {_number(view.samples_per_second, ',.0f')} samples/s"
        f" | allreduce p50 {format_seconds(view.allreduce_p50)}"
        f" | overlap {_number(view.overlap, '.0%')}"
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
    metrics: PodScrape | None


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "-"
    if code > 128:
        try:
            return f"{code} ({signal.Signals(code - 128).name})"
        except ValueError:
            return str(code)
    return str(code)


def _last_rank_zero(results: Sequence[RankResult]) -> PodScrape | None:
    if not results:
        return None
    last = max(r.attempt for r in results)
    return next((r.metrics for r in results if r.attempt == last and r.rank == 0), None)


def straggler_note(results: Sequence[RankResult], threshold: float) -> str | None:
    """The last attempt's straggler as rank 0 last named it, for the summary (None: none)."""
    slow = slow_rank(_last_rank_zero(results), threshold)
    if slow is None:
        return None
    return f"straggler: {describe_slow_rank(*slow)} (rank 0's last exchange)"


def accuracy_note(results: Sequence[RankResult]) -> str | None:
    """The held-out accuracy rank 0 exported at the end of the last attempt (``ddp_eval_accuracy``),
    with its last loss. (Not its steps: ``ddp_sync_steps_total`` counts those of the attempt only.)"""
    rank_zero = _last_rank_zero(results)
    if rank_zero is None or rank_zero.eval_accuracy is None:
        return None
    loss = "" if rank_zero.loss is None else f" (loss {rank_zero.loss:.4f})"
    return f"held-out accuracy: {rank_zero.eval_accuracy:.4f}{loss}"


def rank_table(results: Sequence[RankResult]) -> list[str]:
    """The per-rank table, a line each: `ddpjob run`'s summary and `ddpjob top` print the same."""
    header = ("attempt", "rank", "pod", "exit", "steps", "samples", "allreduce", "p50", "compute", "loss")
    rows: list[tuple[str, ...]] = [header]
    for result in results:
        m = result.metrics or PodScrape()
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
    return lines


def render_summary(
    results: Sequence[RankResult], outcome: str, attempts: int, extra: Sequence[str] = ()
) -> str:
    lines = rank_table(results)
    lines.append(f"attempts: {attempts} (restarts: {max(attempts - 1, 0)})")
    lines.extend(extra)
    lines.append(f"outcome: {outcome}")
    return "\n".join(lines)
