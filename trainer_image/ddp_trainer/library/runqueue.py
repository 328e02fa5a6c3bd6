"""How long this process's gloo threads waited for a CPU: its own share of a stalled collective.

A rank that is starved of CPU (a CPU limit's throttling, a noisy neighbour on its cores) loses time
outside the collectives, which makes it late, and inside them: gloo's ring moves each chunk through
every rank's threads, so while a starved rank's gloo threads wait for a CPU every rank waits in the
collective, the starved one included, and its wait looks like everyone's. Linux counts, per thread,
the time it was ready to run but not running (``/proc/self/task/<tid>/schedstat``, second field;
throttling by a CPU limit is counted there too). The recorder reads gloo's threads when the step's
last collective is issued and again at the step's end: what they waited for a CPU in between is this
rank's stall of its peers (docs/metrics.md). Elsewhere (no ``/proc``, no schedstat) it reads nothing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

TASKS: Final = Path("/proc/self/task")
# torch names gloo's threads pt_gloo_runloop (the collectives) and gloo_tcp_loop (its transport).
GLOO_THREAD_MARK: Final = "gloo"
_NS_PER_S: Final = 1e9


class GlooThreadDelay:
    """Run-queue time of this process's gloo threads, read from descriptors kept open (~2 us a read)."""

    def __init__(self, tasks: Path = TASKS) -> None:
        self._tasks = tasks
        self._files: dict[str, int] = {}  # tid -> an open descriptor of its schedstat
        self._looked = False

    def _discover(self) -> None:
        self._looked = True
        try:
            tids = os.listdir(self._tasks)
        except OSError:
            return
        for tid in tids:
            try:
                name = (self._tasks / tid / "comm").read_text()
                if GLOO_THREAD_MARK in name:
                    self._files[tid] = os.open(self._tasks / tid / "schedstat", os.O_RDONLY)
            except OSError:
                continue

    def mark(self) -> dict[str, float]:
        """Every gloo thread's run-queue time so far (seconds); empty where there is nothing to read.

        The first call looks for the threads (gloo starts them when its process group is created).
        """
        if not self._looked:
            self._discover()
        marks = {}
        for tid, fd in list(self._files.items()):
            try:
                fields = os.pread(fd, 64, 0).split()
                marks[tid] = int(fields[1]) / _NS_PER_S
            except (OSError, IndexError, ValueError):  # the thread is gone (its process group ended)
                self._forget(tid)
        return marks

    def since(self, marks: dict[str, float]) -> float:
        """The longest any gloo thread waited for a CPU since ``marks``. Not the sum: a CPU limit
        throttles them all at once, and one stall would be counted once per thread."""
        now = self.mark()
        return max((now[tid] - before for tid, before in marks.items() if tid in now), default=0.0)

    def _forget(self, tid: str) -> None:
        fd = self._files.pop(tid)
        with contextlib.suppress(OSError):
            os.close(fd)

    def close(self) -> None:
        for tid in list(self._files):
            self._forget(tid)
