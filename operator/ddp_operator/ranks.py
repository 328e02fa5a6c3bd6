"""Conversions between the rank spaces of docs/architecture.md: which pod hosts a global rank.

A fixed-size job's layout never changes: global rank ``r`` runs in the pod of group rank ``r //
nprocPerNode``, which is the pod rank (the env contract's ``NODE_RANK``) unless the job orders its
ranks by topology: then every member's pod carries the order key its launcher brings to the
rendezvous (``PodObservation.rank_order``), and the group rank is the pod's place among the keys
(``policies.topology.group_order``, the rendezvous's own sort). An elastic job's round numbers its members by
torch's group rank, which after a shrink need not be the pod rank: there the answer is the round's
membership as the pods' own metrics endpoints last said it (each endpoint labels its workers' series
with their global ranks; ``progress.pull`` reads it), and unknown without such a read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ddp_operator.observe import PodObservation
from ddp_operator.policies import topology


def pod_of_rank(
    rank: int,
    rank_pods: Mapping[int, str],
    pods: Sequence[PodObservation],
    nproc_per_node: int,
    elastic: bool,
) -> PodObservation | None:
    """The pod of ``pods`` that hosts global rank ``rank`` in the current round; None when unknown.

    ``rank_pods``: global rank -> pod name, as the pods' endpoints last said (``ProgressObservation``).
    """
    if elastic:
        name = rank_pods.get(rank)
        return next((p for p in pods if p.name == name), None) if name is not None else None
    group_rank = rank // max(nproc_per_node, 1)
    return next((p for p, place in group_ranks(pods) if place == group_rank), None)


def group_ranks(pods: Sequence[PodObservation]) -> list[tuple[PodObservation, int]]:
    """Each pod of a fixed-size job's round by its group rank: the pod rank, or, once every pod carries
    an order key (a job whose ranks follow the topology), its place among the keys. A pod without a
    key (not yet bound) trains in no round yet, so until all have one the pod rank stands."""
    ranked = [p for p in pods if p.rank is not None]
    keys = {p.rank: p.rank_order for p in ranked if p.rank is not None and p.rank_order is not None}
    if not ranked or len(keys) < len(ranked):
        return [(p, p.rank) for p in ranked if p.rank is not None]
    order = topology.group_order(keys)
    return [(p, order[p.rank]) for p in ranked if p.rank is not None]


def first_ranks(
    rank_pods: Mapping[int, str], pods: Sequence[PodObservation], nproc_per_node: int, elastic: bool
) -> dict[int, PodObservation]:
    """Each pod of the current round by its lowest global rank (the stall policy's key for a pod).

    A pod outside the round (an elastic job's pod waiting to join) is not in it; without a read of
    the membership an elastic job's pods are unknown (empty).
    """
    if not elastic:
        return {place * nproc_per_node: p for p, place in group_ranks(pods)}
    by_name = {p.name: p for p in pods}
    result: dict[int, PodObservation] = {}
    placed: set[str] = set()
    for rank, name in sorted(rank_pods.items()):
        pod = by_name.get(name)
        if pod is not None and name not in placed:
            result[rank] = pod
            placed.add(name)
    return result


def read_rank_pods(before: Mapping[int, str], answers: Mapping[str, Sequence[int]]) -> dict[int, str]:
    """The membership after a read of the pods' endpoints: each answering pod hosts exactly the global
    ranks it labelled; a pod that did not answer keeps the ranks it had (a hung pod's ranks are still
    its own), unless an answering pod now claims them."""
    rank_pods = {rank: name for rank, name in before.items() if name not in answers}
    for name, ranks in answers.items():
        for rank in ranks:
            rank_pods[rank] = name
    return rank_pods
