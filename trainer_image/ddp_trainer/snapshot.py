"""Survivors carry the state: each rank's last completed step, in memory that outlives the process.

In DDP every rank holds the whole training state after every step. Under the in-place launcher
(docs/restarts.md) each worker copies it, after each completed step, into a file of its pod's
launcher workspace (``/dev/shm`` when the pod has one: memory, never the disk). When the workers are
stopped for a restart (SIGKILL, a lost peer, a hang), the copies stay; the next round's workers agree
on the newest step any member holds and resume there: nothing completed is done again, and a member
without a copy (a replacement pod) receives it over the group's collective (``ddp_trainer.trainer``).

Each rank writes two slots in turn, so a worker killed in the middle of a copy leaves the slot before
it whole. A slot is ``[header][tensor bytes][skeleton]``: the skeleton is the state with every tensor
replaced by its place in the bytes (pickled; a few hundred bytes), and the header's sequence number
is written last, so a slot with a sequence number is complete. The write costs one memory copy of
the state per step, in one call into torch (docs/restarts.md gives the cost).

A state on a GPU is copied less often when a copy every step would cost more than
:data:`GPU_COPY_BUDGET` of the training time (:class:`CopyPacer`): the copy crosses to host memory at
~12 GB/s while the step runs in the GPU's own memory, so a large model's copy is several of its steps
(docs/benchmarks.md, "On a GPU"). The steps since the last copy are then redone after a recovery.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn

SNAPSHOT_DIR_ENV: Final = "DDP_TRAINER_SNAPSHOT_DIR"
# magic, format, sequence (0: incomplete), step, skeleton bytes, tensor bytes
_HEADER: Final = struct.Struct("<8sqqqqq")
_MAGIC: Final = b"ddpsnap1"
_SEQUENCE_OFFSET: Final = 16
_ALIGN: Final = 64
_FORMAT: Final = 2
# Where a slot's tensor bytes start: right after the header, aligned.
_DATA_START: Final = _ALIGN
# The share of the training time a GPU state's copies may take. A CPU state is copied after every step:
# the copy is one more pass over memory that the step itself reads and writes several times.
GPU_COPY_BUDGET: Final = 0.02


def copy_interval(copy_seconds: float, step_seconds: float, budget: float = GPU_COPY_BUDGET) -> int:
    """The fewest steps between two copies that keep one copy within ``budget`` of the steps' time, as
    a power of two: ranks that measure a little differently still copy at common steps (a resume loads
    each rank's own copy only where every rank holds the newest step)."""
    if step_seconds <= 0 or copy_seconds <= budget * step_seconds:
        return 1
    return 1 << math.ceil(math.log2(copy_seconds / (budget * step_seconds)))


@dataclass
class CopyPacer:
    """Which steps a rank copies its state after: every step, or for a state on a GPU (``paced``) every
    :func:`copy_interval` steps, measured again at every copy: the copy's own time against the wall
    time per step between the end of one copy and the start of the next."""

    paced: bool
    every: int = 1
    _last: tuple[int, float] | None = None  # (step, perf_counter) at the end of the last copy

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def copied(self, step: int, started: float, ended: float) -> int | None:
        """Record a copy after ``step`` that ran from ``started`` to ``ended``; the new interval when it
        changed, else None."""
        last, self._last = self._last, (step, ended)
        if not self.paced or last is None or step <= last[0]:
            return None
        every = copy_interval(ended - started, (started - last[1]) / (step - last[0]))
        if every == self.every:
            return None
        self.every = every
        return every


@dataclass(frozen=True)
class _TensorRef:
    """A tensor's place in a slot's bytes."""

    offset: int
    dtype: str  # torch's name of it ("float32"): the skeleton unpickles only plain types
    shape: tuple[int, ...]


def _aligned(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


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


@dataclass
class _Plan:
    """Where each tensor of a model and its optimizer goes in a slot; built again when the optimizer's
    state changes shape (its first step creates it)."""

    signature: tuple[int, ...]
    tensors: list[torch.Tensor]
    offsets: list[int]
    # The model's state dict and the optimizer's ``state`` with every tensor as its _TensorRef.
    layout: bytes
    size: int


def _signature(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return (len(optimizer.state), *(len(state) for state in optimizer.state.values()))


def _build_plan(model: nn.Module, optimizer: torch.optim.Optimizer) -> _Plan:
    tensors: list[torch.Tensor] = []
    offsets: list[int] = []
    end = 0

    def place(value: Any) -> Any:
        nonlocal end
        if not isinstance(value, torch.Tensor):
            return value
        tensors.append(value.detach())
        offsets.append(end)
        ref = _TensorRef(end, str(value.dtype).removeprefix("torch."), tuple(value.shape))
        end += _aligned(value.numel() * value.element_size())
        return ref

    model_refs = OrderedDict(
        (name, place(tensor)) for name, tensor in model.state_dict(keep_vars=True).items()
    )
    # The optimizer's state in its state_dict() form: parameters by their index across the groups.
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    optimizer_refs = {
        index[id(param)]: {key: place(value) for key, value in state.items()}
        for param, state in optimizer.state.items()
    }
    layout = pickle.dumps((model_refs, optimizer_refs), protocol=pickle.HIGHEST_PROTOCOL)
    return _Plan(_signature(optimizer), tensors, offsets, layout, end)


class _Slot:
    """One memory-mapped slot file, grown when the state grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None
        self._targets: tuple[_Plan, list[torch.Tensor]] | None = None

    def ensure(self, size: int) -> mmap.mmap:
        if self._map is None or len(self._map) < size:
            if self._map is not None:
                self._view, self._targets = None, None
                self._map.close()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self._view = torch.frombuffer(self._map, dtype=torch.uint8)
            self._targets = None
        return self._map

    def targets(self, plan: _Plan) -> list[torch.Tensor]:
        """Views of this slot's bytes shaped as the plan's tensors (made once per plan and mapping)."""
        if self._targets is None or self._targets[0] is not plan:
            assert self._view is not None
            views = []
            for tensor, offset in zip(plan.tensors, plan.offsets, strict=True):
                nbytes = tensor.numel() * tensor.element_size()
                raw = self._view[_DATA_START + offset : _DATA_START + offset + nbytes]
                views.append(raw.view(tensor.dtype).view(tensor.shape))
            self._targets = (plan, views)
        return self._targets[1]


class StateSnapshots:
    """This rank's two slots; :meth:`save` after every completed step."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._slots = [_Slot(slot_path(directory, rank, index)) for index in (0, 1)]
        self._sequence = max((read_header(slot.path) or (0, 0))[0] for slot in self._slots)
        self._plan: _Plan | None = None

    def save(
        self, step: int, fields: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """Copy the state after ``step`` completed steps: ``fields`` (plain values), the model's state
        dict and the optimizer's (:func:`load_slot` gives back the checkpoint's form of the three)."""
        plan = self._plan
        if plan is None or plan.signature != _signature(optimizer):
            plan = self._plan = _build_plan(model, optimizer)
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "_count": len(group["params"])}
            for group in optimizer.param_groups
        ]
        plain = pickle.dumps((fields, groups), protocol=pickle.HIGHEST_PROTOCOL)
        # [header][tensor bytes][skeleton]: the tensors' places stay put from step to step.
        skeleton_size = len(plan.layout) + len(plain)
        slot = self._slots[(self._sequence + 1) % 2]
        memory = slot.ensure(_DATA_START + plan.size + skeleton_size)
        # Incomplete until the sequence number is written, last.
        struct.pack_into("<q", memory, _SEQUENCE_OFFSET, 0)
        _copy_all(slot.targets(plan), plan.tensors)
        skeleton_at = _DATA_START + plan.size
        memory[skeleton_at : skeleton_at + skeleton_size] = plan.layout + plain
        self._sequence += 1
        _HEADER.pack_into(memory, 0, _MAGIC, _FORMAT, 0, step, skeleton_size, plan.size)
        struct.pack_into("<q", memory, _SEQUENCE_OFFSET, self._sequence)


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Every source into its target: one call into torch for all of them where torch has it (the
    per-tensor Python overhead is most of a small model's copy), else one copy_ each."""
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


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
    """The state a complete slot holds, as a checkpoint holds it (``fields``, ``model``, ``optimizer``),
    with its tensors copied out; None for an incomplete or unreadable slot."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    magic, version, sequence, _, skeleton_size, data_size = _HEADER.unpack_from(raw)
    skeleton_at = _DATA_START + data_size
    if magic != _MAGIC or version != _FORMAT or sequence <= 0 or len(raw) < skeleton_at + skeleton_size:
        return None
    try:
        stream = io.BytesIO(raw[skeleton_at : skeleton_at + skeleton_size])
        model_refs, optimizer_refs = _SkeletonUnpickler(stream).load()
        fields, groups = _SkeletonUnpickler(stream).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError):
        return None
    data = memoryview(raw)[_DATA_START:skeleton_at]
    first = 0
    param_groups = []
    for group in groups:
        count = group.pop("_count")
        param_groups.append({**group, "params": list(range(first, first + count))})
        first += count
    return {
        **fields,
        "model": _unflatten(model_refs, data),
        "optimizer": {"state": _unflatten(optimizer_refs, data), "param_groups": param_groups},
    }
