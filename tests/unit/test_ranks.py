"""ranks.py: which pod hosts a global rank, for a fixed-size job (its layout) and an elastic one (the
round's membership as the pods' endpoints said it)."""

from __future__ import annotations

import pytest
from tests.unit.kube_factories import at

from ddp_operator import ranks
from ddp_operator.observe import PodObservation

pytestmark = pytest.mark.unit


def pod(rank: int, node: str) -> PodObservation:
    return PodObservation(
        name=f"j-{rank}-0", rank=rank, attempt=0, phase="Running", node=node, created_at=at(0)
    )


PODS = [pod(0, "n0"), pod(2, "n2")]  # pod rank 1 was lost: the group shrank to two members


@pytest.mark.parametrize(
    ("rank", "rank_pods", "nproc", "elastic", "expected"),
    [
        pytest.param(1, {0: "j-0-0", 1: "j-2-0"}, 1, True, "j-2-0", id="elastic-after-a-shrink"),
        pytest.param(1, {}, 1, True, None, id="elastic-unread-is-unknown"),
        pytest.param(5, {0: "j-0-0", 2: "j-2-0"}, 2, True, None, id="elastic-rank-nobody-claims"),
        pytest.param(4, {}, 2, False, "j-2-0", id="fixed-size-layout"),
        pytest.param(2, {}, 2, False, None, id="fixed-size-pod-gone"),
    ],
)
def test_pod_of_rank(
    rank: int, rank_pods: dict[int, str], nproc: int, elastic: bool, expected: str | None
) -> None:
    found = ranks.pod_of_rank(rank, rank_pods, PODS, nproc, elastic)
    assert (found.name if found else None) == expected


@pytest.mark.parametrize(
    ("rank_pods", "elastic", "expected"),
    [
        pytest.param(
            {0: "j-0-0", 1: "j-0-0", 2: "j-2-0", 3: "j-2-0"}, True, {0: "j-0-0", 2: "j-2-0"}, id="elastic"
        ),
        pytest.param({0: "j-0-0", 1: "j-2-0"}, True, {0: "j-0-0", 1: "j-2-0"}, id="elastic-one-worker"),
        pytest.param({}, False, {0: "j-0-0", 4: "j-2-0"}, id="fixed-size-two-workers"),
    ],
)
def test_first_ranks(rank_pods: dict[int, str], elastic: bool, expected: dict[int, str]) -> None:
    firsts = ranks.first_ranks(rank_pods, PODS, 2, elastic)
    assert {r: p.name for r, p in firsts.items()} == expected


@pytest.mark.parametrize(
    ("before", "answers", "expected"),
    [
        pytest.param({}, {"a": [0, 1], "b": [2, 3]}, {0: "a", 1: "a", 2: "b", 3: "b"}, id="first-read"),
        pytest.param({0: "a", 1: "b"}, {"a": [0]}, {0: "a", 1: "b"}, id="silent-pod-keeps-its-ranks"),
        pytest.param({0: "a", 1: "b"}, {"a": [0], "c": [1]}, {0: "a", 1: "c"}, id="claimed-by-another"),
        pytest.param({0: "a", 1: "b"}, {"a": [0], "b": []}, {0: "a"}, id="left-the-round"),
    ],
)
def test_read_rank_pods(
    before: dict[int, str], answers: dict[str, list[int]], expected: dict[int, str]
) -> None:
    assert ranks.read_rank_pods(before, answers) == expected


def keyed(rank: int, key: str | None) -> PodObservation:
    return PodObservation(name=f"j-{rank}-0", rank=rank, attempt=0, phase="Running", rank_order=key)


# Pod 1 landed in another rack than pods 0 and 2: the rendezvous ranks pod 2 second.
ORDERED = [keyed(0, "0/rack-a/n0/000000"), keyed(1, "3/rack-b/n1/000001"), keyed(2, "2/rack-a/n2/000002")]


@pytest.mark.parametrize(
    ("pods", "rank", "expected"),
    [
        pytest.param(ORDERED, 1, "j-2-0", id="ordered-by-key"),
        pytest.param(ORDERED, 2, "j-1-0", id="ordered-other-domain-last"),
        pytest.param(ORDERED, 0, "j-0-0", id="ordered-pod0-first"),
        pytest.param([*ORDERED[:2], keyed(2, None)], 1, "j-1-0", id="a-pod-without-key-pod-ranks-stand"),
    ],
)
def test_a_fixed_size_job_ordered_by_topology_follows_the_keys(
    pods: list[PodObservation], rank: int, expected: str
) -> None:
    found = ranks.pod_of_rank(rank, {}, pods, 1, False)
    assert found is not None and found.name == expected
    firsts = ranks.first_ranks({}, pods, 1, False)
    assert firsts[rank].name == expected
