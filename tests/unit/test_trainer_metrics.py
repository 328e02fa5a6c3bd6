"""The trainer's series before any step (in-memory registry), and what a compressed payload weighs."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ddp_trainer.metrics import create_rank_metrics, payload_bytes

pytestmark = pytest.mark.unit


def test_loss_is_nan_until_a_step_logs_one() -> None:
    registry = CollectorRegistry(auto_describe=True)
    metrics = create_rank_metrics(0, "gloo", "allreduce", "2.15.0", registry)
    assert math.isnan(registry.get_sample_value("ddp_loss", {"rank": "0"}) or 0.0)
    assert 'ddp_loss{rank="0"} NaN' in generate_latest(registry).decode()
    metrics.loss.set(0.25)
    assert registry.get_sample_value("ddp_loss", {"rank": "0"}) == 0.25


@pytest.mark.parametrize(
    ("comm_hook", "gradient_bytes", "elements", "expected"),
    [
        pytest.param("allreduce", 4000, 1000, 4000, id="fp32-uncompressed"),
        pytest.param("fp16", 4000, 1000, 2000, id="fp16-of-fp32-halves"),
        pytest.param("bf16", 4000, 1000, 2000, id="bf16-of-fp32-halves"),
        pytest.param("fp16", 8000, 1000, 2000, id="fp16-of-fp64-quarters"),
        pytest.param("bf16", 2000, 1000, 2000, id="bf16-of-bf16-unchanged"),
        pytest.param("fp16", 2000, 1000, 2000, id="fp16-of-fp16-unchanged"),
    ],
)
def test_compressed_payload_counts_two_bytes_per_element(
    comm_hook: str, gradient_bytes: int, elements: int, expected: int
) -> None:
    assert payload_bytes(comm_hook, gradient_bytes, elements) == expected
