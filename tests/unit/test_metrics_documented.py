"""docs/metrics.md and the series the trainer registers say the same: every series a rank or a pod's
supervisor exports has a row, and every row names a series that exists (a new series without a row,
or a row left behind by a removed one, fails here)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from ddp_trainer import metrics
from ddp_trainer.supervisor.restarts import RestartLedger, RestartRecord

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# A table row's first cell: the series it documents; a backticked ddp_ name in any cell: a name the
# page mentions (the deprecated aliases' table lists the old names in its second column).
ROW = re.compile(r"^\| `(ddp_[a-z0-9_]+)`", re.MULTILINE)
MENTION = re.compile(r"`(ddp_[a-z0-9_]+)`")


def exported() -> set[str]:
    """Every trainer series, as a scrape names it (a counter with its ``_total``)."""
    registry = CollectorRegistry()
    metrics.create_rank_metrics(0, "gloo", "allreduce", "2.15", registry, per_allreduce=True)
    metrics.create_health_metrics(0, registry)
    metrics.kept_step_seconds_gauge(0, registry)
    metrics.resumed_timestamp_gauge(0, registry)
    families = list(registry.collect())
    ledger = RestartLedger()
    record = RestartRecord(
        restarts=1, cause="ExitCode", failed_rank=1, exit_code=137, failure=1.0, stopped=2.0, reformed=3.0,
        steps_before=5, resumed=4.0, resumed_step=5, members_before=2, members_after=2,
    )  # fmt: skip
    ledger.round_formed(1, 0, 2, record)
    families += list(metrics.RestartCollector(ledger, 0).collect())
    return {f"{f.name}_total" if f.type == "counter" else f.name for f in families}


def test_every_exported_series_is_on_the_metrics_page() -> None:
    text = DOC.read_text()
    missing = exported() - set(MENTION.findall(text))
    assert not missing, f"series exported but not in docs/metrics.md: {sorted(missing)}"


def test_every_series_row_of_the_metrics_page_is_exported() -> None:
    stale = set(ROW.findall(DOC.read_text())) - exported()
    assert not stale, f"rows of docs/metrics.md that no code exports: {sorted(stale)}"
