"""What the gradient-sync metrics cost, and whether the bandwidth our hook measures is right.

Two gloo ranks on this machine. Step time of the same MLP under four DDP set-ups, run in interleaved
rounds (every round runs every mode, in a rotating order) and summarized by medians:
  plain       DDP's C++ allreduce, no Python hook, no metrics
  torch-hook  torch's own Python allreduce_hook
  detailed    our timing comm hook (docs/metrics.md), no straggler exchange
  exchange    detailed plus the straggler exchange every --exchange-every steps (instrument()'s default)
  light       no Python hook, metrics from DDP's logger (with the exchange, as instrument() sets it up)
A step's time includes Instrumentation.step(), where the exchange runs. Then the exchange itself
(one allreduce of 7 floats per rank, and one more with the trainer's stop flag riding in it) against
the trainer's old 1-element stop-flag allreduce, what detailed mode reads per step to see a starved
rank's stall (gloo's threads' CPU waits, ddp_trainer.library.runqueue), and the bus bandwidth our hook reports
(payload / service time x 2(n-1)/n) against a raw, timed dist.all_reduce of the same size, at 1, 4
and 25 MiB.

    python benchmarks/bench_sync_overhead.py [--rounds 7 --steps 10 --width 1024 --depth 8]

``--device cuda`` (a lent GPU): one rank on NCCL, the same five set-ups on transformer stacks in bf16
autocast (``--cuda-models``, layers x width: 12x1536 is 342 M parameters, ~38 buckets a step; 4x1024
is 51 M, 7 buckets, a ~10 ms step on an H200), batch 8 x 512 tokens; a set-up's step time is the mean
over ``--steps`` steps with one device synchronization at the end (the host runs ahead as in
training), medians over interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ddp_trainer import Instrumentation, instrument, process_group_session
from ddp_trainer.library.runqueue import GlooThreadDelay
from ddp_trainer.training.workloads import mlp

MODES = ("plain", "torch-hook", "detailed", "exchange", "light")
SIZES_MIB = (1, 4, 25)


def build(
    mode: str, model: nn.Module, exchange_every: int
) -> tuple[DistributedDataParallel, Instrumentation | None]:
    ddp = DistributedDataParallel(model)
    metrics = None
    if mode == "torch-hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif mode in ("detailed", "exchange", "light"):
        # A registry of its own, no server; "detailed" without the exchange, as issue 2 measured it.
        every = 0 if mode == "detailed" else exchange_every
        metrics = instrument(
            ddp, mode="light" if mode == "light" else "detailed", port=0, exchange_every=every
        )
    return ddp, metrics


def step_times(
    ddp: DistributedDataParallel, metrics: Instrumentation | None, batch: Any, steps: int
) -> list[float]:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    inputs, targets = batch
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()
        if metrics is not None:
            metrics.step(len(targets), time.perf_counter() - started)
        times.append(time.perf_counter() - started)
    return times


def bus_bandwidth(rank: int, world: int, mib: int, repeats: int) -> tuple[float, float]:
    """(hook-measured, raw) bus bandwidth in GB/s, medians over ``repeats``."""
    numel = mib * (1 << 20) // 4
    factor = 2 * (world - 1) / world
    raw = []
    tensor = torch.ones(numel)
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        raw.append(numel * 4 / (time.perf_counter() - started) * factor / 1e9)
    model = nn.Linear(numel, 1, bias=False)
    ddp = DistributedDataParallel(model, bucket_cap_mb=mib + 1)
    # Every step timed: this compares one step's service time with a raw allreduce's.
    metrics = instrument(ddp, port=0, exchange_every=0, time_every=1)
    registry = metrics.endpoint.registry
    assert registry is not None
    labels = {"rank": str(rank)}

    def value(name: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    measured = []
    inputs = torch.ones(1, numel)
    for _ in range(repeats):
        dist.barrier()
        before_bytes = value("ddp_allreduce_bytes_total")
        before_service = value("ddp_allreduce_service_seconds_total")
        ddp(inputs).sum().backward()
        metrics.flush()  # no step(): the flush counts the sync
        payload = value("ddp_allreduce_bytes_total") - before_bytes
        service = value("ddp_allreduce_service_seconds_total") - before_service
        measured.append(payload / service * factor / 1e9)
    metrics.close()
    return statistics.median(measured), statistics.median(raw)


def exchange_cost(world: int, calls: int) -> dict[str, float]:
    """Median seconds of one exchange (with and without a flag riding in it) and of a 1-float allreduce.

    A step of a small model runs before each exchange, so that every rank has a window to send and
    rank 0 pools and judges real pictures.
    """
    model = DistributedDataParallel(nn.Linear(8, 2))
    metrics = instrument(model, port=0, exchange_every=0)
    batch = torch.randn(4, 8)
    flag = torch.zeros(1)
    timed: dict[str, list[float]] = {
        "stop-flag allreduce (1 float)": [],
        "exchange": [],
        "exchange + flag": [],
    }

    def one_step() -> None:
        model(batch).sum().backward()
        metrics.step(len(batch))
        dist.barrier()

    for _ in range(calls):
        one_step()
        started = time.perf_counter()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        timed["stop-flag allreduce (1 float)"].append(time.perf_counter() - started)
        one_step()
        started = time.perf_counter()
        metrics.exchange()
        timed["exchange"].append(time.perf_counter() - started)
        one_step()
        started = time.perf_counter()
        metrics.exchange([0.0])
        timed["exchange + flag"].append(time.perf_counter() - started)
    metrics.close()
    medians = {name: statistics.median(values) for name, values in timed.items()}
    # Per step, detailed mode reads gloo's threads twice (at the last bucket's issue, at the step's end).
    delay = GlooThreadDelay()
    reads = []
    for _ in range(calls * 10):
        started = time.perf_counter()
        delay.since(delay.mark())
        reads.append(time.perf_counter() - started)
    delay.close()
    medians["per step: gloo threads' CPU waits, read twice"] = statistics.median(reads)
    return medians


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    # The session closes every instrumentation and ends the group cleanly (ddp_trainer.library.teardown).
    with process_group_session():
        dist.init_process_group("gloo", rank=rank, world_size=world)
        measure(rank, world, args, results)


def measure(rank: int, world: int, args: argparse.Namespace, results: Any) -> None:
    torch.manual_seed(0)
    template = mlp(args.width, args.depth)
    setups = {}
    for mode in MODES:
        model = mlp(args.width, args.depth)
        model.load_state_dict(template.state_dict())
        setups[mode] = build(mode, model, args.exchange_every)
    generator = torch.Generator().manual_seed(rank)
    batch = (
        torch.randn(args.batch, args.width, generator=generator),
        torch.randint(0, 10, (args.batch,), generator=generator),
    )
    for mode in MODES:  # warm-up: bucket rebuild, allocator, gloo connections
        step_times(*setups[mode], batch, 3)
    per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = MODES[round_index % len(MODES) :] + MODES[: round_index % len(MODES)]
        for mode in order:
            dist.barrier()
            per_mode[mode].append(statistics.median(step_times(*setups[mode], batch, args.steps)))
    exchange = exchange_cost(world, args.exchange_calls)
    bandwidth = {mib: bus_bandwidth(rank, world, mib, args.repeats) for mib in SIZES_MIB}
    if rank == 0:
        results.update(
            steps={m: statistics.median(v) for m, v in per_mode.items()},
            bandwidth=bandwidth,
            exchange=exchange,
        )


def transformer(layers: int, width: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(width, max(width // 128, 1), 4 * width, dropout=0.0, batch_first=True)
    return nn.Sequential(
        nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(width, 8)
    )


def cuda_step_time(ddp: DistributedDataParallel, metrics: Instrumentation | None, steps: int) -> float:
    """Mean seconds per step over ``steps`` steps, synchronizing the device only at the ends."""
    device = next(ddp.parameters()).device
    width = next(m for m in ddp.modules() if isinstance(m, nn.Linear)).in_features
    inputs = torch.randn(8, 512, width, device=device)
    targets = torch.randint(0, 8, (8,), device=device)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-5)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(ddp(inputs).mean(dim=1), targets)
        loss.backward()
        optimizer.step()
        if metrics is not None:
            metrics.step(len(targets))
    torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / steps


def measure_cuda(args: argparse.Namespace) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with process_group_session():
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        print(
            f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
            f"{torch.cuda.get_device_name(device)}, 1 rank, bf16 autocast, batch 8 x 512, "
            f"{args.rounds} interleaved rounds x {args.steps} steps, medians"
        )
        print()
        print("| model | mode | step (ms) | vs plain | vs torch-hook |")
        print("|---|---|---:|---:|---:|")
        for spec in args.cuda_models:
            layers, width = (int(part) for part in spec.split("x"))
            torch.manual_seed(0)
            setups = {}
            for mode in MODES:
                setups[mode] = build(mode, transformer(layers, width).to(device), args.exchange_every)
            for mode in MODES:  # warm-up: bucket rebuild, allocator, NCCL's communicator
                cuda_step_time(*setups[mode], 3)
            per_mode: dict[str, list[float]] = {mode: [] for mode in MODES}
            for round_index in range(args.rounds):
                order = MODES[round_index % len(MODES) :] + MODES[: round_index % len(MODES)]
                for mode in order:
                    per_mode[mode].append(cuda_step_time(*setups[mode], args.steps))
            medians = {mode: statistics.median(v) for mode, v in per_mode.items()}
            params = sum(p.numel() for p in setups["plain"][0].parameters()) / 1e6
            for mode in MODES:
                print(
                    f"| {spec} ({params:.0f} M) | {mode} | {medians[mode] * 1e3:.2f} | "
                    f"{medians[mode] / medians['plain'] - 1:+.1%} | "
                    f"{medians[mode] / medians['torch-hook'] - 1:+.1%} |"
                )
            for _, metrics in setups.values():
                if metrics is not None:
                    metrics.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per mode per round")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15, help="allreduces per size for the bandwidth")
    parser.add_argument(
        "--exchange-every", type=int, default=10, help="steps between exchanges (mode exchange)"
    )
    parser.add_argument("--exchange-calls", type=int, default=200, help="exchanges timed one by one")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--cuda-models", nargs="+", default=["4x1024", "12x1536"], help="--device cuda: layers x width"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        measure_cuda(args)
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(worker, args=(2, port, args, results), nprocs=2)
    steps, bandwidth, exchange = results["steps"], results["bandwidth"], results["exchange"]
    print(
        f"torch {torch.__version__}, gloo, 2 ranks, {args.depth}x{args.width} MLP, batch {args.batch}/rank, "
        f"{args.rounds} interleaved rounds x {args.steps} steps, medians"
    )
    print()
    print("| mode | step time (ms) | vs plain | vs torch-hook |")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        print(
            f"| {mode} | {steps[mode] * 1e3:.2f} | {steps[mode] / steps['plain'] - 1:+.1%} | "
            f"{steps[mode] / steps['torch-hook'] - 1:+.1%} |"
        )
    print()
    print(f"Straggler exchange, medians of {args.exchange_calls} calls, each after a step and a barrier:")
    print()
    print(f"| collective | time (us) | per step at every {args.exchange_every} steps, vs detailed's step |")
    print("|---|---:|---:|")
    for name, seconds in exchange.items():
        every = 1 if name.startswith("per step") else args.exchange_every
        share = seconds / every / steps["detailed"]
        print(f"| {name} | {seconds * 1e6:.1f} | {share:.3%} |")
    print()
    print("| size | bus bandwidth, our hook (GB/s) | raw dist.all_reduce (GB/s) | ratio |")
    print("|---|---:|---:|---:|")
    for mib in SIZES_MIB:
        hook, raw = bandwidth[mib]
        print(f"| {mib} MiB | {hook:.3f} | {raw:.3f} | {hook / raw:.2f} |")


if __name__ == "__main__":
    main()
