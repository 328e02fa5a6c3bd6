"""When the controller writes a status change that only moves counters (CounterWrites)."""

from __future__ import annotations

from typing import Any

import pytest

from ddp_operator.status_writes import CounterWrites, HeldCounters

pytestmark = pytest.mark.unit

PENDING = (0, "Pending")
STARTING = (0, "Starting")
PENDING_NEXT_ATTEMPT = (1, "Pending")

# A step is ("ask", phase, counters, now, expected due_in) or ("wrote", phase, counter_only).
Step = tuple[Any, ...]


def _run(policy: CounterWrites, steps: list[Step]) -> None:
    held = HeldCounters()
    for number, step in enumerate(steps):
        if step[0] == "ask":
            _, phase, counters, now, expected = step
            due_in = policy.due_in(held, phase, counters, now)
            wanted = None if expected is None else pytest.approx(expected)
            assert due_in == wanted, f"step {number}: {step}"
        else:
            _, phase, counter_only = step
            policy.written(held, phase, counter_only)


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(
            [
                ("ask", PENDING, (1,), 10.0, 1.0),
                ("ask", PENDING, (1,), 10.4, 0.6),
                ("ask", PENDING, (1,), 11.0, 0.0),
            ],
            id="written-once-the-counters-stood-still-for-an-interval",
        ),
        pytest.param(
            [
                ("ask", PENDING, (1,), 10.0, 1.0),
                ("ask", PENDING, (2,), 10.5, 1.0),
                ("ask", PENDING, (3,), 11.2, 1.0),
            ],
            id="each-change-restarts-the-quiet-wait",
        ),
        pytest.param(
            [("ask", PENDING, (n,), 10.0 + 0.5 * n, 1.0) for n in range(19)]
            + [("ask", PENDING, (19,), 19.5, 0.5), ("ask", PENDING, (20,), 20.0, 0.0)],
            id="steady-progress-is-still-written-after-the-refresh-period",
        ),
        pytest.param(
            [
                ("ask", PENDING, (1,), 10.0, 1.0),
                ("wrote", PENDING, True),
                ("ask", PENDING, (2,), 12.0, 1.0),
                ("wrote", PENDING, True),
                ("ask", PENDING, (3,), 14.0, None),
                ("ask", PENDING, (4,), 60.0, None),
            ],
            id="budget-spent-counters-wait-for-the-phase-change",
        ),
        pytest.param(
            [
                ("wrote", PENDING, True),
                ("wrote", PENDING, True),
                ("ask", PENDING, (3,), 14.0, None),
                ("wrote", STARTING, False),
                ("ask", STARTING, (4,), 15.0, 1.0),
                ("ask", STARTING, (4,), 16.0, 0.0),
            ],
            id="a-phase-change-gives-a-new-budget",
        ),
        pytest.param(
            [
                ("wrote", PENDING, True),
                ("wrote", PENDING, True),
                ("ask", PENDING_NEXT_ATTEMPT, (0,), 5.0, 1.0),
            ],
            id="a-new-attempt-gives-a-new-budget",
        ),
        pytest.param(
            [
                ("ask", PENDING, (1,), 10.0, 1.0),
                ("wrote", PENDING, False),
                ("ask", PENDING, (2,), 15.0, 1.0),
                ("wrote", PENDING, True),
                ("ask", PENDING, (3,), 16.0, 1.0),
            ],
            id="a-write-that-is-not-counter-only-spends-nothing",
        ),
    ],
)
def test_counter_writes(steps: list[Step]) -> None:
    _run(CounterWrites(interval=1.0, refresh=10.0, budget=2), steps)


def test_default_refresh_is_ten_intervals_and_a_new_job_record_has_a_new_budget() -> None:
    policy = CounterWrites(interval=2.0)
    assert policy.refresh == 20.0
    held = HeldCounters()
    policy.written(held, PENDING, True)
    policy.written(held, PENDING, True)
    assert policy.due_in(held, PENDING, (1,), 0.0) is None
    assert policy.due_in(HeldCounters(), PENDING, (1,), 0.0) == 2.0
