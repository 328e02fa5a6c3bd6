"""The trainer's pure parts of issue 12: the stall timeout and the stall watch (the straggler:
test_trainer_straggler.py)."""

from __future__ import annotations

import io

import pytest

from ddp_trainer.library.stall import StallWatch
from ddp_trainer.library.straggler import parse_stall_timeout


@pytest.mark.parametrize(
    ("text", "expected"), [(None, None), ("", None), (" ", None), ("10", 10.0), ("2.5", 2.5)]
)
def test_stall_timeout_from_the_env(text: str | None, expected: float | None) -> None:
    assert parse_stall_timeout(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "nan", "inf", "ten"])
def test_a_bad_stall_timeout_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_stall_timeout(text)


# Each row: (last step's time, the clock) per check, and whether that check dumps. Timeout 10 s:
# a dump at 7.5 s without a step, once per stall.
STALL_CASES = {
    "before the first step": [((None, 100.0), False)],
    "steps keep completing": [((0.0, 5.0), False), ((5.0, 12.0), False), ((12.0, 19.0), False)],
    "a stall dumps once": [
        ((0.0, 7.4), False),
        ((0.0, 7.5), True),
        ((0.0, 9.0), False),
        ((0.0, 60.0), False),
    ],
    "a new stall dumps again": [((0.0, 8.0), True), ((8.5, 9.0), False), ((8.5, 16.0), True)],
}


@pytest.mark.parametrize("case", STALL_CASES, ids=list(STALL_CASES))
def test_stall_watch_dumps_once_per_stall(case: str) -> None:
    state: dict[str, float | None] = {"last": None, "now": 0.0}
    out = io.StringIO()
    watch = StallWatch(
        10.0, rank=3, last_step=lambda: state["last"], stream=out, clock=lambda: float(state["now"] or 0)
    )
    for (last, now), dumps in STALL_CASES[case]:
        state["last"], state["now"] = last, now
        assert watch.check() is dumps, (last, now)
    expected = sum(dumps for _, dumps in STALL_CASES[case])
    assert out.getvalue().count("the Python stack of every thread follows") == expected
    if expected:
        assert "rank 3: no training step completed for" in out.getvalue()
        assert 'Thread "MainThread"' in out.getvalue()
        assert "test_stall_watch_dumps_once_per_stall" in out.getvalue()  # this very stack


def test_a_stall_already_dumped_is_noted_at_the_timeout_and_each_doubling() -> None:
    state = {"last": 0.0, "now": 0.0}
    out = io.StringIO()
    watch = StallWatch(10.0, rank=1, last_step=lambda: state["last"], stream=out, clock=lambda: state["now"])
    noted = []
    for last, now in [
        (0.0, 8.0),
        (0.0, 9.9),
        (0.0, 10.0),
        (0.0, 19.0),
        (0.0, 20.5),
        (0.0, 70.0),
        (0.0, 79.0),
    ]:
        state["last"], state["now"] = last, now
        before = out.getvalue().count("still no training step")
        watch.check()
        if out.getvalue().count("still no training step") > before:
            noted.append(now)
    # At the timeout (10 s), at 20 s, then once for a check that came late (70 s: the 40 s line),
    # none again until 80 s.
    assert noted == [10.0, 20.5, 70.0]
    assert watch.dumps == 1 and out.getvalue().count("the Python stack of every thread follows") == 1
    assert (
        "rank 1: still no training step completed, for 20.5 s (DDP_STALL_TIMEOUT_SECONDS=10)"
        in out.getvalue()
    )
    # A step ends the stall; the next one dumps again, and its notes start over at the timeout.
    state["last"], state["now"] = 80.0, 88.0
    assert watch.check() is True
    state["now"] = 90.0
    watch.check()
    assert out.getvalue().count("still no training step") == 4
