"""`ddpjob run`'s fetch: scrape every rank pod's /metrics in the background into the progress tracker.

Everything else (the reduction, the tracker, the line) is the operator's own ``ddp_operator.progress``;
only how the numbers are fetched differs: every pod, every second, on 127.0.0.1.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from ddp_operator.progress.exposition import PodScrape, reduce_text
from ddp_operator.progress.tracker import ProgressObservation, ProgressTracker


def fetch_metrics(port: int, timeout: float = 1.0) -> PodScrape | None:
    """One pod's numbers, or None while its endpoint is not up (starting, stopped, or already gone)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            return reduce_text(response.read().decode("utf-8", errors="replace"))
    except (OSError, ValueError):  # URLError and timeouts are OSErrors; ValueError: not our format
        return None


class Scraper:
    """Polls the current attempt's endpoints; the last answer of each pod survives its exit."""

    def __init__(
        self,
        tracker: ProgressTracker,
        on_progress: Callable[[ProgressTracker], None],
        interval: float = 1.0,
        fetch: Callable[[int], PodScrape | None] = fetch_metrics,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.tracker = tracker
        self._on_progress = on_progress
        self._interval = interval
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._targets: dict[int, int] = {}
        self._generation = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-scraper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set_targets(self, ports_by_rank: Mapping[int, int]) -> None:
        """A new attempt: new processes, new ports, counters from zero."""
        with self._lock:
            self._targets = dict(ports_by_rank)
            self._generation += 1
            self.tracker.reset()

    def forget(self, rank: int) -> None:
        """A rank exited: stop asking its port (another process may take it)."""
        with self._lock:
            self._targets.pop(rank, None)

    def scrape_once(self) -> None:
        with self._lock:
            targets = dict(self._targets)
            generation = self._generation
        answers = {rank: self._fetch(port) for rank, port in targets.items()}
        with self._lock:
            if generation != self._generation:  # an attempt ended meanwhile: these numbers are stale
                return
            live = {rank: m for rank, m in answers.items() if m is not None and rank in self._targets}
            self.tracker.record(self._clock(), live)
            self._on_progress(self.tracker)

    def scrape_rank(self, rank: int) -> None:
        """Scrape one pod now: its training just ended and its endpoint is about to go away."""
        with self._lock:
            port = self._targets.get(rank)
            generation = self._generation
        if port is None:
            return
        answer = self._fetch(port)
        with self._lock:
            if answer is not None and generation == self._generation:
                self.tracker.keep(rank, answer)

    def snapshot(self) -> dict[int, PodScrape]:
        with self._lock:
            return dict(self.tracker.latest)

    def stall_clock(self) -> ProgressObservation:
        """What the stall policy reads of this attempt: the furthest step and when a read first showed
        it, every rank's last step, the pace, the group's last change, whether training is over."""
        with self._lock:
            tracker = self.tracker
            return ProgressObservation(
                attempt=0,
                step=tracker.step,
                step_changed_at=tracker.step_changed_at or datetime.now(UTC),
                rank_steps=tracker.rank_steps(),
                step_seconds=tracker.step_seconds,
                group_changed_at=tracker.group_changed_at,
                finished=tracker.finished,
            )

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.scrape_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
