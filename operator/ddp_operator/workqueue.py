"""A work queue of DDPJobs: one worker per dirty job, gathered pod events, and timers.

Anything that may change what a job should do (its own event, a pod event, a timer) only marks the
job dirty. One asyncio task per dirty job runs the reconcile callback until the job stays clean, so
reconciles of one job never overlap and a burst of pod events becomes one reconcile. Nothing here
knows what a reconcile does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final

from ddp_operator.kube_api import ApiError
from ddp_operator.podcache import JobKey

logger = logging.getLogger(__name__)

# How long pod events are gathered before a reconcile runs: ranks change together.
DEFAULT_BATCH_DELAY: Final = 0.05
# After a failed reconcile, try the job again after this long.
ERROR_RETRY_SECONDS: Final = 5.0


class JobQueue:
    """Dirty jobs and their workers. ``reconcile(key)`` runs on the loop; ``gather(key)`` says whether
    to wait ``batch_delay`` first (a job never reconciled has no pod events worth gathering)."""

    def __init__(
        self,
        reconcile: Callable[[JobKey], Awaitable[None]],
        *,
        ready: asyncio.Event,
        gather: Callable[[JobKey], bool],
        batch_delay: float = DEFAULT_BATCH_DELAY,
        observe_duration: Callable[[float], None] | None = None,
    ) -> None:
        self._reconcile = reconcile
        self._ready = ready
        self._gather = gather
        self.batch_delay = batch_delay
        self._observe_duration = observe_duration
        self._pending: set[JobKey] = set()
        self._workers: dict[JobKey, asyncio.Task[None]] = {}
        self._timers: dict[JobKey, tuple[float, asyncio.TimerHandle]] = {}

    def kick(self, key: JobKey) -> None:
        """Mark a job dirty; its worker reconciles it soon."""
        self._pending.add(key)
        if key not in self._workers:
            self._workers[key] = asyncio.get_running_loop().create_task(self._work(key))

    def kick_later(self, key: JobKey, seconds: float) -> None:
        """Reconcile again after ``seconds`` (deadlines, TTL, rate-limited status); the earliest wins."""
        loop = asyncio.get_running_loop()
        due = loop.time() + max(seconds, 0.0)
        existing = self._timers.get(key)
        if existing is not None:
            if existing[0] <= due:
                return
            existing[1].cancel()

        def fire() -> None:
            self._timers.pop(key, None)
            self.kick(key)

        self._timers[key] = (due, loop.call_at(due, fire))

    def forget(self, key: JobKey) -> None:
        self._pending.discard(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()

    def stop(self) -> None:
        for _, handle in self._timers.values():
            handle.cancel()
        for task in list(self._workers.values()):
            task.cancel()

    async def _work(self, key: JobKey) -> None:
        try:
            await self._ready.wait()
            while key in self._pending:
                if self._gather(key):
                    await asyncio.sleep(self.batch_delay)
                self._pending.discard(key)
                started = time.perf_counter()
                try:
                    await self._reconcile(key)
                except ApiError as error:
                    logger.warning("reconcile of %s/%s failed: %s; retrying", key[0], key[1], error)
                    self.kick_later(key, ERROR_RETRY_SECONDS)
                except Exception:
                    logger.exception("reconcile of %s/%s crashed; retrying", key[0], key[1])
                    self.kick_later(key, ERROR_RETRY_SECONDS)
                finally:
                    if self._observe_duration is not None:
                        self._observe_duration(time.perf_counter() - started)
        finally:
            self._workers.pop(key, None)
