"""A plain DDP script, the kind written for stock `torchrun` (nothing from this project).

torchrun reads the PET_* variables that the operator (and `ddpjob run`) set on every pod, starts
PET_NPROC_PER_NODE workers here and gives each of them RANK, WORLD_SIZE and LOCAL_RANK. This script
joins the group, checks that it is the size the job asked for, proves it with an allreduce, and
trains a tiny model with DistributedDataParallel for a few steps.

    torchrun --nproc-per-node 2 examples/scripts/plain_ddp.py --expect-world-size 2
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

# Imported before the group exists on purpose: its collectives default to `group=group.WORLD`, which
# Python evaluates at import. DDP imports it lazily, after init_process_group, and the defaults would
# then hold the group past destroy_process_group(); its gloo threads would outlive it, and one of them
# releasing the last backward's work while the interpreter exits aborts the process (torch 2.15).
import torch.distributed.nn
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    # Workers of one pod share its stdout; under PYTHONUNBUFFERED a print() is two writes (text, then
    # newline) that another worker's line can split. Line buffering writes each line at once.
    sys.stdout.reconfigure(line_buffering=True, write_through=False)  # type: ignore[union-attr]
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--expect-world-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    print(f"rank {rank} (local {local_rank}) joined a group of world size {world_size}", flush=True)
    if args.expect_world_size is not None and world_size != args.expect_world_size:
        raise SystemExit(f"expected world size {args.expect_world_size}, got {world_size}")

    # Every rank contributes rank + 1, so the sum proves that all of them took part.
    contribution = torch.tensor([float(rank + 1)])
    dist.all_reduce(contribution)
    expected = world_size * (world_size + 1) / 2
    if contribution.item() != expected:
        raise SystemExit(f"allreduce sum {contribution.item()} != {expected}")
    print(f"rank {rank}: allreduce sum={contribution.item():.0f} (expected {expected:.0f})", flush=True)

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    true_weights = torch.arange(8, dtype=torch.float32) / 8
    loss = torch.tensor(0.0)
    for _ in range(args.steps):
        inputs = torch.randn(32, 8, generator=generator)
        targets = inputs @ true_weights
        loss = torch.nn.functional.mse_loss(model(inputs).squeeze(1), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if rank == 0:
        print(
            f"trained {args.steps} steps, final loss={loss.item():.4f}, world_size={world_size}", flush=True
        )
    # Leave together, and drop the model first: its reducer holds the group, which must end (and
    # join its threads) now, while the interpreter is fully alive.
    dist.barrier()
    del model, optimizer
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
