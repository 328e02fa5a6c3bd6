"""One ladder of bounds for our duration histograms: 1, 2.5 and 5 per decade.

The trainer derives its step buckets from its allreduce buckets (ddp_trainer.metrics). The operator's
reconcile histogram uses the same ladder but cannot take it from there: the operator never imports the
trainer package (test_import_graph.py), so it writes its list out, and this test keeps the copy equal
to its source. docs/metrics.md states each trainer histogram's range in words; a change of the lists
that leaves the page behind fails here too.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from ddp_operator import metrics as operator_metrics
from ddp_trainer import metrics as trainer_metrics

pytestmark = pytest.mark.unit

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
LADDER_STEPS = (1.0, 2.5, 5.0)


def on_the_ladder(bound: float) -> bool:
    """1, 2.5 or 5 times a power of ten (to float precision)."""
    exponent = 10.0 ** int(f"{bound:e}".split("e")[1])
    return any(abs(bound - step * exponent) <= 1e-12 * bound for step in LADDER_STEPS)


def spoken(seconds: float) -> str:
    """A bound as the page writes it: `100 us`, `1 ms`, `60 s`."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g} {unit}"
    raise ValueError(f"{seconds} s is below a microsecond")


@pytest.mark.parametrize(
    ("copy", "source"),
    [
        pytest.param(
            operator_metrics.RECONCILE_BUCKETS,
            tuple(b for b in trainer_metrics.STEP_BUCKETS if b <= 30),
            id="operator-reconcile-is-the-trainer-step-ladder-to-30s",
        ),
        pytest.param(
            trainer_metrics.STEP_BUCKETS[:-2],
            tuple(b for b in trainer_metrics.ALLREDUCE_BUCKETS if b >= 1e-3),
            id="trainer-step-is-the-allreduce-ladder-from-1ms",
        ),
    ],
)
def test_a_copied_bucket_list_equals_its_source(copy: tuple[float, ...], source: tuple[float, ...]) -> None:
    assert tuple(map(float, copy)) == tuple(map(float, source))


@pytest.mark.parametrize(
    "buckets",
    [
        pytest.param(trainer_metrics.ALLREDUCE_BUCKETS, id="trainer-allreduce"),
        pytest.param(trainer_metrics.STEP_BUCKETS[:-2], id="trainer-step-below-30s"),
        pytest.param(operator_metrics.RECONCILE_BUCKETS[:-1], id="operator-reconcile-below-30s"),
    ],
)
def test_the_ladder_has_no_gap(buckets: tuple[float, ...]) -> None:
    """Every bound is on the ladder and the next one up from its predecessor (no rung skipped)."""
    assert all(on_the_ladder(b) for b in buckets), buckets
    for low, high in itertools.pairwise(buckets):
        assert high / low in (pytest.approx(2.5), pytest.approx(2.0)), (low, high)


@pytest.mark.parametrize(
    ("series", "buckets"),
    [
        pytest.param("ddp_step_duration_seconds", trainer_metrics.STEP_BUCKETS, id="step"),
        pytest.param("ddp_allreduce_duration_seconds", trainer_metrics.ALLREDUCE_BUCKETS, id="allreduce"),
    ],
)
def test_the_metrics_page_states_each_histograms_range(series: str, buckets: tuple[float, ...]) -> None:
    row = next(line for line in METRICS_PAGE.read_text().splitlines() if line.startswith(f"| `{series}`"))
    stated = re.search(r"\(([0-9.]+ (?:us|ms|s)) \.\. ([0-9.]+ (?:us|ms|s)) buckets", row)
    assert stated, f"docs/metrics.md's row for {series} states no bucket range: {row}"
    assert stated.groups() == (spoken(buckets[0]), spoken(buckets[-1]))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        pytest.param(1e-4, "100 us", id="microseconds"),
        pytest.param(1e-3, "1 ms", id="milliseconds"),
        pytest.param(2.5e-3, "2.5 ms", id="fraction"),
        pytest.param(60.0, "60 s", id="seconds"),
    ],
)
def test_a_bound_is_spoken_as_the_page_writes_it(seconds: float, text: str) -> None:
    assert spoken(seconds) == text
