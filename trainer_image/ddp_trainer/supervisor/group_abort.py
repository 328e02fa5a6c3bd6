"""Ending a worker's blocked collective from its control thread (docs/trainer.md, "The pod's supervisor").

A worker asked to leave its group (the round changed) that makes no step is blocked in a collective.
On gloo the dead peer's socket raises by itself; on NCCL a collective waits on the device for a peer
that never comes, and nothing on the host returns. The worker's control thread
(``ddp_trainer.supervisor.membership``) then calls :class:`GroupAborter`, which aborts the worker's
process group through torch's public ``ProcessGroup.abort()``: NCCL's kernels of that communicator end,
the host's wait returns, and the next use of the group raises, which the trainer treats as a lost peer.

What torch offers is probed once, here (:func:`probe`); where the installed torch lacks it the worker
says so in one line and the supervisor's kill (its LEAVE_STALL_SECONDS) stays the only way out.

**An abort flushes what was queued.** NCCL's work is asynchronous to the host: by the time the host
blocks, the device may hold a step's optimizer update queued behind the gradient allreduce that waits
for the lost peer. Once the communicator is aborted that update runs on a partial allreduce. So under
NCCL the worker keeps its state only when it can show that nothing it issued this round was in flight:
:class:`DeviceFence` records a CUDA event after every update the round issues (DDP's constructor
broadcast, each step), and the aborter reads them just before it aborts. An update in flight, or a
group that broke without that reading (torch's own NCCL watchdog aborted it), makes the state doubtful;
the trainer then exits as a lost peer and is replaced, as before this module. gloo's collectives end
on the host before anything that uses their result runs, so there the state is always kept.

``TORCH_NCCL_ASYNC_ERROR_HANDLING``: torch's NCCL watchdog reads it when a group is made (0: no
handling; 1: abort the communicator and tear the process down; 2: abort the communicator only; 3: tear
the process down without aborting; torch's default is 3). A worker that keeps its process across rounds
needs 2: :func:`default_nccl_error_handling` sets it where the user has not set it (nor its older name).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

ASYNC_ERROR_HANDLING_ENV: Final = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
# The name torch read before 2.2, which it still reads after the new one.
LEGACY_ASYNC_ERROR_HANDLING_ENV: Final = "NCCL_ASYNC_ERROR_HANDLING"
# Abort the communicator on an error or a timeout, and leave the process alone.
CLEAN_UP_ONLY: Final = "2"

# Backends whose abort makes a pending collective return (gloo's abort() does nothing: its collectives
# end when a peer's socket closes, or at their timeout).
ABORTING_BACKENDS: Final = frozenset({"nccl"})


def log(message: str) -> None:
    print(f"ddp_trainer: {message}", file=sys.stderr, flush=True)


def default_nccl_error_handling(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator, keep the process) unless the
    user set it or its older name; True when it was set here. Call it before the NCCL group is made."""
    environ = os.environ if environ is None else environ
    if ASYNC_ERROR_HANDLING_ENV in environ or LEGACY_ASYNC_ERROR_HANDLING_ENV in environ:
        return False
    environ[ASYNC_ERROR_HANDLING_ENV] = CLEAN_UP_ONLY
    return True


@dataclass(frozen=True)
class Support:
    """What the installed torch offers for ending a blocked collective."""

    abort: bool  # ProcessGroup.abort() exists (public; torch 2.8 and later have it)
    # Reads an NCCL group's own error (None where it cannot be read). ProcessGroupNCCL.get_error() is
    # public, but reaching a group's NCCL backend takes ProcessGroup._get_backend(), which is not.
    error_reader: bool
    missing: str  # what is missing, for the log line ("" when nothing)


@functools.cache
def probe() -> Support:
    """What this torch offers, looked at once."""
    abort = callable(getattr(dist.ProcessGroup, "abort", None))
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    error_reader = (
        nccl is not None
        and callable(getattr(nccl, "get_error", None))
        and callable(getattr(dist.ProcessGroup, "_get_backend", None))
    )
    missing = "" if abort else f"torch {torch.__version__} has no ProcessGroup.abort()"
    return Support(abort=abort, error_reader=error_reader, missing=missing)


def _nccl_error(group: Any) -> bool | None:
    """Whether the group's NCCL backend has recorded an error (its watchdog saw a timeout or a failed
    communicator, and in mode 2 aborted it); None where this torch cannot say."""
    if not probe().error_reader:
        return None
    try:
        backend = group._get_backend(torch.device("cuda"))
        return int(backend.get_error()) != 0  # ErrorType.SUCCESS is 0
    except Exception:  # a torch whose surface moved: the reading is lost, nothing else
        return None


def _default_group() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class DeviceFence:
    """CUDA events after the updates a round issues, to tell whether any was still in flight.

    Used under NCCL only (``enabled``); elsewhere every method does nothing and the state counts as
    exact. One event per update, recorded on the current stream (no host wait); the completed ones at
    the front are dropped as new ones come, so the queue holds what the host has run ahead by.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pending: deque[Any] = deque()
        self.issued = 0

    def reset(self) -> None:
        self._pending.clear()
        self.issued = 0

    def issued_update(self) -> None:
        """The host has just queued an update of the state (a step's optimizer, DDP's broadcast)."""
        if not self.enabled:
            return
        while self._pending and self._pending[0].query():
            self._pending.popleft()
        cuda: Any = torch.cuda  # its Event is untyped
        event = cuda.Event()
        event.record()
        self._pending.append(event)
        self.issued += 1

    def settled(self) -> bool:
        """Whether every update queued so far has finished on the device (asks, never waits)."""
        return all(event.query() for event in list(self._pending))


class GroupAborter:
    """What the control thread calls when the worker, asked to leave, is blocked: abort the default group.

    One per worker process; :meth:`new_round` before each round. Thread-safe: the control thread calls
    :meth:`__call__`, the main thread everything else.
    """

    def __init__(
        self, backend: str, device: torch.device, find_group: Callable[[], Any] | None = None
    ) -> None:
        self.backend = backend
        # The group to abort: the default group (None while there is none).
        self._find_group = find_group or _default_group
        self.fence = DeviceFence(backend == "nccl" and device.type == "cuda")
        self._lock = threading.Lock()
        # This round: the group was aborted here; what the fence read just before (None: no reading).
        self.aborted = False
        self.settled_before_abort: bool | None = None
        support = probe()
        if support.missing:
            log(
                f"{support.missing}: a worker blocked in a collective after its round changed is left to its "
                "supervisor, which ends it after it made no step for a while (it then starts anew)"
            )

    def new_round(self) -> None:
        with self._lock:
            self.aborted = False
            self.settled_before_abort = None
            self.fence.reset()

    def __call__(self, waited: float) -> bool:
        """Abort the default group (the worker made no step for ``waited`` seconds after it was asked to
        leave); False when there is no group yet (the worker is still forming it)."""
        if not probe().abort:
            return True  # said once, at the start: the supervisor's kill is the way out
        group = self._find_group()
        if group is None:
            return False
        with self._lock:
            aborting = self.backend in ABORTING_BACKENDS
            if aborting:
                # Read before the abort flushes what was queued; a group torch's watchdog aborted first
                # has flushed it already, and says so in its error.
                settled = self.fence.settled()
                self.settled_before_abort = settled and not _nccl_error(group)
            group.abort()
            self.aborted = aborting
        what = "its pending collective now raises" if aborting else f"a no-op on {self.backend}"
        log(
            f"rank {os.environ.get('RANK', '?')}: asked to leave its group and no step for {waited:.1f} s: aborted the "
            f"process group ({what})"
        )
        return True

    def intact(self) -> bool:
        """Whether a collective's result can be used: the group was not aborted here nor by torch's NCCL
        watchdog (a flushed collective returns what its buffer held)."""
        if self.aborted:
            return False
        if self.backend not in ABORTING_BACKENDS:
            return True
        group = self._find_group()
        return group is None or _nccl_error(group) is not True

    def state_is_exact(self) -> bool:
        """After this round's group broke: whether the worker's model and optimizer are those of its last
        completed step. Always under gloo; under NCCL when the round issued no update, or the reading
        before this module's abort found every one finished."""
        if not self.fence.enabled or self.fence.issued == 0:
            return True
        return self.settled_before_abort is True
