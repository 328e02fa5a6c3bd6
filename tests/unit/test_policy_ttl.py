"""ttlSecondsAfterFinished (policies/ttl.py)."""

from __future__ import annotations

import pytest
from tests.unit.kube_factories import at

from ddp_operator.policies.ttl import ttl_expired, ttl_seconds_left

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("completed", "ttl", "now", "left", "expired"),
    [
        pytest.param(0, 100, 30, 70.0, False, id="waiting"),
        pytest.param(0, 100, 100, 0.0, True, id="due"),
        pytest.param(0, 0, 0, 0.0, True, id="zero-ttl-deletes-at-once"),
        pytest.param(0, None, 10_000, None, False, id="no-ttl-keeps-forever"),
        pytest.param(None, 100, 10_000, None, False, id="not-finished"),
    ],
)
def test_ttl(completed: float | None, ttl: int | None, now: float, left: float | None, expired: bool) -> None:
    completion = at(completed) if completed is not None else None
    assert ttl_seconds_left(completion, ttl, at(now)) == left
    assert ttl_expired(completion, ttl, at(now)) is expired
