"""A worker's side of the pod's supervisor (ddp_trainer.supervisor.membership), over a real pipe: what the worker
reads while it trains, what it says when it leaves, and how its wait for the next round ends."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from ddp_trainer.supervisor.membership import Membership, Round

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
