"""Pulls training progress from rank 0's metrics endpoint of every running job (never pushed by pods).

Every ``interval`` seconds, one GET of `http://<rank 0 pod IP>:<metrics port>/metrics` per tracked job,
``concurrency`` of them at once across all jobs, each with a short timeout: the cost grows with jobs
and the interval, never with ranks. Each answer is reduced (progress.py, pure) and kept with the one
before it (for rates); the job is kicked only when what its status would show changed, so a job whose
numbers stand still costs no status write. While a stall is suspected (no new step for half the
job's stall timeout), every rank's endpoint is read too, so a Stalled restart can name the ranks
furthest behind. The rank pods need no token and no API access for any of this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Final

from ddp_operator import progress, promtext
from ddp_operator.podcache import JobKey

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS: Final = 15.0
DEFAULT_CONCURRENCY: Final = 16
FETCH_TIMEOUT_SECONDS: Final = 3.0


@dataclass(frozen=True)
class Target:
    """Where one attempt of one job is read from."""

    attempt: int
    rank0_url: str
    pods: int
    world_size: int
    stall_timeout: float | None = None
    rank_urls: Mapping[int, str] = field(default_factory=dict)


@dataclass
class _Tracked:
    target: Target
    newest: progress.RankZeroScrape | None = None
    older: progress.RankZeroScrape | None = None
    observation: progress.ProgressObservation | None = None


def fetch_text(url: str, timeout: float = FETCH_TIMEOUT_SECONDS) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text: str = response.read().decode("utf-8", errors="replace")
        return text


class ProgressScraper:
    def __init__(
        self,
        on_change: Callable[[JobKey], None],
        interval: float = DEFAULT_INTERVAL_SECONDS,
        concurrency: int = DEFAULT_CONCURRENCY,
        straggler_threshold: float = 1.5,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        fetch: Callable[[str], str] = fetch_text,
    ) -> None:
        self._on_change = on_change
        self.interval = interval
        self.straggler_threshold = straggler_threshold
        self._clock = clock
        self._fetch = fetch
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="scrape"
        )
        self._limit = asyncio.Semaphore(concurrency)
        self._jobs: dict[JobKey, _Tracked] = {}
        self._task: asyncio.Task[None] | None = None
        self.scrapes = 0

    # ---- what the controller tells it and asks ------------------------------------------------

    def track(self, key: JobKey, target: Target) -> None:
        tracked = self._jobs.get(key)
        if tracked is None or tracked.target.attempt != target.attempt:
            self._jobs[key] = _Tracked(target)  # a new attempt: counters restart in new processes
        else:
            tracked.target = target

    def untrack(self, key: JobKey) -> None:
        self._jobs.pop(key, None)

    def observation(self, key: JobKey) -> progress.ProgressObservation | None:
        tracked = self._jobs.get(key)
        return tracked.observation if tracked is not None else None

    def tracked(self) -> list[JobKey]:
        return list(self._jobs)

    # ---- the loop ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape_all()

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(key) for key in list(self._jobs)), return_exceptions=True)

    async def _get(self, url: str) -> list[promtext.Sample] | None:
        async with self._limit:
            try:
                text = await asyncio.get_running_loop().run_in_executor(self._pool, self._fetch, url)
                self.scrapes += 1
                return promtext.parse(text)
            except (OSError, ValueError) as error:  # not up yet, gone, or not our format
                logger.debug("progress scrape of %s failed: %s", url, error)
                return None

    async def _scrape(self, key: JobKey) -> None:
        tracked = self._jobs.get(key)
        if tracked is None:
            return
        target = tracked.target
        samples = await self._get(target.rank0_url)
        if samples is None or self._jobs.get(key) is not tracked or tracked.target.attempt != target.attempt:
            return
        now = self._clock()
        scrape = progress.reduce_scrape(samples, now)
        tracked.older, tracked.newest = tracked.newest, scrape
        before = tracked.observation
        step = int(scrape.steps or 0)
        changed_at = before.step_changed_at if before is not None and before.step == step else now
        observation = progress.ProgressObservation(
            attempt=target.attempt,
            step=step,
            step_changed_at=changed_at,
            status=progress.progress_status(scrape, tracked.older, target.pods, target.world_size),
            straggler=progress.follow_straggler(
                before.straggler if before else None, scrape, self.straggler_threshold
            ),
        )
        if (
            target.stall_timeout
            and step > 0
            and (now - changed_at).total_seconds() >= target.stall_timeout / 2
        ):
            observation = replace(observation, rank_steps=await self._rank_steps(target))
        tracked.observation = observation
        if before is None or _shown(before) != _shown(observation):
            self._on_change(key)

    async def _rank_steps(self, target: Target) -> dict[int, int]:
        """Every rank's step, read from each pod's endpoint (its local ranks' furthest)."""
        answers = await asyncio.gather(*(self._get(url) for url in target.rank_urls.values()))
        steps: dict[int, int] = {}
        for samples in answers:
            for rank, value in promtext.by_rank(samples or [], progress.STEPS).items():
                if rank.isdigit():
                    steps[int(rank)] = int(value)
        return steps


def _shown(observation: progress.ProgressObservation) -> tuple[object, ...]:
    """What a status write would carry, without the time it was read (which always moves)."""
    status = {k: v for k, v in (observation.status or {}).items() if k != "observedTime"}
    straggler = observation.straggler.rank if observation.straggler else None
    return (observation.step, sorted(status.items()), straggler, sorted(observation.rank_steps.items()))
