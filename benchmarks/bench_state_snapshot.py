"""What the survivors' in-memory copy of the state costs per step (ddp_trainer.snapshot).

For each workload, one process builds the trainer's model and optimizer (a 1-rank gloo group, DDP as
the trainer wraps it, one intra-op thread) and alternates, in rounds, K training steps without a copy
and K steps each followed by ``StateSnapshots.save`` into /dev/shm. The table gives the median over
the rounds of the step time of each, and the copy's share of the step (the overhead a job pays).

    python benchmarks/bench_state_snapshot.py [--rounds 7 --steps 30]

On a GPU (``--device cuda``: a 1-rank NCCL group, the model and batches on the device) the workloads
are MLPs whose state is 0.1-4 GiB, and a second table gives the copy's raw rates for 1 and 4 GiB:
device to the slot (pageable shared memory, what ``save`` does), device to the same slot once
registered with CUDA (pinned), and the slot back to the device (the resume's load).
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


# On a GPU: MLPs whose model and SGD momentum are 0.1 to 4 GiB (8 layers, 2 x 4 bytes a parameter).
GPU_WORKLOADS: dict[str, list[str]] = {
    f"mlp (8 x {width}), batch 1024": [
        *("--workload", "synthetic", "--synthetic-width", str(width), "--synthetic-depth", "8"),
        *("--synthetic-samples", "8192", "--batch-size", "1024", "--lr", "0.01"),
    ]
    for width in (1024, 4096, 8192)
}


def free_port() -> int:
    return free_ports(1)[0]


def measure(
    args: list[str], rounds: int, steps: int, directory: Path, device: torch.device
) -> tuple[float, float, int]:
    """The median step time without a copy, then with ``save`` after each step, and the parameters'
    bytes."""
    config = parse_args(args, env={})
    workload = build_workload(config)
    cuda = device.type == "cuda"
    ddp = DistributedDataParallel(workload.model.to(device), device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=config.momentum)
    features, labels = (tensor.to(device) for tensor in workload.train.tensors)
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
        if cuda:
            torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / steps

    timed(lambda _: None)  # warm-up: the bucket rebuild, the allocator

    plain: list[float] = []
    copied: list[float] = []
    for _ in range(rounds):
        plain.append(timed(lambda _: None))
        copied.append(timed(lambda step: snapshots.save(step, {"step": step}, ddp.module, optimizer)))
    size = sum(p.numel() * p.element_size() for p in ddp.parameters())
    return statistics.median(plain), statistics.median(copied), size


def copy_rates(
    directory: Path, device: torch.device, gib: int, repeats: int = 5
) -> tuple[float, float, float]:
    """GB/s, median of ``repeats``: device -> a shared-memory mapping (pageable), device -> the same
    mapping registered with CUDA (pinned), and the mapping -> device."""
    import mmap

    size = gib << 30
    path = directory / f"raw-{gib}"
    with open(path, "w+b") as file:
        file.truncate(size)
        mapping = mmap.mmap(file.fileno(), size)
    host = torch.frombuffer(mapping, dtype=torch.uint8)
    source = torch.ones(size, dtype=torch.uint8, device=device)

    def rate(copy: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            started = time.perf_counter()
            copy()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - started)
        return size / statistics.median(times) / 1e9

    pageable = rate(lambda: host.copy_(source))
    back = rate(lambda: source.copy_(host))
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    registered = cudart.cudaHostRegister(host.data_ptr(), size, 0)
    pinned = rate(lambda: host.copy_(source)) if int(registered) == 0 else float("nan")
    if int(registered) == 0:
        cudart.cudaHostUnregister(host.data_ptr())
    path.unlink()  # the memory goes with the last view of the mapping, on return
    return pageable, pinned, back


def amount(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB" if size >= 2**20 else f"{size / 1024:,.0f} KiB"


def scratch() -> str | None:
    """/dev/shm where it has room for two slots of the largest state and the raw copies (else a
    mapping there would SIGBUS when written), else the default temporary directory."""
    shm = "/dev/shm"
    if not os.access(shm, os.W_OK):
        return None
    stats = os.statvfs(shm)
    return shm if stats.f_bavail * stats.f_frsize > 14 << 30 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu", help="cpu (gloo), or cuda (NCCL, GPU-sized workloads)")
    options = parser.parse_args()
    device = torch.device(options.device)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    shm = scratch() if cuda else ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"torch {torch.__version__} on {where}, {options.rounds} rounds of {options.steps} steps, median\n")
    print("| workload | state (model + momentum) | step | step + copy | copy's share |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=shm) as directory:
        for index, (name, args) in enumerate((GPU_WORKLOADS if cuda else WORKLOADS).items()):
            plain, copied, size = measure(
                args, options.rounds, options.steps, Path(directory) / str(index), device
            )
            share = (copied - plain) / plain * 100
            print(
                f"| {name} | {amount(2 * size)} | {plain * 1000:.3f} ms | {copied * 1000:.3f} ms | {share:+.1f}% |",
                flush=True,
            )
        if cuda:
            for path in Path(directory).rglob("state-*"):
                path.unlink()
            print("\n| bytes | device -> slot (pageable) | device -> slot (registered) | slot -> device |")
            print("|---|---|---|---|")
            for gib in (1, 4):
                pageable, pinned, back = copy_rates(Path(directory), device, gib)
                print(
                    f"| {gib} GiB | {pageable:.1f} GB/s | {pinned:.1f} GB/s | {back:.1f} GB/s |", flush=True
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
