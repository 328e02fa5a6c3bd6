"""The executor: carries out what ``reconcile.decide()`` decided for one DDPJob, in the order it fixes.

kopf delivers DDPJob events (handlers.py) and the pod cache (podcache.py) rank-pod changes; both only
mark the job dirty in the work queue (workqueue.py), whose worker calls ``reconcile``. ``reconcile``
reads the caches, asks ``decide()`` (every decision is made there, refusals and invalid specs included)
and executes the Decision through kube_api: deletes, creates, the status write (status_writes.py says
when one is worth it), the Event, the TTL delete. Nothing here LISTs: the only LIST is the pod cache's.

Writes per job lifecycle stay near the floor the benchmark measures (R pods + the Service and the
NetworkPolicy + a few): an Event only on a phase change; the Service, NetworkPolicy and PVC once per
job per process and version of them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from ddp_operator import builders, gang, kueue, names, ownership, standbys
from ddp_operator.decision import (
    DEFAULT_TIMING,
    REASON_INVALID_SPEC,
    CreateRefusal,
    Decision,
    KueueActions,
    TimingRules,
)
from ddp_operator.kube_api import (
    ApiError,
    ChildInvalid,
    ForeignObjectExists,
    JsonDict,
    KubeApi,
    PodCreateForbidden,
    merge_patch_for,
)
from ddp_operator.metrics import OperatorMetrics
from ddp_operator.observe import PodObservation, newest_per_rank, parse_time
from ddp_operator.podcache import JobKey, PodCache
from ddp_operator.policies import standby, straggler, topology
from ddp_operator.progress.pull import ProgressScraper, Target
from ddp_operator.reconcile import decide, decide_deleted, decide_invalid_spec
from ddp_operator.spec import JobSpec, SpecError, parse_job
from ddp_operator.status_writes import COUNTER_KEYS, CounterWrites, HeldCounters
from ddp_operator.versions import Freshness
from ddp_operator.workqueue import DEFAULT_BATCH_DELAY, JobQueue

logger = logging.getLogger(__name__)

# How often a waiting replica looks whether it leads now (the elector's own thread decides that).
LEADERSHIP_POLL_SECONDS: Final = 0.2
# A child name held by an object that is not ours (an old job of the same name being collected).
FOREIGN_RETRY_SECONDS: Final = 2.0
# Pauses before creating a PodGroup again that its admission refused for a Workload not yet cached.
GANG_ADMISSION_RETRIES: Final = (0.05, 0.1, 0.2, 0.4, 0.8)


# How a refused job-level child is named in the job's failure message.
_CHILD_NAMES: Final = {"Service": "the Service", "NetworkPolicy": "the NetworkPolicy"}


def job_key(body: Mapping[str, Any]) -> JobKey:
    meta = body.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def _uid(body: Mapping[str, Any]) -> str:
    return str((body.get("metadata") or {}).get("uid", ""))


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _digest(objects: Sequence[Mapping[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(objects, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class JobState:
    """What the controller holds for one DDPJob object between reconciles, and only for it.

    One record per job key, replaced whole when a new object (another UID) takes the name and dropped
    whole when the job is deleted, so nothing of an old job outlives it or leaks into its successor.
    """

    body: JsonDict
    # Digests of the Service, NetworkPolicy and PVC sets this process created for the job: each is
    # created once per version of them (a job resumed with other ports or a new checkpoint differs).
    children_ready: set[str] = field(default_factory=set)
    # The creates wait for a child name held by an object that is not this job's.
    waiting_for_foreign: bool = False
    # A child the apiserver refused for good, for the next decision (which fails the job).
    refusal: CreateRefusal | None = None
    # Kueue's view of the job's group while Kueue gates its pods, with when it was read (monotonic).
    queue_view: tuple[float, kueue.QueueObservation] | None = None
    # Counter-only status changes held back (status_writes.py).
    counters: HeldCounters = field(default_factory=HeldCounters)
    # Which copy of the job is the newest: kopf's events or our own status write's answer (versions.py).
    versions: Freshness = field(default_factory=Freshness)
    # The apiserver refused a standby pod (policies.standby): none is created before this time, and
    # the refusal's message, whose Event was posted (once per message).
    standby_held_until: datetime | None = None
    standby_refusal: str | None = None

    @property
    def uid(self) -> str:
        return _uid(self.body)


# Collaborators that call the controller back are passed as factories, each given the hook it calls.
# The operator's metrics, given how many jobs are in each phase (read at scrape time).
MetricsFactory = Callable[[Callable[[], Mapping[str, int]]], OperatorMetrics]
# The progress scraper, given the function that marks a job dirty when its progress changed.
ScraperFactory = Callable[[Callable[[JobKey], None]], ProgressScraper]


class Controller:
    def __init__(
        self,
        api: KubeApi,
        namespaces: Sequence[str] | None = None,
        status_interval: float = 1.0,
        batch_delay: float = DEFAULT_BATCH_DELAY,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        rules: TimingRules = DEFAULT_TIMING,
        metrics_allow_from: Sequence[Mapping[str, Any]] = builders.DEFAULT_METRICS_ALLOW_FROM,
        *,
        leadership: threading.Event | None = None,
        metrics: MetricsFactory | None = None,
        scraper: ScraperFactory | None = None,
        standby_priority_class: str | None = names.DEFAULT_STANDBY_PRIORITY_CLASS,
        standby_waiting_cpu: str | None = names.DEFAULT_STANDBY_WAITING_CPU,
    ) -> None:
        """``leadership``: set by leader election while this process leads (None: act at once);
        ``metrics``: builds the operator's own series (None: none); ``scraper``: builds the reader of
        rank 0's metrics (None: no progress in status, no stall checks); ``standby_priority_class``:
        the PriorityClass of standby pods (None or empty: the template's); ``standby_waiting_cpu``:
        the CPU request a standby waits with (None or empty: its rank's; also where the cluster
        serves no pod resize, which discovery finds at start)."""
        self.api = api
        self.standby_priority_class = standby_priority_class or None
        self.standby_waiting_cpu = standby_waiting_cpu or None
        # Pods whose resize the apiserver refused for good: not asked again by this process.
        self._resize_refused: set[tuple[str, str]] = set()
        # NetworkPolicyPeers that may reach the rank pods' metrics port (where Prometheus runs).
        self.metrics_allow_from = tuple(metrics_allow_from)
        self.jobs: dict[JobKey, JobState] = {}
        self.pods = PodCache(api, namespaces, on_change=self.kick, clock=clock)
        self.clock = clock
        self.rules = rules
        self.queue = JobQueue(
            self.reconcile,
            ready=self.pods.synced,
            # A job never reconciled has no pods whose events could be gathered first.
            gather=lambda key: key in self.jobs and bool(self.jobs[key].body.get("status")),
            batch_delay=batch_delay,
            observe_duration=self._observe_reconcile,
        )
        self.counter_writes = CounterWrites(status_interval)
        self._instance = socket.gethostname()
        self.leadership = leadership
        self.metrics = metrics(self.phase_counts) if metrics is not None else None
        if self.metrics is not None:
            self.metrics.follow_leadership(leadership)
        self.scraper = scraper(self.kick) if scraper is not None else None
        # The scheduling.k8s.io version of the in-tree gang API the cluster serves (discovery at start).
        self.gang_version: str | None = None
        # Whether the apiserver keeps a PodGroup's topology constraint (gang.topology_probe), asked the
        # first time a job needs to know.
        self.gang_topology: bool | None = None
        # Node labels by node name, for status.topology (policies.topology); a node's labels are read
        # once (a topology label does not move while a node lives).
        self._node_labels: dict[str, dict[str, str]] = {}
        self._starting: asyncio.Task[None] | None = None
        # Kueue groups of deleted jobs whose Kueue Workload was deleted: (namespace, group, job UID).
        self._released_groups: set[tuple[str, str, str]] = set()
        self._background: set[asyncio.Task[None]] = set()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start acting once this process leads (at once without leader election).

        Until then DDPJob events are only stored: no pod is watched, no job is reconciled, nothing is
        written (workers wait for the pod cache, which starts only here).
        """
        self._starting = asyncio.get_running_loop().create_task(self._start_when_leading())

    async def _start_when_leading(self) -> None:
        if self.leadership is not None:
            # A threading.Event set by the elector's thread: polled, so no thread blocks on it forever.
            while not self.leadership.is_set():  # noqa: ASYNC110
                await asyncio.sleep(LEADERSHIP_POLL_SECONDS)
        await self.api.warm_up()
        await self._discover()
        await self.pods.start()
        if self.scraper is not None:
            self.scraper.start()

    async def _discover(self) -> None:
        """Which in-tree gang API the cluster serves (none: pods are scheduled one by one), and whether
        it resizes pods in place (none: standbys wait with their ranks' CPU request)."""
        if self.standby_waiting_cpu is not None:
            try:
                served = "pods/resize" in await self.api.core_resources()
            except ApiError as error:
                served = False
                logger.warning("API discovery of pods/resize failed (%s)", error)
            if not served:
                logger.warning(
                    "the cluster does not resize pods in place (no pods/resize, Kubernetes < 1.33): "
                    "standby pods wait with their ranks' CPU request, not %s",
                    self.standby_waiting_cpu,
                )
                self.standby_waiting_cpu = None
        try:
            self.gang_version = gang.served_version(await self.api.group_versions())
        except ApiError as error:
            logger.warning(
                "API discovery failed (%s): gang scheduling through the Workload API is off", error
            )
        logger.info(
            "gang scheduling: %s", f"{gang.GROUP}/{self.gang_version}" if self.gang_version else "not served"
        )

    async def stop(self) -> None:
        if self._starting is not None:
            self._starting.cancel()
        self.pods.stop()
        self.queue.stop()
        if self.scraper is not None:
            self.scraper.stop()

    def phase_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for state in list(self.jobs.values()):
            phase = str((state.body.get("status") or {}).get("phase", ""))
            counts[phase] = counts.get(phase, 0) + 1
        return counts

    # ---- inputs ------------------------------------------------------------------------------

    def job_event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A DDPJob event from kopf's watch (type None: kopf's initial listing)."""
        key = job_key(body)
        if event_type == "DELETED":
            self._forget(key)
            self._release_orphaned_groups(key, decide_deleted(self.pods.pods_of(key)).kueue)
            return
        # kopf's listing (its first, and one each time its watch reconnects) has no event type.
        if self._store(key, body, Freshness.listed if event_type is None else Freshness.watched):
            self.kick(key)

    def _store(
        self, key: JobKey, body: Mapping[str, Any], take: Callable[[Freshness, Mapping[str, Any]], bool]
    ) -> bool:
        """Keep the newest copy of a job; False when ``body`` is older than what is held (our own
        status answer may be newer than an event still in flight: versions.py)."""
        state = self.jobs.get(key)
        if state is not None and state.uid != _uid(body):
            self._forget(key)
            state = None
        if state is None:
            state = self.jobs[key] = JobState(dict(body))
            take(state.versions, body)
            return True
        if not take(state.versions, body):
            return False
        state.body = dict(body)
        return True

    def _forget(self, key: JobKey) -> None:
        """The job is gone (or another object took its name): its record goes whole, and the
        collaborators that keep something per job drop it."""
        self.jobs.pop(key, None)
        self.queue.forget(key)
        self.pods.forget_job(key)
        if self.scraper is not None:
            self.scraper.untrack(key)
        if self.metrics is not None:
            self.metrics.forget(key)

    def kick(self, key: JobKey) -> None:
        """Mark a job dirty (pods of unknown jobs wait for the job's own event)."""
        if key in self.jobs:
            self.queue.kick(key)
        else:
            self._release_orphaned_groups(key, decide_deleted(self.pods.pods_of(key)).kueue)

    # ---- Kueue groups of deleted jobs ----------------------------------------------------------

    def _release_orphaned_groups(self, key: JobKey, actions: KueueActions) -> None:
        """Delete the Kueue Workloads of the groups a deleted job left (``actions.release_orphaned``,
        policies.kueue.orphaned_groups), once per group, in the background: a GET first tells whether
        a job of that UID exists after all (its event not seen yet), and then its group stays."""
        groups = {(key[0], group, owner_uid) for group, owner_uid in actions.release_orphaned}
        for group in groups - self._released_groups:
            self._released_groups.add(group)
            task = asyncio.get_running_loop().create_task(self._release_group(key, *group))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _release_group(self, key: JobKey, namespace: str, group: str, owner_uid: str) -> None:
        try:
            # The job may be a new one of the same name, or may not have reached this cache yet.
            job = await self.api.get_job(namespace, key[1])
            if job is not None and _uid(job) == owner_uid:
                self._released_groups.discard((namespace, group, owner_uid))
                return
            gone = await self.api.delete_children(namespace, kueue.KUEUE_WORKLOAD_KIND, [group])
        except ApiError as error:
            self._released_groups.discard((namespace, group, owner_uid))
            logger.warning(
                "could not release Kueue group %s/%s of a deleted job: %s", namespace, group, error
            )
            return
        logger.info(
            "job=%s/%s uid=%s action=release-kueue-group group=%s found=%s",
            namespace,
            key[1],
            owner_uid,
            group,
            gone[0][1] is not None,
        )

    def kick_later(self, key: JobKey, seconds: float) -> None:
        self.queue.kick_later(key, seconds)

    def _observe_reconcile(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.reconcile_duration.observe(seconds)

    # ---- one reconcile -----------------------------------------------------------------------

    async def reconcile(self, key: JobKey) -> None:
        state = self.jobs.get(key)
        if state is None:
            return
        body = state.body
        status: Mapping[str, Any] = body.get("status") or {}
        try:
            job = parse_job(body)
        except SpecError as error:
            generation = int((body.get("metadata") or {}).get("generation", 0) or 0)
            decision = decide_invalid_spec(status, generation, str(error), self.clock())
            await self._write_status(key, state, status, decision)
            return
        observed = self.scraper.observation(key) if self.scraper is not None else None
        carried_out = False
        while not carried_out:
            # Asked again when a standby a promotion named was gone: the cache no longer holds it, so
            # policies.standby's plan gives its rank another pod (each round drops one such pod).
            pods = self.pods.pods_of(key)
            queue = await self._queue_view(state, job, pods)
            decision = decide(
                job,
                status,
                pods,
                self.clock(),
                state.refusal,
                self.rules,
                observed,
                queue,
                standby_held_until=state.standby_held_until,
                nodes=await self._nodes_of(key, job, status, pods),
            )
            _log_decision(key, decision)
            carried_out = await self.execute(key, state, job, decision)
        self._follow_progress(key, job, decision, pods)

    async def _queue_view(
        self, state: JobState, job: JobSpec, pods: Sequence[PodObservation]
    ) -> kueue.QueueObservation | None:
        """What Kueue says of the job's group, while Kueue gates its pods; read at most every
        kueue.REFRESH_SECONDS per job, and best effort (Kueue absent or unreadable: None)."""
        if job.kueue is None or not any(p.kueue_gated and not p.deleting for p in pods):
            state.queue_view = None
            return None
        held = state.queue_view
        now = time.monotonic()
        if held is not None and now - held[0] < kueue.REFRESH_SECONDS:
            return held[1]
        group = names.kueue_pod_group_name(job.name, job.uid)
        try:
            workload = await self.api.get_child(job.namespace, kueue.KUEUE_WORKLOAD_KIND, group)
            local_queue = None
            admitted = workload is not None and kueue.observe_queue(group, "", workload, None).admitted
            if not admitted:
                local_queue = await self.api.get_child(
                    job.namespace, kueue.LOCAL_QUEUE_KIND, job.kueue.queue_name
                )
        except ApiError as error:
            logger.debug("job=%s/%s could not read Kueue's view: %s", job.namespace, job.name, error)
            return held[1] if held is not None else None
        view = kueue.observe_queue(group, job.kueue.queue_name, workload, local_queue)
        state.queue_view = (now, view)
        return view

    async def _nodes_of(
        self, key: JobKey, job: JobSpec, status: Mapping[str, Any], pods: Sequence[PodObservation]
    ) -> dict[str, dict[str, str]]:
        """The labels of the nodes the live attempt's rank pods are bound to, for where they landed
        (policies.placement), read only for a job that asks for a topology; a node that cannot be read
        is left out (its pod counts as not bound yet, and the pod's own updates bring another look)."""
        attempt = status.get("attempt")
        if job.scheduling.topology is None or status.get("phase") not in names.LIVE_PHASES:
            return {}
        bound = {p.node for p in pods if p.node and p.rank is not None and p.attempt == attempt}
        found: dict[str, dict[str, str]] = {}
        for node in sorted(bound):
            labels = await self._labels_of(key, node)
            if labels is not None:
                found[node] = labels
        return found

    async def _labels_of(self, key: JobKey, node: str) -> dict[str, str] | None:
        """A node's labels, read once per node (a topology label does not move while a node lives); None
        when the node is gone or cannot be read now."""
        labels = self._node_labels.get(node)
        if labels is not None:
            return labels
        try:
            labels = await self.api.node_labels(node)
        except ApiError as error:
            logger.debug("job=%s/%s node %s unreadable: %s", *key, node, error)
            return None
        if labels is not None:
            self._node_labels[node] = labels
        return labels

    async def _write_rank_orders(self, key: JobKey, job: JobSpec, decision: Decision) -> None:
        """Annotate bound pods with their rendezvous order keys (policies.placement); a pod gone by now
        is skipped (the next decision sees it gone), any other error retries the reconcile."""
        for pod, order in decision.rank_orders:
            patch = {"metadata": {"annotations": {names.ANNOTATION_RANK_ORDER: order}}}
            try:
                self.pods.remember(await self.api.patch_child(job.namespace, "Pod", pod, patch))
            except ApiError as error:
                if error.status != 404:
                    raise
                continue
            logger.info("job=%s/%s action=rank-order pod=%s key=%s", *key, pod, order)

    def _follow_progress(
        self, key: JobKey, job: JobSpec, decision: Decision, pods: Sequence[PodObservation]
    ) -> None:
        """Read the progress of a Running attempt from its rank 0 pod; of nothing else."""
        if self.scraper is None:
            return
        attempt = decision.report.status.get("attempt")
        # Each rank's pod as decide() sees it; one being deleted or without an address is not read.
        current = {
            rank: p for rank, p in newest_per_rank(pods, attempt).items() if p.pod_ip and not p.deleting
        }
        rank0 = current.get(0)
        if decision.phase != names.PHASE_RUNNING or not job.metrics.enabled or rank0 is None:
            self.scraper.untrack(key)
            return
        port = job.metrics.port
        target = Target(
            attempt=int(attempt or 0),
            rank0_url=f"http://{_host(rank0.pod_ip)}:{port}/metrics",
            pods=job.replicas,
            world_size=job.world_size,
            stall_timeout=job.run_policy.stall_timeout_seconds,
            pod_urls={pod.name: f"http://{_host(pod.pod_ip)}:{port}/metrics" for pod in current.values()},
            elastic=job.elastic is not None,
            read_every_pod_at=decision.read_every_pod_at,
        )
        self.scraper.track(key, target)

    async def execute(self, key: JobKey, state: JobState, job: JobSpec, decision: Decision) -> bool:
        """Carry out a Decision in the order decision.py fixes (its module docstring). False: a standby
        pod a promotion named was gone, and the rest waits for a new decision (the pod cache says so)."""
        old_status: Mapping[str, Any] = state.body.get("status") or {}
        # Their node stopped reporting: no kubelet will honour a grace period (docs/restarts.md).
        await self._force_delete(key, job, decision.delete.lost_pods, "NodeLost")
        # Stopped or wedged processes take no SIGTERM: a grace period would only delay the restart.
        await self._force_delete(key, job, decision.delete.hung_pods, "Hung")
        if decision.delete.pods:
            deleted = await self.api.delete_children(job.namespace, "Pod", list(decision.delete.pods))
            for _, remains in deleted:
                if remains is not None:
                    self.pods.remember(remains)
        await self._release_from_kueue(key, job, decision)
        for event in decision.events:
            await self._post_event(state.body, event.type, event.reason, event.message)
        if not await self._promote(key, job, decision):
            return False
        await self._resize(key, state, job, decision)

        if decision.create.rendezvous and not (decision.create.ranks or decision.create.replacements):
            # A lost rendezvous pod replaced alone: the ranks and the attempt's children are there.
            await self._create_rendezvous(key, state, job, decision)
        if decision.create.ranks or decision.create.replacements or decision.create.standbys:
            refusal = await self._create_attempt(key, state, job, decision)
            if refusal is not None:
                # Decided on at once by the next reconcile; this decision's status is not written.
                state.refusal = refusal
                self.kick(key)
                return True
            if state.waiting_for_foreign:
                return True  # a name is still held by an old job's object: the status waits with the creates

        await self._write_rank_orders(key, job, decision)
        await self._write_status(key, state, old_status, decision)
        if decision.phase in names.FINISHED_PHASES:
            state.refusal = None

        if decision.delete.job:
            logger.info("job=%s/%s uid=%s action=delete reason=TTLExpired", *key, job.uid)
            await self.api.delete_job(job.namespace, job.name, job.uid)
            return True
        if decision.requeue_after is not None:
            self.kick_later(key, decision.requeue_after)
        return True

    async def _promote(self, key: JobKey, job: JobSpec, decision: Decision) -> bool:
        """Give each promotion's standby pod its rank (policies.standby). False at the first standby
        that is gone by now (deleted, its node lost): it leaves the pod cache, and the caller asks
        ``decide()`` again, whose plan gives that rank another standby or a new pod."""
        for promotion in decision.create.promotions:
            patch = builders.standby_promotion(
                promotion.rank, promotion.replacement, promotion.budget, self.clock()
            )
            try:
                self.pods.remember(await self.api.patch_child(job.namespace, "Pod", promotion.pod, patch))
            except ApiError as error:
                if error.status != 404:
                    raise
                logger.info(
                    "job=%s/%s standby %s is gone: rank %d is decided again",
                    *key,
                    promotion.pod,
                    promotion.rank,
                )
                self.pods.gone(key, promotion.pod)
                return False
            logger.info(
                "job=%s/%s action=promote pod=%s rank=%d budget=%d",
                *key,
                promotion.pod,
                promotion.rank,
                promotion.budget,
            )
        return True

    async def _resize(self, key: JobKey, state: JobState, job: JobSpec, decision: Decision) -> None:
        """Give each standby that holds a rank its rank's CPU request back, in place. A refusal never
        stops the job: the rank trains on with the standby's waiting CPU, and one Event says why."""
        for pod, cpu in decision.create.resizes:
            if (job.namespace, pod) in self._resize_refused:
                continue
            try:
                self.pods.remember(
                    await self.api.resize_cpu(job.namespace, pod, names.TRAINER_CONTAINER, cpu)
                )
            except ApiError as error:
                if error.status >= 500:
                    raise  # retried like any other write
                if error.status in (404, 409):
                    continue  # the pod is gone (the cache will say so), or changed: the next decision
                self._resize_refused.add((job.namespace, pod))
                logger.warning("job=%s/%s resize of %s refused: %s", *key, pod, error)
                event = standbys.not_resized(pod, cpu, error.message or error.reason)
                await self._post_event(state.body, event.type, event.reason, event.message)
                continue
            logger.info("job=%s/%s action=resize pod=%s cpu=%s", *key, pod, cpu)

    async def _force_delete(self, key: JobKey, job: JobSpec, pods: Sequence[str], reason: str) -> None:
        """Delete with grace 0: pods no kubelet will confirm (their node is gone, or never answered)."""
        if not pods:
            return
        logger.info("job=%s/%s action=force-delete pods=%s reason=%s", *key, ",".join(pods), reason)
        await self.api.delete_children(job.namespace, "Pod", list(pods), grace_seconds=0)

    async def _release_from_kueue(self, key: JobKey, job: JobSpec, decision: Decision) -> None:
        """Old pods Kueue would still count, a failed group Kueue would keep, and the groups an earlier
        job of the same name left (policies/kueue.py)."""
        self._release_orphaned_groups(key, decision.kueue)
        await self._force_delete(key, job, decision.kueue.force_delete_pods, "DeletionUnconfirmed")
        if decision.kueue.release_group:
            group = names.kueue_pod_group_name(job.name, job.uid)
            try:
                gone = await self.api.delete_children(job.namespace, kueue.KUEUE_WORKLOAD_KIND, [group])
            except ApiError as error:
                logger.warning("job=%s/%s could not release Kueue group %s: %s", *key, group, error)
            else:
                if gone[0][1] is not None:
                    logger.info("job=%s/%s action=release-kueue-group group=%s reason=Suspended", *key, group)
        held = {p.name: p for p in self.pods.pods_of(key)}
        for name in decision.kueue.release_pods:
            pod = held.get(name)
            if pod is not None:
                await self.api.remove_finalizer(
                    job.namespace, "Pod", name, pod.finalizers, names.KUEUE_POD_FINALIZER
                )
        for name in decision.kueue.mark_unretriable:
            patch = {"metadata": {"annotations": {names.KUEUE_RETRIABLE_IN_GROUP_ANNOTATION: "false"}}}
            try:
                self.pods.remember(await self.api.patch_child(job.namespace, "Pod", name, patch))
            except ApiError as error:
                if error.status != 404:
                    raise

    async def _write_status(
        self, key: JobKey, state: JobState, old_status: Mapping[str, Any], decision: Decision
    ) -> None:
        if not decision.report.changed:
            return
        patch = merge_patch_for(old_status, decision.report.status)
        if not patch:
            return
        old_phase, new_phase = str(old_status.get("phase", "")), decision.phase
        phase_of_attempt = (decision.report.status.get("attempt"), new_phase)
        counter_only = not decision.create.ranks and patch.keys() <= COUNTER_KEYS
        if counter_only:
            counters = tuple(decision.report.status.get(field) for field in sorted(COUNTER_KEYS))
            due_in = self.counter_writes.due_in(state.counters, phase_of_attempt, counters, time.monotonic())
            if due_in is None:
                return
            if due_in > 0:
                self.kick_later(key, due_in)
                return
        namespace, name = key
        stored = await self.api.patch_job_status(namespace, name, patch)
        self.counter_writes.written(state.counters, phase_of_attempt, counter_only)
        # The answer is the newest version: stored without another reconcile (it changes nothing to do).
        self._store(key, stored, Freshness.answered)
        held = self.jobs.get(key)
        body = held.body if held is not None else stored
        if self.metrics is not None:
            self.metrics.observe_restarts(key, decision.report)
        if old_phase != new_phase:
            self._observe_phase_change(body, new_phase)
            if decision.report.event is not None:
                self._log_transition(key, body, old_phase, decision)
                await self._post_event(
                    body,
                    decision.report.event.type,
                    decision.report.event.reason,
                    decision.report.event.message,
                )
        # Events of what the new status shows without a phase change (a straggler), once it is stored.
        for notice in decision.report.notices:
            await self._post_event(body, notice.type, notice.reason, notice.message)

    def _log_transition(
        self, key: JobKey, body: Mapping[str, Any], old_phase: str, decision: Decision
    ) -> None:
        """One INFO line per phase change: what an operator on call greps for."""
        assert decision.report.event is not None
        status = decision.report.status
        logger.info(
            "job=%s/%s uid=%s attempt=%s restarts=%s phase=%s->%s reason=%s message=%s",
            key[0],
            key[1],
            _uid(body),
            status.get("attempt", "-"),
            status.get("restarts", 0),
            old_phase or "-",
            decision.phase,
            decision.report.event.reason,
            json.dumps(decision.report.event.message),
        )

    def _observe_phase_change(self, body: Mapping[str, Any], new: str) -> None:
        if self.metrics is None or new != names.PHASE_RUNNING:
            return
        status = body.get("status") or {}
        if int(status.get("restarts", 0) or 0) != 0:
            return
        created = parse_time((body.get("metadata") or {}).get("creationTimestamp"))
        if created is not None:
            self.metrics.time_to_running.observe(max((self.clock() - created).total_seconds(), 0.0))

    async def _post_event(self, body: Mapping[str, Any], event_type: str, reason: str, message: str) -> None:
        event = builders.build_event(body, event_type, reason, message, self.clock(), self._instance)
        try:
            await self.api.create_event(event)
        except ApiError as error:  # an Event is best effort: never fail a reconcile over it
            logger.warning("could not post Event %s: %s", reason, error)

    # ---- creating an attempt -----------------------------------------------------------------

    async def _create_attempt(
        self, key: JobKey, state: JobState, job: JobSpec, decision: Decision
    ) -> CreateRefusal | None:
        """The Service, NetworkPolicy, PVC and missing rank pods; a refusal when one was refused for good."""
        state.waiting_for_foreign = False

        def accept(wanted: Mapping[str, Any], existing: Mapping[str, Any]) -> bool:
            return ownership.is_ours(wanted, existing, job.uid)

        children: list[JsonDict] = []
        if decision.create.service:
            children.append(builders.build_service(job, decision.create.attempt))
        policy = (
            builders.build_network_policy(job, self.metrics_allow_from)
            if decision.create.network_policy
            else None
        )
        if policy is not None:
            children.append(policy)
        pvc = builders.build_checkpoint_pvc(job) if decision.create.pvc else None
        if pvc is not None:
            children.append(pvc)
        digest = _digest(children)
        if children and digest not in state.children_ready:
            report = await self.api.create_children(children, accept)
            if isinstance(report.error, ForeignObjectExists):
                self._foreign(key, state, job, report.error)
                return None
            if isinstance(report.error, ChildInvalid):
                kind = (report.failed or {}).get("kind")
                child = _CHILD_NAMES.get(str(kind), "the checkpoint PVC")
                return CreateRefusal(
                    False, child, decision.create.attempt, report.error.message or report.error.reason
                )
            if report.error is not None:
                raise report.error
            for existing in report.existing:
                await self._follow_spec(job, existing, children)
            state.children_ready.add(digest)

        def on_result(pod: JsonDict, created: bool) -> None:
            self.pods.remember(pod)
            rank_pod = names.LABEL_RANK in ((pod.get("metadata") or {}).get("labels") or {})
            if created and rank_pod and self.metrics is not None:
                self.metrics.pods_created.inc()

        attempt = decision.create.attempt
        unavailable = gang.unavailable_reason(job, self.gang_version)
        if unavailable is not None:
            return CreateRefusal(False, "the gang", attempt, unavailable, reason=REASON_INVALID_SPEC)
        in_tree_gang = gang.wants_gang(job, self.gang_version)
        in_tree_topology = await self._gang_topology(job) if in_tree_gang else False
        placing = topology.plan(job, in_tree_gang=in_tree_gang, in_tree_topology=in_tree_topology)
        if placing.refusal is not None:
            return CreateRefusal(False, "the gang", attempt, placing.refusal, reason=REASON_INVALID_SPEC)
        objects = gang.gang_objects(job, attempt, self.gang_version, topology_served=in_tree_topology)
        patch = None
        if objects is not None:
            # The gang first: a pod naming a PodGroup that does not exist yet waits for it anyway, but
            # the scheduler must see the whole minimum before it places any rank.
            await self._create_gang(objects.workload, objects.pod_group, accept)
            patch = objects.pod_spec_patch
        pods = _rank_pods(job, decision, patch)
        report = await self.api.create_children(pods, accept, on_result=on_result)
        if isinstance(report.error, PodCreateForbidden | ChildInvalid):
            labels = ((report.failed or {}).get("metadata") or {}).get("labels") or {}
            return CreateRefusal(
                isinstance(report.error, PodCreateForbidden),
                _pod_child(labels),
                decision.create.attempt,
                report.error.message or report.error.reason,
            )
        if isinstance(report.error, ForeignObjectExists):
            self._foreign(key, state, job, report.error)
            return None
        if report.error is not None:
            raise report.error
        await self._create_standbys(key, state, job, decision, accept, on_result)
        return None

    async def _create_rendezvous(
        self, key: JobKey, state: JobState, job: JobSpec, decision: Decision
    ) -> None:
        """The attempt's rendezvous pod alone (policies.rendezvous); an error retries the reconcile."""
        store = builders.build_rendezvous_pod(job, decision.create.attempt, decision.create.rendezvous)
        if store is None:
            return

        def accept(wanted: Mapping[str, Any], existing: Mapping[str, Any]) -> bool:
            return ownership.is_ours(wanted, existing, job.uid)

        report = await self.api.create_children(
            [store], accept, on_result=lambda pod, _: self.pods.remember(pod)
        )
        if isinstance(report.error, ForeignObjectExists):
            self._foreign(key, state, job, report.error)
        elif report.error is not None:
            raise report.error

    async def _create_standbys(
        self,
        key: JobKey,
        state: JobState,
        job: JobSpec,
        decision: Decision,
        accept: Callable[[Mapping[str, Any], Mapping[str, Any]], bool],
        on_result: Callable[[JsonDict, bool], None],
    ) -> None:
        """The decision's new standby pods, after its rank pods (a rank never waits for a standby).
        One the apiserver refuses (its PriorityClass missing, a quota full, Pod Security) never fails
        the job: one Event per refusal message, and no standby for REFUSAL_RETRY_SECONDS."""
        if not decision.create.standbys:
            return
        avoid = straggler.avoided_nodes(decision.report.status)
        pods = [
            builders.build_standby_pod(
                job,
                decision.create.attempt,
                number,
                avoid_nodes=avoid,
                priority_class=self.standby_priority_class,
                waiting_cpu=self.standby_waiting_cpu,
            )
            for number in decision.create.standbys
        ]
        report = await self.api.create_children(pods, accept, on_result=on_result)
        if isinstance(report.error, ForeignObjectExists):
            self._foreign(key, state, job, report.error)
            return
        if not isinstance(report.error, PodCreateForbidden | ChildInvalid):
            if report.error is not None:
                raise report.error
            state.standby_refusal = None
            return
        name = str(((report.failed or {}).get("metadata") or {}).get("name", "?"))
        message = report.error.message or report.error.reason
        state.standby_held_until = self.clock() + timedelta(seconds=standby.REFUSAL_RETRY_SECONDS)
        logger.warning("job=%s/%s standby %s refused: %s", *key, name, message)
        self.kick_later(key, standby.REFUSAL_RETRY_SECONDS)
        if message != state.standby_refusal:
            state.standby_refusal = message
            event = standbys.refused(name, message)
            await self._post_event(state.body, event.type, event.reason, event.message)

    async def _gang_topology(self, job: JobSpec) -> bool:
        """Whether the in-tree PodGroup's topology constraint is served; asked once, with a dry-run
        create in the namespace of the first job that needs to know (where the operator may create
        PodGroups), and only for a job that asks for a required topology without Kueue."""
        # Only a required topology without Kueue can use the constraint (policies.topology.job_path).
        wants = job.scheduling.topology is not None and topology.job_path(job) is None
        if self.gang_topology is not None or not wants:
            return bool(self.gang_topology)
        assert self.gang_version is not None  # wants_gang
        # An error here is retried like any other create's: a job is never refused for a failed probe.
        answer = await self.api.dry_run_create(gang.topology_probe(self.gang_version, job.namespace))
        self.gang_topology = gang.topology_kept(answer)
        logger.info("in-tree topology constraint: %s", "served" if self.gang_topology else "not served")
        return self.gang_topology

    async def _create_gang(
        self,
        workload: JsonDict,
        pod_group: JsonDict,
        accept: Callable[[Mapping[str, Any], Mapping[str, Any]], bool],
    ) -> None:
        """The Workload, then its PodGroup. The apiserver's PodGroup admission looks the Workload up in
        its own cache and refuses (403 "Workload ... not found") until the cache has it, a few ms after
        the create (seen in 7 of 26 benchmark runs when both were created at once): that refusal is
        retried at once a few times instead of costing the job the 5 s error retry."""
        report = await self.api.create_children([workload], accept)
        if report.error is not None:
            raise report.error
        for delay in (*GANG_ADMISSION_RETRIES, None):
            error = (await self.api.create_children([pod_group], accept)).error
            if error is None:
                return
            cache_lag = isinstance(error, ApiError) and error.status == 403 and "not found" in str(error)
            if not cache_lag or delay is None:
                raise error
            await asyncio.sleep(delay)

    async def _follow_spec(
        self, job: JobSpec, existing: Mapping[str, Any], wanted: Sequence[JsonDict]
    ) -> None:
        """Our Service from an earlier attempt follows the job: this attempt's pods, the job's ports.

        Our NetworkPolicy follows the job's metrics port and the operator's --metrics-allow-from.
        """
        kind = existing.get("kind")
        if kind not in ("Service", "NetworkPolicy"):
            return
        child = next(child for child in wanted if child.get("kind") == kind)
        if kind == "Service":
            patch = ownership.service_patch(child, existing)
        else:
            patch = ownership.network_policy_patch(child, existing)
        if patch is not None:
            await self.api.patch_child(job.namespace, str(kind), str(child["metadata"]["name"]), patch)

    def _foreign(self, key: JobKey, state: JobState, job: JobSpec, error: ForeignObjectExists) -> None:
        logger.info("job=%s/%s waiting: %s", job.namespace, job.name, error.message)
        state.waiting_for_foreign = True
        self.kick_later(key, FOREIGN_RETRY_SECONDS)


def _log_decision(key: JobKey, decision: Decision) -> None:
    """One DEBUG line per decision, changed or not: why a job waits (a failure held for the decision
    window until every rank reported, a timer) when the INFO lines say nothing happened."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    status = decision.report.status

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    logger.debug(
        "job=%s/%s decided phase=%s attempt=%s restarts=%s failed=%s judged_in=%s creates=%d deletes=%d "
        "requeue_after=%s",
        key[0],
        key[1],
        decision.phase or "-",
        status.get("attempt", "-"),
        status.get("restarts", 0),
        status.get("failedReplicas", 0),
        seconds(decision.judged_in),
        len(decision.create.ranks) + len(decision.create.replacements),
        len(decision.delete.pods) + len(decision.delete.lost_pods) + len(decision.delete.hung_pods),
        seconds(decision.requeue_after),
    )


def _pod_child(labels: Mapping[str, Any]) -> str:
    """Which of the job's pods a refused pod was, by its labels, for the job's condition."""
    if labels.get(names.LABEL_ROLE) == names.ROLE_STANDBY:
        return f"standby pod {labels.get(names.LABEL_STANDBY)}"
    rank = labels.get(names.LABEL_RANK)
    return f"rank {rank}'s pod" if rank is not None else "the rendezvous pod"


def _rank_pods(job: JobSpec, decision: Decision, patch: Mapping[str, Any] | None) -> list[JsonDict]:
    """The attempt's missing ranks and the replacements of lost pods, each with the gang's restart budget,
    kept off the nodes the job moved away from (the status the decision writes records them); first the
    attempt's rendezvous pod where the decision creates one (policies.rendezvous: the attempt's first,
    or the replacement of a lost one)."""
    attempt, budget = decision.create.attempt, decision.create.restart_budget
    avoid = straggler.avoided_nodes(decision.report.status)
    name = decision.create.rendezvous
    store = builders.build_rendezvous_pod(job, attempt, name) if name is not None else None
    pods = [store] if store is not None else []
    pods += [
        builders.build_rank_pod(
            job, rank, attempt, pod_spec_patch=patch, restart_budget=budget, avoid_nodes=avoid
        )
        for rank in decision.create.ranks
    ]
    pods += [
        builders.build_rank_pod(
            job,
            rank,
            attempt,
            pod_spec_patch=patch,
            replacement=replacement,
            restart_budget=budget,
            avoid_nodes=avoid,
        )
        for rank, replacement in decision.create.replacements
    ]
    return pods
