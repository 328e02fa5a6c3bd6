"""Ending a blocked collective (ddp_trainer.supervisor.group_abort): the NCCL error-handling default a
worker gets, what the aborter does with a group per backend, and what it says where torch lacks abort()."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ddp_trainer.config import parse_args, parse_env
from ddp_trainer.exitcodes import PeerLostError
from ddp_trainer.supervisor import group_abort
from ddp_trainer.supervisor.group_abort import (
    ASYNC_ERROR_HANDLING_ENV,
    CLEAN_UP_ONLY,
    LEGACY_ASYNC_ERROR_HANDLING_ENV,
    GroupAborter,
    Support,
    default_nccl_error_handling,
)
from ddp_trainer.training import trainer

CPU = torch.device("cpu")


def test_the_default_is_to_abort_the_communicator_and_keep_the_process() -> None:
    environ: dict[str, str] = {}
    assert default_nccl_error_handling(environ)
    assert environ == {ASYNC_ERROR_HANDLING_ENV: CLEAN_UP_ONLY}


@pytest.mark.parametrize("name", [ASYNC_ERROR_HANDLING_ENV, LEGACY_ASYNC_ERROR_HANDLING_ENV])
@pytest.mark.parametrize("value", ["0", "1", "3"])
def test_what_the_user_set_is_kept(name: str, value: str) -> None:
    environ = {name: value}
    assert not default_nccl_error_handling(environ)
    assert environ == {name: value}


def _setup_until_the_store(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Run the trainer's setup() up to its first store, which fails (no group is made here)."""

    def no_store(*_args: object, **_kwargs: object) -> None:
        raise OSError("no store in a unit test")

    monkeypatch.setattr(trainer, "_device", lambda env: CPU)
    monkeypatch.setattr(trainer, "tcp_store", no_store)
    env = parse_env(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "DDP_BACKEND": backend,
        }
    )
    with pytest.raises(PeerLostError):
        trainer.setup(env, parse_args([]))


@pytest.mark.parametrize(
    ("backend", "user", "expected"),
    [
        pytest.param("nccl", None, CLEAN_UP_ONLY, id="nccl-gets-the-default"),
        pytest.param("nccl", "1", "1", id="nccl-keeps-the-users"),
        pytest.param("gloo", None, None, id="gloo-is-left-alone"),
    ],
)
def test_the_trainer_sets_the_default_before_an_nccl_group_only(
    monkeypatch: pytest.MonkeyPatch, backend: str, user: str | None, expected: str | None
) -> None:
    monkeypatch.delenv(LEGACY_ASYNC_ERROR_HANDLING_ENV, raising=False)
    if user is None:
        monkeypatch.delenv(ASYNC_ERROR_HANDLING_ENV, raising=False)
    else:
        monkeypatch.setenv(ASYNC_ERROR_HANDLING_ENV, user)
    _setup_until_the_store(monkeypatch, backend)
    assert os.environ.get(ASYNC_ERROR_HANDLING_ENV) == expected


class StandInGroup:
    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


def test_an_nccl_group_is_aborted_and_its_results_no_longer_count() -> None:
    group = StandInGroup()
    aborter = GroupAborter("nccl", CPU, lambda: group)
    assert aborter.intact()
    assert aborter(6.0)
    assert group.aborts == 1
    assert aborter.aborted and not aborter.intact()
    aborter.new_round()
    assert not aborter.aborted


def test_on_gloo_abort_is_called_but_changes_nothing_the_trainer_reads() -> None:
    # gloo's abort() does nothing (its collectives end on their own): the round goes on as before.
    group = StandInGroup()
    aborter = GroupAborter("gloo", CPU, lambda: group)
    assert aborter(6.0)
    assert group.aborts == 1
    assert not aborter.aborted and aborter.intact() and aborter.state_is_exact()


def test_no_group_yet_means_ask_again() -> None:
    aborter = GroupAborter("nccl", CPU, lambda: None)
    assert not aborter(6.0)
    assert not aborter.aborted


def test_a_torch_without_abort_is_said_once_and_nothing_is_called(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        group_abort, "probe", lambda: Support(False, False, "torch 2.x has no ProcessGroup.abort()")
    )
    group = StandInGroup()
    aborter = GroupAborter("nccl", CPU, lambda: group)
    assert "has no ProcessGroup.abort()" in capsys.readouterr().err
    assert aborter(6.0)  # nothing to retry: the supervisor's kill is the way out
    assert group.aborts == 0 and not aborter.aborted


def test_this_torch_offers_abort() -> None:
    # torch 2.8 and later: the public ProcessGroup.abort() the control thread calls.
    assert group_abort.probe().abort, group_abort.probe().missing


def test_off_nccl_the_state_is_always_exact(tmp_path: Path) -> None:
    aborter = GroupAborter("gloo", CPU, lambda: None)
    aborter.fence.issued_update()
    assert not aborter.fence.enabled and aborter.fence.issued == 0
    assert aborter.state_is_exact()


def test_on_nccl_the_state_is_exact_only_where_the_reading_before_the_abort_says_so() -> None:
    aborter = GroupAborter("nccl", CPU, lambda: StandInGroup())
    # The fence runs on CUDA only; stand in for a round that issued an update on the device.
    aborter.fence.enabled, aborter.fence.issued = True, 1
    assert not aborter.state_is_exact()  # broken without this module's reading (torch's watchdog)
    aborter.settled_before_abort = False
    assert not aborter.state_is_exact()  # an update was in flight when it was aborted
    aborter.settled_before_abort = True
    assert aborter.state_is_exact()
