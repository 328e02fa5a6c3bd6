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
    """``create``: the rendezvous pod to create (again: a 409 means it exists); ``record``: the name
    status.rendezvousPod holds after this decision; ``delete``: rendezvous pods to delete; ``lost``:
    the pod ``create`` replaces, and why (for the Event), when one was lost."""

    create: str | None = None
    record: str | None = None
    delete: tuple[str, ...] = ()
    lost: tuple[str, str] | None = None


NO_PLAN: Final = RendezvousPlan()


def replacement_number(job: str, attempt: int, name: str) -> int | None:
    """``name``'s place among the attempt's rendezvous pods (0: the first), None for a pod of another
    attempt or job."""
    first = names.rendezvous_pod_name(job, attempt)
    if name == first:
        return 0
    tail = name.removeprefix(f"{first}r")
    return int(tail) if tail != name and tail.isdigit() and not tail.startswith("0") else None


def why_lost(pod: PodObservation) -> str | None:
    """How a rendezvous pod was lost (deleted, its node gone, its store ended), None while it serves."""
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
    status.rendezvousPod said before it. Only a live attempt (Queued to Running) of a job whose store
    is apart has one; the pods of earlier attempts, and every one once the attempt is no longer live,
    go (a store holds nothing a finished job needs, whatever cleanPodPolicy keeps)."""
    stores = [p for p in pods if p.rendezvous]
    live = phase in names.LIVE_PHASES and isinstance(attempt, int) and rendezvous_apart(job)
    if not live or not isinstance(attempt, int):
        return RendezvousPlan(delete=_deletable(stores, keep=None))
    number = replacement_number(job.name, attempt, recorded) if isinstance(recorded, str) else None
    current = names.rendezvous_pod_name(job.name, attempt, number or 0)
    seen = next((p for p in stores if p.name == current), None)
    why = why_lost(seen) if seen is not None else None
    if why is None:
        # Not seen: created (again) by name, which costs only a 409 where it exists (created a moment
        # ago, not in the cache yet); a pod whose deletion completed has freed its name.
        create = current if seen is None else None
        return RendezvousPlan(create=create, record=current, delete=_deletable(stores, keep=current))
    new = names.rendezvous_pod_name(job.name, attempt, (number or 0) + 1)
    return RendezvousPlan(create=new, record=new, delete=_deletable(stores, keep=new), lost=(current, why))


def _deletable(stores: Sequence[PodObservation], keep: str | None) -> tuple[str, ...]:
    return tuple(sorted(p.name for p in stores if p.name != keep and not p.deleting))


def replaced_message(job: str, lost: tuple[str, str], new: str) -> str:
    """The RendezvousReplaced Event's text."""
    pod, why = lost
    return (
        f"the rendezvous pod {pod} was lost ({why}); {new} replaces it behind the same name "
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
    # No record says the attempt's first: only a replacement changes what the status holds.
    attempt = status.get("attempt")
    first = names.rendezvous_pod_name(job.name, attempt) if isinstance(attempt, int) else None
    if found.record is not None and status.get(STATUS_KEY, first) != found.record:
        report = replace(report, status={**status, STATUS_KEY: found.record}, changed=True)
    events = decision.events
    if found.lost is not None and found.create is not None:
        message = replaced_message(job.name, found.lost, found.create)
        events += (PhaseEvent(type="Warning", reason=REASON_RENDEZVOUS_REPLACED, message=message),)
    return replace(
        decision,
        report=report,
        create=replace(decision.create, rendezvous=found.create),
        delete=replace(decision.delete, pods=decision.delete.pods + found.delete),
        events=events,
    )
