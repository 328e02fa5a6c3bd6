"""The trainer's series before any step: nothing reads as a measured value (in-memory registry)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ddp_trainer.metrics import create_rank_metrics

pytestmark = pytest.mark.unit


def test_loss_is_nan_until_a_step_logs_one() -> None:
    registry = CollectorRegistry(auto_describe=True)
    metrics = create_rank_metrics(0, "gloo", "allreduce", "2.15.0", registry)
    assert math.isnan(registry.get_sample_value("ddp_loss", {"rank": "0"}) or 0.0)
    assert 'ddp_loss{rank="0"} NaN' in generate_latest(registry).decode()
    metrics.loss.set(0.25)
    assert registry.get_sample_value("ddp_loss", {"rank": "0"}) == 0.25
