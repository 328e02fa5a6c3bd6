"""Survivors carry the state: each rank's last completed step, in memory that outlives the process.

In DDP every rank holds the whole training state after every step. Under the in-place launcher
(docs/restarts.md) each worker copies it, after each completed step, into a file of its pod's
launcher workspace (``/dev/shm`` when the pod has one: memory, never the disk). When the workers are
stopped for a restart (SIGKILL, a lost peer, a hang), the copies stay; the next round's workers agree
on the newest step any member holds and resume there: nothing completed is done again, and a member
without a copy (a replacement pod) receives it over the group's collective (``ddp_trainer.trainer``).

Each rank writes two slots in turn, so a worker killed in the middle of a copy leaves the slot before
it whole. A slot is ``[header][skeleton][tensor bytes]``: the skeleton is the state with every tensor
replaced by its place in the bytes (pickled; a few hundred bytes), and the header's sequence number
is written last, so a slot with a sequence number is complete. Torch-free apart from the tensors
themselves; the write costs one memory copy of the state per step (docs/restarts.md gives the cost).
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

SNAPSHOT_DIR_ENV: Final = "DDP_TRAINER_SNAPSHOT_DIR"
# magic, format, sequence (0: incomplete), step, skeleton bytes, tensor bytes
_HEADER: Final = struct.Struct("<8sqqqqq")
_MAGIC: Final = b"ddpsnap1"
_SEQUENCE_OFFSET: Final = 16
_ALIGN: Final = 64


@dataclass(frozen=True)
class _TensorRef:
    """A tensor's place in a slot's bytes."""

    offset: int
    dtype: str  # torch's name of it ("float32"): the skeleton unpickles only plain types
    shape: tuple[int, ...]


def _aligned(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


def _flatten(value: Any, tensors: list[torch.Tensor], offset: list[int]) -> Any:
    """``value`` with every tensor replaced by a _TensorRef, the tensors appended to ``tensors``."""
    if isinstance(value, torch.Tensor):
        ref = _TensorRef(offset[0], str(value.dtype).removeprefix("torch."), tuple(value.shape))
        tensors.append(value)
        offset[0] += _aligned(value.numel() * value.element_size())
        return ref
    if isinstance(value, dict):
        return type(value)((key, _flatten(item, tensors, offset)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return type(value)(_flatten(item, tensors, offset) for item in value)
    return value


def _unflatten(value: Any, data: memoryview) -> Any:
    if isinstance(value, _TensorRef):
        dtype = getattr(torch, value.dtype)
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"not a tensor type: {value.dtype}")
        tensor = torch.empty(value.shape, dtype=dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            raw = torch.frombuffer(bytearray(data[value.offset : value.offset + nbytes]), dtype=torch.uint8)
            tensor = raw.view(dtype).reshape(value.shape)
        return tensor
    if isinstance(value, dict):
        return type(value)((key, _unflatten(item, data)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return type(value)(_unflatten(item, data) for item in value)
    return value


class _Slot:
    """One memory-mapped slot file, grown when the state grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None

    def ensure(self, size: int) -> mmap.mmap:
        if self._map is None or len(self._map) < size:
            if self._map is not None:
                self._view = None
                self._map.close()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._view = torch.frombuffer(self._map, dtype=torch.uint8)
        return self._map

    @property
    def view(self) -> torch.Tensor:
        assert self._view is not None
        return self._view


class StateSnapshots:
    """This rank's two slots; :meth:`save` after every completed step."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._slots = [_Slot(slot_path(directory, rank, index)) for index in (0, 1)]
        self._sequence = max((read_header(slot.path) or (0, 0))[0] for slot in self._slots)

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Copy ``state`` (tensors, and plain values) as the state after ``step`` completed steps."""
        tensors: list[torch.Tensor] = []
        end = [0]
        skeleton = pickle.dumps(_flatten(state, tensors, end), protocol=pickle.HIGHEST_PROTOCOL)
        data_start = _aligned(_HEADER.size + len(skeleton))
        slot = self._slots[(self._sequence + 1) % 2]
        memory = slot.ensure(data_start + end[0])
        # Incomplete until the sequence number is written, last.
        struct.pack_into("<q", memory, _SEQUENCE_OFFSET, 0)
        memory[_HEADER.size : _HEADER.size + len(skeleton)] = skeleton
        view, offset = slot.view, data_start
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                source = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                view[offset : offset + nbytes].copy_(source, non_blocking=False)
            offset += _aligned(nbytes)
        self._sequence += 1
        _HEADER.pack_into(memory, 0, _MAGIC, 1, 0, step, len(skeleton), end[0])
        struct.pack_into("<q", memory, _SEQUENCE_OFFSET, self._sequence)


class _SkeletonUnpickler(pickle.Unpickler):
    """Plain values, ordered dicts and tensor places only: a slot never makes the reader run code."""

    _ALLOWED: Final = {("collections", "OrderedDict"), (__name__, "_TensorRef")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"a state snapshot may not hold {module}.{name}")
        return super().find_class(module, name)


def slot_path(directory: Path, rank: int, index: int) -> Path:
    return directory / f"state-{rank}.{index}"


def read_header(path: Path) -> tuple[int, int] | None:
    """(sequence, step) of a complete slot, or None."""
    try:
        with open(path, "rb") as file:
            raw = file.read(_HEADER.size)
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    magic, _, sequence, step, _, _ = _HEADER.unpack(raw)
    return (sequence, step) if magic == _MAGIC and sequence > 0 else None


def newest_slot(directory: Path) -> tuple[int, Path] | None:
    """(step, path) of the newest complete slot of any rank in ``directory``."""
    best: tuple[int, int, Path] | None = None
    for path in directory.glob("state-*.[01]"):
        header = read_header(path)
        if header is not None and (best is None or (header[1], header[0]) > (best[0], best[1])):
            best = (header[1], header[0], path)
    return None if best is None else (best[0], best[2])


def load_slot(path: Path) -> dict[str, Any] | None:
    """The state a complete slot holds (tensors copied out of it), or None."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    magic, _, sequence, _, skeleton_size, data_size = _HEADER.unpack_from(raw)
    if magic != _MAGIC or sequence <= 0:
        return None
    try:
        skeleton = _SkeletonUnpickler(io.BytesIO(raw[_HEADER.size : _HEADER.size + skeleton_size])).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError):
        return None
    data_start = _aligned(_HEADER.size + skeleton_size)
    state = _unflatten(skeleton, memoryview(raw)[data_start : data_start + data_size])
    return state if isinstance(state, dict) else None
