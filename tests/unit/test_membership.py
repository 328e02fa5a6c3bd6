"""A worker's side of the pod's supervisor (ddp_trainer.supervisor.membership), over a real pipe: what the worker
reads while it trains, what it says when it leaves, and how its wait for the next round ends."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable

import pytest

from ddp_trainer.supervisor import membership as membership_module
from ddp_trainer.supervisor.membership import (
    ABORT_BROKEN_SECONDS,
    ABORT_STALL_CAP_SECONDS,
    ABORT_STALL_SECONDS,
    Membership,
    Round,
    abort_window,
)

ROUND = Round(
    restarts=2,
    members=3,
    group_rank=1,
    rank=3,
    local_rank=1,
    world_size=6,
    master_addr="10.0.0.7",
    master_port=41234,
)


def test_a_rounds_environment_is_what_torchrun_would_give_the_worker() -> None:
    assert ROUND.environ(2) == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "6",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "41234",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }


@pytest.mark.parametrize(
    ("sent", "leave"),
    [
        pytest.param([], False, id="nothing-sent"),
        pytest.param([("leave",)], True, id="asked-to-leave"),
        pytest.param([("end",)], True, id="the-gang-ends"),
    ],
)
def test_a_training_worker_reads_what_arrived_without_waiting(sent: list[tuple[str]], leave: bool) -> None:
    supervisor, worker = multiprocessing.Pipe()
    for message in sent:
        supervisor.send(message)
    assert Membership(worker).leave_requested() is leave


def test_a_closed_pipe_means_the_supervisor_is_gone() -> None:
    supervisor, worker = multiprocessing.Pipe()
    supervisor.close()
    membership = Membership(worker)
    assert membership.leave_requested()
    assert membership.next_round(lambda: False) is None


def test_leaving_says_the_step_held_and_why_and_the_next_round_comes_with_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    supervisor, worker = multiprocessing.Pipe()
    membership = Membership(worker)
    supervisor.send(("leave",))
    assert membership.leave_requested()
    membership.left(41, "asked")
    kind, step, _, why = supervisor.recv()
    assert (kind, step, why) == ("left", 41, "asked")
    # A leave that arrives late (after the worker left) is no reason to leave the next round.
    supervisor.send(("leave",))
    supervisor.send(("round", ROUND))
    assert membership.next_round(lambda: False) == ROUND
    assert not membership.leave_requested()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"]) == ("3", "6", "41234")


@pytest.mark.parametrize(
    ("sent", "stopped"),
    [
        pytest.param([("end",)], False, id="the-gang-ends"),
        pytest.param([], True, id="the-pod-is-stopped-while-it-waits"),
    ],
)
def test_the_wait_for_a_next_round_ends_without_one(sent: list[tuple[str]], stopped: bool) -> None:
    supervisor, worker = multiprocessing.Pipe()
    for message in sent:
        supervisor.send(message)
    assert Membership(worker).next_round(lambda: stopped) is None


# --- the control thread (Membership.watch) ------------------------------------------------------------
# A short window, so that the tests wait fractions of a second; abort_window reads these when it is called.
WINDOW = 0.3


@pytest.fixture
def short_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membership_module, "ABORT_STALL_SECONDS", WINDOW)
    monkeypatch.setattr(membership_module, "ABORT_STALL_CAP_SECONDS", 2 * WINDOW)
    monkeypatch.setattr(membership_module, "ABORT_BROKEN_SECONDS", WINDOW / 3)


class StandInGroup:
    """What the control thread aborts: records each call (True: there was a group to abort)."""

    def __init__(self, formed: Callable[[], bool] = lambda: True) -> None:
        self.calls: list[float] = []
        self.formed = formed

    def abort(self, waited: float) -> bool:
        if not self.formed():
            return False
        self.calls.append(waited)
        return True


def _until(predicate: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_abort_window_grows_with_the_step_within_bounds() -> None:
    assert abort_window(0.01, broken=False) == ABORT_STALL_SECONDS
    assert abort_window(2.0, broken=False) == 8.0
    assert abort_window(60.0, broken=False) == ABORT_STALL_CAP_SECONDS
    assert abort_window(60.0, broken=True) == ABORT_BROKEN_SECONDS


@pytest.mark.usefixtures("short_window")
def test_a_worker_asked_to_leave_that_makes_no_step_has_its_group_aborted_once() -> None:
    supervisor, worker = multiprocessing.Pipe()
    membership, group = Membership(worker), StandInGroup()
    membership.watch(group.abort)
    membership.step_done()
    started = time.monotonic()
    supervisor.send(("leave",))
    assert _until(lambda: bool(group.calls), 5 * WINDOW), "the blocked worker's group was never aborted"
    assert time.monotonic() - started >= WINDOW
    assert membership.aborted
    time.sleep(3 * WINDOW)
    assert len(group.calls) == 1, group.calls  # once per round
    # The leave was seen by the control thread; the main thread reads it too.
    assert membership.leave_requested()


@pytest.mark.usefixtures("short_window")
def test_a_worker_that_reaches_its_stop_check_is_never_aborted() -> None:
    supervisor, worker = multiprocessing.Pipe()
    membership, group = Membership(worker), StandInGroup()
    membership.watch(group.abort)
    supervisor.send(("leave",))
    # Steps go on for longer than the window (a healthy worker on its way to the stop check) ...
    for _ in range(int(2 * WINDOW / 0.05)):
        membership.step_done()
        time.sleep(0.05)
    # ... then its stop check agrees to leave: from there on nothing is aborted, however long it takes.
    assert membership.leave_requested()
    membership.leaving()
    time.sleep(4 * WINDOW)
    membership.left(12, "asked")
    time.sleep(2 * WINDOW)
    assert group.calls == []
    assert not membership.aborted


@pytest.mark.usefixtures("short_window")
def test_nothing_is_aborted_without_a_leave() -> None:
    _, worker = multiprocessing.Pipe()
    membership, group = Membership(worker), StandInGroup()
    membership.watch(group.abort)
    time.sleep(4 * WINDOW)  # no step at all: a blocked worker nobody asked to leave is the watchdog's
    assert group.calls == []


@pytest.mark.usefixtures("short_window")
def test_a_broken_group_is_aborted_sooner_than_a_slow_step_would_allow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(membership_module, "ABORT_STALL_SECONDS", 30.0)
    monkeypatch.setattr(membership_module, "ABORT_STALL_CAP_SECONDS", 30.0)
    supervisor, worker = multiprocessing.Pipe()
    membership, group = Membership(worker), StandInGroup()
    membership.watch(group.abort)
    supervisor.send(("leave", "broken"))
    assert _until(lambda: bool(group.calls), 10 * WINDOW)


@pytest.mark.usefixtures("short_window")
def test_an_unknown_leave_reason_is_a_plain_leave(monkeypatch: pytest.MonkeyPatch) -> None:
    supervisor, worker = multiprocessing.Pipe()
    membership, group = Membership(worker), StandInGroup()
    monkeypatch.setattr(membership_module, "ABORT_BROKEN_SECONDS", 30.0)
    membership.watch(group.abort)
    supervisor.send(("leave", "some-later-reason"))
    assert _until(lambda: bool(group.calls), 5 * WINDOW)
    assert membership.leave_requested()


@pytest.mark.usefixtures("short_window")
def test_a_worker_still_forming_its_group_is_aborted_once_it_has_one() -> None:
    supervisor, worker = multiprocessing.Pipe()
    formed: list[bool] = []
    membership, group = Membership(worker), StandInGroup(lambda: bool(formed))
    membership.watch(group.abort)
    supervisor.send(("leave",))
    time.sleep(3 * WINDOW)
    assert group.calls == [] and not membership.aborted
    formed.append(True)
    assert _until(lambda: len(group.calls) == 1, 5 * WINDOW)


@pytest.mark.usefixtures("short_window")
def test_each_round_may_be_aborted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    supervisor, worker = multiprocessing.Pipe()
    membership, group = Membership(worker), StandInGroup()
    membership.watch(group.abort)
    supervisor.send(("leave",))
    assert _until(lambda: len(group.calls) == 1, 5 * WINDOW)
    membership.left(3, "peer-lost")
    supervisor.send(("round", ROUND))
    assert membership.next_round(lambda: False) == ROUND
    assert not membership.aborted and not membership.leave_requested()
    time.sleep(3 * WINDOW)
    assert len(group.calls) == 1  # the new round was not asked to leave
    membership.step_done()
    supervisor.send(("leave",))
    assert _until(lambda: len(group.calls) == 2, 5 * WINDOW)
