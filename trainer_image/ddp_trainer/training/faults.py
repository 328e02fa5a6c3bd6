"""Testing aid (``--inject-fault RANK:POINT:ACTION``, docs/trainer.md): one rank fails on purpose.

Every way a rank is made to fail lives here; the trainer only says where it is (``inject``), hands
each batch through ``misshape`` and asks the health check's delay of ``send_delay``. A fault goes off
once, at its point, on its rank.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from ddp_trainer.config import InjectedFault
from ddp_trainer.supervisor.resume import PROGRESS_DIR_ENV, read_restarts


class InjectedExitError(Exception):
    """``exit=CODE``: this rank's own failure with that code, through the normal exit path."""

    def __init__(self, code: int) -> None:
        super().__init__(f"injected exit {code}")
        self.code = code


def _log(message: str) -> None:
    print(f"ddp_trainer: {message}", file=sys.stderr, flush=True)


def first_run() -> bool:
    """Whether this is the job's first run: attempt 0 (DDPJOB_ATTEMPT) before any in-place restart."""
    directory = os.environ.get(PROGRESS_DIR_ENV)
    restarted = read_restarts(Path(directory)) if directory else 0
    return restarted == 0 and os.environ.get("DDPJOB_ATTEMPT", "0") in ("", "0")


def _armed(fault: InjectedFault | None, rank: int, point: str, step: int | None) -> bool:
    return fault is not None and fault.at(rank, point, step) and (not fault.once or first_run())


def inject(fault: InjectedFault | None, rank: int, point: str, step: int | None = None) -> None:
    """Fail here if this rank was told to ("bad-shape" is ``misshape``'s, "slow" ``send_delay``'s)."""
    if fault is None or not _armed(fault, rank, point, step) or fault.action in ("bad-shape", "slow"):
        return
    _log(f"rank {rank}: injected fault: {fault.describe()}")
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # vanish like a lost node: no cleanup, no exit record
    if fault.action == "crash" and fault.code is not None:
        os._exit(fault.code)  # like a crash in native code: no exit record
    if fault.action == "exit" and fault.code is not None:
        raise InjectedExitError(fault.code)  # run_worker exits with it, as with its own error
    raise ValueError(f"injected fault on rank {rank}: {fault.describe()}")


def misshape(fault: InjectedFault | None, rank: int, step: int, inputs: torch.Tensor) -> torch.Tensor:
    """``bad-shape``: the batch one feature short at its step, so the model raises its own shape error
    (a RuntimeError from torch that is not about a peer)."""
    if fault is None or fault.action != "bad-shape" or not _armed(fault, rank, "step", step):
        return inputs
    _log(f"rank {rank}: injected fault: a batch of the wrong shape at step {step}")
    return inputs[..., :-1]


def send_delay(fault: InjectedFault | None, rank: int) -> float:
    """``slow=MS`` at ``health``: the seconds this rank sleeps before each send of the health check
    (a rank with a slow link to everyone), 0 for every other rank."""
    if (
        fault is None
        or fault.action != "slow"
        or fault.code is None
        or not _armed(fault, rank, "health", None)
    ):
        return 0.0
    _log(f"rank {rank}: injected fault: {fault.describe()}")
    return fault.code / 1000.0
