"""A plain DDP training script that gets ddp-operator's gradient-sync metrics with one line.

Run it like any DDP script, e.g. ``torchrun --nproc-per-node 2 examples/scripts/instrument_ddp.py``;
with ``DDP_METRICS_PORT`` set, each worker serves /metrics on that port plus its LOCAL_RANK.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddp_trainer


def main() -> None:
    # The session brackets the group's life: entered before init_process_group, it ends the group on
    # the way out, after closing the instrumentation, while the interpreter is fully alive. A gloo
    # group that outlived its end could abort the process at exit (ddp_trainer.library.teardown).
    with ddp_trainer.process_group_session():
        dist.init_process_group("gloo")
        train()  # the DDP model lives and dies in train(), so nothing holds the group afterwards


def train() -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    metrics = ddp_trainer.instrument(model)  # the one line: comm hook + /metrics endpoint
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(dist.get_rank())
    steps, batch = 20, 16
    for _ in range(steps):
        started = time.perf_counter()
        inputs = torch.randn(batch, 32, generator=generator)
        targets = torch.randint(0, 4, (batch,), generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        # Optional: samples, step time and loss, which no comm hook can see.
        metrics.step(samples=batch, seconds=time.perf_counter() - started, loss=loss.item())
    wanted = ("ddp_sync_steps_total", "ddp_allreduce_calls_total", "ddp_buckets")
    lines = [line for line in metrics.render().splitlines() if line.startswith(wanted)]
    # One write per rank, so that the two workers' lines do not interleave on a shared stdout.
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()
    dist.barrier()  # leave together


if __name__ == "__main__":
    main()
