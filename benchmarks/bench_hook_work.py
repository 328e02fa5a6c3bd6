"""Our comm hook's own work per step, the collective excluded: what `detailed` adds to torch's hook.

One gloo rank (a group of one: its allreduce is cheap, and the same in every set-up), a chain of
elementwise layers whose every parameter (1,024 floats) is one bucket (`bucket_cap_mb` set to one
parameter's size), at 8 and at 40 buckets: the step is almost nothing but the hooks. Mean step time
over a run (so the timed steps weigh as often as they come) under torch's own Python
`allreduce_hook`, under our `detailed` hook as configured by default (no exchange: one step in 10
timed) and with every step timed (``time_every=1``), in interleaved rounds (every round runs all
three, in a rotating order), medians over the rounds; a set-up's extra work is the median of its
differences to torch's hook within each round. The difference to torch's hook is the time our
code spends per step beyond what any Python comm hook costs: counting every bucket, timing the
sampled ones, their callbacks and the per-step accounting (docs/metrics.md). The target
(docs/benchmarks.md) is under 0.1 ms at 8 and at 40 buckets for the default. ``--device cuda`` runs
the same on NCCL (one rank), for a lent GPU.

    python benchmarks/bench_hook_work.py [--rounds 9 --steps 30 --buckets 8 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp_trainer import instrument, process_group_session

MODES = ("torch-hook", "detailed", "every-step")
WIDTH = 1024


class Scale(nn.Module):
    """x * w: one parameter, one bucket, almost no compute."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def build(mode: str, buckets: int, device: torch.device) -> tuple[DistributedDataParallel, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[Scale() for _ in range(buckets)]).to(device)
    ddp = DistributedDataParallel(
        model,
        bucket_cap_mb=WIDTH * 4 / 2**20,
        device_ids=[device.index] if device.type == "cuda" else None,
    )
    metrics = None
    if mode == "torch-hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        every = 1 if mode == "every-step" else None
        metrics = instrument(ddp, mode="detailed", port=0, exchange_every=0, time_every=every)
    return ddp, metrics


def run(mode: str, buckets: int, steps: int, device: torch.device) -> float:
    """The mean step time of ``steps`` steps (after two that settle DDP's buckets)."""
    ddp, metrics = build(mode, buckets, device)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    inputs = torch.randn(8, WIDTH, device=device)
    times = []
    for index in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        ddp(inputs).square().mean().backward()
        optimizer.step()
        if metrics is not None:
            metrics.step(len(inputs), time.perf_counter() - started)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index >= 2:
            times.append(time.perf_counter() - started)
    found = len(str(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")).split(","))
    assert found == buckets, f"DDP made {found} buckets, not {buckets}"
    if metrics is not None:
        metrics.close()
    return statistics.fmean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--buckets", type=int, nargs="+", default=[8, 40])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    options = parser.parse_args()
    device = torch.device("cuda", 0) if options.device == "cuda" else torch.device("cpu")
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="bench-hook-"), "store"), 1)
    with process_group_session():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1
        )
        print(
            f"torch {torch.__version__}, {device}, {options.rounds} rounds x {options.steps} steps, medians"
        )
        print(
            "| buckets | torch's allreduce_hook | ours, detailed (default) | our own work per step | "
            "per bucket | every step timed | its own work per step |"
        )
        print("|---|---|---|---|---|---|---|")
        for buckets in options.buckets:
            timed: dict[str, list[float]] = {mode: [] for mode in MODES}
            for round_index in range(options.rounds):
                shift = round_index % len(MODES)
                for mode in MODES[shift:] + MODES[:shift]:
                    timed[mode].append(run(mode, buckets, options.steps, device))
            torch_hook, ours, every = (statistics.median(timed[mode]) for mode in MODES)
            # Differences within a round, then their median: a slow spell of the machine moves all of a
            # round's set-ups together and cancels.
            extra = statistics.median(
                o - t for o, t in zip(timed["detailed"], timed["torch-hook"], strict=True)
            )
            every_extra = statistics.median(
                e - t for e, t in zip(timed["every-step"], timed["torch-hook"], strict=True)
            )
            print(
                f"| {buckets} | {torch_hook * 1e3:.3f} ms | {ours * 1e3:.3f} ms | "
                f"{extra * 1e3:+.3f} ms | {extra / buckets * 1e6:+.2f} us | {every * 1e3:.3f} ms | "
                f"{every_extra * 1e3:+.3f} ms |"
            )


if __name__ == "__main__":
    main()
