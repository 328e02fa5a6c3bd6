"""The operator's fetch: pulls training progress from rank 0's metrics endpoint of every running job.

Every ``interval`` seconds, one GET of `http://<rank 0 pod IP>:<metrics port>/metrics` per tracked job,
``concurrency`` of them at once across all jobs, each with a short timeout: the cost grows with jobs
and the interval, never with ranks. Each answer is reduced (``exposition``) and recorded in the job's
tracker (``tracker``, one per attempt); the job is kicked only when what its status would show
changed, so a job whose numbers stand still costs no status write. While a stall is suspected (no new
step for half the job's stall timeout, ``policies.stall``), every rank's endpoint is read too, so a
Stalled restart can name the ranks furthest behind; and once more when decide() asks for it
(``Target.read_every_pod_at``: just before the stall falls due), whatever the interval, so the stall is
judged on a read of that moment. The rank pods need no token and no API access.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import urllib.request
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Final

from ddp_operator import ranks
from ddp_operator.podcache import JobKey
from ddp_operator.policies import stall
from ddp_operator.progress import render
from ddp_operator.progress.exposition import ExpositionReader, HealthCheck, PodScrape
from ddp_operator.progress.tracker import STRAGGLER_THRESHOLD, ProgressObservation, ProgressTracker

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS: Final = 15.0
DEFAULT_CONCURRENCY: Final = 16
FETCH_TIMEOUT_SECONDS: Final = stall.READ_TIMEOUT_SECONDS


@dataclass(frozen=True)
class Target:
    """Where one attempt of one job is read from."""

    attempt: int
    rank0_url: str
    pods: int
    world_size: int
    stall_timeout: int | None = None
    # Every pod of the attempt's endpoint, by pod name: read while a stall is suspected (every rank's
    # step) and when the round's membership is needed (a straggler sighted after the group changed).
    pod_urls: Mapping[str, str] = field(default_factory=dict)
    # An elastic job: its round may number its members otherwise than their pod ranks (ranks.py).
    elastic: bool = False
    # When decide() needs a read of every pod (policies.stall.read_due: a stall's verdict is judged on
    # it), read then whatever the interval; None: no such need.
    read_every_pod_at: datetime | None = None


@dataclass
class _Tracked:
    target: Target
    tracker: ProgressTracker
    observation: ProgressObservation | None = None
    # Rank 0's endpoint: a line unchanged since the last read is not parsed again.
    reader: ExpositionReader = field(default_factory=ExpositionReader)
    # Global rank -> pod name in the current round, as the pods' endpoints last said (ranks.py), and
    # when that read was.
    rank_pods: dict[int, str] = field(default_factory=dict)
    rank_pods_read_at: datetime | None = None
    # When the newest read of every pod started (it satisfies a read asked for at or before then).
    every_pod_read_at: datetime | None = None
    # One read of a job at a time: an asked-for read and the interval's never interleave their rounds.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


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
        straggler_threshold: float = STRAGGLER_THRESHOLD,
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
        # Set when a target asks for a read sooner than the loop would wake.
        self._wake = asyncio.Event()
        self._reads: set[asyncio.Task[None]] = set()
        self.scrapes = 0

    # ---- what the controller tells it and asks ------------------------------------------------

    def track(self, key: JobKey, target: Target) -> None:
        tracked = self._jobs.get(key)
        if tracked is None or tracked.target.attempt != target.attempt:
            # A new attempt: counters restart in new processes.
            tracker = ProgressTracker(target.pods, target.world_size, threshold=self.straggler_threshold)
            self._jobs[key] = _Tracked(target, tracker)
        else:
            tracked.target = target
        if target.read_every_pod_at is not None:
            self._wake.set()

    def untrack(self, key: JobKey) -> None:
        self._jobs.pop(key, None)

    def observation(self, key: JobKey) -> ProgressObservation | None:
        tracked = self._jobs.get(key)
        return tracked.observation if tracked is not None else None

    # ---- the loop ----------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for task in self._reads:
            task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _loop(self) -> None:
        next_round = self._clock() + timedelta(seconds=self.interval)
        while True:
            now = self._clock()
            if now >= next_round:
                next_round = now + timedelta(seconds=self.interval)
                self._spawn(self.scrape_all())
            self._spawn(self.read_asked())
            wake = min([next_round, *(at for at in map(_asked, self._jobs.values()) if at is not None)])
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, (wake - self._clock()).total_seconds()))

    def _spawn(self, work: Coroutine[object, object, None]) -> None:
        # Reads run beside the loop, so one that waits out a silent pod delays no other job's.
        task = asyncio.get_running_loop().create_task(work)
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(key) for key in list(self._jobs)), return_exceptions=True)

    async def read_asked(self) -> None:
        """Read every pod of each job whose target asked for it by now (Target.read_every_pod_at)."""
        now = self._clock()
        due = [
            key for key, tracked in self._jobs.items() if (at := _asked(tracked)) is not None and at <= now
        ]
        for key in due:  # asked for and under way: not asked again
            self._jobs[key].every_pod_read_at = now
        await asyncio.gather(*(self._scrape(key, every_pod=True) for key in due), return_exceptions=True)

    async def _get(self, url: str, reader: ExpositionReader | None = None) -> PodScrape | None:
        async with self._limit:
            try:
                text = await asyncio.get_running_loop().run_in_executor(self._pool, self._fetch, url)
                self.scrapes += 1
                return (reader or ExpositionReader()).reduce(text)
            except (OSError, ValueError) as error:  # not up yet, gone, or not our format
                logger.debug("progress scrape of %s failed: %s", url, error)
                return None

    async def _scrape(self, key: JobKey, every_pod: bool = False) -> None:
        tracked = self._jobs.get(key)
        if tracked is None:
            return
        async with tracked.lock:
            await self._read(key, tracked, every_pod)

    async def _read(self, key: JobKey, tracked: _Tracked, asked: bool) -> None:
        """One read of a job: rank 0's pod, and every pod when asked for (at once, beside rank 0's) or
        while a stall is suspected or the round's membership is needed (after rank 0's answer)."""
        target, every_pod = tracked.target, asked
        started = self._clock()
        others = (
            [name for name, url in target.pod_urls.items() if url != target.rank0_url] if every_pod else []
        )
        rank_zero, *answers = await asyncio.gather(
            self._get(target.rank0_url, tracked.reader), *(self._get(target.pod_urls[n]) for n in others)
        )
        if self._jobs.get(key) is not tracked or tracked.target.attempt != target.attempt:
            return
        now = self._clock()
        tracker = tracked.tracker
        if rank_zero is not None:
            tracker.record(now, {0: rank_zero})
        elif not every_pod or tracked.observation is None:
            return  # nothing new: rank 0's pod is not up yet, or gone
        answered = {name: a for name, a in zip(others, answers, strict=True) if a is not None}
        if every_pod and rank_zero is not None:
            answered.update(
                {name: rank_zero for name, url in target.pod_urls.items() if url == target.rank0_url}
            )
        stall_limit, since = stall.clock(
            target.stall_timeout, tracker.step_seconds, tracker.step_changed_at, tracker.group_changed_at
        )
        if tracker.finished:
            stall_limit = None
        suspected = stall.suspected(stall_limit, tracker.step, since, now)
        health = rank_zero.health if rank_zero is not None else None
        if not every_pod and (suspected or _members_needed(tracked, tracker, health)) and target.pod_urls:
            every_pod, started = True, now
            names = list(target.pod_urls)
            reads = await asyncio.gather(*(self._get(target.pod_urls[name]) for name in names))
            answered = {name: answer for name, answer in zip(names, reads, strict=True) if answer is not None}
        if every_pod:
            tracked.rank_pods = ranks.read_rank_pods(
                tracked.rank_pods, {name: sorted(answer.rank_steps) for name, answer in answered.items()}
            )
            tracked.rank_pods_read_at = tracked.every_pod_read_at = started
        # Every rank's step, for a stall's verdict: while one is suspected, and when asked for.
        judged = suspected or asked
        rank_steps = (
            {r: s for answer in answered.values() for r, s in answer.rank_steps.items()} if judged else {}
        )
        read_at = started if judged else None
        before = tracked.observation
        if rank_zero is None and before is not None:
            # Rank 0's pod did not answer an asked-for read (it may be the silent one): what it showed
            # last stands, and the read of the others is new.
            observation = replace(
                before, rank_steps=rank_steps, rank_steps_read_at=read_at, rank_pods=dict(tracked.rank_pods)
            )
        else:
            observation = ProgressObservation(
                attempt=target.attempt,
                step=tracker.step,
                step_changed_at=tracker.step_changed_at or now,
                status=render.status_progress(tracker.view(), health),
                straggler=tracker.straggler,
                rank_steps=rank_steps,
                rank_steps_read_at=read_at,
                step_seconds=tracker.step_seconds,
                group_changed_at=tracker.group_changed_at,
                finished=tracker.finished,
                restart=rank_zero.restart if rank_zero is not None else None,
                rank_pods=dict(tracked.rank_pods),
                health=health,
            )
        tracked.observation = observation
        # An asked-for read is what a verdict waits for: it is handed on even when it shows nothing new.
        if before is None or _shown(before) != _shown(observation) or asked:
            self._on_change(key)


def _asked(tracked: _Tracked) -> datetime | None:
    """When the target asked for a read of every pod that no read since has given; None: none."""
    at = tracked.target.read_every_pod_at
    done = tracked.every_pod_read_at
    return None if at is None or (done is not None and done >= at) else at


def _members_needed(tracked: _Tracked, tracker: ProgressTracker, health: HealthCheck | None) -> bool:
    """An elastic job's straggler is sighted, or its last health check named a slow rank, and the
    membership that names that rank's pod is unknown or older than the group's last change (a round
    numbers its members anew; a fixed-size job's never does)."""
    if not tracked.target.elastic:
        return False
    sighting = tracker.straggler
    ranks = {
        r
        for r in (sighting.rank if sighting else None, health.slow_rank if health else None)
        if r is not None
    }
    if not ranks:
        return False
    read_at, changed_at = tracked.rank_pods_read_at, tracker.group_changed_at
    stale = read_at is None or (changed_at is not None and changed_at > read_at)
    return stale or not ranks <= tracked.rank_pods.keys()


def _shown(observation: ProgressObservation) -> tuple[object, ...]:
    """What a status write would carry, without the time it was read (which always moves)."""
    status = {k: v for k, v in (observation.status or {}).items() if k != "observedTime"}
    straggler = (observation.straggler.rank, observation.straggler.phase) if observation.straggler else None
    restart = observation.restart
    # A restart's count and phases (not the kept time, which moves with every step as the step does).
    restart_shown = (
        (
            restart.restarts,
            restart.stopped_at,
            restart.reformed_at,
            restart.resumed_at,
            restart.any_resumed_at,
        )
        if restart
        else None
    )
    return (
        observation.step,
        sorted(status.items()),
        straggler,
        sorted(observation.rank_steps.items()),
        sorted(observation.rank_pods.items()),
        restart_shown,
        observation.health,
    )
