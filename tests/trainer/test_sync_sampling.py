"""Detailed mode counts every step and times one in ``time_every`` (docs/metrics.md, "What is
sampled"): the counters against what DDP reduced, the histogram and the step parts against the steps
that were timed, for both timing strategies, with the library's step() and without it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from trainer_gang import run_torchrun

pytestmark = pytest.mark.trainer

PROBE = Path(__file__).with_name("sampling_probe.py")
STEPS = 11  # sampling_probe.STEPS


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    result = run_torchrun(PROBE)
    assert result.returncode == 0, result.stdout + result.stderr
    found = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(found) == 2 * 2 * 2 * 2, result.stdout + result.stderr
    return found


def case_id(case: dict[str, Any]) -> str:
    stepped = "with-step" if case["stepped"] else "hook-only"
    return f"{case['strategy']}-every-{case['every']}-{stepped}-rank-{case['rank']}"


def test_every_step_is_counted_whole(cases: list[dict[str, Any]]) -> None:
    for case in cases:
        assert case["sync_steps"] == STEPS, case_id(case)
        assert case["gradient_bytes"] == case["gradient_bytes_per_step"] * STEPS, case_id(case)
        assert case["allreduce_bytes"] == case["gradient_bytes"], case_id(case)
        if case["stepped"]:
            # Each step's calls reach the counters at its end: all its buckets (several once DDP has
            # rebuilt them after the first step).
            per_step = case["buckets_per_step"]
            assert len(per_step) == STEPS and min(per_step[1:]) > 1, case_id(case)
            assert sum(per_step) == case["calls"], case_id(case)


def test_one_step_in_every_is_timed(cases: list[dict[str, Any]]) -> None:
    for case in cases:
        timed = math.ceil(STEPS / case["every"])  # the 1st, then every `every`-th
        assert case["timed_steps"] == timed, case_id(case)
        assert case["service"] > 0, case_id(case)
        if case["stepped"]:
            timed_calls = sum(case["buckets_per_step"][:: case["every"]])
            assert case["durations"] == timed_calls, case_id(case)


def test_step_parts_come_from_the_timed_steps_after_the_first(cases: list[dict[str, Any]]) -> None:
    for case in cases:
        # The first step has no beginning (no earlier step's end), so it is timed but not split.
        expected = math.ceil(STEPS / case["every"]) - 1 if case["stepped"] else 0
        assert case["window_steps"] == expected, case_id(case)
        assert case["window_parts_nonnegative"], case_id(case)
