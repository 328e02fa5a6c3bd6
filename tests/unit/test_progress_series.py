"""The series progress reads (ddp_operator.progress.series) are the trainer's: a series renamed in
ddp_trainer/metrics.py fails here instead of silently vanishing from status.progress and `ddpjob run`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ddp_operator.progress import series
from ddp_operator.progress.exposition import reduce_text
from ddp_trainer.library.health import HealthResult
from ddp_trainer.library.straggler import Straggler, Window
from ddp_trainer.metrics import (
    DEPRECATED_ALIASES,
    RestartCollector,
    create_health_metrics,
    create_rank_metrics,
    kept_step_seconds_gauge,
    resumed_timestamp_gauge,
)
from ddp_trainer.supervisor.restarts import RestartLedger, RestartRecord

pytestmark = pytest.mark.unit


def rank_zero_registry() -> CollectorRegistry:
    """Rank 0 of a detailed-mode trainer after one step: every series it can export, with values."""
    registry = CollectorRegistry(auto_describe=True)
    metrics = create_rank_metrics(0, "gloo", "allreduce", "2.15.0", registry, per_allreduce=True)
    metrics.sync_steps.inc()
    metrics.samples.inc(32)
    metrics.allreduce_bytes.inc(4096)
    metrics.allreduce_service_seconds.inc(0.002)
    metrics.allreduce_duration.observe(0.002)
    metrics.step_duration.observe(0.05)
    metrics.loss.set(0.5)
    metrics.target_steps.set(100)
    metrics.comm_overlap_ratio.set(0.25)
    metrics.compute_seconds.set(0.01)
    metrics.last_sync_timestamp.set(1.7e9)
    metrics.eval_accuracy.set(0.9)
    assert metrics.straggler is not None
    windows = [
        Window(10, compute=0.1, wait=0.3),
        Window(10, compute=0.35, wait=0.05),
        Window(10, compute=0.1, wait=0.3),
    ]
    metrics.straggler.show(list(windows), Straggler(rank=1, slowdown=3.0, phase="compute"))
    # A health check at the start that found rank 2's links far below the others'.
    health = HealthResult(3, 1 << 20, 2e8, 0.01, (3e8, 3e8, 1e7), slow_rank=2)
    create_health_metrics(0, registry).show(health, 0.5, 1.7e9 + 1)
    kept_step_seconds_gauge(0, registry).set(12.5)
    resumed_timestamp_gauge(0, registry).set(1.7e9 + 9)
    # Rank 0's pod's launcher after one in-place restart that shrank an elastic group of 3 to 2 (its
    # series share the pod's endpoint).
    ledger = RestartLedger()
    record = RestartRecord(
        1,
        "ExitCode",
        1,
        137,
        1.7e9,
        1.7e9 + 1,
        1.7e9 + 2,
        30,
        1.7e9 + 9,
        20,
        members_before=3,
        members_after=2,
    )
    ledger.round_formed(1, 0, 2, record)
    registry.register(RestartCollector(ledger, 0))
    return registry


def test_every_series_progress_reads_is_one_the_trainer_exports() -> None:
    exported = {sample.name for family in rank_zero_registry().collect() for sample in family.samples}
    assert sorted(series.READ - exported) == []


def test_the_reduction_of_a_real_rank_zero_fills_every_field() -> None:
    scrape = reduce_text(generate_latest(rank_zero_registry()).decode())
    empty = [f.name for f in dataclasses.fields(scrape) if getattr(scrape, f.name) in (None, {})]
    assert empty == []
    assert (scrape.steps, scrape.straggler_rank, scrape.eval_accuracy) == (1.0, 1, 0.9)
    restart = scrape.restart
    assert restart is not None
    assert (restart.restarts, restart.cause, restart.failed_rank, restart.exit_code) == (
        1,
        "ExitCode",
        1,
        137,
    )
    assert (restart.failure_at, restart.resumed_at, restart.steps_redone) == (1.7e9, 1.7e9 + 9, 10)
    assert (restart.kept_step_seconds, restart.any_resumed_at) == (12.5, 1.7e9 + 9)
    assert (scrape.straggler_slowdown, scrape.straggler_phase) == (3.0, "compute")


def _without(text: str, names: Iterable[str]) -> str:
    """The exposition without the lines (samples and comments) of the series ``names``."""
    return "\n".join(line for line in text.splitlines() if not any(name in line for name in names))


def _members(text: str) -> tuple[int | None, int | None, int | None]:
    restart = reduce_text(text).restart
    assert restart is not None
    return restart.group_members, restart.members_before, restart.members_after


def test_the_operator_reads_the_members_under_either_name() -> None:
    text = generate_latest(rank_zero_registry()).decode()
    current = _without(text, DEPRECATED_ALIASES.values())  # the series alone
    older = _without(text, DEPRECATED_ALIASES)  # an older trainer image: the deprecated names alone
    assert "ddp_group_nodes" in older and "ddp_group_members" not in older
    assert _members(text) == _members(current) == _members(older) == (2, 3, 2)
