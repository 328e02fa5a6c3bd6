"""Naming the rank everyone waits for (ddp_trainer.library.straggler, pure): a step's parts, the exchange's
packing, rank 0's pool of recent windows, and the attribution with its slowdown and phase; and what
ddp_trainer.library.runqueue reads of gloo's threads (from a /proc look-alike)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ddp_trainer.library.runqueue import GlooThreadDelay
from ddp_trainer.library.straggler import (
    MISSING,
    History,
    Window,
    attribute,
    own_stalls,
    pack,
    step_parts,
    unpack,
)

MS = 1e-3

# One step on one rank's clock (ms): began, forward, buckets (entered, issued, done), ended ->
# (data, compute, comm, wait).
Bucket = tuple[float, float, float]
STEP_CASES: dict[str, tuple[float, float | None, list[Bucket], float, tuple[float, float, float, float]]] = {
    "no forward and no bucket seen: all compute": (0, None, [], 10, (0, 10, 0, 0)),
    "one bucket: blocked from its issue to its end": (0, 2, [(6, 6.5, 9)], 10, (2, 5, 0.5, 2.5)),
    "two buckets overlapping the backward: the wait starts at the last issue": (
        0,
        1,
        [(4, 4.1, 7), (6, 6.2, 9.5)],
        10,
        (1, 5.4, 0.3, 3.3),
    ),
    "the first bucket ends last": (0, 1, [(4, 4.1, 9.5), (6, 6.2, 7)], 10, (1, 5.4, 0.3, 3.3)),
    "a collective that ended before its issue was noted waits nothing": (
        0,
        1,
        [(6, 7, 6.9)],
        10,
        (1, 8, 1, 0),
    ),
    "a forward before the step's start (an exchange reset it) is no data": (
        5,
        4,
        [(6, 6, 8)],
        10,
        (0, 3, 0, 2),
    ),
    "a delayed issue is communication, not wait": (0, 1, [(3, 8, 8.5)], 10, (1, 3.5, 5, 0.5)),
}


@pytest.mark.parametrize("case", STEP_CASES, ids=list(STEP_CASES))
def test_one_step_splits_into_its_parts(case: str) -> None:
    began, forward, buckets, ended, (data, compute, comm, wait) = STEP_CASES[case]
    parts = step_parts(
        began * MS,
        None if forward is None else forward * MS,
        [(entered * MS, issued * MS, done * MS) for entered, issued, done in buckets],
        ended * MS,
    )
    assert parts.steps == 1
    assert (parts.data, parts.compute, parts.comm, parts.wait) == pytest.approx(
        (data * MS, compute * MS, comm * MS, wait * MS)
    )
    assert parts.seconds == pytest.approx((ended - began) * MS)


def rank(
    data: float = 2,
    compute: float = 5,
    comm: float = 0.2,
    wait: float = 1,
    stall: float = 0.5,
    steps: int = 10,
) -> Window:
    """A rank's window of ``steps`` steps, each split as given (ms)."""
    per_step = (data, compute, comm, wait, stall)
    return Window(steps, *(part * steps * MS for part in per_step))


# Every rank's step lasts the same (the collectives line them up): a late rank's extra time is its
# peers' extra wait. Each case: the ranks' windows, their pods (None: one per rank), the expected
# straggler (rank, slowdown, phase) or None.
Expected = tuple[int, float, str | None] | None
ATTRIBUTION_CASES: dict[str, tuple[list[Window | None], list[int] | None, Expected]] = {
    "one rank: nobody to wait for": ([rank()], None, None),
    "a rank without a measured step: no partial verdict": ([rank(), None, rank()], None, None),
    "a rank whose window holds no step": ([rank(), Window(0), rank()], None, None),
    "nothing measured yet": ([Window(0), Window(0)], None, None),
    "a quiet group: the lowest rank, holding nobody up": ([rank(), rank(), rank()], None, (0, 1.0, None)),
    "slow in compute: the others wait 40 ms for it": (
        [rank(wait=41), rank(wait=41), rank(compute=45)],
        None,
        (2, 48.2 / 8.2, "compute"),
    ),
    "slow loading data": ([rank(wait=31), rank(data=32), rank(wait=31)], None, (1, 38.2 / 8.2, "data")),
    "late to each collective": (
        [rank(comm=20.2, wait=1), rank(wait=21), rank(wait=21), rank(wait=21)],
        None,
        (0, 28.2 / 8.2, "communication"),
    ),
    "two late ranks: without one the other sets the pace": (
        [rank(wait=21), rank(compute=25), rank(wait=21), rank(compute=24, wait=2)],
        None,
        (1, 28.2 / 27.2, "compute"),
    ),
    "one slow pod of two ranks: without it the job saves the whole lateness": (
        [rank(wait=21), rank(wait=21), rank(compute=25), rank(compute=24, wait=2)],
        [0, 0, 1, 1],
        (2, 28.2 / 8.2, "compute"),
    ),
    "one pod holds every rank: the ranks are judged alone": (
        [rank(wait=21), rank(compute=25), rank(wait=21)],
        [0, 0, 0],
        (1, 28.2 / 8.2, "compute"),
    ),
    "two ranks: the one that waited less": (
        [rank(wait=3), rank(compute=7)],
        None,
        (1, 10.2 / 8.2, "compute"),
    ),
}


@pytest.mark.parametrize("case", ATTRIBUTION_CASES, ids=list(ATTRIBUTION_CASES))
def test_the_rank_the_others_wait_for(case: str) -> None:
    windows, pods, expected = ATTRIBUTION_CASES[case]
    found = attribute(windows, pods)
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert found.rank == expected[0]
    assert found.slowdown == pytest.approx(expected[1])
    if expected[2] is not None:
        assert found.phase == expected[2]
    first = windows[0]
    assert first is not None
    step = first.per_step().seconds
    assert found.lateness == pytest.approx(step - step / found.slowdown)


@pytest.mark.parametrize(
    ("stalls", "waits", "expected"),
    [
        ([2, 3, 60], [38, 38, 37], [0, 0, 37]),  # beyond its peers' median, at most its wait
        ([5, 5, 5, 5], [3, 3, 3, 3], [0, 0, 0, 0]),
        ([1, 31], [30, 30], [0, 30]),
        ([0, 4, 8, 20], [50, 50, 50, 50], [0, 0, 4, 16]),
        ([0, 2, 4, 6, 30], [50] * 5, [0, 0, 0, 3, 27]),  # four peers: the mean of the middle two
        ([7], [9], [7]),  # no peer: all of it
    ],
    ids=["one starved rank", "all alike", "two ranks", "four ranks", "five ranks", "one rank"],
)
def test_a_ranks_own_stall_is_what_its_peers_did_not_suffer(
    stalls: list[float], waits: list[float], expected: list[float]
) -> None:
    means = [Window(1, wait=w * MS, stall=s * MS) for s, w in zip(stalls, waits, strict=True)]
    assert own_stalls(means) == pytest.approx([e * MS for e in expected])


def test_the_slowdown_is_the_step_time_with_over_without_it() -> None:
    # 3 ranks whose own work takes 8, 9 and 20 ms a step, 1 ms of transfer: the job steps every 21 ms;
    # without rank 2 it would step every 10 ms (rank 1 setting the pace).
    work, transfer = [8.0, 9.0, 20.0], 1.0
    step = max(work) + transfer
    windows = [rank(data=0, compute=w, comm=0, wait=step - w) for w in work]
    found = attribute(windows)
    assert found is not None and (found.rank, found.phase) == (2, "compute")
    assert found.slowdown == pytest.approx(step / (9.0 + transfer))
    assert found.lateness == pytest.approx(11 * MS)


def exchange(contributions: list[list[float]]) -> list[float]:
    """What the allreduce (MAX) leaves on every rank."""
    return [max(values) for values in zip(*contributions, strict=True)]


@pytest.mark.parametrize(
    ("windows", "pods", "flags"),
    [
        ([rank(), rank(wait=9, stall=4), rank(compute=1)], [0, 1, 2], [[0.0], [1.0], [0.0]]),
        ([rank(), None, rank()], [0, 0, 1], [[], [], []]),
        ([Window(0), rank()], [3, 3], [[1.0, 0.0], [0.0, 0.0]]),
    ],
    ids=["every rank measured, one stop flag", "a rank that measured nothing", "no step and two flags"],
)
def test_the_exchange_carries_every_ranks_window_and_pod(
    windows: list[Window | None], pods: list[int], flags: list[list[float]]
) -> None:
    world = len(windows)
    combined = exchange([pack(r, world, windows[r], pods[r], flags[r]) for r in range(world)])
    got, got_pods, got_flags = unpack(combined, world)
    for mine, theirs in zip(windows, got, strict=True):
        if mine is None or mine.steps == 0:
            assert theirs is None
        else:
            assert theirs is not None and theirs.steps == mine.steps
            assert (theirs.data, theirs.compute, theirs.comm, theirs.wait, theirs.stall) == pytest.approx(
                (mine.data, mine.compute, mine.comm, mine.wait, mine.stall)
            )
    assert got_pods == pods
    assert got_flags == [max(f) for f in zip(*flags, strict=True)]


def test_a_slot_nobody_filled_reads_as_missing() -> None:
    windows, pods, _ = unpack([MISSING] * 14, 2)
    assert windows == [None, None] and pods == [0, 1]
    windows, _, _ = unpack([5, 0.1, 0.2, math.nan, 0.1, 0, 0] * 2, 2)
    assert windows == [None, None]


def seconds(pool: list[Window | None]) -> list[float]:
    return [round(w.seconds, 6) if w is not None else -1 for w in pool]


def test_rank_zero_pools_recent_windows_until_they_hold_enough_seconds() -> None:
    history = History(pool_seconds=1.0, max_windows=8)
    short = [Window(5, compute=0.3), Window(5, compute=0.3)]
    assert seconds(history.add(short)) == [0.3, 0.3]
    assert seconds(history.add(short)) == [0.6, 0.6]
    assert seconds(history.add(short)) == [0.9, 0.9]
    assert seconds(history.add(short)) == [1.2, 1.2]  # 4 windows reach 1 s
    assert seconds(history.add(short)) == [1.2, 1.2]  # the oldest is dropped
    long = [Window(5, compute=1.5), Window(5, compute=1.5)]
    assert seconds(history.add(long)) == [1.5, 1.5]  # enough by itself
    # An incomplete picture (a rank without steps) is left out; the pool stays as it was.
    assert seconds(history.add([None, Window(5, compute=0.2)])) == [1.5, 1.5]
    # A different world starts anew.
    assert seconds(history.add([Window(1, wait=0.1)] * 3)) == [0.1, 0.1, 0.1]


def test_an_empty_history_has_no_picture() -> None:
    assert History().add([None, None]) == [None, None]


def fake_thread(tasks: Path, tid: str, name: str, waited_ns: int) -> None:
    (tasks / tid).mkdir(parents=True, exist_ok=True)
    (tasks / tid / "comm").write_text(f"{name}\n")
    (tasks / tid / "schedstat").write_text(f"123456 {waited_ns} 7\n")


def test_the_gloo_threads_longest_wait_for_a_cpu(tmp_path: Path) -> None:
    # A /proc/self/task look-alike: two gloo threads, the main thread, an intra-op thread.
    for tid, name, waited in [
        ("100", "python", 5_000_000),
        ("101", "pt_gloo_runloop", 1_000_000),
        ("102", "gloo_tcp_loop", 2_000_000),
        ("103", "python", 0),
    ]:
        fake_thread(tmp_path, tid, name, waited)
    delay = GlooThreadDelay(tmp_path)
    marks = delay.mark()
    assert marks == pytest.approx({"101": 0.001, "102": 0.002})
    # The main thread waits 1 s more (it was late: that shows elsewhere); the gloo threads were
    # throttled together for ~40 ms: one stall, not two.
    fake_thread(tmp_path, "100", "python", 1_005_000_000)
    fake_thread(tmp_path, "101", "pt_gloo_runloop", 41_000_000)
    fake_thread(tmp_path, "102", "gloo_tcp_loop", 39_000_000)
    assert delay.since(marks) == pytest.approx(0.040)
    delay.close()


def test_no_gloo_thread_no_stall(tmp_path: Path) -> None:
    fake_thread(tmp_path, "100", "python", 5_000_000)
    delay = GlooThreadDelay(tmp_path)
    assert delay.mark() == {}
    assert delay.since({}) == 0.0
    assert GlooThreadDelay(tmp_path / "absent").mark() == {}
