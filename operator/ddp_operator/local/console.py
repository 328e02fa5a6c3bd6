"""One place that writes to the terminal, so rank logs and the progress line never interleave.

On a TTY the progress line is a single line redrawn in place at the bottom, with log lines printed
above it; elsewhere (CI logs, pipes) it is printed as a plain line every so often.
"""

from __future__ import annotations

import threading
import time
from typing import TextIO

_CLEAR_LINE = "\r\x1b[2K"


class Console:
    def __init__(self, stream: TextIO, *, live: bool, plain_interval: float = 10.0) -> None:
        self._stream = stream
        self._live = live
        self._plain_interval = plain_interval
        self._lock = threading.Lock()
        self._status = ""
        self._last_plain = 0.0

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (BrokenPipeError, ValueError):  # a closed pipe must not stop the supervisor
            pass

    def line(self, text: str) -> None:
        """A log line (a rank's output or ddpjob's own message)."""
        with self._lock:
            if self._live and self._status:
                self._write(f"{_CLEAR_LINE}{text}\n{self._status}")
            else:
                self._write(f"{text}\n")

    def rank_line(self, rank: int, text: str) -> None:
        self.line(f"[rank {rank}] {text}")

    def note(self, text: str) -> None:
        self.line(f"[ddpjob] {text}")

    def status(self, text: str, *, now: float | None = None) -> None:
        """The progress line: redrawn on a TTY, printed at most every plain_interval otherwise."""
        with self._lock:
            if self._live:
                self._status = text
                self._write(f"{_CLEAR_LINE}{text}")
                return
            moment = time.monotonic() if now is None else now
            if moment - self._last_plain >= self._plain_interval:
                self._last_plain = moment
                self._write(f"[progress] {text}\n")

    def clear_status(self) -> None:
        with self._lock:
            if self._live and self._status:
                self._write(_CLEAR_LINE)
            self._status = ""
