"""Leaving the process group so that the interpreter's exit cannot abort a finished rank.

Why this exists (torch 2.15, gloo): a backward pass stashes a Python object (a ``contextvars``
context) in the thread-local state that every collective started during it captures. When the last
reference to such a work is dropped by one of gloo's worker threads, that thread takes the GIL. If
the main thread is already finalizing the interpreter, taking the GIL ends the worker thread with a
forced unwind through a ``noexcept`` destructor: ``terminate called without an active exception``,
SIGABRT, exit 134, after a run that had succeeded. Roughly one run in fifteen of a 2x2 torchrun job
hit it on a busy two-core machine.

The cure is to have the process group destroyed, and its worker threads joined, while the interpreter
is fully alive: ``~ProcessGroupGloo`` joins them and torch releases the GIL around it. That only
happens when the last reference to the group goes, and two things keep one alive after
``destroy_process_group()``: the DDP model (its reducer holds the group) and
``torch.distributed.nn.functional``, whose collectives take ``group=group.WORLD`` as a default that
Python evaluates once, when DDP first imports the module (after the group exists).

The whole protocol is one context manager, :func:`process_group_session`: entered before
``init_process_group``, it imports those modules early; on its way out it closes every
:func:`ddp_trainer.instrument` opened inside it (which lets go of the model), releases captured
defaults, and ends the group while the interpreter is alive. The built-in trainer uses it too.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

# The threads a ProcessGroupGloo runs (names as torch and gloo set them).
GLOO_THREAD_NAMES = frozenset({"pt_gloo_runloop", "gloo_tcp_loop"})
THREADS_OUTLIVED_GROUP = "the process group's threads outlived it; exiting without interpreter teardown"


def import_group_defaults_early() -> None:
    """Import the modules whose defaults capture the default group while there is none yet.

    Call it before ``init_process_group``: their ``group=group.WORLD`` defaults then hold ``None``
    (the default group, whatever it is), not a reference that outlives ``destroy_process_group``.
    """
    import torch.distributed.nn  # noqa: F401


def release_group_defaults() -> int:
    """Replace process groups captured as argument defaults by ``None`` (which means the default group).

    For scripts that imported ``torch.distributed.nn`` after ``init_process_group`` (DDP does so
    itself). Returns how many defaults were replaced.
    """
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:
        return 0
    from torch.distributed import ProcessGroup

    replaced = 0
    for value in vars(functional).values():
        defaults = getattr(value, "__defaults__", None)
        if not defaults or getattr(value, "__module__", None) != functional.__name__:
            continue
        if any(isinstance(default, ProcessGroup) for default in defaults):
            value.__defaults__ = tuple(None if isinstance(d, ProcessGroup) else d for d in defaults)
            replaced += 1
    return replaced


def collective_threads() -> int | None:
    """How many gloo worker threads this process still runs (None where /proc cannot tell)."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    count = 0
    for task in tasks.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended while we looked
        count += name in GLOO_THREAD_NAMES
    return count


def leave_process_group(timeout: float = 10.0) -> bool:
    """Destroy the default process group and wait for its worker threads; True when none remain.

    Drop every DDP model (and anything else holding the group) before calling it. A thread still
    stuck in a collective after a failure must not hang the rank, so destroying runs in a daemon
    thread bounded by ``timeout`` seconds.
    """
    import torch.distributed as dist

    release_group_defaults()
    gc.collect()  # DDP modules sit in reference cycles: free their reducers now
    if dist.is_available() and dist.is_initialized():
        closer = threading.Thread(target=dist.destroy_process_group, name="ddp-leave-group", daemon=True)
        closer.start()
        closer.join(timeout=timeout)
    gc.collect()
    return collective_threads() in (0, None)


class GroupSession:
    """The lifetime of one process group, from before ``init_process_group`` to its end.

    Whatever must let go of the group before it ends (an instrumentation's recorder and server)
    registers a closer with :meth:`on_leave`; :func:`ddp_trainer.instrument` does so by itself.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        # After leaving: True when no gloo thread outlived the group, False when one did, None when
        # /proc cannot tell or the session was abandoned.
        self.left: bool | None = None
        self.abandoned = False
        self._closers: list[Callable[[], None]] = []

    def on_leave(self, close: Callable[[], None]) -> None:
        """Call ``close`` when the session ends, before the group does (last registered, first called)."""
        self._closers.append(close)

    def abandon(self) -> None:
        """Do not end the group: this process is about to exit at once and skip finalization.

        For a rank whose own code failed: ending the group closes its connections, and the peers would
        then fail (and report their collateral exit) before this rank has recorded its own.
        """
        self.abandoned = True

    def leave(self) -> None:
        if self.abandoned:
            return
        while self._closers:
            self._closers.pop()()
        self.left = leave_process_group(self.timeout)


_sessions: list[GroupSession] = []


def active_session() -> GroupSession | None:
    """The innermost :func:`process_group_session` this process is in, if any."""
    return _sessions[-1] if _sessions else None


@contextlib.contextmanager
def process_group_session(timeout: float = 10.0) -> Iterator[GroupSession]:
    """Bracket a process group's life so that exiting afterwards cannot abort the process.

    Enter it before ``init_process_group`` and let go of the DDP model inside it (train in a function
    called from the block, or ``del`` the model): the group ends on the way out, its worker threads
    joined within ``timeout`` seconds, whether the block returned or raised. ``session.left`` then
    says whether the threads are gone; if not, end the process with :func:`exit_without_finalizing`.
    """
    import_group_defaults_early()
    session = GroupSession(timeout)
    _sessions.append(session)
    try:
        yield session
    finally:
        _sessions.remove(session)
        session.leave()


def exit_without_finalizing(code: int) -> NoReturn:
    """Exit now, skipping interpreter finalization (for when gloo threads outlived the group's end)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
