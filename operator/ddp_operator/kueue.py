"""What the operator reads of Kueue, as plain data for ``reconcile.decide()`` (pure: no API calls).

A DDPJob labelled with a LocalQueue is one Kueue plain-pod group (builders.kueue_pod_metadata). While
Kueue gates its pods, the job is Queued, and the status names what Kueue says: the LocalQueue, the
ClusterQueue behind it and why the group's Kueue Workload is not admitted yet. The executor reads that
Workload (named after the group) and, before it is admitted, the LocalQueue; this module turns them
into a ``QueueObservation``. Kueue's API (``kueue.x-k8s.io/v1beta2``, Kueue v0.15 and later) is read
only here and in kube_api's path table.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

KUEUE_API_VERSION: Final = "kueue.x-k8s.io/v1beta2"
# kube_api's kinds for Kueue's objects ("Workload" alone is the in-tree scheduling.k8s.io kind).
KUEUE_WORKLOAD_KIND: Final = "KueueWorkload"
LOCAL_QUEUE_KIND: Final = "LocalQueue"
# While queued, the operator reads Kueue's view at most this often per job, and looks again this often
# without a pod event (Kueue's reason can change when other jobs come and go).
REFRESH_SECONDS: Final = 10.0
QUEUED_POLL_SECONDS: Final = 30.0
# Kueue's messages can be long (one line per flavor tried): the condition keeps this much.
MAX_MESSAGE: Final = 300


@dataclass(frozen=True)
class QueueObservation:
    """Kueue's view of a job's group: what it said, not a decision."""

    workload: str  # the Kueue Workload (named after the group)
    local_queue: str
    cluster_queue: str | None = None
    admitted: bool = False
    # Why the Workload waits (QuotaReserved False, Inadmissible LocalQueue, ...); None when unknown.
    message: str | None = None
    # The Kueue Workload does not exist (yet): Kueue creates it once every rank pod exists.
    missing: bool = False


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition  # type: ignore[no-any-return]
    return None


def observe_queue(
    workload_name: str,
    local_queue: str,
    workload: Mapping[str, Any] | None,
    local_queue_object: Mapping[str, Any] | None,
) -> QueueObservation:
    """Kueue's Workload and LocalQueue (either may be None: not found, or not readable) in one record."""
    cluster_queue = str((local_queue_object or {}).get("spec", {}).get("clusterQueue") or "") or None
    if workload is None:
        return QueueObservation(workload_name, local_queue, cluster_queue, missing=True)
    admission = (workload.get("status") or {}).get("admission") or {}
    cluster_queue = str(admission.get("clusterQueue") or "") or cluster_queue
    admitted = _condition(workload, "Admitted")
    if admitted is not None and admitted.get("status") == "True":
        return QueueObservation(workload_name, local_queue, cluster_queue, admitted=True)
    message = None
    for kind in ("QuotaReserved", "Evicted", "Admitted"):
        condition = _condition(workload, kind)
        if condition is not None and condition.get("message"):
            message = " ".join(str(condition["message"]).split())
            break
    if message is not None and len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return QueueObservation(workload_name, local_queue, cluster_queue, message=message)


def queued_message(
    gated: int, replicas: int, attempt: int, queue: QueueObservation | None, local_queue: str
) -> str:
    """The Queued condition's message: what waits, in which queues, and Kueue's own reason."""
    where = f"LocalQueue {local_queue}"
    if queue is not None and queue.cluster_queue:
        where += f" (ClusterQueue {queue.cluster_queue})"
    text = (
        f"waiting for Kueue to admit the gang in {where}: {gated} of {replicas} rank pod(s) of "
        f"attempt {attempt} are gated"
    )
    if queue is None:
        return text
    if queue.missing:
        return f"{text}; Kueue has not created Workload {queue.workload} yet"
    if queue.message:
        return f"{text}; Workload {queue.workload}: {queue.message}"
    return f"{text}; Workload {queue.workload}"
