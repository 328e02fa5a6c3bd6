"""Deadlines and the classification of a slow start (policies/deadline.py)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import at, observe, pod

from ddp_operator.policies.deadline import classify_startup, seconds_left

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("since", "limit", "now", "left"),
    [
        pytest.param(0, 60, 10, 50.0, id="running-early"),
        pytest.param(0, 60, 60, 0.0, id="exactly-due"),
        pytest.param(0, 60, 90, -30.0, id="overdue"),
        pytest.param(None, 60, 90, None, id="not-started"),
        pytest.param(0, None, 90, None, id="no-deadline"),
    ],
)
def test_seconds_left(since: float | None, limit: int | None, now: float, left: float | None) -> None:
    assert seconds_left(at(since) if since is not None else None, limit, at(now)) == left


@pytest.mark.parametrize(
    ("pods", "reason", "in_message"),
    [
        pytest.param(
            [pod(0), pod(1, unschedulable="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")],
            "Unschedulable",
            "rank 1 could not be scheduled",
            id="unschedulable",
        ),
        pytest.param(
            [pod(0, waiting="ImagePullBackOff"), pod(1)],
            "ImagePullFailed",
            "ImagePullBackOff",
            id="image-backoff",
        ),
        pytest.param(
            [pod(0), pod(1, waiting="ErrImagePull")], "ImagePullFailed", "rank 1", id="err-image-pull"
        ),
        pytest.param(
            [pod(0, waiting="ImagePullBackOff"), pod(1, unschedulable="no nodes")],
            "Unschedulable",
            "no nodes",
            id="unschedulable-explains-first",
        ),
        pytest.param(
            [pod(0), pod(1, waiting="ContainerCreating")],
            "StartupTimeout",
            "1 of 2 rank(s) running",
            id="slow-container-creation",
        ),
        pytest.param([pod(0)], "StartupTimeout", "1 of 2", id="pod-missing"),
    ],
)
def test_classify_startup(pods: list[dict[str, Any]], reason: str, in_message: str) -> None:
    got_reason, message = classify_startup(observe(*pods), replicas=2, limit_seconds=120)
    assert got_reason == reason
    assert in_message in message
    assert "120s" in message
