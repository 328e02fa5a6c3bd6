"""One torchrun worker for tests/trainer/test_sync_sampling.py: detailed mode's sampled timing on a
model of several buckets, for each timing strategy and sampling period, with and without step().

The CUDA strategy runs here on gloo with stand-in events (their clock is the host's): what is tested
is its bookkeeping (which steps are timed, what is resolved when), not the device. Each case prints
one JSON line of what the metrics counted next to what DDP reduced.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddp_trainer
from ddp_trainer.library import sync
from ddp_trainer.metrics import create_rank_metrics

STEPS = 11
WIDTH = 32


class StandInEvent:
    """What CudaEventRecorder uses of torch.cuda.Event, on the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: StandInEvent) -> float:
        return (other.at - self.at) * 1000.0


class StandInCuda:
    Event = StandInEvent


def model() -> DistributedDataParallel:
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    # One bucket per layer or so: several buckets a step.
    return DistributedDataParallel(layers, bucket_cap_mb=(WIDTH * WIDTH + WIDTH) * 4 / 2**20)


def measure(strategy: str, every: int, stepped: bool) -> dict[str, Any]:
    ddp = model()
    registry = CollectorRegistry()
    rank = dist.get_rank()
    metrics = create_rank_metrics(rank, "gloo", "allreduce", torch.__version__, registry)
    settings = sync.SyncSettings(world_size=dist.get_world_size(), time_every=every)
    recorder: sync.SyncRecorder
    if strategy == "cuda-events":
        sync._cuda = lambda: StandInCuda  # type: ignore[assignment]
        recorder = sync.CudaEventRecorder(metrics, settings)
    else:
        recorder = sync.WallClockRecorder(metrics, settings)
    recorder.install(ddp)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    buckets_per_step = []
    for _ in range(STEPS):
        before = registry.get_sample_value("ddp_allreduce_calls_total", {"rank": str(rank)}) or 0.0
        optimizer.zero_grad()
        ddp(torch.randn(8, WIDTH)).square().mean().backward()
        optimizer.step()
        if stepped:
            recorder.step_done()
            after = registry.get_sample_value("ddp_allreduce_calls_total", {"rank": str(rank)}) or 0.0
            buckets_per_step.append(after - before)
    recorder.flush()
    window = recorder.take_window()
    recorder.detach()

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"rank": str(rank)}) or 0.0

    return {
        "strategy": strategy,
        "every": every,
        "stepped": stepped,
        "rank": rank,
        "gradient_bytes_per_step": sum(p.numel() * p.element_size() for p in ddp.parameters()),
        "buckets_per_step": buckets_per_step,
        "sync_steps": value("ddp_sync_steps_total"),
        "gradient_bytes": value("ddp_gradient_bytes_total"),
        "allreduce_bytes": value("ddp_allreduce_bytes_total"),
        "calls": value("ddp_allreduce_calls_total"),
        "timed_steps": value("ddp_sync_timed_steps_total"),
        "durations": value("ddp_allreduce_duration_seconds_count"),
        "service": value("ddp_allreduce_service_seconds_total"),
        "window_steps": 0 if window is None else window.steps,
        "window_parts_nonnegative": window is None
        or min(window.data, window.compute, window.comm, window.wait) >= 0.0,
    }


def main() -> None:
    lines = []
    with ddp_trainer.process_group_session():
        dist.init_process_group("gloo")
        for strategy in ("wall-clock", "cuda-events"):
            for every in (1, 3):
                for stepped in (True, False):
                    lines.append(json.dumps(measure(strategy, every, stepped)) + "\n")
        dist.barrier()
    sys.stdout.write("".join(lines))  # one write per rank: the workers share stdout
    sys.stdout.flush()


if __name__ == "__main__":
    main()
