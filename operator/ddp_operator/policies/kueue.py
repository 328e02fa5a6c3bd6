"""Kueue's pod groups (docs/scheduling.md): what a decision does so that Kueue neither deletes a new
attempt's pods as excess nor holds a group's quota for pods that will never come back.

Kueue counts every pod of a group that is not Failed (v0.17 ``isPodRunnableOrSucceeded``), keeps its
finalizer on each, and waits for replacements of pods that go. So between attempts the operator
releases the old pods Kueue still counts; a failed job marks one pod retriable-in-group "false" (Kueue
then ends the group); a suspended job deletes the group's Workload (quota back; resuming queues again).
Pure: pod observations in, ``KueueActions`` out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from ddp_operator import names
from ddp_operator.observe import PodObservation


@dataclass(frozen=True)
class KueueActions:
    """What the executor does to Kueue's view of a job's group."""

    # Pods of old attempts whose Kueue finalizer the operator removes, because Kueue would count them
    # in the group and delete the next attempt's pods as excess.
    release_pods: tuple[str, ...] = ()
    # Of those, the ones whose deletion no kubelet confirms: deleted at once (grace 0) so they stop
    # counting (the pod GC does the same for a node that is gone).
    force_delete_pods: tuple[str, ...] = ()
    # The pod annotated retriable-in-group "false" when the job failed for good, so Kueue frees the quota.
    mark_unretriable: tuple[str, ...] = ()
    # Delete the group's Kueue Workload (a suspended job gives its quota back; resuming queues again).
    release_group: bool = False


NONE = KueueActions()


def release_stale(
    stale: Sequence[PodObservation], now: datetime, unconfirmed_deletion_seconds: float
) -> KueueActions:
    """Old pods Kueue still counts in the group: their finalizer goes once they are terminal or their
    deletion is overdue; an overdue one is also deleted at once (grace 0), as no kubelet will confirm it."""
    held = [p for p in stale if p.kueue_counts_active and p.deleting]
    overdue = [
        p
        for p in held
        if p.deletion_deadline is not None
        and (now - p.deletion_deadline).total_seconds() >= unconfirmed_deletion_seconds
    ]
    release = sorted(p.name for p in held if p.kueue_finalizer and (p.terminal or p in overdue))
    return KueueActions(release_pods=tuple(release), force_delete_pods=tuple(sorted(p.name for p in overdue)))


def still_counted(stale: Sequence[PodObservation]) -> list[PodObservation]:
    """Old pods Kueue still counts (Succeeded, or deleted on a node that never confirmed): the next
    attempt waits until they stop counting, else Kueue would delete its pods as excess."""
    return [p for p in stale if p.kueue_counts_active]


def give_up(queued: bool, phase: str, pods: Sequence[PodObservation]) -> KueueActions:
    """A failed job's Kueue group: one pod says retriable-in-group "false", so Kueue ends the group and
    frees its quota once no pod of it is active (otherwise Kueue waits for replacements forever).
    ``queued``: the job runs through Kueue (spec.kueue)."""
    if not queued or phase != names.PHASE_FAILED:
        return NONE
    managed = [p for p in pods if p.kueue_group is not None and p.kueue_finalizer]
    if not managed or any(p.kueue_unretriable for p in pods):
        return NONE
    return KueueActions(mark_unretriable=(min(p.name for p in managed),))


def suspend(queued: bool, pods: Sequence[PodObservation]) -> KueueActions:
    """Kueue keeps a group's quota while its pods are gone, waiting for replacements: a suspended job
    gives it back by ending the group (Kueue's Workload), and queues again when resumed."""
    return KueueActions(release_group=queued and any(p.kueue_finalizer for p in pods))
