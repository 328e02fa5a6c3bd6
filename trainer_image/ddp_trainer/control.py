"""Stopping together and failing fast: the SIGTERM flag, the collective watchdog, exit records."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Final

from ddp_trainer.exitcodes import EXIT_PEER_LOST

# Set by the launcher for its workers: where each failing worker records its exit code and time, so
# the launcher can tell which worker failed first.
EXIT_RECORD_ENV: Final = "DDP_TRAINER_EXIT_RECORD_DIR"


class StopFlag:
    """Set by SIGTERM (or SIGINT); the ranks combine it at step boundaries."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.event.is_set()


def write_exit_record(rank: int, exit_code: int) -> None:
    """Leave ``rank-<rank>.json`` for the launcher (only under a launcher; best effort)."""
    directory = os.environ.get(EXIT_RECORD_ENV)
    if not directory or exit_code == 0:
        return
    try:
        record = {"rank": rank, "exit_code": exit_code, "time_ns": time.time_ns()}
        path = Path(directory) / f"rank-{rank}.json"
        path.write_text(json.dumps(record))
    except OSError:
        pass


def read_exit_records(directory: Path) -> list[dict[str, Any]]:
    """The exit records the workers left in ``directory`` (unreadable ones skipped)."""
    records = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


class Watchdog:
    """Ends the process with EXIT_PEER_LOST when one guarded region (a collective) outlives its timeout.

    gloo and NCCL have their own collective timeouts, but a peer that hangs without closing its
    sockets, or a wedged device, can keep a rank waiting far longer; this thread does not rely on them.
    """

    def __init__(self, timeout: float, rank: int, poll_interval: float = 0.2) -> None:
        self.timeout = timeout
        self.rank = rank
        self.poll_interval = min(poll_interval, timeout / 4)
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ddp-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def guard(self, what: str) -> Iterator[None]:
        with self._lock:
            self._deadline = time.monotonic() + self.timeout
            self._what = what
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_interval)
            with self._lock:
                deadline, what = self._deadline, self._what
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"ddp_trainer: rank {self.rank} stuck in {what} for more than {self.timeout:g} s "
                    f"(a peer is gone or hung); exiting {EXIT_PEER_LOST}",
                    file=sys.stderr,
                    flush=True,
                )
                write_exit_record(self.rank, EXIT_PEER_LOST)
                os._exit(EXIT_PEER_LOST)
