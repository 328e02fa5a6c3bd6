"""At most one operator acts: leader election on a coordination.k8s.io Lease, like client-go's.

Every operator process starts kopf (so its liveness probe answers) but its controller does nothing until
this process holds the Lease: no pod watch, no reconcile, no write. The holder renews the Lease every
``retry_period`` seconds; a candidate takes it over only after the holder's record has stood unchanged
for ``lease_duration`` seconds of the candidate's own clock (no clock is compared across machines). A
holder that cannot renew within ``renew_deadline`` has lost the Lease and ends its process at once
(exit 1, as controller-runtime does): another replica may be acting already, and a restarted process
comes back as a candidate. A process that stops cleanly releases the Lease, so a rolling update hands
over in seconds instead of a lease duration.

``LeaseRecord`` and ``next_lease`` are pure; ``LeaderElector`` runs the loop on a thread of its own, so
a busy asyncio loop cannot delay a renewal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from ddp_operator.kube_api import ApiError, Conflict, JsonDict, KubeApi

logger = logging.getLogger(__name__)

DEFAULT_LEASE_NAME: Final = "ddp-operator"
SERVICE_ACCOUNT_NAMESPACE_FILE: Final = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclass(frozen=True)
class Timing:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def problem(self) -> str | None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            return (
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period} < {self.renew_deadline} < {self.lease_duration}"
            )
        return None


def _micro_time(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def holder_of(lease: Mapping[str, Any] | None) -> str:
    return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")


def next_lease(
    current: Mapping[str, Any] | None,
    namespace: str,
    name: str,
    identity: str,
    lease_duration: float,
    now: datetime,
) -> JsonDict:
    """The Lease this candidate writes to take or renew leadership (the caller checked it may)."""
    spec: Mapping[str, Any] = (current or {}).get("spec") or {}
    taking_over = holder_of(current) != identity
    transitions = int(spec.get("leaseTransitions") or 0) + (1 if taking_over and current is not None else 0)
    metadata: JsonDict = {"name": name, "namespace": namespace}
    if current is not None:
        metadata["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": max(1, round(lease_duration)),
            "acquireTime": _micro_time(now) if taking_over else spec.get("acquireTime"),
            "renewTime": _micro_time(now),
            "leaseTransitions": transitions,
        },
    }


def released_lease(current: Mapping[str, Any]) -> JsonDict:
    """The Lease as a holder that stops leaves it: no holder, free to take at once."""
    lease = dict(current)
    lease["spec"] = {**(current.get("spec") or {}), "holderIdentity": "", "leaseDurationSeconds": 1}
    return lease


def default_namespace() -> str:
    """The operator pod's namespace (downward API or its service account), else "default"."""
    namespace = os.environ.get("POD_NAMESPACE")
    if namespace:
        return namespace
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE_FILE, encoding="utf-8") as handle:
            return handle.read().strip() or "default"
    except OSError:
        return "default"


class LeaderElector:
    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str = DEFAULT_LEASE_NAME,
        timing: Timing = Timing(),
        identity: str | None = None,
        on_lost: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.timing = timing
        self.identity = identity or f"{os.uname().nodename}_{uuid.uuid4().hex[:8]}"
        self._on_lost = on_lost or _exit_on_lost
        self._clock = clock
        self.leading = threading.Event()
        self._stop = threading.Event()
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and release the Lease if this process holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timing.retry_period * 2)
        if self.leading.is_set():
            try:
                current = self.api.get_lease_blocking(self.namespace, self.name)
                if current is not None and holder_of(current) == self.identity:
                    self.api.write_lease_blocking(released_lease(current), create=False)
                    logger.info("leader election: released Lease %s/%s", self.namespace, self.name)
            except ApiError as error:
                logger.warning("leader election: could not release the Lease: %s", error)
            # No longer renewed, so no longer ours to act on (ddpjob_operator_leader reads this event).
            self.leading.clear()

    def _run(self) -> None:
        logger.info(
            "leader election: %s waiting to lead through Lease %s/%s",
            self.identity,
            self.namespace,
            self.name,
        )
        while not self._stop.is_set() and not self.leading.is_set():
            if self._try_acquire_or_renew():
                self.leading.set()
                logger.info("leader election: %s leads; starting the controller", self.identity)
                break
            self._stop.wait(self.timing.retry_period)
        last_renewed = self._clock()
        while not self._stop.is_set():
            self._stop.wait(self.timing.retry_period)
            if self._stop.is_set():
                return
            if self._try_acquire_or_renew():
                last_renewed = self._clock()
            elif self._clock() - last_renewed >= self.timing.renew_deadline:
                logger.critical(
                    "leader election: %s could not renew Lease %s/%s within %.0fs; another operator may "
                    "lead now: stopping",
                    self.identity,
                    self.namespace,
                    self.name,
                    self.timing.renew_deadline,
                )
                self._on_lost()
                return

    def _try_acquire_or_renew(self) -> bool:
        try:
            current = self.api.get_lease_blocking(self.namespace, self.name)
            now = self._clock()
            if current is not None:
                record = (holder_of(current), str((current.get("spec") or {}).get("renewTime")))
                if record != self._observed:
                    self._observed, self._observed_at = record, now
                holder = record[0]
                expired = now - self._observed_at >= self.timing.lease_duration
                if holder and holder != self.identity and not expired:
                    return False
            lease = next_lease(
                current,
                self.namespace,
                self.name,
                self.identity,
                self.timing.lease_duration,
                datetime.now(UTC),
            )
            written = self.api.write_lease_blocking(lease, create=current is None)
        except Conflict:
            return False
        except (ApiError, OSError) as error:
            logger.warning("leader election: %s", error)
            return False
        except Exception as error:  # urllib3's connection errors: the apiserver is away, try again
            logger.warning("leader election: %s", error)
            return False
        self._observed = (holder_of(written), str((written.get("spec") or {}).get("renewTime")))
        self._observed_at = self._clock()
        return True


def _exit_on_lost() -> None:
    logging.shutdown()
    os._exit(1)
