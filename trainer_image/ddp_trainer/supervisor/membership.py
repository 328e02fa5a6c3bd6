"""A worker's side of the pod's supervisor (``ddp_trainer.supervisor.inplace``): the rounds it trains in.

A worker started by the supervisor keeps its process, its model and its optimizer (on the device, where
they are) across the rounds of its gang: when its group breaks (a peer's worker or pod is lost) or the
supervisor asks it to leave (a pod waits to join), it leaves the group, tells the supervisor at which
step its state is, and waits for the next round's ranks and store; then it forms the new group in this
same process (docs/trainer.md, "The pod's supervisor").

The channel is one ``multiprocessing`` pipe per worker. Supervisor to worker: ``("leave",)`` (leave at
the next stop check, with the others; ``("leave", "broken")`` says the group is known broken: a worker
of the gang failed, so nobody need wait for a stop check), ``("round", Round)`` (the next round),
``("end",)`` (no next round: the gang ends). Worker to supervisor: ``("left", step, time, why)``
(``step`` -1: it holds no state; ``why``: one of LEFT_REASONS).

**The control thread** (:meth:`Membership.watch`): a worker asked to leave that makes no step is blocked
in a collective (on NCCL a wait on the device for a peer that is gone never returns by itself). The
thread reads the pipe while the worker trains and, once a leave has come and no step has followed for
:func:`abort_window` seconds, calls the worker's abort (``ddp_trainer.supervisor.group_abort``): the
blocked collective raises, and the worker leaves with its state as from a lost peer. It never does once
the worker's stop check has agreed to leave (:meth:`Membership.leaving`): from there the worker is on
its way out. The supervisor's own kill (LEAVE_STALL_SECONDS without a step) stays the last resort.

Torch-free: the supervisor imports it before any worker exists.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
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

# The control thread aborts a worker asked to leave once it has made no step for this long, or for
# ABORT_STEP_MULTIPLE of its longest step of the round if that is longer, never longer than
# ABORT_STALL_CAP_SECONDS: well inside the supervisor's LEAVE_STALL_SECONDS (15 s), after which it
# kills the worker instead.
ABORT_STALL_SECONDS: Final = 5.0
ABORT_STEP_MULTIPLE: Final = 4.0
ABORT_STALL_CAP_SECONDS: Final = 10.0
# After ("leave", "broken") the group is known to be broken: a step that has not come in this long
# will not come.
ABORT_BROKEN_SECONDS: Final = 1.0
# How often the control thread reads the pipe and looks at the worker's progress.
CONTROL_POLL_SECONDS: Final = 0.05
# While no leave is pending, the control thread waits in the pipe for this long at most (it wakes at once
# when a message arrives).
IDLE_POLL_SECONDS: Final = 1.0
BROKEN: Final = "broken"


def abort_window(longest_step: float, broken: bool) -> float:
    """Seconds without a step after a leave request before a worker counts as blocked."""
    if broken:
        return ABORT_BROKEN_SECONDS
    return min(ABORT_STALL_CAP_SECONDS, max(ABORT_STALL_SECONDS, ABORT_STEP_MULTIPLE * longest_step))


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
    """The worker's end of its pipe to the supervisor, and its control thread (:meth:`watch`)."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        # Everything below is read and written under the lock: the main thread and the control thread.
        self._lock = threading.Lock()
        self._leave = False
        self._broken = False
        self._ended = False
        self._rounds: deque[Round] = deque()
        # Since when a leave is pending (monotonic), the last step's time and the longest step's length.
        self._asked_at: float | None = None
        self._stepped_at: float | None = None
        self._longest_step = 0.0
        # The worker's stop check agreed to leave, or it left: the control thread stands down.
        self._leaving = False
        self._aborted = False
        self._abort: Callable[[float], bool] | None = None
        self._thread: threading.Thread | None = None

    # --- the main thread ---------------------------------------------------------------------------
    def leave_requested(self) -> bool:
        """Whether the supervisor asked this worker to leave the group at the next stop check (reads
        what has arrived, never waits)."""
        if self._thread is not None:
            # The control thread reads the pipe as messages come: no syscall and no lock per look.
            return self._leave or self._ended
        with self._lock:
            self._drain()
            return self._leave or self._ended

    def watch(self, abort: Callable[[float], bool]) -> None:
        """Start the control thread: ``abort(seconds waited)`` is called when the worker, asked to leave,
        makes no step for :func:`abort_window` seconds before its stop check agrees; once per round
        after it returns True (False: there was no group to abort yet, ask again)."""
        with self._lock:
            self._abort = abort
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._control, name="ddp-membership", daemon=True)
            self._thread.start()

    def step_done(self) -> None:
        """The worker completed a step (cheap: the main thread calls it every step)."""
        # No lock: each field is one reference the GIL writes whole, and the control thread only
        # compares them against its window (a step's lock was measurable on a 0.4 ms step).
        now = time.monotonic()
        last = self._stepped_at
        if last is not None and now - last > self._longest_step:
            self._longest_step = now - last
        self._stepped_at = now

    def leaving(self) -> None:
        """The worker is on its way out of the group (its stop check agreed to leave, or its group
        broke): nothing is to be aborted any more this round. Waits for an abort under way to end."""
        with self._lock:
            self._leaving = True

    @property
    def aborted(self) -> bool:
        """Whether the control thread aborted this round's group."""
        with self._lock:
            return self._aborted

    def left(self, step: int, why: LeftReason) -> None:
        """Say that this worker left its group holding the state after ``step`` (-1: none), and why."""
        self.leaving()
        try:
            self._connection.send(("left", step, time.time(), why))
        except OSError:
            with self._lock:
                self._ended = True

    def next_round(self, stopped: Callable[[], bool]) -> Round | None:
        """Wait for the next round; None when there is none (the supervisor ended the gang, or is gone)
        or ``stopped()`` became true (this pod is being stopped)."""
        while True:
            with self._lock:
                self._drain()
                if self._rounds:
                    round_ = self._rounds.popleft()
                    self._new_round()
                    break
                if self._ended:
                    return None
            if stopped():
                return None
            try:
                self._connection.poll(WAIT_POLL_SECONDS)
            except (EOFError, OSError):
                with self._lock:
                    self._ended = True
        os.environ.update(round_.environ(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))
        return round_

    # --- under the lock ----------------------------------------------------------------------------
    def _drain(self) -> None:
        """Take every message that has arrived, in order (a leave sent before a round belongs to the
        round the worker left; one sent after it, to the next)."""
        try:
            while not self._ended and self._connection.poll():
                message = self._connection.recv()
                if message[0] == "leave":
                    if not self._leave:
                        self._leave, self._asked_at = True, time.monotonic()
                    # Any other second element (a newer supervisor's) is a plain leave.
                    self._broken = self._broken or message[1:2] == (BROKEN,)
                elif message[0] == "end":
                    self._ended = True
                elif message[0] == "round":
                    self._rounds.append(message[1])
                    self._leave, self._broken, self._asked_at = False, False, None
        except (EOFError, OSError):
            self._ended = True

    def _new_round(self) -> None:
        self._stepped_at, self._longest_step = None, 0.0
        self._leaving = self._aborted = False

    def _blocked_for(self, now: float) -> float | None:
        """Seconds the worker has been blocked since a leave request, once past the window; else None."""
        if not self._leave or self._asked_at is None or self._leaving or self._aborted or self._rounds:
            return None
        since = max(self._asked_at, self._stepped_at or self._asked_at)
        waited = now - since
        return waited if waited > abort_window(self._longest_step, self._broken) else None

    # --- the control thread ------------------------------------------------------------------------
    def _control(self) -> None:
        while True:
            with self._lock:
                self._drain()
                if self._ended:
                    return
                waited = self._blocked_for(time.monotonic())
                if waited is not None and self._abort is not None:
                    # Under the lock: the main thread cannot end the group while it is being aborted.
                    try:
                        self._aborted = self._abort(waited)
                    except Exception as error:  # the supervisor's kill remains; say why this failed
                        self._aborted = True
                        print(
                            f"ddp_trainer: aborting the process group failed: {error!r}",
                            file=sys.stderr,
                            flush=True,
                        )
                pending = self._leave and not self._leaving and not self._aborted
            if pending:
                time.sleep(CONTROL_POLL_SECONDS)
            else:
                # Nothing asked: sleep in the pipe's own wait (no lock, no GIL held), woken by the
                # supervisor's next message, so a training worker's steps share the GIL with no one.
                with contextlib.suppress(EOFError, OSError, ValueError):
                    self._connection.poll(IDLE_POLL_SECONDS)


# The worker's membership, set by the supervisor's entry point (ddp_trainer.training.worker.supervised_worker)
# before training starts; None in any process the supervisor did not start.
_current: Membership | None = None


def current() -> Membership | None:
    return _current


def attach(connection: Connection) -> Membership:
    global _current
    _current = Membership(connection)
    return _current
