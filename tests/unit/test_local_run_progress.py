"""`ddpjob run`'s reading of the trainer's /metrics: the reduction, the live line, the summary table
and the local fetcher (the shared ddp_operator.progress; the operator's side: tests/unit/test_progress.py)."""

from __future__ import annotations

import math

import pytest
from tests.unit.kube_factories import at

from ddp_operator.local.scrape import Scraper
from ddp_operator.progress import histogram
from ddp_operator.progress.exposition import PodScrape, reduce_text
from ddp_operator.progress.render import (
    RankResult,
    accuracy_note,
    format_bytes,
    format_seconds,
    render_line,
    render_summary,
    straggler_note,
)
from ddp_operator.progress.tracker import STRAGGLER_THRESHOLD, ProgressTracker

pytestmark = pytest.mark.unit


def exposition(rank: int, steps: int, samples: int, bucket_counts: tuple[int, int, int], loss: float) -> str:
    """A trainer endpoint's text: allreduce observations in the 1 ms, 10 ms and +Inf buckets."""
    le_1ms, le_10ms, le_inf = bucket_counts
    return f"""\
# HELP ddp_sync_steps_total Steps.
# TYPE ddp_sync_steps_total counter
ddp_sync_steps_total{{rank="{rank}"}} {steps}.0
ddp_samples_total{{rank="{rank}"}} {samples}.0
ddp_allreduce_bytes_total{{rank="{rank}"}} 2048.0
ddp_allreduce_duration_seconds_bucket{{le="0.001",rank="{rank}"}} {le_1ms}.0
ddp_allreduce_duration_seconds_bucket{{le="0.01",rank="{rank}"}} {le_10ms}.0
ddp_allreduce_duration_seconds_bucket{{le="+Inf",rank="{rank}"}} {le_inf}.0
ddp_allreduce_duration_seconds_count{{rank="{rank}"}} {le_inf}.0
ddp_loss{{rank="{rank}"}} {loss}
ddp_comm_overlap_ratio{{rank="{rank}"}} 0.5
ddp_build_info{{backend="gloo",comm_hook="allreduce",rank="{rank}",torch="2.15"}} 1.0
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param('ddp_loss{rank="0"} 0.5\n', PodScrape(loss=0.5), id="a-read-series"),
        pytest.param(
            'ddp_loss{note="q\\"uote, {x}",rank="0"} 0.5 1700000000\n',
            PodScrape(loss=0.5),
            id="escapes-and-time",
        ),
        pytest.param("ddp_sync_steps_total 7\n", PodScrape(steps=7.0), id="no-labels"),
        pytest.param(
            'ddp_loss_extra{rank="0"} 9\nddp_build_info{rank="0"} 1\n', PodScrape(), id="other-series"
        ),
        pytest.param(
            'ddp_rank_compute_seconds{rank="0",peer="1" 2\n', PodScrape(), id="malformed-but-unread"
        ),
    ],
)
def test_only_the_series_progress_reads_are_parsed(text: str, expected: PodScrape) -> None:
    assert reduce_text(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('ddp_loss{rank="0" 0.5\n', id="unterminated-labels"),
        pytest.param('ddp_loss{rank="0"} one\n', id="not-a-number"),
    ],
)
def test_a_malformed_line_of_a_read_series_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        reduce_text(text)


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        pytest.param({0.001: 10.0, 0.01: 10.0, math.inf: 10.0}, 0.5, 0.0005, id="all-in-first-bucket"),
        pytest.param({0.001: 0.0, 0.01: 10.0, math.inf: 10.0}, 0.5, 0.0055, id="interpolates-inside-bucket"),
        pytest.param({0.001: 0.0, 0.01: 0.0, math.inf: 4.0}, 0.5, 0.01, id="inf-bucket-answers-top-bound"),
    ],
)
def test_quantile_like_promql(buckets: dict[float, float], q: float, expected: float) -> None:
    result = histogram.quantile(q, buckets)
    assert result is not None and result == pytest.approx(expected)


@pytest.mark.parametrize(
    "buckets",
    [pytest.param({}, id="no-buckets"), pytest.param({0.1: 0.0, math.inf: 0.0}, id="no-observations")],
)
def test_quantile_without_observations(buckets: dict[float, float]) -> None:
    assert histogram.quantile(0.5, buckets) is None


def test_a_pod_scrape_combines_local_ranks() -> None:
    text = exposition(0, 10, 320, (4, 6, 6), 0.5) + exposition(1, 9, 288, (2, 6, 6), 0.25)
    metrics = reduce_text(text)
    assert metrics.steps == 10  # the furthest rank
    assert metrics.rank_steps == {0: 10, 1: 9}
    assert metrics.samples == 608
    assert metrics.allreduce_bytes == 4096
    assert metrics.allreduce_buckets == {0.001: 6.0, 0.01: 12.0, math.inf: 12.0}
    assert metrics.loss == pytest.approx(0.375)
    assert metrics.overlap == pytest.approx(0.5)
    assert metrics.allreduce_p50 == pytest.approx(0.001)


def test_a_pod_scrape_of_an_endpoint_without_trainer_series() -> None:
    assert reduce_text("process_cpu_seconds_total 3.0\n") == PodScrape()


def test_tracker_rates_over_the_window() -> None:
    tracker = ProgressTracker(2, 2, rate_window_seconds=10)
    first = {r: reduce_text(exposition(r, 1, 100, (0, 0, 0), 1.0)) for r in (0, 1)}
    later = {r: reduce_text(exposition(r, 5, 500, (8, 8, 8), 0.5)) for r in (0, 1)}
    tracker.record(at(100), first)
    tracker.record(at(104), later)
    view = tracker.view()
    assert view.step == 5
    assert view.samples_per_second == pytest.approx((1000 - 200) / 4)
    assert view.allreduce_p50 == pytest.approx(0.0005)
    assert view.loss == pytest.approx(0.5)
    assert (view.pods_reporting, view.pods_total) == (2, 2)


def test_tracker_keeps_a_pods_last_answer_after_it_goes_quiet() -> None:
    tracker = ProgressTracker(2, 2)
    tracker.record(at(1), {0: PodScrape(steps=3.0), 1: PodScrape(steps=3.0)})
    tracker.record(at(2), {0: PodScrape(steps=4.0)})
    assert tracker.latest[1].steps == 3.0 and tracker.view().step == 4.0


def test_tracker_reset_forgets_the_attempt() -> None:
    tracker = ProgressTracker(1, 1)
    tracker.record(at(1), {0: PodScrape(steps=3.0, samples=10.0)})
    tracker.reset()
    view = tracker.view()
    assert (view.step, view.samples_per_second, view.pods_reporting) == (None, None, 0)
    assert (tracker.step, tracker.step_changed_at, tracker.latest) == (0, None, {})


def test_progress_line_names_every_quantity() -> None:
    tracker = ProgressTracker(1, 1)
    tracker.record(at(0), {0: reduce_text(exposition(0, 1, 0, (0, 0, 0), 2.0))})
    tracker.record(at(2), {0: reduce_text(exposition(0, 42, 640, (2, 2, 2), 0.125))})
    line = render_line(tracker.view(), attempt=1, straggler_window=10)
    assert line == (
        "attempt 1 | step 42 | loss 0.1250 | 320 samples/s | allreduce p50 500us | overlap 50% | metrics 1/1 pods"
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [
        pytest.param(None, "-", id="unknown"),
        pytest.param(0.00025, "250us", id="micro"),
        pytest.param(0.0125, "12.5ms", id="milli"),
        pytest.param(2.5, "2.50s", id="seconds"),
    ],
)
def test_format_seconds(value: float | None, text: str) -> None:
    assert format_seconds(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        pytest.param(None, "-", id="unknown"),
        pytest.param(512, "512B", id="bytes"),
        pytest.param(1536, "1.5KiB", id="kibibytes"),
        pytest.param(3 * 2**30, "3.0GiB", id="gibibytes"),
    ],
)
def test_format_bytes(value: float | None, text: str) -> None:
    assert format_bytes(value) == text


def test_summary_table() -> None:
    results = [
        RankResult(0, 0, "demo-0-0", 170, PodScrape(steps=7.0)),
        RankResult(0, 1, "demo-1-0", 137, None),
        RankResult(
            1, 0, "demo-0-1", 0, PodScrape(steps=20.0, samples=640.0, allreduce_bytes=2048.0, loss=0.1)
        ),
    ]
    text = render_summary(results, "Succeeded", attempts=2, extra=["held-out accuracy: 0.95"])
    lines = text.splitlines()
    assert lines[0].split() == [
        "attempt",
        "rank",
        "pod",
        "exit",
        "steps",
        "samples",
        "allreduce",
        "p50",
        "compute",
        "loss",
    ]
    assert lines[3].split() == ["0", "1", "demo-1-0", "137", "(SIGKILL)", "-", "-", "-", "-", "-", "-"]
    assert lines[4].split() == ["1", "0", "demo-0-1", "0", "20", "640", "2.0KiB", "-", "-", "0.1000"]
    assert lines[-3:] == ["attempts: 2 (restarts: 1)", "held-out accuracy: 0.95", "outcome: Succeeded"]


def test_scraper_drops_answers_from_an_ended_attempt() -> None:
    shown: list[int | None] = []
    tracker = ProgressTracker(1, 1)
    scraper: Scraper

    def fetch(port: int) -> PodScrape | None:
        if port == 1000:
            scraper.set_targets({0: 2000})  # the attempt ends while this scrape is in flight
        return PodScrape(steps=float(port))

    scraper = Scraper(tracker, lambda t: shown.append(t.view().step), fetch=fetch, clock=lambda: at(0))
    scraper.set_targets({0: 1000})
    scraper.scrape_once()
    assert tracker.latest == {} and shown == []
    scraper.scrape_once()
    assert shown == [2000]
    scraper.scrape_rank(0)
    assert scraper.snapshot()[0].steps == 2000.0


def test_scraper_forgets_exited_ranks_but_keeps_their_numbers() -> None:
    asked: list[int] = []

    def fetch(port: int) -> PodScrape | None:
        asked.append(port)
        return PodScrape(steps=1.0)

    scraper = Scraper(ProgressTracker(2, 2), lambda _t: None, fetch=fetch, clock=lambda: at(0))
    scraper.set_targets({0: 10, 1: 11})
    scraper.scrape_once()
    scraper.forget(1)
    scraper.scrape_once()
    assert asked == [10, 11, 10]
    assert set(scraper.snapshot()) == {0, 1}


def progress_exposition(
    steps: int, samples: int, target: int, straggler: int = -1, slowdown: float = math.nan
) -> str:
    """Rank 0's series; a named straggler lost its time in compute (the trainer's StateSet of phases)."""
    phases = "".join(
        f'ddp_straggler_phase{{phase="{phase}",rank="0"}} {1.0 if straggler >= 0 and phase == "compute" else 0.0}\n'
        for phase in ("data", "compute", "communication")
    )
    return f"""\
ddp_sync_steps_total{{rank="0"}} {steps}.0
ddp_samples_total{{rank="0"}} {samples}.0
ddp_target_steps{{rank="0"}} {target}.0
ddp_compute_seconds{{rank="0"}} 0.0125
ddp_straggler_rank{{rank="0"}} {straggler}.0
ddp_straggler_slowdown{{rank="0"}} {slowdown}
{phases}ddp_loss{{rank="0"}} 0.5
"""


# Scrapes at t=0, 5 and 10 (window 10 s): (step, total, straggler rank, slowdown) each -> what the line
# shows for the step and the straggler. Step 0: no series yet. The step rate runs from the first round
# that saw a step; a straggler is shown once it lasted the window.
NONE = (-1, math.nan)
LINE_CASES = {
    "total unknown": ([(0, 0, *NONE), (10, 0, *NONE), (30, 0, *NONE)], "| step 30 |", None),
    "before training": (
        [(0, 100, *NONE), (0, 100, *NONE), (0, 100, *NONE)],
        "| step - |",
        None,
    ),
    "percent and ETA": (
        [(0, 100, *NONE), (10, 100, *NONE), (30, 100, *NONE)],
        "| step 30/100 (30%, ETA 18s) |",
        None,
    ),
    "the rate from the first step seen": (
        [(0, 5000, *NONE), (10, 5000, *NONE), (30, 5000, *NONE)],
        "| step 30/5000 (0%, ETA 20m42s) |",
        None,
    ),
    "a lasting straggler": (
        [(0, 100, 2, 2.5), (10, 100, 2, 2.5), (30, 100, 2, 2.5)],
        "| step 30/100",
        "| straggler rank 2 (2.50x, compute) |",
    ),
    "a new straggler": ([(0, 100, *NONE), (10, 100, 2, 2.5), (30, 100, 2, 2.5)], "| step 30/100", None),
    "another rank": ([(0, 100, 1, 2.5), (10, 100, 2, 2.5), (30, 100, 2, 2.5)], "| step 30/100", None),
    "slowest, not slow enough": (
        [(0, 100, 1, 1.2), (10, 100, 1, 1.2), (30, 100, 1, 1.2)],
        "| step 30/100",
        None,
    ),
}


@pytest.mark.parametrize("case", LINE_CASES, ids=list(LINE_CASES))
def test_progress_line_shows_percent_eta_and_the_straggler(case: str) -> None:
    rounds, shown, named = LINE_CASES[case]
    tracker = ProgressTracker(1, 1, rate_window_seconds=10)
    for when, (step, target, straggler, slowdown) in zip((0.0, 5.0, 10.0), rounds, strict=True):
        text = progress_exposition(step, step * 8, target, straggler, slowdown)
        if step == 0:  # no step synchronized yet: the trainer's counter exists but reads 0
            text = text.replace('ddp_sync_steps_total{rank="0"} 0.0\n', "")
        tracker.record(at(when), {0: reduce_text(text)})
    line = render_line(tracker.view(), attempt=0, straggler_window=10)
    assert shown in line
    if named is None:
        assert "straggler" not in line
    else:
        assert named in line


@pytest.mark.parametrize(
    ("straggler", "slowdown", "note"),
    [
        (
            2,
            3.0,
            "straggler: rank 2 makes the job's step 3.00x as long as it would be without it, losing its "
            "time in compute (rank 0's last exchange)",
        ),
        (2, 1.1, None),
        (-1, math.nan, None),
    ],
)
def test_summary_names_the_last_attempts_straggler(straggler: int, slowdown: float, note: str | None) -> None:
    rank_zero = reduce_text(progress_exposition(30, 240, 30, straggler, slowdown))
    results = [
        RankResult(0, 0, "demo-0-0", 170, PodScrape(steps=3.0, straggler_rank=1, straggler_slowdown=9.0)),
        RankResult(1, 0, "demo-0-1", 0, rank_zero),
        RankResult(1, 1, "demo-1-1", 0, PodScrape(steps=30.0)),
    ]
    assert straggler_note(results, STRAGGLER_THRESHOLD) == note
    assert render_summary(results, "Succeeded", attempts=2).splitlines()[3].split()[-2:] == [
        "12.5ms",
        "0.5000",
    ]


@pytest.mark.parametrize(
    ("rank_zero", "note"),
    [
        pytest.param(
            'ddp_eval_accuracy{rank="0"} 0.96104\nddp_loss{rank="0"} 0.128867\nddp_sync_steps_total{rank="0"} 230\n',
            "held-out accuracy: 0.9610 (loss 0.1289)",
            id="exported",
        ),
        pytest.param('ddp_eval_accuracy{rank="0"} NaN\n', None, id="not-yet"),
        pytest.param('ddp_loss{rank="0"} 0.1\n', None, id="a-trainer-without-it"),
    ],
)
def test_the_summary_reads_the_accuracy_from_rank_zeros_metric(rank_zero: str, note: str | None) -> None:
    results = [
        RankResult(0, 0, "demo-0-0", 137, PodScrape(eval_accuracy=0.5)),
        RankResult(1, 0, "demo-0-1", 0, reduce_text(rank_zero)),
        RankResult(1, 1, "demo-1-1", 0, PodScrape(eval_accuracy=0.7)),
    ]
    assert accuracy_note(results) == note
