"""What the decision code needs to know about one rank pod, read once from the pod object.

``observe_pod`` takes a pod as the apiserver returns it (a plain mapping: kopf's body or a client's
``to_dict()`` with camelCase keys) and never raises on missing fields: a pod that was just created has
almost no status yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from ddp_operator import names

IMAGE_PULL_FAILURES: Final = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable"}
)

# DisruptionTarget reasons (set by the scheduler, taint manager, eviction API, kubelet and pod GC),
# mapped to the reason a job reports when such a pod ends an attempt.
_DISRUPTION_REASONS: Final = {
    "PreemptionByScheduler": "Preempted",
    "PreemptionByKubeScheduler": "Preempted",
    "DeletionByTaintManager": "Evicted",
    "EvictionByEvictionAPI": "Evicted",
    "TerminationByKubelet": "Evicted",
    "DeletionByPodGC": "PodDeleted",
}
# Kueue's pod condition, set on every pod of a plain-pod group just before Kueue deletes it
# (kueue pkg/controller/jobs/pod: ConditionTypeTerminationTarget), with Kueue's stop reason. An
# eviction from the queue reads "WorkloadEvicted", or for a group "WorkloadEvictedDueTo<the Workload's
# Evicted reason>" (jobframework/reconciler.go stopJob): Preempted, PodsReadyTimeout, Deactivated, ...
KUEUE_TERMINATION_TARGET: Final = "TerminationTarget"
# A process that ended by a signal exits 128 + its number.
SIGNAL_EXIT_CODES: Final = 128
# The trainer's launcher writes this to its container's termination message whenever it exits by its
# own decision (ddp_trainer.exitcodes.LAUNCHER_EXIT_MARKER; a unit test keeps the two equal).
LAUNCHER_EXIT_MARKER: Final = "ddp-launcher-exit"
KUEUE_EVICTED: Final = "WorkloadEvicted"
_KUEUE_STOP_REASONS: Final = {
    KUEUE_EVICTED: "Preempted",
    f"{KUEUE_EVICTED}DueToPreempted": "Preempted",
    # The Kueue Workload was deleted (by a user): the pods go like pods deleted under the job.
    "WorkloadDeleted": "PodDeleted",
}
# metav1.Time (creationTimestamp, startTime, a condition's time) is written to the whole second.
API_TIME_RESOLUTION_SECONDS: Final = 1.0


def parse_time(value: Any) -> datetime | None:
    """An RFC 3339 timestamp from the apiserver (or a datetime from a typed client)."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value
    text = str(value)
    if text.endswith("Z"):
        text = text[:-1] + "+00:00"
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def format_time(value: datetime) -> str:
    """The apiserver's own format: UTC, whole seconds, a trailing Z (a naive datetime is taken as UTC)."""
    if value.tzinfo is not None:
        value = value.astimezone(UTC)
    return value.strftime("%Y-%m-%dT%H:%M:%SZ")


def int_field(value: Any, default: int) -> int:
    """An integer field as an object holds it (a bool is not one), else ``default``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


@dataclass(frozen=True)
class PodObservation:
    name: str
    rank: int | None
    attempt: int | None
    # 0 for the rank's first pod of the attempt; n for the n-th that replaced a lost one (docs/restarts.md).
    replacement: int = 0
    # The spec version that built it (names.LABEL_SPEC_HASH); None on pods of older operators.
    spec_hash: str | None = None
    phase: str = "Pending"
    uid: str = ""
    node: str = ""  # spec.nodeName once scheduled
    pod_ip: str = ""
    owner_uid: str | None = None
    created_at: datetime | None = None
    deleting: bool = False
    # When the deletion was requested: deletionTimestamp is that instant plus the grace period.
    deleted_at: datetime | None = None
    # deletionTimestamp itself: by then a live kubelet has confirmed the deletion (or will in seconds).
    deletion_deadline: datetime | None = None
    scheduled: bool = False
    unschedulable_message: str | None = None
    # spec.priority, which the apiserver's Priority admission resolves from priorityClassName (a
    # standby's is below its ranks' unless the classes say otherwise: policies.standby).
    priority: int | None = None
    ready: bool = False
    started_at: datetime | None = None
    # The trainer container's termination (or, when it never ran, the first failed init container's).
    terminated: bool = False
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    finished_at: datetime | None = None
    waiting_reason: str | None = None
    waiting_message: str | None = None
    # Evicted, preempted or removed by node loss: the job-facing reason, or None.
    disruption: str | None = None
    # What the component that disrupted the pod said (Kueue's eviction message, for one).
    disruption_message: str | None = None
    # Kueue evicted the pod's group from its queue (preempted, or requeued): not the job's failure.
    evicted_by_queue: bool = False
    # The taint manager deleted it because its node stopped being Ready (unreachable, not ready): no
    # kubelet may be left to honour the grace period, so nothing waits for it.
    node_lost: bool = False
    # Kueue (docs/scheduling.md): the group the pod belongs to, whether Kueue still gates it (the
    # group is not admitted), whether Kueue's finalizer holds the pod object, and whether the pod tells
    # Kueue the group failed for good (retriable-in-group "false").
    kueue_group: str | None = None
    kueue_managed: bool = False  # Kueue's webhook took the pod (its managed label): Kueue counts it
    kueue_gated: bool = False
    kueue_finalizer: bool = False
    kueue_unretriable: bool = False
    finalizers: tuple[str, ...] = ()
    # The job's rendezvous pod (names.ROLE_RENDEZVOUS), which is no rank's: rank is None on it.
    rendezvous: bool = False
    # A standby pod's number (names.LABEL_STANDBY), kept once it has been given a rank; and whether
    # it still waits for one (names.ROLE_STANDBY: rank is None on it then).
    standby: int | None = None
    standby_waiting: bool = False
    # When a standby pod was given its rank (names.ANNOTATION_ASSIGNED_AT): for the group, its start.
    assigned_at: datetime | None = None
    # The trainer container's CPU request in the pod's spec, and on a standby that waits with less
    # (policies.standby.waiting_cpu) the request of its rank (names.ANNOTATION_RANK_CPU).
    cpu_request: str | None = None
    rank_cpu: str | None = None
    # The rendezvous order key the operator wrote on the bound pod (names.ANNOTATION_RANK_ORDER,
    # policies.topology.order_key); None until then, and on a job whose ranks are not ordered.
    rank_order: str | None = None
    # When this operator first saw the pod end badly (failed, disrupted, deleted): when a report
    # arrived, not when the failure happened. Set by the pod cache (see ``seen``), None elsewhere.
    failure_seen_at: datetime | None = None

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def trainer_succeeded(self) -> bool:
        return self.phase == "Succeeded" or (self.terminated and self.exit_code == 0)

    @property
    def launcher_killed(self) -> bool:
        """The trainer container ended by a signal (exit >= 128) without its launcher's last word: killed
        from outside, launcher and all (the pod's memory limit, a kill of the container), so nothing in
        the pod restarted in place."""
        code = self.exit_code
        return (
            self.terminated
            and code is not None
            and code >= SIGNAL_EXIT_CODES
            and LAUNCHER_EXIT_MARKER not in (self.message or "")
        )

    @property
    def trainer_failed(self) -> bool:
        if self.terminated and self.exit_code not in (None, 0):
            return True
        return self.phase == "Failed" and not self.trainer_succeeded

    @property
    def running(self) -> bool:
        return self.phase == "Running" and not self.deleting

    @property
    def refuses_root_image(self) -> bool:
        """The kubelet will not start the trainer: runAsNonRoot with an image that runs as root (or as a
        non-numeric user it cannot check). Waiting cannot help; the pod would wait forever."""
        return self.waiting_reason == "CreateContainerConfigError" and "runAsNonRoot" in (
            self.waiting_message or ""
        )

    @property
    def ended_badly(self) -> bool:
        """The trainer failed, or the pod was disrupted or deleted before its trainer succeeded."""
        if self.trainer_succeeded:
            return False
        return self.trainer_failed or self.disruption is not None or self.deleting

    @property
    def reported_end(self) -> bool:
        """Whatever happened to this rank has been reported: it will not change its story any more."""
        return self.terminal or self.terminated or self.disruption is not None or self.deleting

    @property
    def kueue_counts_active(self) -> bool:
        """Kueue still counts this pod in its group (v0.17 `isPodRunnableOrSucceeded`): anything but
        Failed, or deleted before it had a node. Such a pod of an old attempt makes the new attempt's
        pods "excess", and Kueue deletes those."""
        if self.kueue_group is None or not self.kueue_managed:
            return False
        if self.deleting and not self.node:
            return False
        return self.phase != "Failed"

    def deletion_unconfirmed(self, now: datetime, margin_seconds: float) -> bool:
        """Deleted, and no kubelet confirmed it ``margin_seconds`` after its grace period ended.

        A kubelet on an unreachable node never confirms a deletion: such a pod stays Terminating until
        the node returns or the Node object goes. It no longer blocks anything of this job.
        """
        if self.terminal or self.deletion_deadline is None:
            return False
        return (now - self.deletion_deadline).total_seconds() >= margin_seconds


def seen(observation: PodObservation, previous: PodObservation | None, now: datetime) -> PodObservation:
    """``observation`` stamped with when its bad end was first seen (kept from ``previous``)."""
    if not observation.ended_badly:
        return observation
    first = previous.failure_seen_at if previous is not None else None
    return replace(observation, failure_seen_at=first or now)


def superseded(pods: Sequence[PodObservation]) -> list[PodObservation]:
    """Pods a newer pod of the same rank and attempt replaced (docs/restarts.md): a rank's pod is its
    one with the highest replacement number, whether that one is being deleted or not."""
    newest: dict[tuple[int | None, int | None], int] = {}
    for p in pods:
        key = (p.attempt, p.rank)
        newest[key] = max(newest.get(key, 0), p.replacement)
    return [p for p in pods if p.replacement < newest[(p.attempt, p.rank)]]


def newest_per_rank(pods: Sequence[PodObservation], attempt: int | None) -> dict[int, PodObservation]:
    """Each rank's pod of ``attempt``: the one no other pod supersedes (``superseded``)."""
    old = superseded(pods)
    return {p.rank: p for p in pods if p.attempt == attempt and p.rank is not None and p not in old}


def _int_label(labels: Mapping[str, Any], key: str) -> int | None:
    value = labels.get(key)
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _condition(status: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for condition in status.get("conditions") or []:
        if condition.get("type") == kind:
            return condition  # type: ignore[no-any-return]
    return None


def _container_status(statuses: list[Any], name: str) -> Mapping[str, Any] | None:
    for status in statuses:
        if status.get("name") == name:
            return status  # type: ignore[no-any-return]
    return None


def _disruption(status: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The job-facing reason a pod was disrupted, and what the disrupting component said."""
    if status.get("reason") == "Evicted":
        return "Evicted", status.get("message")
    if status.get("reason") == "Preempting":
        return "Preempted", status.get("message")
    kueue = _condition(status, KUEUE_TERMINATION_TARGET)
    if kueue is not None and kueue.get("status") == "True":
        return _KUEUE_STOP_REASONS.get(str(kueue.get("reason")), "Evicted"), kueue.get("message")
    condition = _condition(status, "DisruptionTarget")
    if condition is not None and condition.get("status") == "True":
        return _DISRUPTION_REASONS.get(str(condition.get("reason")), "Evicted"), condition.get("message")
    return None, None


def _terminated(pod: Mapping[str, Any], trainer_state: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """How the trainer container ended, or the init container whose failure kept it from starting."""
    terminated: Mapping[str, Any] | None = trainer_state.get("terminated")
    if terminated is not None:
        return terminated
    # A trainer that never started because an init container failed: that container's ending decides.
    # Not a native sidecar's (an init container with restartPolicy Always): the kubelet restarts it,
    # and its brief terminated state says nothing about the rank.
    sidecars = {
        c.get("name")
        for c in (pod.get("spec") or {}).get("initContainers") or []
        if c.get("restartPolicy") == "Always"
    }
    for init in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if init.get("name") in sidecars:
            continue
        candidate = (init.get("state") or {}).get("terminated")
        if candidate and candidate.get("exitCode", 0) != 0:
            return candidate  # type: ignore[no-any-return]
    return None


def _waiting(status: Mapping[str, Any], trainer_state: Mapping[str, Any]) -> Mapping[str, Any]:
    """Why the trainer waits, or why another container of the pod cannot pull its image."""
    waiting: Mapping[str, Any] = trainer_state.get("waiting") or {}
    if waiting:
        return waiting
    for other in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        other_waiting = (other.get("state") or {}).get("waiting") or {}
        if other_waiting.get("reason") in IMAGE_PULL_FAILURES:
            return other_waiting
    return {}


def _disrupted_by(status: Mapping[str, Any], reason: str) -> bool:
    condition = _condition(status, "DisruptionTarget")
    return condition is not None and condition.get("status") == "True" and condition.get("reason") == reason


def observe_pod(pod: Mapping[str, Any]) -> PodObservation:
    metadata: Mapping[str, Any] = pod.get("metadata") or {}
    status: Mapping[str, Any] = pod.get("status") or {}
    labels: Mapping[str, Any] = metadata.get("labels") or {}
    owners = [o for o in metadata.get("ownerReferences") or [] if o.get("controller")]

    deletion = parse_time(metadata.get("deletionTimestamp"))
    grace = metadata.get("deletionGracePeriodSeconds") or 0
    deleted_at = deletion - timedelta(seconds=int(grace)) if deletion is not None else None

    scheduled = _condition(status, "PodScheduled")
    unschedulable = (
        str(scheduled.get("message") or "unschedulable")
        if scheduled is not None
        and scheduled.get("status") == "False"
        and scheduled.get("reason") == "Unschedulable"
        else None
    )
    ready = _condition(status, "Ready")
    trainer = _container_status(status.get("containerStatuses") or [], names.TRAINER_CONTAINER) or {}
    state: Mapping[str, Any] = trainer.get("state") or {}
    terminated = _terminated(pod, state)
    waiting = _waiting(status, state)
    exit_code = terminated.get("exitCode") if terminated else None
    disruption, disruption_message = _disruption(status)
    kueue_stop = _condition(status, KUEUE_TERMINATION_TARGET)
    evicted_by_queue = (
        kueue_stop is not None
        and kueue_stop.get("status") == "True"
        and str(kueue_stop.get("reason")).startswith(KUEUE_EVICTED)
    )
    finalizers = tuple(str(f) for f in metadata.get("finalizers") or [])
    annotations: Mapping[str, Any] = metadata.get("annotations") or {}
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return PodObservation(
        name=str(metadata.get("name", "")),
        rank=_int_label(labels, names.LABEL_RANK),
        attempt=_int_label(labels, names.LABEL_ATTEMPT),
        replacement=_int_label(labels, names.LABEL_REPLACEMENT) or 0,
        spec_hash=labels.get(names.LABEL_SPEC_HASH) or None,
        phase=str(status.get("phase") or "Pending"),
        uid=str(metadata.get("uid") or ""),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        pod_ip=str(status.get("podIP") or ""),
        owner_uid=str(owners[0].get("uid")) if owners else None,
        created_at=parse_time(metadata.get("creationTimestamp")),
        deleting=deletion is not None,
        deleted_at=deleted_at,
        deletion_deadline=deletion,
        scheduled=scheduled is not None and scheduled.get("status") == "True",
        unschedulable_message=unschedulable,
        priority=_priority(pod.get("spec") or {}),
        ready=ready is not None and ready.get("status") == "True",
        started_at=parse_time(status.get("startTime")),
        terminated=terminated is not None,
        exit_code=int(exit_code) if isinstance(exit_code, int) else None,
        reason=(terminated.get("reason") if terminated else None) or status.get("reason"),
        message=(terminated.get("message") if terminated else None) or status.get("message"),
        finished_at=parse_time(terminated.get("finishedAt")) if terminated else None,
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        disruption=disruption,
        disruption_message=disruption_message,
        evicted_by_queue=evicted_by_queue,
        node_lost=_disrupted_by(status, "DeletionByTaintManager"),
        kueue_group=labels.get(names.KUEUE_POD_GROUP_LABEL) or None,
        kueue_managed=labels.get(names.KUEUE_MANAGED_LABEL) == "true",
        kueue_gated=any(g.get("name") == names.KUEUE_ADMISSION_GATE for g in gates),
        kueue_finalizer=names.KUEUE_POD_FINALIZER in finalizers,
        kueue_unretriable=annotations.get(names.KUEUE_RETRIABLE_IN_GROUP_ANNOTATION) == "false",
        rank_order=str(annotations.get(names.ANNOTATION_RANK_ORDER) or "") or None,
        finalizers=finalizers,
        rendezvous=labels.get(names.LABEL_ROLE) == names.ROLE_RENDEZVOUS,
        standby=_int_label(labels, names.LABEL_STANDBY),
        standby_waiting=labels.get(names.LABEL_ROLE) == names.ROLE_STANDBY,
        assigned_at=parse_time(annotations.get(names.ANNOTATION_ASSIGNED_AT)),
        cpu_request=_trainer_cpu(pod.get("spec") or {}),
        rank_cpu=str(annotations.get(names.ANNOTATION_RANK_CPU) or "") or None,
    )


def _trainer_cpu(spec: Mapping[str, Any]) -> str | None:
    for container in spec.get("containers") or []:
        if container.get("name") == names.TRAINER_CONTAINER:
            value = ((container.get("resources") or {}).get("requests") or {}).get("cpu")
            return None if value is None else str(value)
    return None


def _priority(spec: Mapping[str, Any]) -> int | None:
    value = spec.get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
