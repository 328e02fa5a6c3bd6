"""The controller: event-driven reconciles of DDPJobs from cached observations.

kopf delivers DDPJob events (handlers.py); the pod cache (podcache.py) delivers rank-pod changes. Both
only mark a job dirty. One worker task per dirty job runs `reconcile.decide()` on what the caches hold and
executes its Decision through kube_api, so reconciles of one job never overlap and a burst of pod events
becomes one reconcile. Nothing here LISTs: the only LIST is the pod cache's, once per namespace at start.

Writes per job lifecycle are kept near the floor the benchmark measures (R pods + 1 Service + a few):
- a status write is skipped when nothing changed; one that only moves counters (readyReplicas...) waits
  until the counters stand still or a coarse refresh is due, and at most COUNTER_WRITES_PER_PHASE of
  them go out per phase of an attempt (CounterWrites), so status costs a constant whatever R is and
  however long ranks take to start;
- an Event is posted only when the phase changes;
- the Service (and PVC) are created once per job per process, not once per reconcile.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from ddp_operator import builders, names
from ddp_operator.kube_api import (
    ApiError,
    ChildInvalid,
    ForeignObjectExists,
    JsonDict,
    KubeApi,
    PodCreateForbidden,
    merge_patch_for,
)
from ddp_operator.observe import format_time, parse_time
from ddp_operator.podcache import JobKey, PodCache
from ddp_operator.spec import JobSpec, SpecError, parse_job

if TYPE_CHECKING:
    from ddp_operator.metrics import OperatorMetrics
    from ddp_operator.reconcile import Decision

logger = logging.getLogger(__name__)

# How long pod events are gathered before a reconcile runs: ranks change together. A job's first
# reconcile (no status yet) does not wait: it has no pods yet, and its creates are what users wait for.
DEFAULT_BATCH_DELAY = 0.05
# After an API error other than the typed ones, try the job again after this long.
ERROR_RETRY_SECONDS = 5.0
# A child name held by an object that is not ours (an old job of the same name being collected).
FOREIGN_RETRY_SECONDS = 2.0
# Status fields that only count ranks; a change to nothing else is a counter-only change.
COUNTER_KEYS: Final = frozenset({"replicas", "readyReplicas", "ready", "succeededReplicas", "failedReplicas"})
# Counter-only status writes allowed per phase of an attempt; the phase change itself writes exact counts.
COUNTER_WRITES_PER_PHASE: Final = 2
# Counters that keep moving are still written after this many status intervals (a long steady start-up).
REFRESH_INTERVALS: Final = 10.0


@dataclass
class _HeldCounters:
    phase: tuple[Any, ...]
    spent: int = 0
    counters: tuple[Any, ...] | None = None  # the latest counters not written yet
    held_since: float = 0.0  # when the first of them was held back
    still_since: float = 0.0  # when they last changed


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
        self._jobs: dict[JobKey, _HeldCounters] = {}

    def due_in(
        self, key: JobKey, phase: tuple[Any, ...], counters: tuple[Any, ...], now: float
    ) -> float | None:
        """0: write now; a number of seconds: look again then; None: not in this phase (budget spent)."""
        held = self._jobs.get(key)
        if held is None or held.phase != phase:
            held = self._jobs[key] = _HeldCounters(phase)
        if held.spent >= self.budget:
            return None
        if held.counters is None:
            held.held_since = now
        if counters != held.counters:
            held.counters, held.still_since = counters, now
        due = min(held.still_since + self.interval, held.held_since + self.refresh)
        return max(due - now, 0.0)

    def written(self, key: JobKey, phase: tuple[Any, ...], counter_only: bool) -> None:
        """A status write carrying the current counters went out."""
        held = self._jobs.get(key)
        if held is None or held.phase != phase:
            held = self._jobs[key] = _HeldCounters(phase)
        held.counters = None
        if counter_only:
            held.spent += 1

    def forget(self, key: JobKey) -> None:
        self._jobs.pop(key, None)


def _resource_version(obj: Mapping[str, Any]) -> int | None:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion", ""))
    except ValueError:
        return None


def job_key(body: Mapping[str, Any]) -> JobKey:
    meta = body.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


class Controller:
    def __init__(
        self,
        api: KubeApi,
        namespaces: Sequence[str] | None = None,
        status_interval: float = 1.0,
        batch_delay: float = DEFAULT_BATCH_DELAY,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.api = api
        self.jobs: dict[JobKey, JsonDict] = {}
        self.pods = PodCache(api, namespaces, on_change=self.kick)
        self.metrics: OperatorMetrics | None = None
        self.status_interval = status_interval
        self.batch_delay = batch_delay
        self.clock = clock
        self._pending: set[JobKey] = set()
        self._workers: dict[JobKey, asyncio.Task[None]] = {}
        self._timers: dict[JobKey, tuple[float, asyncio.TimerHandle]] = {}
        self.counter_writes = CounterWrites(status_interval)
        # (namespace, name, uid, Service ports) whose Service and PVC exist: created once per job per
        # process, and again (the Service patched) when a resumed job changed its ports.
        self._services_ready: set[tuple[str, str, str, str]] = set()
        # Jobs whose creates wait for a child name held by an object that is not theirs.
        self._timers_foreign: set[JobKey] = set()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self.api.warm_up()
        await self.pods.start()

    async def stop(self) -> None:
        self.pods.stop()
        for _, handle in self._timers.values():
            handle.cancel()
        for task in list(self._workers.values()):
            task.cancel()

    def phase_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for body in list(self.jobs.values()):
            phase = str((body.get("status") or {}).get("phase", ""))
            counts[phase] = counts.get(phase, 0) + 1
        return counts

    # ---- inputs ------------------------------------------------------------------------------

    def job_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A DDPJob event from kopf's watch (type None: kopf's initial listing)."""
        key = job_key(body)
        if event_type == "DELETED":
            self._forget(key)
            return
        current = self.jobs.get(key)
        if current is not None:
            same_job = (current.get("metadata") or {}).get("uid") == (body.get("metadata") or {}).get("uid")
            new_version, old_version = _resource_version(body), _resource_version(current)
            # Our own status answer may be newer than an event still in flight.
            if same_job and new_version is not None and old_version is not None and new_version < old_version:
                return
            if not same_job:
                self._forget(key)
        self.jobs[key] = dict(body)
        self.kick(key)

    def _forget(self, key: JobKey) -> None:
        body = self.jobs.pop(key, None)
        self._pending.discard(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()
        self.counter_writes.forget(key)
        self._timers_foreign.discard(key)
        self.pods.forget_job(key)
        if body is not None:
            uid = str((body.get("metadata") or {}).get("uid", ""))
            self._services_ready = {
                ready for ready in self._services_ready if ready[:3] != (key[0], key[1], uid)
            }

    def kick(self, key: JobKey) -> None:
        """Mark a job dirty; its worker reconciles it soon (pods of unknown jobs wait for the job event)."""
        if key not in self.jobs:
            return
        self._pending.add(key)
        if key not in self._workers:
            self._workers[key] = asyncio.get_running_loop().create_task(self._work(key))

    def kick_later(self, key: JobKey, seconds: float) -> None:
        """Reconcile again after `seconds` (deadlines, TTL, rate-limited status); the earliest wins."""
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

    # ---- the worker --------------------------------------------------------------------------

    async def _work(self, key: JobKey) -> None:
        try:
            await self.pods.synced.wait()
            while key in self._pending:
                if self._has_status(key):
                    await asyncio.sleep(self.batch_delay)
                self._pending.discard(key)
                started = time.perf_counter()
                try:
                    await self.reconcile(key)
                except ApiError as error:
                    logger.warning("reconcile of %s/%s failed: %s; retrying", key[0], key[1], error)
                    self.kick_later(key, ERROR_RETRY_SECONDS)
                except Exception:
                    logger.exception("reconcile of %s/%s crashed; retrying", key[0], key[1])
                    self.kick_later(key, ERROR_RETRY_SECONDS)
                finally:
                    if self.metrics is not None:
                        self.metrics.reconcile_duration.observe(time.perf_counter() - started)
        finally:
            self._workers.pop(key, None)

    def _has_status(self, key: JobKey) -> bool:
        """False for a job never reconciled: it has no pods whose events could be gathered first."""
        return bool((self.jobs.get(key) or {}).get("status"))

    async def reconcile(self, key: JobKey) -> None:
        from ddp_operator.reconcile import decide

        body = self.jobs.get(key)
        if body is None:
            return
        status: Mapping[str, Any] = body.get("status") or {}
        try:
            job = parse_job(body)
        except SpecError as error:
            await self._fail_invalid(key, body, error)
            return
        decision = decide(job, status, self.pods.pods_of(key), self.clock())
        await self.execute(key, body, job, decision)

    # ---- executing a decision ----------------------------------------------------------------

    async def execute(self, key: JobKey, body: JsonDict, job: JobSpec, decision: Decision) -> None:
        """Carry out a Decision in the order reconcile.py fixes (its module docstring)."""
        from ddp_operator.reconcile import child_invalid, pod_create_forbidden

        old_status: Mapping[str, Any] = body.get("status") or {}
        if decision.delete_pods:
            deleted = await self.api.delete_children(job.namespace, "Pod", list(decision.delete_pods))
            for _, remains in deleted:
                if remains is not None:
                    self.pods.remember(remains)

        if decision.create_ranks:
            refused = await self._create_attempt(key, job, decision)
            if refused is not None:
                refusal, child, rank = refused
                message = refusal.message or refusal.reason
                if isinstance(refusal, PodCreateForbidden):
                    decision = pod_create_forbidden(
                        job, old_status, rank, decision.create_attempt, message, self.clock()
                    )
                else:
                    decision = child_invalid(
                        job, old_status, child, decision.create_attempt, message, self.clock()
                    )
            elif key in self._timers_foreign:
                return  # a name is still held by an old job's pod: the status waits with the creates

        body = await self._write_status(key, body, old_status, decision)

        if decision.delete_job:
            await self.api.delete_job(job.namespace, job.name, job.uid)
            return
        if decision.requeue_after is not None:
            self.kick_later(key, decision.requeue_after)

    async def _write_status(
        self, key: JobKey, body: JsonDict, old_status: Mapping[str, Any], decision: Decision
    ) -> JsonDict:
        if not decision.status_changed:
            return body
        patch = merge_patch_for(old_status, decision.status)
        if not patch:
            return body
        old_phase, new_phase = str(old_status.get("phase", "")), decision.phase
        phase_changed = old_phase != new_phase
        phase_of_attempt = (decision.status.get("attempt"), new_phase)
        counter_only = not decision.create_ranks and patch.keys() <= COUNTER_KEYS
        if counter_only:
            counters = tuple(decision.status.get(field) for field in sorted(COUNTER_KEYS))
            due_in = self.counter_writes.due_in(key, phase_of_attempt, counters, time.monotonic())
            if due_in is None:
                return body
            if due_in > 0:
                self.kick_later(key, due_in)
                return body
        namespace, name = key
        stored = await self.api.patch_job_status(namespace, name, patch)
        self.counter_writes.written(key, phase_of_attempt, counter_only)
        self.job_event("MODIFIED", stored)
        body = self.jobs.get(key, stored)
        if decision.gang_restart and self.metrics is not None:
            self.metrics.gang_restarts.inc()
        if phase_changed:
            self._observe_phase_change(body, old_phase, new_phase)
            if decision.event is not None:
                await self._post_event(
                    body, decision.event.type, decision.event.reason, decision.event.message
                )
        return body

    def _observe_phase_change(self, body: Mapping[str, Any], old: str, new: str) -> None:
        if self.metrics is None:
            return
        if new != names.PHASE_RUNNING:
            return
        status = body.get("status") or {}
        if int(status.get("restarts", 0) or 0) != 0:
            return
        created = parse_time((body.get("metadata") or {}).get("creationTimestamp"))
        if created is not None:
            self.metrics.time_to_running.observe(max((self.clock() - created).total_seconds(), 0.0))

    async def _create_attempt(
        self, key: JobKey, job: JobSpec, decision: Decision
    ) -> tuple[PodCreateForbidden | ChildInvalid, str, int] | None:
        """The Service, PVC and missing rank pods.

        Returns (the refusal, which child, its rank or -1) when the apiserver refused a pod with 403 or
        any child as invalid: both are permanent, so the job fails instead of retrying forever.
        """
        self._timers_foreign.discard(key)
        service = builders.build_service(job) if decision.create_service else None
        # The ports are part of the identity: a job resumed with new ports gets its Service updated.
        ports = json.dumps((service or {}).get("spec", {}).get("ports"), sort_keys=True)
        identity = (job.namespace, job.name, job.uid, ports)
        if identity not in self._services_ready:
            children: list[JsonDict] = [service] if service is not None else []
            pvc = builders.build_checkpoint_pvc(job) if decision.create_pvc else None
            if pvc is not None:
                children.append(pvc)
            report = await self.api.create_children(children, job.uid)
            if isinstance(report.error, ForeignObjectExists):
                self._foreign(key, job, report.error)
                return None
            if isinstance(report.error, ChildInvalid):
                kind = (report.failed or {}).get("kind")
                return report.error, "the Service" if kind == "Service" else "the checkpoint PVC", -1
            if report.error is not None:
                raise report.error
            self._services_ready.add(identity)

        def on_result(pod: JsonDict, created: bool) -> None:
            self.pods.remember(pod)
            if created and self.metrics is not None:
                self.metrics.pods_created.inc()

        pods = [builders.build_rank_pod(job, rank, decision.create_attempt) for rank in decision.create_ranks]
        report = await self.api.create_children(pods, job.uid, on_result=on_result)
        if isinstance(report.error, PodCreateForbidden | ChildInvalid):
            labels = ((report.failed or {}).get("metadata") or {}).get("labels") or {}
            rank = int(labels.get(names.LABEL_RANK, decision.create_ranks[0]))
            return report.error, f"rank {rank}'s pod", rank
        if isinstance(report.error, ForeignObjectExists):
            self._foreign(key, job, report.error)
            return None
        if report.error is not None:
            raise report.error
        return None

    def _foreign(self, key: JobKey, job: JobSpec, error: ForeignObjectExists) -> None:
        logger.info("%s/%s: %s; waiting for it to go", job.namespace, job.name, error.message)
        self._timers_foreign.add(key)
        self.kick_later(key, FOREIGN_RETRY_SECONDS)

    async def _fail_invalid(self, key: JobKey, body: JsonDict, error: SpecError) -> None:
        """A manifest the CRD let through but the operator cannot run (e.g. an older CRD)."""
        status: Mapping[str, Any] = body.get("status") or {}
        if status.get("phase") == names.PHASE_FAILED:
            return
        now = format_time(self.clock())
        failed = {
            "phase": names.PHASE_FAILED,
            "conditions": [
                {
                    "type": names.PHASE_FAILED,
                    "status": "True",
                    "reason": "InvalidSpec",
                    "message": str(error),
                    "lastTransitionTime": now,
                }
            ],
            "observedGeneration": int((body.get("metadata") or {}).get("generation", 0) or 0),
            "completionTime": now,
        }
        namespace, name = key
        stored = await self.api.patch_job_status(namespace, name, merge_patch_for(status, failed))
        self.job_event("MODIFIED", stored)
        await self._post_event(stored, "Warning", "InvalidSpec", str(error))

    async def _post_event(self, body: Mapping[str, Any], event_type: str, reason: str, message: str) -> None:
        try:
            await self.api.post_event(body, event_type, reason, message)
        except ApiError as error:  # an Event is best effort: never fail a reconcile over it
            logger.warning("could not post Event %s: %s", reason, error)
