"""Stack dumps before a stalled gang is restarted: the ``DDP_STALL_TIMEOUT_SECONDS`` contract.

The operator restarts a gang that has made no synchronized step for ``runPolicy.stallTimeoutSeconds``
(reason Stalled) and passes that timeout to every rank. Before it acts, each rank still alive writes
every thread's Python stack to its own log (stderr), so the log of a hung gloo or NCCL collective
says where each rank was waiting. :class:`StallWatch` is a daemon thread that does that once no step
has completed for ``DUMP_FRACTION`` of the timeout, once per stall: a step that completes ends the
stall, and only the next one dumps again. A collective that is slow but whose steps still complete
within the fraction is not a stall and dumps nothing. The clock starts at the first completed step
(the operator, too, counts a stall only once training has started). While the same stall lasts, one
line says so at the full timeout and again each time its length doubles, so the log shows whether the
rank was still stuck when the operator acted (and, without one, how long it has been stuck) without
repeating the dump.

It reads the clock of the last step through a callable, so the step path pays one ``monotonic()``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Final, TextIO

# Dump at this fraction of the timeout: before the operator acts at the full timeout, with time left
# for the log line to be shipped.
DUMP_FRACTION: Final = 0.75
STALL_ENV: Final = "DDP_STALL_TIMEOUT_SECONDS"


def format_all_stacks() -> str:
    """Every thread's Python stack, named (``faulthandler`` prints no thread names)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f'Thread "{names.get(ident, "?")}" (id {ident}), most recent call last:\n')
        parts.extend(traceback.format_stack(frame))
    return "".join(parts)


class StallWatch:
    """Dumps every thread's stack to ``stream`` once per stall of ``timeout * DUMP_FRACTION`` seconds.

    ``last_step``: the monotonic time of the last completed step, None before the first.
    """

    def __init__(
        self,
        timeout: float,
        rank: int,
        last_step: Callable[[], float | None],
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.threshold = timeout * DUMP_FRACTION
        self.rank = rank
        self._last_step = last_step
        self._stream = stream
        self._clock = clock
        self._dumped_for: float | None = None
        self.dumps = 0
        # The stall's length at which the next "still stalled" line is due (the timeout, then doubled).
        self._next_note = timeout
        self._stop = threading.Event()
        self._poll = max(0.05, min(1.0, self.threshold / 10))
        self._thread = threading.Thread(target=self._run, name="ddp-stall-watch", daemon=True)

    def start(self) -> StallWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def check(self) -> bool:
        """Dump now if a stall began and was not dumped yet; True when it dumped. A stall already
        dumped gets its "still stalled" line when one is due."""
        last = self._last_step()
        if last is None:
            return False
        idle = self._clock() - last
        if last == self._dumped_for:
            self._note_still_stalled(idle)
            return False
        if idle < self.threshold:
            return False
        self._dumped_for = last
        self._next_note = self.timeout
        self.dumps += 1
        stream = self._stream if self._stream is not None else sys.stderr
        stream.write(
            f"ddp_trainer: rank {self.rank}: no training step completed for {idle:.1f} s "
            f"({STALL_ENV}={self.timeout:g}: the operator restarts a gang stalled that long); "
            "the Python stack of every thread follows\n"
            + format_all_stacks()
            + f"ddp_trainer: rank {self.rank}: end of the stack dump\n"
        )
        stream.flush()
        return True

    def _note_still_stalled(self, idle: float) -> None:
        if idle < self._next_note:
            return
        while self._next_note <= idle:  # a check that came late owes one line, not several
            self._next_note *= 2
        stream = self._stream if self._stream is not None else sys.stderr
        stream.write(
            f"ddp_trainer: rank {self.rank}: still no training step completed, for {idle:.1f} s "
            f"({STALL_ENV}={self.timeout:g}); the stacks were dumped above\n"
        )
        stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            try:
                self.check()
            except (OSError, ValueError):  # the log is gone (closed at exit): nothing to write to
                return
