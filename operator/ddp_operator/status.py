"""A DDPJob's status as the phase machine writes it: built from a ``Transition``, compared with the old
status for a write, and its conditions read back.

Every field the build writes is one of ``_Written``'s, in JSON's camelCase, so the keys compared for
"changed" (``STATUS_KEYS``) are the keys the build can write: a new field is compared without a second
list to keep in step (tests/unit/test_status.py checks each key's change alone is a change).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Final

from ddp_operator import names
from ddp_operator.observe import PodObservation, format_time, int_field, parse_time
from ddp_operator.policies import accounting, elastic, straggler
from ddp_operator.spec import JobSpec


@dataclass(frozen=True)
class Counts:
    replicas: int = 0
    ready: int = 0
    succeeded: int = 0
    failed: int = 0


def count_pods(pods: Sequence[PodObservation]) -> Counts:
    return Counts(
        replicas=len(pods),
        ready=sum(1 for p in pods if p.ready and not p.deleting and not p.terminal),
        succeeded=sum(1 for p in pods if p.trainer_succeeded),
        failed=sum(1 for p in pods if p.trainer_failed),
    )


@dataclass(frozen=True)
class Transition:
    """What a decision changes in status; the build keeps the rest as the old status says."""

    phase: str
    reason: str
    message: str
    counts: Counts = field(default_factory=Counts)
    attempt: int | None = None
    restarts: int = 0
    # Retries that did not spend backoffLimit (preemptions); None: as the old status says.
    preemptions: int | None = None
    start_time: str | None = None
    completion_time: str | None = None
    # What the operator read of the training (status.progress, status.straggler), when shown.
    progress: Mapping[str, Any] | None = None
    straggler: Mapping[str, Any] | None = None
    # status.lastRestart, status.goodput, status.podReplacements; None: as the old status says.
    last_restart: Mapping[str, Any] | None = None
    goodput: float | None = None
    pod_replacements: int | None = None
    # A straggler's pod replaced (policies.straggler): the job's count of those and its nodes to avoid.
    straggler_replacements: int | None = None
    avoided_nodes: tuple[str, ...] | None = None
    # An elastic job's pods in the group as rank 0 last said, and the resizes so far; None: as the old
    # status says.
    group_replicas: int | None = None
    resizes: int | None = None
    # status.ranksCreated: the attempt whose every rank's pod has been observed; None: as the old
    # status says.
    ranks_created: int | None = None


def conditions(
    old: Sequence[Mapping[str, Any]], phase: str, reason: str, message: str, now: str
) -> list[Any]:
    """Each condition type is True exactly while the phase has its name; times change only on a flip."""
    result: list[dict[str, Any]] = []
    seen = False
    for condition in old:
        updated = dict(condition)
        kind = condition.get("type")
        was_true = condition.get("status") == "True"
        if kind == phase:
            seen = True
            updated.update(status="True", reason=reason, message=message)
            if not was_true:
                updated["lastTransitionTime"] = now
        elif was_true:
            updated.update(status="False", reason=reason, message=message, lastTransitionTime=now)
        result.append(updated)
    if not seen and phase in names.CONDITION_TYPES:
        result.append(
            {"type": phase, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
        )
    return result


@dataclass(frozen=True)
class _Written:
    """Every field the build writes, as snake_case of its JSON key, in the order written; None: absent."""

    phase: str
    conditions: list[Any]
    observed_generation: int
    replicas: int
    ready_replicas: int
    ready: str
    succeeded_replicas: int
    failed_replicas: int
    restarts: int
    world_size: int
    attempt: int | None = None
    ranks_created: int | None = None
    preemptions: int | None = None
    start_time: str | None = None
    completion_time: str | None = None
    progress: dict[str, Any] | None = None
    straggler: dict[str, Any] | None = None
    last_restart: dict[str, Any] | None = None
    goodput: Any = None
    lost_seconds: dict[str, Any] | None = None
    pod_replacements: int | None = None
    straggler_replacements: int | None = None
    avoided_nodes: list[str] | None = None
    elastic: dict[str, int] | None = None
    # Where the ranks landed (policies.topology); observed and written by the controller, kept here.
    topology: dict[str, Any] | None = None
    # The attempt's rendezvous pod (policies.rendezvous records it as it creates one; kept here).
    rendezvous_pod: str | None = None

    def as_status(self) -> dict[str, Any]:
        values = ((key, getattr(self, name)) for name, key in _FIELD_KEYS)
        return {key: value for key, value in values if value is not None}


def _json_key(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


_FIELD_KEYS: Final = tuple((f.name, _json_key(f.name)) for f in fields(_Written))
# The status fields the build owns: a change to any of them is a change to write.
STATUS_KEYS: Final = tuple(key for _, key in _FIELD_KEYS)


def _optional_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def build_status(job: JobSpec, old: Mapping[str, Any], change: Transition, now: datetime) -> dict[str, Any]:
    """The status ``change`` makes of ``old``."""
    preemptions = (
        change.preemptions if change.preemptions is not None else int_field(old.get("preemptions"), 0)
    )
    last_restart = change.last_restart if change.last_restart is not None else old.get("lastRestart")
    replaced = change.pod_replacements if change.pod_replacements is not None else old.get("podReplacements")
    created = change.ranks_created if change.ranks_created is not None else old.get("ranksCreated")
    shown_elastic = None
    world_size = job.world_size
    if job.elastic is not None:
        shown_elastic = elastic.elastic_status(
            job.elastic, job.replicas, old.get("elastic"), change.group_replicas, change.resizes
        )
        world_size = shown_elastic["replicas"] * job.nproc_per_node
    return _Written(
        phase=change.phase,
        conditions=conditions(
            old.get("conditions") or [], change.phase, change.reason, change.message, format_time(now)
        ),
        observed_generation=job.generation,
        replicas=change.counts.replicas,
        ready_replicas=change.counts.ready,
        # For the Ready printer column, which can only show one field: "<ready ranks>/<ranks>".
        ready=f"{change.counts.ready}/{job.replicas}",
        succeeded_replicas=change.counts.succeeded,
        failed_replicas=change.counts.failed,
        restarts=change.restarts,
        world_size=world_size,
        attempt=change.attempt,
        ranks_created=_optional_int(created),
        preemptions=preemptions or None,
        start_time=change.start_time,
        completion_time=change.completion_time,
        progress=dict(change.progress) if change.progress else None,
        straggler=dict(change.straggler) if change.straggler else None,
        last_restart=dict(last_restart) if isinstance(last_restart, Mapping) else None,
        goodput=f"{change.goodput:.3f}" if change.goodput is not None else old.get("goodput"),
        lost_seconds=accounting.lost_seconds(old.get("lostSeconds"), old.get("lastRestart"), last_restart),
        pod_replacements=replaced if isinstance(replaced, int) and replaced else None,
        straggler_replacements=(
            change.straggler_replacements
            if change.straggler_replacements is not None
            else straggler.replaced_so_far(old)
        )
        or None,
        avoided_nodes=list(
            change.avoided_nodes if change.avoided_nodes is not None else straggler.avoided_nodes(old)
        )
        or None,
        elastic=shown_elastic,
        topology=old.get("topology") if job.scheduling.topology is not None else None,
        rendezvous_pod=old.get("rendezvousPod") if isinstance(old.get("rendezvousPod"), str) else None,
    ).as_status()


def status_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``new`` differs from ``old`` in a field the build writes: a status write is due."""
    return any(new.get(key) != old.get(key) for key in STATUS_KEYS)


def failed_status(status: Mapping[str, Any], reason: str, message: str, now: datetime) -> dict[str, Any]:
    """``status`` moved to Failed for a reason found outside ``decide`` (a refused create, an invalid spec)."""
    old: Mapping[str, Any] = status or {}
    result = dict(old)
    timestamp = format_time(now)
    result.update(
        phase=names.PHASE_FAILED,
        conditions=conditions(old.get("conditions") or [], names.PHASE_FAILED, reason, message, timestamp),
        restarts=int_field(old.get("restarts"), 0),
        startTime=old.get("startTime") or timestamp,
        completionTime=timestamp,
    )
    return result


def _true_condition(old: Mapping[str, Any], kind: Any) -> Mapping[str, Any] | None:
    for condition in old.get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return condition  # type: ignore[no-any-return]
    return None


def condition_message(old: Mapping[str, Any], kind: str) -> str | None:
    """The message of the condition ``kind`` while it is True."""
    condition = _true_condition(old, kind)
    return str(condition.get("message", "")) if condition is not None else None


def condition_reason(old: Mapping[str, Any]) -> str | None:
    """The reason of the phase's condition while it is True."""
    condition = _true_condition(old, old.get("phase"))
    return str(condition.get("reason", "")) if condition is not None else None


def condition_time(old: Mapping[str, Any], kind: str) -> datetime | None:
    """When the condition ``kind`` turned True, None if it is not True."""
    condition = _true_condition(old, kind)
    return parse_time(condition.get("lastTransitionTime")) if condition is not None else None


def condition_ended_at(old: Mapping[str, Any], kind: str) -> datetime | None:
    """When the condition ``kind`` last turned False (the job left that phase), None if it is not False."""
    for condition in old.get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "False":
            return parse_time(condition.get("lastTransitionTime"))
    return None
