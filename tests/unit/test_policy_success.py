"""When an attempt has succeeded (policies/success.py)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import observe, pod

from ddp_operator.policies.success import attempt_succeeded, succeeded_ranks

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("pods", "ranks", "succeeded"),
    [
        pytest.param([pod(0, exit_code=0), pod(1, exit_code=0)], {0, 1}, True, id="all-exited-0"),
        pytest.param([pod(0, exit_code=0), pod(1)], {0}, False, id="rank0-done-rank1-running"),
        pytest.param([pod(0, exit_code=0)], {0}, False, id="rank1-missing"),
        pytest.param([pod(0, exit_code=0), pod(1, exit_code=1)], {0}, False, id="one-failed"),
        pytest.param(
            [pod(0, exit_code=0, phase="Running"), pod(1, exit_code=0, phase="Running")],
            {0, 1},
            True,
            id="trainer-done-sidecar-still-running",
        ),
        pytest.param(
            [pod(0, phase="Succeeded"), pod(1, phase="Succeeded")], {0, 1}, True, id="pod-phase-succeeded"
        ),
    ],
)
def test_attempt_succeeded(pods: list[dict[str, Any]], ranks: set[int], succeeded: bool) -> None:
    observed = observe(*pods)
    assert succeeded_ranks(observed) == ranks
    assert attempt_succeeded(2, observed) is succeeded
