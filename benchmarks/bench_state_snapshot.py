"""What the survivors' in-memory copy of the state costs per step (ddp_trainer.snapshot).

For each workload, one process builds the trainer's model and optimizer (a 1-rank gloo group, DDP as
the trainer wraps it, one intra-op thread) and alternates, in rounds, K training steps without a copy
and K steps each followed by ``StateSnapshots.save`` into /dev/shm. The table gives the median over
the rounds of the step time of each, and the copy's share of the step (the overhead a job pays).

    python benchmarks/bench_state_snapshot.py [--rounds 7 --steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ddp_operator.local.ports import free_ports

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_trainer.config import parse_args
from ddp_trainer.snapshot import StateSnapshots
from ddp_trainer.workloads import build_workload

WORKLOADS: dict[str, list[str]] = {
    "digits (linear 64x10), batch 32": ["--workload", "digits"],
    "mlp (8 x 1024), batch 64": ["--workload", "synthetic", "--batch-size", "64", "--lr", "0.01"],
    "gcn (20,000 nodes, hidden 128), batch 800": [
        *("--workload", "gcn", "--graph-nodes", "20000", "--gcn-hidden", "128", "--gcn-layers", "2"),
        *("--batch-size", "800", "--lr", "0.2"),
    ],
}


def free_port() -> int:
    return free_ports(1)[0]


def measure(args: list[str], rounds: int, steps: int, directory: Path) -> tuple[float, float, int]:
    config = parse_args(args, env={})
    workload = build_workload(config)
    ddp = DistributedDataParallel(workload.model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)
    features, labels = workload.train.tensors
    loss_fn = nn.CrossEntropyLoss()
    snapshots = StateSnapshots(directory, 0)

    def timed(after: Callable[[int], None]) -> float:
        started = time.perf_counter()
        for step in range(steps):
            batch = slice((step * config.batch_size) % (len(features) - config.batch_size), None)
            inputs, targets = features[batch][: config.batch_size], labels[batch][: config.batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(ddp(inputs), targets).backward()
            optimizer.step()
            after(step)
        return (time.perf_counter() - started) / steps

    timed(lambda _: None)  # warm-up: the bucket rebuild, the allocator
    plain, copied = [], []
    for _ in range(rounds):
        plain.append(timed(lambda _: None))
        copied.append(timed(lambda step: snapshots.save(step, {"step": step}, ddp.module, optimizer)))
    size = sum(p.numel() * p.element_size() for p in ddp.parameters())
    return statistics.median(plain), statistics.median(copied), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    options = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    print(f"torch {torch.__version__}, {options.rounds} rounds of {options.steps} steps, median\n")
    print("| workload | parameters | step | step + copy | copy's share |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=shm) as directory:
        for name, args in WORKLOADS.items():
            plain, copied, size = measure(args, options.rounds, options.steps, Path(directory) / name[:5])
            share = (copied - plain) / plain * 100
            print(
                f"| {name} | {size / 1024:,.0f} KiB | {plain * 1000:.3f} ms | {copied * 1000:.3f} ms | {share:+.1f}% |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
