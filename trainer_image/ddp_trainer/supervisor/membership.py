"""A worker's side of the pod's supervisor (``ddp_trainer.supervisor.inplace``): the rounds it trains in.

A worker started by the supervisor keeps its process, its model and its optimizer (on the device, where
they are) across the rounds of its gang: when its group breaks (a peer's worker or pod is lost) or the
supervisor asks it to leave (a pod waits to join), it leaves the group, tells the supervisor at which
step its state is, and waits for the next round's ranks and store; then it forms the new group in this
same process (docs/trainer.md, "The pod's supervisor").

The channel is one ``multiprocessing`` pipe per worker. Supervisor to worker: ``("leave",)`` (leave at
the next stop check, with the others), ``("round", Round)`` (the next round), ``("end",)`` (no next
round: the gang ends). Worker to supervisor: ``("left", step, time, why)`` (``step`` -1: it holds no state; ``why``: one of
LEFT_REASONS).

Torch-free: the supervisor imports it before any worker exists.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Final, Literal

# Why a worker left its group: a collective failed (a peer is gone), another rank's own stop (its pod
# is being stopped) was agreed, or this worker's supervisor asked it to leave (a pod joins).
LeftReason = Literal["peer-lost", "stopped", "asked"]
LEFT_REASONS: Final = ("peer-lost", "stopped", "asked")

# How often a worker waiting for its next round looks at its own stop flag (a pod stopped meanwhile).
WAIT_POLL_SECONDS: Final = 0.2


@dataclass(frozen=True)
class Round:
    """One round of the gang as one worker of it sees it: its ranks, the group's size, the store."""

    restarts: int
    members: int  # pods in the round
    group_rank: int  # this pod's rank in the round
    rank: int  # this worker's global rank
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int

    def environ(self, nproc_per_node: int) -> dict[str, str]:
        """The variables a worker started in this round reads (torchrun's names, so a user's own script
        under the supervisor finds what torchrun would give it)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(nproc_per_node),
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(self.members),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restarts),
        }


class Membership:
    """The worker's end of its pipe to the supervisor."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._leave = False
        self._ended = False

    def leave_requested(self) -> bool:
        """Whether the supervisor asked this worker to leave the group at the next stop check (reads
        what has arrived, never waits)."""
        self._drain()
        return self._leave or self._ended

    def _drain(self) -> None:
        try:
            while not self._leave and not self._ended and self._connection.poll():
                message = self._connection.recv()
                if message[0] == "leave":
                    self._leave = True
                elif message[0] == "end":
                    self._ended = True
        except (EOFError, OSError):
            self._ended = True

    def left(self, step: int, why: LeftReason) -> None:
        """Say that this worker left its group holding the state after ``step`` (-1: none), and why."""
        try:
            self._connection.send(("left", step, time.time(), why))
        except OSError:
            self._ended = True

    def next_round(self, stopped: Callable[[], bool]) -> Round | None:
        """Wait for the next round; None when there is none (the supervisor ended the gang, or is gone)
        or ``stopped()`` became true (this pod is being stopped)."""
        self._leave = False
        while not self._ended:
            try:
                if not self._connection.poll(WAIT_POLL_SECONDS):
                    if stopped():
                        return None
                    continue
                message = self._connection.recv()
            except (EOFError, OSError):
                return None
            if message[0] == "round":
                round_: Round = message[1]
                os.environ.update(round_.environ(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))
                return round_
            if message[0] == "end":
                return None
        return None


# The worker's membership, set by the supervisor's entry point (ddp_trainer.training.worker.supervised_worker)
# before training starts; None in any process the supervisor did not start.
_current: Membership | None = None


def current() -> Membership | None:
    return _current


def attach(connection: Connection) -> Membership:
    global _current
    _current = Membership(connection)
    return _current
