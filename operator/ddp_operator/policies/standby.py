"""Standby pods (``runPolicy.standbyPods``, docs/restarts.md "Standby pods"): which lost ranks a
standby takes, and which standbys to start and to delete.

A standby is a pod of the attempt with no rank (names.ROLE_STANDBY): its launcher has started, imported
torch and started its workers' forkserver, and waits for an assignment. When the operator replaces a
lost pod alone (policies.recovery.replace_pods), a running standby takes that rank instead of a new pod
being created: the operator labels it as the rank's newest pod and writes its assignment
(``builders.standby_promotion``). A new standby is started in its place.

- Standbys run only while the job is Running: started after every rank's pod, so a standby never takes
  a node a rank needs (on a cluster sized to the gang, a standby started first could hold one and leave
  a rank unschedulable); deleted when the attempt ends, the job is suspended or finished, or they ended.
- A job with a checkpoint volume gives rank 0 to a new pod, never to a standby: only rank 0's pod
  mounts the volume, and a pod's volumes are fixed when it is created.
- At most ``standbyPods`` wait at once; their numbers (names.LABEL_STANDBY) are never reused in an attempt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ddp_operator import names
from ddp_operator.observe import PodObservation
from ddp_operator.spec import JobSpec


@dataclass(frozen=True)
class Promotion:
    """Standby pod ``pod`` becomes rank ``rank``'s ``replacement``-th replacement, with ``budget``."""

    pod: str
    rank: int
    replacement: int
    budget: int


@dataclass(frozen=True)
class StandbyPlan:
    promotions: tuple[Promotion, ...] = ()
    # The replacements no standby takes: still created as new pods, (rank, n) as replace_pods gave them.
    replacements: tuple[tuple[int, int], ...] = ()
    create: tuple[int, ...] = ()  # the numbers of new standby pods
    delete: tuple[str, ...] = ()

    @property
    def changes(self) -> bool:
        return bool(self.promotions or self.create or self.delete)


def plan(
    job: JobSpec,
    phase: str,
    attempt: object,
    replacements: Sequence[tuple[int, int]],
    budget: int,
    pods: Sequence[PodObservation],
) -> StandbyPlan:
    """What to do with the job's standbys, given the decision's new ``phase`` and ``attempt`` and the
    lost pods it replaces (``replacements``, with the new pods' restart ``budget``). ``pods``: the job
    object's pods (rank pods are ignored but for the numbers of the standbys they were)."""
    waiting = sorted((p for p in pods if p.standby_waiting), key=lambda p: p.standby or 0)
    live = phase == names.PHASE_RUNNING and isinstance(attempt, int)
    kept = [p for p in waiting if live and p.attempt == attempt and not p.deleting and not p.terminal]
    usable = [p for p in kept if p.running]
    promotions: list[Promotion] = []
    left: list[tuple[int, int]] = []
    for rank, replacement in replacements:
        if usable and not (rank == 0 and job.checkpoint is not None):
            promotions.append(Promotion(usable.pop(0).name, rank, replacement, budget))
        else:
            left.append((rank, replacement))
    promoted = {promotion.pod for promotion in promotions}
    # The ones that stay waiting: the oldest, up to standbyPods; every other waiting pod goes.
    keep = [p for p in kept if p.name not in promoted][: job.run_policy.standby_pods]
    delete = [p.name for p in waiting if p not in keep and p.name not in promoted and not p.deleting]
    create: tuple[int, ...] = ()
    missing = job.run_policy.standby_pods - len(keep)
    if live and missing > 0:
        used = max(
            (p.standby or 0 for p in pods if p.standby is not None and p.attempt == attempt), default=0
        )
        create = tuple(range(used + 1, used + 1 + missing))
    return StandbyPlan(
        promotions=tuple(promotions),
        replacements=tuple(left),
        create=create,
        delete=tuple(sorted(delete)),
    )


def named(text: str, job: str, attempt: int, promotions: Sequence[Promotion]) -> str:
    """``text`` (a replacement's Event) with each new pod's name the promotions stand in for replaced
    by the standby pod that took its rank."""
    for p in promotions:
        text = text.replace(names.pod_name(job, p.rank, attempt, p.replacement), f"standby pod {p.pod}")
    return text


def noted(record: object, promotions: Sequence[Promotion]) -> object:
    """``status.lastRestart`` with a note of which standby pod took which rank."""
    if not isinstance(record, Mapping):
        return record
    note = "; ".join(f"rank {p.rank}'s pod taken by standby pod {p.pod}" for p in promotions)
    return {**record, "note": f"{record['note']}; {note}" if record.get("note") else note}
