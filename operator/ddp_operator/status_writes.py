"""When a status change is worth a write: the coalescing that keeps status writes per job near constant.

A status write is skipped when nothing changed; one that only moves counters (readyReplicas...) waits
until the counters stand still or a coarse refresh is due, and at most COUNTER_WRITES_PER_PHASE of them
go out per phase of an attempt, so status costs a constant whatever the number of ranks and however
long they take to start. A phase change always writes, with exact counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

# Status fields that only count ranks; a change to nothing else is a counter-only change.
COUNTER_KEYS: Final = frozenset({"replicas", "readyReplicas", "ready", "succeededReplicas", "failedReplicas"})
# Counter-only status writes allowed per phase of an attempt; the phase change itself writes exact counts.
COUNTER_WRITES_PER_PHASE: Final = 2
# Counters that keep moving are still written after this many status intervals (a long steady start-up).
REFRESH_INTERVALS: Final = 10.0


@dataclass
class HeldCounters:
    """One job's counter-only changes in the current phase of its attempt (the controller keeps one per
    job, in its job record, so it goes with the job)."""

    phase: tuple[Any, ...] | None = None
    spent: int = 0
    counters: tuple[Any, ...] | None = None  # the latest counters not written yet
    held_since: float = 0.0  # when the first of them was held back
    still_since: float = 0.0  # when they last changed

    def enter(self, phase: tuple[Any, ...]) -> None:
        """A new phase of an attempt starts with a new budget."""
        if self.phase != phase:
            self.phase, self.spent, self.counters = phase, 0, None
            self.held_since = self.still_since = 0.0


class CounterWrites:
    """When a status change that only moves counters (readyReplicas while ranks start or finish) is written.

    Such a change waits until the counters have stood still for `interval` seconds (progress stalled:
    the count a user needs to see is the one written) or have been held back for `refresh` seconds (a
    long, steady start-up still shows progress), and at most `budget` of them go out per phase of an
    attempt; once the budget is spent, counters wait for the next phase change, which always writes
    them exactly. Per job lifecycle that is at most `budget` writes per live phase, whatever the number
    of ranks and however long they take to start. `now` is a monotonic clock reading.
    """

    def __init__(
        self, interval: float, refresh: float | None = None, budget: int = COUNTER_WRITES_PER_PHASE
    ) -> None:
        self.interval = interval
        self.refresh = interval * REFRESH_INTERVALS if refresh is None else refresh
        self.budget = budget

    def due_in(
        self, held: HeldCounters, phase: tuple[Any, ...], counters: tuple[Any, ...], now: float
    ) -> float | None:
        """0: write now; a number of seconds: look again then; None: not in this phase (budget spent)."""
        held.enter(phase)
        if held.spent >= self.budget:
            return None
        if held.counters is None:
            held.held_since = now
        if counters != held.counters:
            held.counters, held.still_since = counters, now
        due = min(held.still_since + self.interval, held.held_since + self.refresh)
        return max(due - now, 0.0)

    def written(self, held: HeldCounters, phase: tuple[Any, ...], counter_only: bool) -> None:
        """A status write carrying the current counters went out."""
        held.enter(phase)
        held.counters = None
        if counter_only:
            held.spent += 1
