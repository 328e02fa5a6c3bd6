"""An in-memory, event-driven cache of the operator's rank pods, grouped by job.

kopf would watch every pod of a namespace and filter labels on the client, so the operator's cost would
grow with pods that are not ours. This cache is an informer of its own instead: one LIST per watched
namespace (or one cluster-wide) with a server-side label selector, then a WATCH from that list's
resourceVersion, resuming it from the last version seen when a connection breaks and relisting only
when the apiserver answers 410 Gone. Reconciles read the cache and never
LIST. `synced` is set once every scope has been listed: before that, a job with pods would look like a
job whose pods vanished, so the controller waits for it.

Objects also enter the cache from the operator's own create and delete answers (`remember`), so a second
reconcile right after a create sees the pods without waiting for the watch. versions.py keeps an older
copy from overwriting a newer one (resourceVersions compared for equality only), and a deleted pod's UID
keeps a late answer from bringing it back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from ddp_operator import names
from ddp_operator.kube_api import ApiError, JsonDict, KubeApi, ResourceVersionGone
from ddp_operator.observe import PodObservation, observe_pod, seen
from ddp_operator.versions import Freshness

logger = logging.getLogger(__name__)

JobKey = tuple[str, str]  # (namespace, job name)


def job_key_of(pod: JsonDict) -> JobKey | None:
    """The job a pod of ours belongs to: a rank pod's, or a rendezvous pod's (names.LABEL_RENDEZVOUS_OF)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    job = labels.get(names.LABEL_JOB_NAME) or labels.get(names.LABEL_RENDEZVOUS_OF)
    if not job:
        return None
    return str(meta.get("namespace", "")), str(job)


class PodCache:
    """Rank pods by job. All mutation happens on the asyncio loop; watch threads only post callbacks."""

    def __init__(
        self,
        api: KubeApi,
        namespaces: Sequence[str] | None,
        on_change: Callable[[JobKey], None],
        label_selector: str | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._api = api
        self._clock = clock
        self._scopes: list[str | None] = list(namespaces) if namespaces else [None]
        self._on_change = on_change
        self._selector = label_selector or names.label_selector()
        # Observations, not pod objects: each pod is parsed once per event, never once per reconcile.
        self._pods: dict[JobKey, dict[str, tuple[Freshness, PodObservation]]] = {}
        # name -> UID of the pod of its DELETED event, so a late create answer cannot resurrect it.
        self._tombstones: dict[JobKey, dict[str, str]] = {}
        self._listed: set[str | None] = set()
        self.synced = asyncio.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.events_seen = 0

    # ---- reads -------------------------------------------------------------------------------

    def pods_of(self, key: JobKey) -> list[PodObservation]:
        return [observation for _, observation in self._pods.get(key, {}).values()]

    def jobs(self) -> list[JobKey]:
        return list(self._pods)

    # ---- writes (loop only) ----------------------------------------------------------------------

    def remember(self, pod: JsonDict) -> None:
        """An object from the operator's own create/delete answer."""
        self._apply("MODIFIED", pod, notify=False, take=Freshness.answered)

    def gone(self, key: JobKey, name: str) -> None:
        """A pod the apiserver answered 404 for: gone from the cache before its DELETED event comes
        (its UID kept, so a late event or answer of that pod cannot bring it back)."""
        pods = self._pods.get(key, {})
        held = pods.pop(name, None)
        if held is not None and held[1].uid:
            self._tombstones.setdefault(key, {})[name] = held[1].uid
        if not pods:
            self._pods.pop(key, None)

    def forget_job(self, key: JobKey) -> None:
        """The job is gone; its pods go by garbage collection and their DELETED events may still come."""
        self._tombstones.pop(key, None)

    def _apply(
        self,
        event_type: str,
        pod: JsonDict,
        notify: bool = True,
        take: Callable[[Freshness, JsonDict], bool] = Freshness.watched,
    ) -> None:
        """A watch event, or with ``take=Freshness.answered`` an answer (versions.py says which copy
        of a pod is the newest)."""
        key = job_key_of(pod)
        if key is None:
            return
        meta = pod.get("metadata") or {}
        name, uid = str(meta.get("name", "")), meta.get("uid")
        pods = self._pods.setdefault(key, {})
        tombstones = self._tombstones.setdefault(key, {})
        if event_type == "DELETED":
            pods.pop(name, None)
            if uid:
                tombstones[name] = str(uid)
            if not pods:
                self._pods.pop(key, None)
        else:
            if uid and tombstones.get(name) == uid:
                return  # that very pod was deleted: a late answer of it is older than its end
            current = pods.get(name)
            versions = current[0] if current is not None else Freshness()
            if not take(versions, pod):
                return
            previous = current[1] if current is not None else None
            pods[name] = (versions, seen(observe_pod(pod), previous, self._clock()))
        if notify:
            self._on_change(key)

    def _replace_scope(self, scope: str | None, items: list[JsonDict]) -> None:
        """A fresh LIST of one scope: everything in it replaces what the cache held for that scope."""
        touched: set[JobKey] = set()
        before: dict[tuple[JobKey, str], PodObservation] = {}
        for key in list(self._pods):
            if scope is None or key[0] == scope:
                touched.add(key)
                for name, (_, observation) in self._pods.pop(key).items():
                    before[(key, name)] = observation
        now = self._clock()
        for pod in items:
            pod_key = job_key_of(pod)
            if pod_key is None:
                continue
            key = pod_key
            name = str(pod["metadata"]["name"])
            observation = seen(observe_pod(pod), before.get((key, name)), now)
            versions = Freshness()
            versions.listed(pod)
            self._pods.setdefault(key, {})[name] = (versions, observation)
            touched.add(key)
        self._listed.add(scope)
        if all(s in self._listed for s in self._scopes):
            self.synced.set()
        for key in touched:
            self._on_change(key)

    # ---- the informer --------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for scope in self._scopes:
            # Daemon threads: a watch blocked in a read must not hold the process open at exit.
            thread = threading.Thread(
                target=self._informer, args=(loop, scope), name=f"pod-informer-{scope or 'all'}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()

    def _informer(self, loop: asyncio.AbstractEventLoop, scope: str | None) -> None:
        """List once, then watch from the last resourceVersion seen, across broken connections (an
        apiserver restart, a proxy timeout) as client-go's reflector does; list again only when the
        apiserver answers 410 Gone (that version is compacted away). Runs on a watch thread until
        `stop()`."""
        backoff = 0.5
        version: str | None = None
        where = scope or "all namespaces"
        while not self._stop.is_set():
            try:
                if version is None:
                    items, version = self._api.list_pods_blocking(scope, self._selector)
                    loop.call_soon_threadsafe(self._replace_scope, scope, items)
                for event in self._api.watch_pods_blocking(scope, self._selector, version):
                    if self._stop.is_set():
                        return
                    backoff = 0.5
                    obj = event.get("object") or {}
                    new_version = (obj.get("metadata") or {}).get("resourceVersion")
                    if new_version:
                        version = str(new_version)
                    if event.get("type") == "BOOKMARK":
                        continue
                    self.events_seen += 1
                    loop.call_soon_threadsafe(self._apply, str(event.get("type")), obj)
            except ResourceVersionGone:
                logger.info("pod watch of %s expired (410); listing again", where)
                version = None
            except (ApiError, OSError, ValueError, Exception) as error:
                if self._stop.is_set():
                    return
                logger.warning(
                    "pod watch of %s failed: %s; resuming from %s", where, error, version or "a list"
                )
                time.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
