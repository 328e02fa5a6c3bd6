"""Naming the rank everyone waits for, and where it lost its time (pure; no torch).

A gradient collective ends only once every rank has joined it, so the rank that arrives last waits
least and every other rank waits for it as long as it was late. Each rank therefore times its own
steps, on its own clock (no clock is compared across nodes), and splits each step (docs/metrics.md):

- ``wait``: blocked in the step's gradient collectives, from its arrival at the last of them (its
  last bucket handed to the collective) to the end of all of them;
- ``data``: from the end of the previous step (``Instrumentation.step()``) to the forward (data
  loading, the host-to-device copy, whatever the loop does between steps);
- ``comm``: in the comm hook before its collectives were under way (compression, issuing them);
- ``compute``: the rest (forward, backward, the optimizer);

and, beside them, its ``stall``: how long its gloo threads waited for a CPU (``ddp_trainer.library.runqueue``).
A rank starved of CPU also stalls the collectives themselves (every rank's threads relay gloo's
ring), and then its wait looks like everyone's: the part of its stall beyond its peers' typical one
is time the others waited for it inside the collective, so it counts as that rank's communication,
not as its wait.

Every few steps the ranks pool the sums of their window in one allreduce (:func:`pack`,
:func:`unpack`); rank 0 keeps the recent windows (:class:`History`) and :func:`attribute` names the
rank that waited least for the others, how much faster the job's step would be without it (the
next-latest rank would then set the pace), and the phase in which it spent more time than its peers.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

NO_STRAGGLER: Final = -1
# The phases a straggler can lose its time in, as ``ddp_straggler_phase`` names them.
PHASES: Final = ("data", "compute", "communication")
# Floats per rank in the exchange: steps, data, compute, comm, wait, stall, and the rank's pod (group).
SLOTS: Final = 7
# What a rank leaves in the slots of the others: the exchange combines by MAX and every real value
# is >= 0, so a rank's own values come through, and a rank that measured nothing shows as missing.
MISSING: Final = -1.0
# Rank 0 judges the newest windows that hold this many seconds of steps together: one window of a
# few short steps says more about the machine's scheduler than about a rank.
POOL_SECONDS: Final = 2.0
POOL_WINDOWS: Final = 256


@dataclass(frozen=True)
class Window:
    """One rank's steps over a window: how many, the seconds of each part, and its stall, summed.

    ``stall`` overlaps the parts (it is no part of the wall time): its gloo threads' run-queue time.
    """

    steps: int
    data: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    wait: float = 0.0
    stall: float = 0.0

    def __add__(self, other: Window) -> Window:
        return Window(
            steps=self.steps + other.steps,
            data=self.data + other.data,
            compute=self.compute + other.compute,
            comm=self.comm + other.comm,
            wait=self.wait + other.wait,
            stall=self.stall + other.stall,
        )

    def __sub__(self, other: Window) -> Window:
        return Window(
            steps=self.steps - other.steps,
            data=self.data - other.data,
            compute=self.compute - other.compute,
            comm=self.comm - other.comm,
            wait=self.wait - other.wait,
            stall=self.stall - other.stall,
        )

    @property
    def seconds(self) -> float:
        """Wall time of the window's steps."""
        return self.data + self.compute + self.comm + self.wait

    def per_step(self) -> Window:
        """The mean step (``steps`` 1); a window without steps stays as it is."""
        if self.steps <= 0:
            return self
        n = float(self.steps)
        return Window(1, self.data / n, self.compute / n, self.comm / n, self.wait / n, self.stall / n)

    def phase(self, name: str) -> float:
        """Seconds in one of PHASES."""
        return {"data": self.data, "compute": self.compute, "communication": self.comm}[name]


@dataclass(frozen=True)
class Straggler:
    """The rank the others wait for, its effect on the job's step, and where it lost its time.

    ``slowdown``: the job's step time now over the estimated step time without it (1.0: it holds
    nobody up); ``lateness``: the seconds per step the job would save.
    """

    rank: int
    slowdown: float
    phase: str
    lateness: float = 0.0


def step_parts(
    began: float, forward: float | None, buckets: Sequence[tuple[float, float, float]], ended: float
) -> Window:
    """One step of one rank on its own clock (seconds): a Window of one step.

    ``began``: the end of the previous step; ``forward``: the forward's start (None: not seen, e.g. a
    forward outside DDP); each bucket ``(entered, issued, done)``: when its gradients reached the comm
    hook, when its collective was under way, when it ended; ``ended``: this step's end.
    """
    total = max(ended - began, 0.0)
    data = min(max(forward - began, 0.0), total) if forward is not None else 0.0
    comm = sum(max(issued - entered, 0.0) for entered, issued, _ in buckets)
    wait = 0.0
    if buckets:
        arrived = max(issued for _, issued, _ in buckets)
        wait = max(max(done for _, _, done in buckets) - arrived, 0.0)
    comm = min(comm, total - data)
    wait = min(wait, total - data - comm)
    return Window(1, data=data, compute=total - data - comm - wait, comm=comm, wait=wait)


def pack(
    rank: int, world_size: int, window: Window | None, group: int, flags: Sequence[float]
) -> list[float]:
    """This rank's contribution to the exchange: its slots filled, the others' MISSING, flags last."""
    values = [MISSING] * (world_size * SLOTS) + [float(flag) for flag in flags]
    base = rank * SLOTS
    if window is not None and window.steps > 0:
        parts = (window.data, window.compute, window.comm, window.wait, window.stall)
        values[base : base + 6] = [float(window.steps), *(max(part, 0.0) for part in parts)]
    values[base + 6] = float(max(group, 0))
    return values


def unpack(values: Sequence[float], world_size: int) -> tuple[list[Window | None], list[int], list[float]]:
    """Every rank's window (None: it measured no step), every rank's group, and the combined flags."""
    windows: list[Window | None] = []
    groups: list[int] = []
    for rank in range(world_size):
        steps, data, compute, comm, wait, stall, group = values[rank * SLOTS : (rank + 1) * SLOTS]
        parts = (data, compute, comm, wait, stall)
        fine = steps >= 1 and all(math.isfinite(v) and v >= 0 for v in parts)
        windows.append(Window(int(steps), *parts) if fine else None)
        groups.append(int(group) if math.isfinite(group) and group >= 0 else rank)
    return windows, groups, list(values[world_size * SLOTS :])


class History:
    """Rank 0's recent pictures of every rank, pooled: the newest ones that hold ``pool_seconds``."""

    def __init__(self, pool_seconds: float = POOL_SECONDS, max_windows: int = POOL_WINDOWS) -> None:
        self.pool_seconds = pool_seconds
        self.max_windows = max_windows
        self._pictures: deque[list[Window]] = deque()  # oldest first
        self._pooled: list[Window] = []  # their sums, kept as they come and go

    def add(self, windows: Sequence[Window | None]) -> list[Window | None]:
        """Keep a complete picture and return the pool; an incomplete one is left out of it."""
        complete = [w for w in windows if w is not None]
        if len(complete) == len(windows) and complete:
            if len(self._pooled) != len(complete):
                self._pictures.clear()
                self._pooled = [Window(0)] * len(complete)
            self._pictures.append(complete)
            self._pooled = [a + b for a, b in zip(self._pooled, complete, strict=True)]
            while len(self._pictures) > 1 and (
                len(self._pictures) > self.max_windows or self._holds_without_oldest()
            ):
                oldest = self._pictures.popleft()
                self._pooled = [a - b for a, b in zip(self._pooled, oldest, strict=True)]
        if not self._pictures:
            return [None] * len(windows)
        return list(self._pooled)

    def _holds_without_oldest(self) -> bool:
        oldest = self._pictures[0]
        rest = (a.seconds - b.seconds for a, b in zip(self._pooled, oldest, strict=True))
        return statistics.median(rest) >= self.pool_seconds


def own_stalls(means: Sequence[Window]) -> list[float]:
    """Per rank, the part of its stall (per step) beyond the median of its peers', at most its wait:
    the time the others waited inside the collectives for this rank's threads to get a CPU. What
    every rank suffers (a busy machine) is nobody's."""
    ordered = sorted(m.stall for m in means)
    own = []
    for mean in means:
        typical = _median_without(ordered, mean.stall)
        own.append(min(max(mean.stall - typical, 0.0), mean.wait))
    return own


def _median_without(ordered: Sequence[float], value: float) -> float:
    """The median of sorted ``ordered`` without one occurrence of ``value`` (0 if nothing is left)."""
    left = len(ordered) - 1
    if left <= 0:
        return 0.0
    gone = bisect.bisect_left(ordered, value)

    def at(index: int) -> float:
        return ordered[index if index < gone else index + 1]

    middle = left // 2
    return at(middle) if left % 2 else (at(middle - 1) + at(middle)) / 2.0


def attribute(windows: Sequence[Window | None], groups: Sequence[int] | None = None) -> Straggler | None:
    """The rank the others wait for, or None while the picture is incomplete.

    ``windows[r]``: rank r's steps (None: it measured none, and then nobody is named: a partial
    picture could blame a rank against ranks never measured). ``groups[r]``: rank r's pod; without
    the straggler its whole pod is gone, so the next-latest rank is looked for in the other pods
    (ranks of one slow node are late together), or among the other ranks when one pod holds them all.
    """
    if len(windows) < 2 or any(w is None or w.steps <= 0 for w in windows):
        return None
    means = [w.per_step() for w in windows if w is not None]
    step = statistics.median(m.seconds for m in means)
    if not step > 0:
        return None
    stalls = own_stalls(means)
    # How long each rank waited for the others: its wait, less the time they waited for it in there.
    waited = [m.wait - stall for m, stall in zip(means, stalls, strict=True)]
    rank = min(range(len(means)), key=lambda r: (waited[r], r))
    peers = [r for r in range(len(means)) if r != rank]
    if groups is not None and len(groups) == len(means):
        other_pods = [r for r in peers if groups[r] != groups[rank]]
        peers = other_pods or peers
    # Without it, the peer that waited least would be the last to arrive: the others would wait that
    # much less, and so would the step.
    lateness = max(min(waited[r] for r in peers) - waited[rank], 0.0)
    without = max(step - lateness, step * 1e-6)

    def spent(r: int, phase: str) -> float:
        return means[r].phase(phase) + (stalls[r] if phase == "communication" else 0.0)

    excess = {
        phase: spent(rank, phase) - statistics.median(spent(r, phase) for r in peers) for phase in PHASES
    }
    phase = max(PHASES, key=lambda name: excess[name])
    return Straggler(rank=rank, slowdown=step / without, phase=phase, lateness=lateness)


def parse_stall_timeout(text: str | None) -> float | None:
    """``DDP_STALL_TIMEOUT_SECONDS``: None when unset or empty, else a positive number of seconds."""
    if text is None or not text.strip():
        return None
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive number of seconds, got {text!r}")
    return value
