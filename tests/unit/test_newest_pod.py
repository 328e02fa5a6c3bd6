"""Which pod is a rank's: one rule (observe.superseded, observe.newest_per_rank) for the decision and for
the progress reads the controller points at a rank's pod."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import observe, pod

from ddp_operator.observe import newest_per_rank, superseded

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("pods", "attempt", "newest", "old"),
    [
        pytest.param([pod(0), pod(1)], 0, {0: "mnist-0-0", 1: "mnist-1-0"}, [], id="first-pods"),
        pytest.param(
            [pod(1), pod(1, replacement=1)],
            0,
            {1: "mnist-1-0r1"},
            ["mnist-1-0"],
            id="a-replacement-supersedes",
        ),
        pytest.param(
            [pod(1, replacement=2), pod(1), pod(1, replacement=1)],
            0,
            {1: "mnist-1-0r2"},
            ["mnist-1-0", "mnist-1-0r1"],
            id="replacement-order-not-list-order",
        ),
        pytest.param(
            [pod(0), pod(0, 1), pod(1, replacement=3), pod(1, 1)],
            1,
            {0: "mnist-0-1", 1: "mnist-1-1"},
            [],
            id="several-attempts-each-its-own",
        ),
        pytest.param(
            [pod(0), pod(0, 1), pod(1, replacement=3), pod(1, 1)],
            0,
            {0: "mnist-0-0", 1: "mnist-1-0r3"},
            [],
            id="an-older-attempt-asked",
        ),
        pytest.param(
            [pod(1), pod(1, replacement=1, deleting_at=5)],
            0,
            {1: "mnist-1-0r1"},
            ["mnist-1-0"],
            id="a-deleting-newest-pod-is-still-the-ranks",
        ),
        pytest.param([pod(0)], 2, {}, [], id="no-pod-of-the-attempt"),
    ],
)
def test_the_newest_pod_of_each_rank(
    pods: list[dict[str, Any]], attempt: int, newest: dict[int, str], old: list[str]
) -> None:
    observed = observe(*pods)
    assert {rank: p.name for rank, p in newest_per_rank(observed, attempt).items()} == newest
    assert sorted(p.name for p in superseded(observed)) == old
