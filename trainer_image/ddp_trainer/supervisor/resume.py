"""A rank's resume bookkeeping: the seconds of kept steps, and what the in-place launcher reads.

- ``kept_step_seconds``: the seconds spent in the steps that the current training state includes.
  It is saved in every checkpoint and restored on resume, so the steps a restart redoes are counted
  once; rank 0 exports it as ``ddp_kept_step_seconds`` (the job's goodput is it over wall time,
  docs/metrics.md). A step's seconds run from the end of the step before (the first step of a run:
  from the loop's start), so data loading, checkpoints and the stop check count, start-up does not.
- Under the in-place launcher (docs/restarts.md), which sets ``DDP_TRAINER_PROGRESS_DIR``: the
  current step in a memory-mapped 8-byte file per rank (a store per step costs a microsecond), read by
  the launcher when it stops the workers for a restart, and, after the first step that follows an
  in-place restart (the launcher's ``restarts`` file there says how many the gang has made), a note
  saying when and from which step rank 0 resumed. From both the launcher exports the restart's resume
  time and the steps it redid.

Torch-free: the launcher reads these files too.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from ddp_trainer.supervisor.restarts import ResumeNote

PROGRESS_DIR_ENV: Final = "DDP_TRAINER_PROGRESS_DIR"
# The checkpoint field that carries kept_step_seconds.
KEPT_SECONDS_FIELD: Final = "kept_step_seconds"
_STEP: Final = struct.Struct("<q")


def restarts_path(directory: Path) -> Path:
    """The gang's in-place restarts before the round the workers run in (written by the launcher
    before it starts them: a forked worker does not see the launcher's later environment)."""
    return directory / "restarts"


def write_restarts(directory: Path, restarts: int) -> None:
    temporary = directory / "restarts.tmp"
    temporary.write_text(str(restarts))
    os.replace(temporary, restarts_path(directory))


def read_restarts(directory: Path) -> int:
    try:
        return int(restarts_path(directory).read_text())
    except (OSError, ValueError):
        return 0


def step_marker_path(directory: Path, rank: int) -> Path:
    return directory / f"step-{rank}"


def resume_note_path(directory: Path, rank: int) -> Path:
    return directory / f"resumed-{rank}.json"


class StepMarker:
    """This rank's current step, in a memory-mapped file that outlives the process."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _STEP.size)
            self._map = mmap.mmap(fd, _STEP.size)
        finally:
            os.close(fd)

    def set(self, step: int) -> None:
        _STEP.pack_into(self._map, 0, step)


def read_step_marker(path: Path) -> int | None:
    """The step a (possibly dead) rank last recorded, or None when it never did."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return int(_STEP.unpack_from(data)[0]) if len(data) >= _STEP.size else None


def read_resume_note(path: Path) -> ResumeNote | None:
    try:
        return ResumeNote.decode(path.read_text())
    except OSError:
        return None


class StepBook:
    """One rank's bookkeeping of its steps across resumes (see the module's docstring)."""

    def __init__(self, rank: int, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.rank = rank
        self.kept_seconds = 0.0
        directory = environ.get(PROGRESS_DIR_ENV)
        self._dir = Path(directory) if directory else None
        self._restarts = read_restarts(self._dir) if self._dir is not None else 0
        self._marker = StepMarker(step_marker_path(self._dir, rank)) if self._dir is not None else None
        self._resumed_step = 0
        self._note_due = self._dir is not None and self._restarts > 0 and rank == 0
        self._mark = time.perf_counter()

    def resumed(self, step: int, state: Mapping[str, object] | None) -> None:
        """The training state starts at ``step`` (0: from scratch), restored from ``state`` if any."""
        self._resumed_step = step
        kept = state.get(KEPT_SECONDS_FIELD) if state is not None else None
        self.kept_seconds = float(kept) if isinstance(kept, int | float) else 0.0
        if self._marker is not None:
            self._marker.set(step)

    def loop_started(self) -> None:
        self._mark = time.perf_counter()

    def step_done(self, step: int) -> None:
        now = time.perf_counter()
        self.kept_seconds += now - self._mark
        self._mark = now
        if self._marker is not None:
            self._marker.set(step)
        if self._note_due and self._dir is not None:
            self._note_due = False
            note = ResumeNote(restarts=self._restarts, time=time.time(), resumed_step=self._resumed_step)
            path = resume_note_path(self._dir, self.rank)
            temporary = path.with_suffix(".tmp")
            try:
                temporary.write_text(note.encode())
                os.replace(temporary, path)
            except OSError:
                pass  # bookkeeping only: the restart's resume time goes missing, training goes on

    def checkpoint_fields(self) -> dict[str, float]:
        return {KEPT_SECONDS_FIELD: self.kept_seconds}
