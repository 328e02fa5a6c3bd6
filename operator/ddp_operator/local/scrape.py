"""Scrape every rank pod's /metrics in the background and keep the progress line fresh."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from ddp_operator import promtext
from ddp_operator.local.progress import PodMetrics, ProgressTracker, pod_metrics


def fetch_metrics(port: int, timeout: float = 1.0) -> PodMetrics | None:
    """One pod's numbers, or None while its endpoint is not up (starting, or already gone)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
        return pod_metrics(promtext.parse(text))
    except (OSError, urllib.error.URLError, promtext.ParseError, ValueError):
        return None


class Scraper:
    """Polls the current attempt's endpoints; the last answer of each pod survives its exit."""

    def __init__(
        self,
        tracker: ProgressTracker,
        on_progress: Callable[[ProgressTracker], None],
        interval: float = 1.0,
        fetch: Callable[[int], PodMetrics | None] = fetch_metrics,
    ) -> None:
        self.tracker = tracker
        self._on_progress = on_progress
        self._interval = interval
        self._fetch = fetch
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
            self.tracker.record(time.monotonic(), live)
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
                self.tracker.latest[rank] = answer

    def snapshot(self) -> dict[int, PodMetrics]:
        with self._lock:
            return dict(self.tracker.latest)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            self.scrape_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
