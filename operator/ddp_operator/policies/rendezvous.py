"""The job's rendezvous pod (docs/restarts.md, "No rank is special"): which one the attempt has, a lost
one replaced alone, and which ones go.

A job whose pods restart in place and that has more than one pod (``recovery.rendezvous_apart``) keeps
the launchers' rounds in a store of its own pod. Its loss is one more lost pod: the ranks train on (no
supervisor needs the store while the group trains), a new pod of the same hostname takes its place,
and every supervisor reconnects to it and seeds it with what it holds (the trainer's
``ddp_trainer.supervisor.gang_store``). Nothing restarts and no backoffLimit is spent.

The pod the attempt has now is recorded in ``status.rendezvousPod`` when it is created, not inferred
from the pods seen: a replacement created a moment ago may not be in the pod cache yet while its lost
predecessor has already left it, and two live stores behind one DNS name would split the gang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from ddp_operator import names
from ddp_operator.decision import REASON_RENDEZVOUS_REPLACED, Decision, PhaseEvent
from ddp_operator.observe import PodObservation
from ddp_operator.policies.recovery import rendezvous_apart
from ddp_operator.spec import JobSpec

# The status field that names the attempt's rendezvous pod.
STATUS_KEY: Final = "rendezvousPod"


@dataclass(frozen=True)
class RendezvousPlan:
    """``create``: the rendezvous pod to create (again: a 409 means it exists); ``record``: what
    status.rendezvousPod says after this decision (None: unchanged); ``delete``: rendezvous pods to
    delete; ``replaced``: (lost pod, its replacement, how it was lost) once the replacement is seen."""

    create: str | None = None
    record: str | None = None
    delete: tuple[str, ...] = ()
    replaced: tuple[str, str, str] | None = None


def replacement_number(job: str, attempt: int, name: str) -> int | None:
    """``name``'s place among the attempt's rendezvous pods (0: the first), None for a pod of another
    attempt or job."""
    first = names.rendezvous_pod_name(job, attempt)
    if name == first:
        return 0
    tail = name.removeprefix(f"{first}r")
    return int(tail) if tail != name and tail.isdigit() and not tail.startswith("0") else None


def why_lost(pod: PodObservation | None) -> str | None:
    """How a rendezvous pod was lost (deleted, its node gone, its store ended, gone from the cluster),
    None while it serves."""
    if pod is None:
        return "it was deleted"
    if pod.node_lost:
        return "its node stopped reporting"
    if pod.deleting:
        return "it was deleted"
    if pod.terminal:
        return f"its store ended (the pod {pod.phase}{f', {pod.disruption}' if pod.disruption else ''})"
    return None


def plan(
    job: JobSpec, phase: str | None, attempt: object, pods: Sequence[PodObservation], recorded: object
) -> RendezvousPlan:
    """The rendezvous pods' part of a decision: ``pods`` are the job object's own, ``recorded`` what
    status.rendezvousPod said before it: the newest of the attempt's rendezvous pods the operator has
    seen. Only a live attempt (Queued to Running) of a job whose store is apart has one; the pods of
    earlier attempts, and every one once the attempt is no longer live, go (a store holds nothing a
    finished job needs, whatever cleanPodPolicy keeps).

    The newest seen is the one that serves; once it is lost (or gone: a pod it recorded and no longer
    sees), the next number replaces it. A pod not seen yet is created by name, which costs only a 409
    where it exists, so a replacement never gets a second number while the cache has not shown it."""
    stores = [p for p in pods if p.rendezvous]
    live = phase in names.LIVE_PHASES and isinstance(attempt, int) and rendezvous_apart(job)
    if not live or not isinstance(attempt, int):
        return RendezvousPlan(delete=_deletable(stores, keep=None))
    numbered = {n: p for p in stores if (n := replacement_number(job.name, attempt, p.name)) is not None}
    before = replacement_number(job.name, attempt, recorded) if isinstance(recorded, str) else None
    newest = max([*numbered, *([] if before is None else [before])], default=None)
    record = names.rendezvous_pod_name(job.name, attempt, newest) if newest is not None else None
    replaced = None
    if before is not None and newest is not None and newest > before:
        lost = names.rendezvous_pod_name(job.name, attempt, before)
        replaced = (lost, record or "", why_lost(numbered.get(before)) or "it was replaced")
    target = 0 if newest is None else newest
    if newest is not None and why_lost(numbered.get(newest)) is not None:
        target = newest + 1
    name = names.rendezvous_pod_name(job.name, attempt, target)
    return RendezvousPlan(
        create=None if target in numbered else name,
        record=record if record != recorded else None,
        delete=_deletable(stores, keep=name),
        replaced=replaced,
    )


def _deletable(stores: Sequence[PodObservation], keep: str | None) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in stores if p.name != keep and not p.deleting))


def replaced_message(job: str, lost: str, new: str, why: str) -> str:
    """The RendezvousReplaced Event's text."""
    return (
        f"the rendezvous pod {lost} was lost ({why}); {new} replaces it behind the same name "
        f"({names.rendezvous_hostname(job)}): the ranks train on, and each pod's supervisor reconnects "
        "to the new store when it next needs it (no restart, no backoffLimit spent)"
    )


def with_rendezvous(
    job: JobSpec, decision: Decision, old: Mapping[str, Any], pods: Sequence[PodObservation]
) -> Decision:
    """decide()'s step for the rendezvous pods: ``decision`` with ``plan``'s creates, deletes, record
    and Event (``old``: the status before the decision; ``pods``: the job object's own)."""
    status = decision.report.status
    found = plan(job, decision.phase, status.get("attempt"), pods, old.get(STATUS_KEY))
    report = decision.report
    if found.record is not None:
        report = replace(report, status={**status, STATUS_KEY: found.record}, changed=True)
    events = decision.events
    if found.replaced is not None:
        lost, new, why = found.replaced
        message = replaced_message(job.name, lost, new, why)
        events += (PhaseEvent(type="Warning", reason=REASON_RENDEZVOUS_REPLACED, message=message),)
    return replace(
        decision,
        report=report,
        create=replace(decision.create, rendezvous=found.create),
        delete=replace(decision.delete, pods=decision.delete.pods + found.delete),
        events=events,
    )
