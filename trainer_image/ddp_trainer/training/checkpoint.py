"""Checkpoints on rank 0's volume: atomic writes (temporary file, fsync, rename, fsync of the directory).

A complete checkpoint is a file named ``ckpt-<step>.pt``; a temporary file never has that name, so a
crash in the middle of a write leaves at worst a stray ``.ckpt-*.tmp`` that the next write removes.

A checkpoint holds only tensors and plain values (dicts, lists, numbers, strings), and is loaded with
``torch.load(weights_only=True)``: unpickling anything else could run code from whoever can write to
the volume, so a file that needs more is refused like a corrupt one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Final

import torch

FORMAT_VERSION: Final = 1
_COMPLETE = re.compile(r"^ckpt-(\d{10})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:010d}.pt"


def complete_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _COMPLETE.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` (tensors and plain values only) as the checkpoint of ``step``; keep the ``keep``
    newest ones."""
    directory.mkdir(parents=True, exist_ok=True)
    for stray in directory.glob(".ckpt-*.tmp"):
        stray.unlink(missing_ok=True)
    target = checkpoint_path(directory, step)
    temporary = directory / f".{target.name}.{os.getpid()}.tmp"
    with open(temporary, "wb") as out:
        torch.save({"format_version": FORMAT_VERSION, **state}, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, target)
    _fsync_directory(directory)
    for _, old in complete_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return target


def load_newest_checkpoint(directory: Path) -> tuple[dict[str, Any], Path] | None:
    """The newest checkpoint that loads; an unreadable one (a torn volume) falls back to the one before."""
    for _, path in reversed(complete_checkpoints(directory)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a corrupt or unsafe file must not stop the job resuming an older one
            print(f"ddp_trainer: skipping unreadable checkpoint {path}: {error}", flush=True)
            continue
        if isinstance(state, dict) and state.get("format_version") == FORMAT_VERSION:
            return state, path
    return None
