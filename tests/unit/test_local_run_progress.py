"""Reading the trainer's /metrics for the progress line and the summary table (pure)."""

from __future__ import annotations

import math

import pytest

from ddp_operator import promtext
from ddp_operator.local.progress import (
    PodMetrics,
    ProgressTracker,
    RankResult,
    format_bytes,
    format_seconds,
    pod_metrics,
    render_line,
    render_summary,
    straggler_note,
)

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
    ("line", "expected"),
    [
        pytest.param("up 1", promtext.Sample("up", {}, 1.0), id="bare"),
        pytest.param('x{a="1",b="two"} 3.5', promtext.Sample("x", {"a": "1", "b": "two"}, 3.5), id="labels"),
        pytest.param('x{a="q\\"uote"} 1', promtext.Sample("x", {"a": 'q"uote'}, 1.0), id="escaped-quote"),
        pytest.param('x{a="has space"} 2 1700000000', promtext.Sample("x", {"a": "has space"}, 2.0), id="ts"),
        pytest.param('x{le="+Inf"} +Inf', promtext.Sample("x", {"le": "+Inf"}, math.inf), id="inf"),
    ],
)
def test_parse_one_line(line: str, expected: promtext.Sample) -> None:
    assert promtext.parse(line) == [expected]


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("novalue", id="no-value"),
        pytest.param('x{a="1" 2', id="unterminated-labels"),
        pytest.param("x one", id="not-a-number"),
    ],
)
def test_parse_refuses_malformed(line: str) -> None:
    with pytest.raises(promtext.ParseError):
        promtext.parse(line)


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        pytest.param({0.001: 10.0, 0.01: 10.0, math.inf: 10.0}, 0.5, 0.0005, id="all-in-first-bucket"),
        pytest.param({0.001: 0.0, 0.01: 10.0, math.inf: 10.0}, 0.5, 0.0055, id="interpolates-inside-bucket"),
        pytest.param({0.001: 0.0, 0.01: 0.0, math.inf: 4.0}, 0.5, 0.01, id="inf-bucket-answers-top-bound"),
    ],
)
def test_quantile_like_promql(buckets: dict[float, float], q: float, expected: float) -> None:
    result = promtext.quantile(q, buckets)
    assert result is not None and result == pytest.approx(expected)


@pytest.mark.parametrize(
    "buckets",
    [pytest.param({}, id="no-buckets"), pytest.param({0.1: 0.0, math.inf: 0.0}, id="no-observations")],
)
def test_quantile_without_observations(buckets: dict[float, float]) -> None:
    assert promtext.quantile(0.5, buckets) is None


def test_pod_metrics_combines_local_ranks() -> None:
    text = exposition(0, 10, 320, (4, 6, 6), 0.5) + exposition(1, 9, 288, (2, 6, 6), 0.25)
    metrics = pod_metrics(promtext.parse(text))
    assert metrics.steps == 10  # the furthest rank
    assert metrics.samples == 608
    assert metrics.allreduce_bytes == 4096
    assert metrics.allreduce_buckets == {0.001: 6.0, 0.01: 12.0, math.inf: 12.0}
    assert metrics.loss == pytest.approx(0.375)
    assert metrics.overlap == pytest.approx(0.5)
    assert metrics.allreduce_p50 == pytest.approx(0.001)


def test_pod_metrics_of_an_endpoint_without_trainer_series() -> None:
    metrics = pod_metrics(promtext.parse("process_cpu_seconds_total 3.0\n"))
    assert metrics == PodMetrics()


def test_tracker_rates_over_the_window() -> None:
    tracker = ProgressTracker(pods_total=2, window_seconds=10)
    first = {r: pod_metrics(promtext.parse(exposition(r, 1, 100, (0, 0, 0), 1.0))) for r in (0, 1)}
    later = {r: pod_metrics(promtext.parse(exposition(r, 5, 500, (8, 8, 8), 0.5))) for r in (0, 1)}
    tracker.record(100.0, first)
    tracker.record(104.0, later)
    view = tracker.view()
    assert view.step == 5
    assert view.samples_per_second == pytest.approx((1000 - 200) / 4)
    assert view.allreduce_p50 == pytest.approx(0.0005)
    assert view.loss == pytest.approx(0.5)
    assert (view.pods_reporting, view.pods_total) == (2, 2)


def test_tracker_keeps_a_pods_last_answer_after_it_goes_quiet() -> None:
    tracker = ProgressTracker(pods_total=2)
    tracker.record(1.0, {0: PodMetrics(steps=3.0), 1: PodMetrics(steps=3.0)})
    tracker.record(2.0, {0: PodMetrics(steps=4.0)})
    assert tracker.latest[1].steps == 3.0 and tracker.view().step == 4.0


def test_tracker_reset_forgets_the_attempt() -> None:
    tracker = ProgressTracker(pods_total=1)
    tracker.record(1.0, {0: PodMetrics(steps=3.0, samples=10.0)})
    tracker.reset()
    view = tracker.view()
    assert (view.step, view.samples_per_second, view.pods_reporting) == (None, None, 0)


def test_progress_line_names_every_quantity() -> None:
    tracker = ProgressTracker(pods_total=1)
    tracker.record(0.0, {0: pod_metrics(promtext.parse(exposition(0, 1, 0, (0, 0, 0), 2.0)))})
    tracker.record(2.0, {0: pod_metrics(promtext.parse(exposition(0, 42, 640, (2, 2, 2), 0.125)))})
    line = render_line(tracker.view(), attempt=1)
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
        RankResult(0, 0, "demo-0-0", 170, PodMetrics(steps=7.0)),
        RankResult(0, 1, "demo-1-0", 137, None),
        RankResult(
            1, 0, "demo-0-1", 0, PodMetrics(steps=20.0, samples=640.0, allreduce_bytes=2048.0, loss=0.1)
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
    from ddp_operator.local.scrape import Scraper

    shown: list[float | None] = []
    tracker = ProgressTracker(pods_total=1)
    scraper: Scraper

    def fetch(port: int) -> PodMetrics | None:
        if port == 1000:
            scraper.set_targets({0: 2000})  # the attempt ends while this scrape is in flight
        return PodMetrics(steps=float(port))

    scraper = Scraper(tracker, lambda t: shown.append(t.view().step), fetch=fetch)
    scraper.set_targets({0: 1000})
    scraper.scrape_once()
    assert tracker.latest == {} and shown == []
    scraper.scrape_once()
    assert shown == [2000.0]
    scraper.scrape_rank(0)
    assert scraper.snapshot()[0].steps == 2000.0


def test_scraper_forgets_exited_ranks_but_keeps_their_numbers() -> None:
    from ddp_operator.local.scrape import Scraper

    asked: list[int] = []

    def fetch(port: int) -> PodMetrics | None:
        asked.append(port)
        return PodMetrics(steps=1.0)

    scraper = Scraper(ProgressTracker(pods_total=2), lambda _t: None, fetch=fetch)
    scraper.set_targets({0: 10, 1: 11})
    scraper.scrape_once()
    scraper.forget(1)
    scraper.scrape_once()
    assert asked == [10, 11, 10]
    assert set(scraper.snapshot()) == {0, 1}


def progress_exposition(
    steps: int, samples: int, target: int, straggler: int = -1, slowdown: float = math.nan
) -> str:
    return f"""\
ddp_sync_steps_total{{rank="0"}} {steps}.0
ddp_samples_total{{rank="0"}} {samples}.0
ddp_target_steps{{rank="0"}} {target}.0
ddp_compute_seconds{{rank="0"}} 0.0125
ddp_straggler_rank{{rank="0"}} {straggler}.0
ddp_straggler_slowdown{{rank="0"}} {slowdown}
ddp_loss{{rank="0"}} 0.5
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
        "| straggler rank 2 (2.50x) |",
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
    tracker = ProgressTracker(pods_total=1, window_seconds=10)
    for when, (step, target, straggler, slowdown) in zip((0.0, 5.0, 10.0), rounds, strict=True):
        text = progress_exposition(step, step * 8, target, straggler, slowdown)
        if step == 0:  # no step synchronized yet: the trainer's counter exists but reads 0
            text = text.replace('ddp_sync_steps_total{rank="0"} 0.0\n', "")
        tracker.record(when, {0: pod_metrics(promtext.parse(text))})
    line = render_line(tracker.view(), attempt=0)
    assert shown in line
    if named is None:
        assert "straggler" not in line
    else:
        assert named in line


@pytest.mark.parametrize(
    ("straggler", "slowdown", "note"),
    [
        (2, 3.0, "straggler: rank 2, 3.00x the median rank's compute time per step (rank 0's last exchange)"),
        (2, 1.1, None),
        (-1, math.nan, None),
    ],
)
def test_summary_names_the_last_attempts_straggler(straggler: int, slowdown: float, note: str | None) -> None:
    rank_zero = pod_metrics(promtext.parse(progress_exposition(30, 240, 30, straggler, slowdown)))
    results = [
        RankResult(0, 0, "demo-0-0", 170, PodMetrics(steps=3.0, straggler_rank=1, straggler_slowdown=9.0)),
        RankResult(1, 0, "demo-0-1", 0, rank_zero),
        RankResult(1, 1, "demo-1-1", 0, PodMetrics(steps=30.0)),
    ]
    assert straggler_note(results) == note
    assert render_summary(results, "Succeeded", attempts=2).splitlines()[3].split()[-2:] == [
        "12.5ms",
        "0.5000",
    ]
