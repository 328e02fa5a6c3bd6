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
from datetime import datetime
from typing import Final

from ddp_operator import names
from ddp_operator.decision import NO_KUEUE_ACTIONS, KueueActions
from ddp_operator.kueue import QUEUED_POLL_SECONDS
from ddp_operator.observe import PodObservation
from ddp_operator.policies.rule import Attempt, Rule

NONE = NO_KUEUE_ACTIONS


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


def release_replaced(
    queued: bool, pods: Sequence[PodObservation], now: datetime, unconfirmed_deletion_seconds: float
) -> KueueActions:
    """Replaced pods of a Kueue group (``queued``) go once they have ended: Kueue's finalizer would
    keep them."""
    return release_stale(pods, now, unconfirmed_deletion_seconds) if queued else NONE


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


def orphaned_groups(pods: Sequence[PodObservation], live_uid: str | None) -> tuple[tuple[str, str], ...]:
    """The Kueue groups of a deleted job among ``pods`` (a job key's pods: the job's own, an earlier
    job's of the same name), as (group, owner UID): pods owned by another job than ``live_uid`` (None:
    no job holds the key now) that still hold Kueue's finalizer. Kueue keeps them, and the group its
    quota, until the group's Workload is deleted (docs/scheduling.md)."""
    return tuple(
        sorted(
            {
                (p.kueue_group, p.owner_uid)
                for p in pods
                if p.kueue_group and p.kueue_finalizer and p.owner_uid and p.owner_uid != live_uid
            }
        )
    )


def orphans(pods: Sequence[PodObservation], live_uid: str | None) -> KueueActions:
    """``orphaned_groups`` as the executor's actions (none: ``NONE``)."""
    groups = orphaned_groups(pods, live_uid)
    return KueueActions(release_orphaned=groups) if groups else NONE


def suspend(queued: bool, pods: Sequence[PodObservation]) -> KueueActions:
    """Kueue keeps a group's quota while its pods are gone, waiting for replacements: a suspended job
    gives it back by ending the group (Kueue's Workload), and queues again when resumed."""
    return KueueActions(release_group=queued and any(p.kueue_finalizer for p in pods))


# ---- the rule ------------------------------------------------------------------------------------


def queued(live: Attempt) -> bool:
    """Kueue holds the attempt's gang: some of its pods are gated and it has not trained yet (the
    phase the progress of a live attempt then shows is Queued)."""
    started = live.can_train or live.old.get("phase") == names.PHASE_RUNNING
    return not started and bool(live.kueue_gated) and live.job.kueue is not None


def _queued_look(live: Attempt, held: bool) -> float | None:
    # What Kueue says changes without a pod event: look again now and then.
    return QUEUED_POLL_SECONDS if held else None


RULES: Final = (Rule("queued", 90, queued, lambda live, held: None, _queued_look),)
