"""Standby pods (``runPolicy.standbyPods``, docs/restarts.md "Standby pods"): which lost ranks a
standby takes, and which standbys to start and to delete.

A standby is a pod of the attempt with no rank (names.ROLE_STANDBY): its launcher has started, imported
torch and started its workers' forkserver, and waits for an assignment. When the operator replaces a
lost pod alone (policies.replacement.replace_pods), a running standby takes that rank instead of a new pod
being created: the operator labels it as the rank's newest pod and writes its assignment
(``builders.standby_promotion``). A new standby is started in its place.

- **A standby never blocks a rank.** It runs at the standby PriorityClass, below the ranks, so the
  scheduler preempts it for a rank pod (of this job or another) and it never preempts anything. And
  whatever the priorities say (a template whose class is below the standby class, a cluster without
  the class): no standby is started while a rank pod of the attempt waits for a node, and every
  waiting standby is deleted as soon as the scheduler finds no node for one (``yielded``).
- Standbys run only while the job is Running: started after every rank's pod is bound, so a standby
  never takes a node a rank needs; deleted when the attempt ends, the job is suspended or finished, or
  they ended.
- **Any rank, rank 0 included.** A standby mounts the checkpoint claim where its access mode lets a
  second pod do so (``checkpoint_mount``), so it can take rank 0, the rank that writes checkpoints.
  A ReadWriteOncePod claim lets none do so: the CRD refuses standbys with it; should such a job exist
  anyway, rank 0 goes to a new pod.
- **It waits with little CPU.** A standby's start (the interpreter, torch, the forkserver's imports) is
  the most CPU it ever uses, and the kubelet shares a busy node's CPU by the pods' requests: a standby
  requesting its rank's CPU takes a rank's share of the node while it starts. It waits with the
  operator's waiting CPU instead (``waiting_cpu``), and the rank's request is written back in place
  (the pod's resize subresource) as soon as it holds a rank (``plan``'s ``resize``).
- At most ``standbyPods`` wait at once; a new one's number (names.LABEL_STANDBY) follows the highest of
  the attempt's pods that still exist, so no name is reused while a pod holds it (a preempted standby
  that is gone may see its number again: standbys are never in a Kueue group, whose finalizers are
  what make a reused name deadlock).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ddp_operator import names
from ddp_operator.observe import PodObservation, newest_per_rank
from ddp_operator.quantity import parse_quantity
from ddp_operator.spec import ACCESS_MODE_ROX, ACCESS_MODE_RWO, ACCESS_MODE_RWOP, ACCESS_MODE_RWX, JobSpec

# How a job's standbys hold its checkpoint claim (``checkpoint_mount``).
MOUNT_NONE: Final = "None"  # the job has no checkpoint volume: nothing to mount
MOUNT_ANYWHERE: Final = "Anywhere"  # ReadWriteMany (or ReadOnlyMany): any number of nodes attach it
MOUNT_ON_NODE: Final = "OnNode"  # ReadWriteOnce: one node attaches it; its pods share that attachment
MOUNT_NEVER: Final = "Never"  # ReadWriteOncePod: one pod only; rank 0 never goes to a standby


# After the apiserver refused a standby pod (its PriorityClass missing, a quota full), the next one is
# tried this much later: soon enough to follow a fix, seldom enough not to load the apiserver.
REFUSAL_RETRY_SECONDS: Final = 60.0


def checkpoint_mount(job: JobSpec) -> str:
    """How the job's standbys mount its checkpoint claim, by the claim's access modes: a standby that
    mounts it can take rank 0. A ReadWriteOnce claim is attached to one node at a time, so the pods
    that mount it (rank 0's and the standbys) are kept on one node (``builders``: a required pod
    affinity on the hostname to the pods labelled names.LABEL_CHECKPOINT_MOUNT)."""
    if job.checkpoint is None:
        return MOUNT_NONE
    modes = set(job.checkpoint.access_modes)
    if modes & {ACCESS_MODE_RWX, ACCESS_MODE_ROX}:
        return MOUNT_ANYWHERE
    if ACCESS_MODE_RWOP in modes:
        return MOUNT_NEVER
    if ACCESS_MODE_RWO in modes:
        return MOUNT_ON_NODE
    return MOUNT_NEVER  # a mode Kubernetes does not know: the apiserver refuses the claim anyway


def takes_rank0(job: JobSpec) -> bool:
    """Whether a standby may take rank 0: it holds the checkpoint volume, or there is none."""
    return checkpoint_mount(job) != MOUNT_NEVER


def pins_to_checkpoint_node(job: JobSpec) -> bool:
    """Whether the pods that mount the claim must share one node (ReadWriteOnce, with standbys)."""
    return job.run_policy.standby_pods > 0 and checkpoint_mount(job) == MOUNT_ON_NODE


def waiting_cpu(pod_spec: Mapping[str, Any], waiting: str | None) -> str | None:
    """The CPU request a standby's trainer container waits with instead of its rank's (None: the
    rank's). None where a lower request cannot be given back in place: no ``waiting`` (the operator's
    flag is empty, or the cluster serves no pod resize), a trainer that requests no CPU or no more than
    ``waiting``, a pod with pod-level resources, or a Guaranteed pod (a resize never changes a pod's QoS
    class, and a lower request would)."""
    if not waiting or pod_spec.get("resources"):
        return None
    trainer = next(c for c in pod_spec.get("containers") or [] if c.get("name") == names.TRAINER_CONTAINER)
    requested = ((trainer.get("resources") or {}).get("requests") or {}).get("cpu")
    if requested is None:
        return None
    try:
        lower = parse_quantity(waiting) < parse_quantity(requested) and not _guaranteed(pod_spec)
    except ValueError:
        return None  # not a quantity: the apiserver refuses the pod with a clear error anyway
    return waiting if lower else None


def _guaranteed(pod_spec: Mapping[str, Any]) -> bool:
    """Whether the pod's QoS class is Guaranteed: every container limits CPU and memory and requests
    what it limits (a request left out defaults to the limit)."""
    containers = [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]
    for container in containers:
        resources = container.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for resource in ("cpu", "memory"):
            if resource not in limits:
                return False
            if resource in requests and parse_quantity(requests[resource]) != parse_quantity(
                limits[resource]
            ):
                return False
    return bool(containers)


def resizes(pods: Sequence[PodObservation], attempt: object) -> tuple[tuple[str, str], ...]:
    """(pod, CPU) for each of the attempt's live pods that holds a rank (a standby that took one) and
    still requests its waiting CPU: the rank's request it is given back (names.ANNOTATION_RANK_CPU)."""
    return tuple(
        sorted(
            (p.name, p.rank_cpu)
            for p in pods
            if p.rank_cpu is not None
            and p.cpu_request != p.rank_cpu
            and not p.standby_waiting
            and p.attempt == attempt
            and not p.deleting
            and not p.terminal
        )
    )


@dataclass(frozen=True)
class Promotion:
    """Standby pod ``pod`` becomes rank ``rank``'s ``replacement``-th replacement, with ``budget``."""

    pod: str
    rank: int
    replacement: int
    budget: int


@dataclass(frozen=True)
class Yield:
    """The waiting standbys deleted because rank ``rank``'s pod ``pod`` found no node: the scheduler's
    ``message``, and the two priorities where they are known (a standby at or above its ranks' is one
    the scheduler cannot preempt for them)."""

    pod: str
    rank: int
    message: str
    standbys: tuple[str, ...]
    standby_priority: int | None = None
    rank_priority: int | None = None


@dataclass(frozen=True)
class StandbyPlan:
    promotions: tuple[Promotion, ...] = ()
    # The replacements no standby takes: still created as new pods, (rank, n) as replace_pods gave them.
    replacements: tuple[tuple[int, int], ...] = ()
    create: tuple[int, ...] = ()  # the numbers of new standby pods
    delete: tuple[str, ...] = ()
    yielded: Yield | None = None
    # (pod, CPU): standbys that hold a rank, given its CPU request back in place (``resizes``).
    resize: tuple[tuple[str, str], ...] = ()

    @property
    def changes(self) -> bool:
        return bool(self.promotions or self.create or self.delete or self.resize)


def plan(
    job: JobSpec,
    phase: str,
    attempt: object,
    replacements: Sequence[tuple[int, int]],
    budget: int,
    pods: Sequence[PodObservation],
    *,
    held: bool = False,
) -> StandbyPlan:
    """What to do with the job's standbys, given the decision's new ``phase`` and ``attempt`` and the
    lost pods it replaces (``replacements``, with the new pods' restart ``budget``). ``pods``: the job
    object's pods (rank pods count for the standbys they were, and for whether a rank waits for a
    node). ``held``: the apiserver refused a standby pod a moment ago; none is created for now."""
    waiting = sorted((p for p in pods if p.standby_waiting), key=lambda p: p.standby or 0)
    live = phase == names.PHASE_RUNNING and isinstance(attempt, int)
    kept = [p for p in waiting if live and p.attempt == attempt and not p.deleting and not p.terminal]
    usable = [p for p in kept if p.running]
    promotions: list[Promotion] = []
    left: list[tuple[int, int]] = []
    for rank, replacement in replacements:
        if usable and (rank != 0 or takes_rank0(job)):
            promotions.append(Promotion(usable.pop(0).name, rank, replacement, budget))
        else:
            left.append((rank, replacement))
    promoted = {promotion.pod for promotion in promotions}
    # A standby promoted now is resized in the same decision (its observation still says waiting).
    resize = resizes(pods, attempt) + tuple(
        (p.name, p.rank_cpu) for p in kept if p.name in promoted and p.rank_cpu is not None
    )
    ranks = [
        p
        for p in (newest_per_rank(pods, attempt if isinstance(attempt, int) else None).values())
        if not p.deleting and not p.terminal
    ]
    blocked = next((p for p in sorted(ranks, key=lambda p: p.rank or 0) if p.unschedulable_message), None)
    # The ones that stay waiting: the oldest, up to standbyPods; every other waiting pod goes. None
    # stays while a rank's pod finds no node: the room a standby holds may be the room it needs.
    keep = [] if blocked else [p for p in kept if p.name not in promoted][: job.run_policy.standby_pods]
    delete = [p.name for p in waiting if p not in keep and p.name not in promoted and not p.deleting]
    yielded = None
    if blocked is not None:
        gone = tuple(sorted(p.name for p in kept if p.name not in promoted))
        if gone:
            yielded = Yield(
                pod=blocked.name,
                rank=blocked.rank or 0,
                message=blocked.unschedulable_message or "",
                standbys=gone,
                standby_priority=next((p.priority for p in kept if p.priority is not None), None),
                rank_priority=blocked.priority,
            )
    create: tuple[int, ...] = ()
    missing = job.run_policy.standby_pods - len(keep)
    # A new standby waits until every rank's pod is bound (new replacement pods are not yet).
    waits = blocked is not None or bool(left) or any(not p.node for p in ranks)
    if live and missing > 0 and not waits and not held:
        used = max(
            (p.standby or 0 for p in pods if p.standby is not None and p.attempt == attempt), default=0
        )
        create = tuple(range(used + 1, used + 1 + missing))
    return StandbyPlan(
        promotions=tuple(promotions),
        replacements=tuple(left),
        create=create,
        delete=tuple(sorted(delete)),
        yielded=yielded,
        resize=tuple(sorted(resize)),
    )


def yield_message(job: str, yielded: Yield) -> str:
    """The Event of standbys deleted for a rank that found no node."""
    text = (
        f"standby pod(s) {', '.join(yielded.standbys)} deleted: rank {yielded.rank}'s pod {yielded.pod} "
        f"found no node ({yielded.message}); standbys come back once every rank's pod of {job} is bound"
    )
    low, high = yielded.standby_priority, yielded.rank_priority
    if low is not None and high is not None and low >= high:
        text += (
            f". The standbys' priority ({low}) is not below the rank's ({high}), so the scheduler could "
            "not preempt them: give the ranks a PriorityClass above the standby class (docs/restarts.md)"
        )
    return text


def refusal_message(pod: str, message: str, retry_seconds: float) -> str:
    """The Event of a standby pod the apiserver refused (a missing PriorityClass, a quota): the job
    trains on without it."""
    return (
        f"standby pod {pod} was not created: {message}; the job trains on without it, and a standby is "
        f'tried again in {retry_seconds:g} s (docs/restarts.md, "Standby pods")'
    )


def not_resized_message(pod: str, cpu: str, message: str) -> str:
    """The Event of a standby that took a rank and could not be given the rank's CPU request."""
    return (
        f"standby pod {pod} holds a rank but still requests its waiting CPU: the resize to the rank's "
        f"{cpu} was refused ({message}); the rank trains on with less CPU weight. Allow pods/resize "
        "(the operator's ClusterRole, a quota), or run the operator with --standby-waiting-cpu='' "
        'so that standbys wait with their ranks\' request (docs/restarts.md, "Standby pods")'
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
