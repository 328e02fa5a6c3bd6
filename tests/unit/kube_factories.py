"""Builders of DDPJob and pod objects as the apiserver returns them, for table-driven unit tests."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

from ddp_operator import names
from ddp_operator.observe import LAUNCHER_EXIT_MARKER, PodObservation, format_time, observe_pod, seen
from ddp_operator.spec import JobSpec, parse_job

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
JOB_UID = "uid-1234"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def job_object(name: str = "mnist", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "replicas": 2,
        "template": {"spec": {"containers": [{"name": "trainer", "image": "ddp-trainer:1"}]}},
    }
    body.update(spec)
    return {
        "apiVersion": names.API_GROUP_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "namespace": "team-a", "uid": JOB_UID, "generation": 1},
        "spec": body,
    }


def job_spec(name: str = "mnist", **spec: Any) -> JobSpec:
    return parse_job(job_object(name, **spec))


def with_run_policy(**policy: Any) -> dict[str, Any]:
    return {"runPolicy": policy}


# The status of a 2-rank job whose attempt 0 has been Running since T0 (what progress is read for).
RUNNING_STATUS: dict[str, Any] = {
    "phase": "Running",
    "attempt": 0,
    "replicas": 2,
    "startTime": format_time(T0),
    "conditions": [],
}


def pod(
    rank: int,
    attempt: int = 0,
    *,
    job: str = "mnist",
    phase: str = "Running",
    ready: bool | None = None,
    scheduled: bool = True,
    created: float = 0.0,
    exit_code: int | None = None,
    reason: str | None = None,
    finished: float | None = None,
    waiting: str | None = None,
    unschedulable: str | None = None,
    deleting_at: float | None = None,
    pod_reason: str | None = None,
    disruption: str | None = None,
    owner_uid: str = JOB_UID,
    phase_lags: bool = False,
    replacement: int = 0,
    launcher_killed: bool = False,
) -> dict[str, Any]:
    """A rank pod; a given exit_code makes the trainer terminated (phase defaults from the code, unless
    phase_lags: a real kubelet keeps the phase Running until it has torn the pod's sandbox down). The
    trainer's launcher leaves its last word in the termination message, unless ``launcher_killed`` (the
    container was killed from outside, launcher and all)."""
    metadata: dict[str, Any] = {
        "name": names.pod_name(job, rank, attempt, replacement),
        "namespace": "team-a",
        "uid": f"pod-{rank}-{attempt}-{replacement}",
        "creationTimestamp": format_time(at(created)),
        "labels": {
            **names.rank_labels(job, rank, attempt),
            **({names.LABEL_REPLACEMENT: str(replacement)} if replacement else {}),
        },
        "ownerReferences": [{"kind": names.KIND, "name": job, "uid": owner_uid, "controller": True}],
    }
    if deleting_at is not None:
        metadata["deletionTimestamp"] = format_time(at(deleting_at + 30))
        metadata["deletionGracePeriodSeconds"] = 30
    conditions: list[dict[str, Any]] = []
    if unschedulable is not None:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
        phase = "Pending"
    else:
        conditions.append({"type": "PodScheduled", "status": "True" if scheduled else "False"})
    state: dict[str, Any] = {"running": {"startedAt": format_time(at(created + 1))}}
    if exit_code is not None:
        state = {
            "terminated": {
                "exitCode": exit_code,
                "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                "finishedAt": format_time(at(finished if finished is not None else created + 10)),
            }
        }
        if not launcher_killed:
            state["terminated"]["message"] = f"{LAUNCHER_EXIT_MARKER} code={exit_code}\n"
        if phase == "Running" and not phase_lags:
            phase = "Succeeded" if exit_code == 0 else "Failed"
    elif waiting is not None:
        state = {"waiting": {"reason": waiting, "message": f"{waiting} for ddp-trainer:1"}}
        phase = "Pending"
    if ready is None:
        ready = phase == "Running"
    conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    if disruption is not None:
        conditions.append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "containerStatuses": [{"name": "trainer", "state": state}],
    }
    if pod_reason is not None:
        status["reason"] = pod_reason
    spec: dict[str, Any] = {"nodeName": f"node-{rank}"} if scheduled and unschedulable is None else {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": status}


def standby_pod(number: int, attempt: int = 0, **state: Any) -> dict[str, Any]:
    """A standby pod as the apiserver returns it (a rank pod's status; its own name and labels)."""
    made = pod(9, attempt, **state)
    made["metadata"]["name"] = names.standby_pod_name("mnist", attempt, number)
    labels = made["metadata"]["labels"]
    del labels[names.LABEL_RANK]
    labels |= {names.LABEL_ROLE: names.ROLE_STANDBY, names.LABEL_STANDBY: str(number)}
    return made


def observe(*pods: dict[str, Any], seen_at: float = 0.0) -> list[PodObservation]:
    """Observations as the pod cache holds them: a bad end first seen at ``seen_at`` (seconds after T0)."""
    return [seen(observe_pod(copy.deepcopy(p)), None, at(seen_at)) for p in pods]


def kueue_job(name: str = "mnist", queue: str = "team-a-gpus", **spec: Any) -> JobSpec:
    """A job labelled for a Kueue LocalQueue (its rank pods form one Kueue plain-pod group)."""
    body = job_object(name, **spec)
    body["metadata"]["labels"] = {names.KUEUE_QUEUE_LABEL: queue}
    return parse_job(body)


def kueue_managed(
    pod_object: dict[str, Any],
    *,
    gated: bool = False,
    finalizer: bool = True,
    stopped_by: str | None = None,
    stop_message: str = "Preempted to accommodate a workload due to prioritization in the ClusterQueue",
    unretriable: bool = False,
    node: str | None = "node-1",
) -> dict[str, Any]:
    """``pod_object`` as Kueue's webhook and controller leave it: group label, finalizer, admission gate,
    and the TerminationTarget condition Kueue sets (reason ``stopped_by``) before it deletes a pod."""
    meta = pod_object["metadata"]
    meta["labels"][names.KUEUE_POD_GROUP_LABEL] = names.kueue_pod_group_name(
        meta["labels"][names.LABEL_JOB_NAME], JOB_UID
    )
    meta["labels"][names.KUEUE_MANAGED_LABEL] = "true"
    if finalizer:
        meta["finalizers"] = [names.KUEUE_POD_FINALIZER]
    if unretriable:
        meta.setdefault("annotations", {})[names.KUEUE_RETRIABLE_IN_GROUP_ANNOTATION] = "false"
    spec = pod_object.setdefault("spec", {})
    if gated:
        spec.pop("nodeName", None)
        spec["schedulingGates"] = [{"name": names.KUEUE_ADMISSION_GATE}]
        pod_object["status"] = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}],
        }
    elif node is not None:
        spec["nodeName"] = node
    if stopped_by is not None:
        pod_object["status"].setdefault("conditions", []).append(
            {"type": "TerminationTarget", "status": "True", "reason": stopped_by, "message": stop_message}
        )
    return pod_object
