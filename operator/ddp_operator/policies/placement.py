"""Where a live attempt's ranks landed, written down (docs/scheduling.md, "Topology"): the rendezvous
order key each bound rank pod still lacks, and ``status.topology`` once every rank is bound. Pure: the
pods and the labels of their nodes in, the Decision with both out (policies/topology.py owns the form
of a key and of the placement; the executor writes the keys on the pods, before the status write).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

from ddp_operator import names
from ddp_operator.decision import Decision
from ddp_operator.observe import PodObservation, newest_per_rank
from ddp_operator.policies import topology
from ddp_operator.spec import JobSpec

# The labels of each node by name, as the executor read them (a node it could not read is absent).
NodeLabels = Mapping[str, Mapping[str, str]]

# A placement is recorded while the attempt's pods are placed and run.
_PLACED_PHASES: Final = frozenset({names.PHASE_STARTING, names.PHASE_RUNNING})


def bound(
    job: JobSpec, pods: Sequence[PodObservation], attempt: object, nodes: NodeLabels
) -> tuple[dict[int, PodObservation], dict[int, topology.Bound]]:
    """The attempt's current pod of each rank (none being deleted), and of those the ones bound to a
    node whose labels are known, as the rank order sees them."""
    asked = job.scheduling.topology
    current = {
        rank: p
        for rank, p in newest_per_rank(pods, attempt if isinstance(attempt, int) else None).items()
        if not p.deleting
    }
    if asked is None:
        return current, {}
    placed: dict[int, topology.Bound] = {}
    for rank, pod in current.items():
        labels = nodes.get(pod.node) if pod.node else None
        if labels is not None:
            placed[rank] = topology.Bound(pod.node, labels.get(asked.key, ""), pod.rank_order)
    return current, placed


def shown(
    job: JobSpec, current: Mapping[int, PodObservation], placed: Mapping[int, topology.Bound]
) -> dict[str, Any] | None:
    """``status.topology`` once every rank of the attempt is bound (and, where the ranks follow the
    topology, has its order key: the ranks are those the rendezvous gives); None before."""
    asked = job.scheduling.topology
    if asked is None or len(current) < job.min_replicas or len(placed) < len(current):
        return None
    if topology.orders_ranks(job) and any(pod.key is None for pod in placed.values()):
        return None
    path = topology.job_path(job) or topology.PATH_POD_GROUP
    return topology.status_of(asked.key, path, topology.placement(topology.domains_by_group_rank(placed)))


def with_placement(
    job: JobSpec, decision: Decision, pods: Sequence[PodObservation], nodes: NodeLabels
) -> Decision:
    """``decision`` with the order keys to write on the attempt's newly bound pods (its launcher waits
    for its key; a written key never changes) and ``status.topology`` where it changed. Keys written
    by this decision count as written for the status: the executor writes them before the status."""
    if job.scheduling.topology is None or decision.phase not in _PLACED_PHASES:
        return decision
    current, placed = bound(job, pods, decision.report.status.get("attempt"), nodes)
    keys = topology.keys_to_write(placed) if topology.orders_ranks(job) else {}
    placed = {rank: replace(pod, key=keys.get(rank, pod.key)) for rank, pod in placed.items()}
    if keys:
        orders = tuple((current[rank].name, key) for rank, key in sorted(keys.items()))
        decision = replace(decision, rank_orders=decision.rank_orders + orders)
    status = shown(job, current, placed)
    if status is None or decision.report.status.get("topology") == status:
        return decision
    report = replace(decision.report, status={**decision.report.status, "topology": status}, changed=True)
    return replace(decision, report=report)
