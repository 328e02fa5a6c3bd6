"""Where the gang lands by the network (docs/scheduling.md, "Topology"): spec.scheduling.topology
translated for whatever places the gang, and the placement read back. Pure.

One field, three paths, chosen per attempt from what the cluster offers:

- **Kueue** (the job has a queue): Kueue's topology-aware scheduling (TAS) places the whole group,
  asked for with the pod annotation ``kueue.x-k8s.io/podset-required-topology`` (or ``-preferred-``).
  The annotation ``kueue.x-k8s.io/pod-group-pod-index-label`` names our rank label as the pods' index,
  so Kueue lays the ranks out in order: consecutive ranks share the lowest domain they can, and the
  allreduce ring crosses as few domain boundaries as the placement allows. Kueue wins over the in-tree
  path when both are there (it decides the nodes; the PodGroup only gangs them).
- **PodGroup** (the in-tree gang, Kubernetes 1.36 with ``TopologyAwareWorkloadScheduling``): the
  attempt's PodGroup gets ``schedulingConstraints.topology[{key}]``, so the scheduler places all of
  its pods in one domain, a replacement joining the group included. Required only: the in-tree
  constraint has no preferred form.
- **Affinity** (preferred, with neither of the above): a preferred pod affinity to the job's other
  ranks on the key, weight 100. Pods are scheduled one by one, so this is best effort: the first rank
  picks the domain and the others follow while it has room. A required topology gets no such
  fallback: a required pod affinity scheduled pod by pod can strand half a gang in a domain too small
  for it, so the job fails with InvalidSpec and says what to enable instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from ddp_operator import names
from ddp_operator.spec import RESTART_MODE_IN_PLACE, JobSpec, TopologySpec

KUEUE_REQUIRED_ANNOTATION: Final = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED_ANNOTATION: Final = "kueue.x-k8s.io/podset-preferred-topology"
# Names the label that holds a pod's index in its group: Kueue's TAS assigns domains in index order.
KUEUE_POD_INDEX_LABEL_ANNOTATION: Final = "kueue.x-k8s.io/pod-group-pod-index-label"
# The weight of the preferred pod affinity (the most a preference can weigh).
AFFINITY_WEIGHT: Final = 100
# The in-tree gate the apiserver and the scheduler need for the PodGroup's topology constraint.
IN_TREE_GATE: Final = "TopologyAwareWorkloadScheduling"

Path = Literal["Kueue", "PodGroup", "Affinity"]
PATH_KUEUE: Final[Path] = "Kueue"
PATH_POD_GROUP: Final[Path] = "PodGroup"
PATH_AFFINITY: Final[Path] = "Affinity"


@dataclass(frozen=True)
class TopologyPlan:
    """How one attempt's gang is placed by topology: ``path`` (None: the job asks for no topology),
    or ``refusal`` (the job asks for what this cluster cannot do; the job fails with it)."""

    path: Path | None = None
    refusal: str | None = None


def plan(job: JobSpec, *, in_tree_gang: bool, in_tree_topology: bool) -> TopologyPlan:
    """The path for ``job`` on a cluster where the in-tree gang is used for it (``in_tree_gang``:
    gang.wants_gang) and the apiserver keeps a PodGroup's topology constraint (``in_tree_topology``:
    gang.topology_served)."""
    topology = job.scheduling.topology
    if topology is None:
        return TopologyPlan()
    path = job_path(job)
    if path is not None:
        return TopologyPlan(path)
    if in_tree_gang and in_tree_topology:
        return TopologyPlan(PATH_POD_GROUP)
    return TopologyPlan(refusal=_refusal(job, topology, in_tree_gang))


def job_path(job: JobSpec) -> Path | None:
    """The path the job alone decides (Kueue for a queued job, Affinity for a preferred topology
    without Kueue); None where it depends on the cluster (required without Kueue) or no topology is
    asked for."""
    topology = job.scheduling.topology
    if topology is None:
        return None
    if job.kueue is not None:
        return PATH_KUEUE
    return None if topology.required else PATH_AFFINITY


def _refusal(job: JobSpec, topology: TopologySpec, in_tree_gang: bool) -> str:
    if not in_tree_gang and job.scheduling.gang == "None":
        why = "spec.scheduling.gang is None, so no PodGroup carries the constraint"
    elif not in_tree_gang:
        why = "the cluster does not serve the in-tree gang API (scheduling.k8s.io/v1alpha2)"
    else:
        why = (
            f"the apiserver drops a PodGroup's schedulingConstraints.topology (the {IN_TREE_GATE} "
            f"feature gate is off)"
        )
    return (
        f"spec.scheduling.topology.required is {topology.key!r} but nothing here can place the whole "
        f"gang by it: {why}. Queue the job with Kueue (the DDPJob label {names.KUEUE_QUEUE_LABEL} naming "
        f"a LocalQueue whose ResourceFlavor has a topologyName), or enable {IN_TREE_GATE} on the "
        f"kube-apiserver and the kube-scheduler (Kubernetes 1.36, with the gang gates), or ask for "
        f"spec.scheduling.topology.preferred instead"
    )


def kueue_annotations(job: JobSpec) -> dict[str, str]:
    """The annotations of every rank pod of a Kueue-managed job that asks for a topology (identical
    on every pod of the group, as Kueue requires)."""
    topology = job.scheduling.topology
    if topology is None or job.kueue is None:
        return {}
    key = KUEUE_REQUIRED_ANNOTATION if topology.required else KUEUE_PREFERRED_ANNOTATION
    return {key: topology.key, KUEUE_POD_INDEX_LABEL_ANNOTATION: names.LABEL_RANK}


def pod_group_constraints(job: JobSpec) -> dict[str, Any] | None:
    """The PodGroup's ``schedulingConstraints`` for the in-tree path (None: none)."""
    topology = job.scheduling.topology
    if topology is None or job_path(job) is not None:
        return None
    return {"topology": [{"key": topology.key}]}


def affinity_term(job: JobSpec) -> dict[str, Any] | None:
    """The preferred pod affinity term of the affinity path (None on any other): near the job's other
    pods on the key."""
    topology = job.scheduling.topology
    if topology is None or job_path(job) != PATH_AFFINITY:
        return None
    selector = {names.LABEL_JOB_UID: job.uid} if job.uid else names.job_selector(job.name)
    # The job's rank pods: its rendezvous pod carries no rank (and placing ranks near it gains nothing).
    ranks = [{"key": names.LABEL_RANK, "operator": "Exists"}]
    return {
        "weight": AFFINITY_WEIGHT,
        "podAffinityTerm": {
            "labelSelector": {"matchLabels": selector, "matchExpressions": ranks},
            "topologyKey": topology.key,
        },
    }


# ---- the rank order -------------------------------------------------------------------------------

# The width of the pod rank in an order key: the launcher's own (ddp_trainer.supervisor.restarts.NODE_RANK_DIGITS).
RANK_DIGITS: Final = 6
# Separates an order key's fields: never in a label value nor a node name, so every key of one domain
# (and of one node) shares a prefix no key of another has, and a sort keeps each together.
KEY_SEPARATOR: Final = "/"


def orders_ranks(job: JobSpec) -> bool:
    """Whether the job's rendezvous orders its ranks by topology: a topology is asked for and the
    launchers re-form on their rendezvous (InPlace), whose rounds rank their members by a key
    each pod brings. Recreate's static rendezvous fixes group rank = pod rank."""
    return job.scheduling.topology is not None and job.run_policy.restart_mode == RESTART_MODE_IN_PLACE


def order_key(rank: int, domain: str, node: str, first_domain: str, first_node: str) -> str:
    """The rendezvous order key of the pod of ``rank`` on ``node`` in ``domain`` (the topology label's
    value on its node), given where the pod of rank 0 landed (``first_domain``, ``first_node``).

    A round ranks its members by sorting their keys: rank 0's pod first (its launcher hosts the
    rendezvous and its first worker holds the checkpoint), then the pods on its node, then the rest of
    its domain, then every other domain, each domain's pods together and, inside a domain, each
    node's; pod rank breaks ties. So consecutive ranks share the closest domain they can and the ring
    (r to r+1) crosses each domain boundary once.
    """
    if rank == 0:
        tier = "0"
    elif node == first_node:
        tier = "1"
    elif domain == first_domain:
        tier = "2"
    else:
        tier = "3"
    return KEY_SEPARATOR.join((tier, domain, node, f"{rank:0{RANK_DIGITS}d}"))


def group_order(keys: Mapping[int, str]) -> dict[int, int]:
    """Pod rank -> group rank of a round of the pods whose order keys are ``keys`` (pod rank -> key):
    their positions in the sorted keys, as torch's rendezvous assigns them."""
    return {rank: position for position, rank in enumerate(sorted(keys, key=lambda r: keys[r]))}


@dataclass(frozen=True)
class Bound:
    """A bound rank pod as the rank order sees it: its node, the topology label's value there, and the
    order key already on the pod (None: not written yet)."""

    node: str
    domain: str
    key: str | None = None


def keys_to_write(bound: Mapping[int, Bound]) -> dict[int, str]:
    """Pod rank -> the order key to write on each bound pod (pod rank -> ``Bound``) that has none,
    once rank 0's pod is bound (every key is placed relative to it); a written key is never changed: its
    launcher may already have brought it to a round."""
    first = bound.get(0)
    if first is None:
        return {}
    return {
        rank: order_key(rank, pod.domain, pod.node, first.domain, first.node)
        for rank, pod in sorted(bound.items())
        if pod.key is None
    }


def domains_by_group_rank(bound: Mapping[int, Bound]) -> dict[int, str]:
    """The domain of each member by the rank it trains as: by its place among the order keys once
    every pod has one, else by pod rank (a job whose ranks are not ordered)."""
    keys = {rank: pod.key for rank, pod in bound.items() if pod.key is not None}
    if not keys or len(keys) < len(bound):
        return {rank: pod.domain for rank, pod in bound.items()}
    return {place: bound[rank].domain for rank, place in group_order(keys).items()}


# ---- the placement read back ---------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """The domains of one attempt's ranks: ``domains`` as (label value, ranks) in order of each
    domain's first rank; ``ring_crossings``: ring links (r to r+1, the last to 0) that join two
    domains."""

    domains: tuple[tuple[str, tuple[int, ...]], ...]
    ring_crossings: int


def placement(domain_of_rank: Mapping[int, str]) -> Placement:
    """The placement of ranks 0..n-1 whose domain (the label's value on the rank's node; "" where the
    node lacks it) is ``domain_of_rank``."""
    ranks = sorted(domain_of_rank)
    grouped: dict[str, list[int]] = {}
    for rank in ranks:
        grouped.setdefault(domain_of_rank[rank], []).append(rank)
    crossings = 0
    if len(ranks) > 1:
        crossings = sum(
            1
            for rank, following in zip(ranks, [*ranks[1:], ranks[0]], strict=True)
            if domain_of_rank[rank] != domain_of_rank[following]
        )
    return Placement(tuple((name, tuple(members)) for name, members in grouped.items()), crossings)


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as ranges: (0, 1, 2, 3, 8) -> "0-3,8"."""
    parts: list[str] = []
    ordered = sorted(ranks)
    start = previous = None
    for rank in [*ordered, None]:
        if rank is not None and previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    return ",".join(parts)


def status_of(key: str, path: Path, result: Placement) -> dict[str, Any]:
    """``status.topology`` (the CRD's schema)."""
    return {
        "key": key,
        "path": path,
        "domains": [{"name": name, "ranks": rank_ranges(members)} for name, members in result.domains],
        "ringCrossings": result.ring_crossings,
    }
