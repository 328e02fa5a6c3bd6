"""One stock-torchrun worker for tests/trainer/test_inplace_restarts.py (nothing of ours imported).

It joins the group, checks it with an allreduce, then makes ``--steps`` more allreduces 50 ms apart.
With ``--fail-once``, global rank 1 dies in its first round as a killed process would (exit 137), so
torchrun's agents must restart the group in place.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-once", action="store_true")
    parser.add_argument("--steps", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"probe started rank={rank} restart_count={restarts}", flush=True)
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    assert total.item() == world_size
    if args.fail_once and rank == 1 and restarts == 0:
        sys.stdout.flush()
        os._exit(137)
    for step in range(args.steps):
        dist.all_reduce(torch.ones(1))
        print(f"probe step={step} rank={rank}", flush=True)
        time.sleep(0.05)
    dist.barrier()
    print(f"probe done rank={rank}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
