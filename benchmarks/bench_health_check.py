"""What the gang health check costs, and whether it names a slow rank (ddp_trainer.training.health_check).

For each group size and buffer size, N gloo ranks on loopback (one intra-op thread each) form a group
and run ``check_links`` --runs times, a barrier before each. Per row: the check's wall time (the
slowest rank's, median over the runs, and the worst run), the all-reduce bus bandwidth and the
links' median and lowest bandwidth (medians over the runs), and how many runs named a slow rank.
The rows marked "slow" make the last rank sleep --slow-ms before each of its sends (the trainer's
``--inject-fault RANK:health:slow=MS``): every run should name it. "lowest rank / median" is what the
verdict compares with ``SLOW_FRACTION`` (0.25): the lowest rank's bandwidth (its better link) over the
median rank's, in the row's worst run (its lowest; a quiet group's margin, a slow rank's depth).

    python benchmarks/bench_health_check.py [--runs 7 --sizes 2,4,8 --bytes 1048576 --slow-ms 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from ddp_operator.local.ports import free_ports

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_trainer import process_group_session
from ddp_trainer.library.health import NO_SLOW_RANK, rank_bandwidths
from ddp_trainer.training.health_check import check_links


def free_port() -> int:
    return free_ports(1)[0]


def worker(rank: int, world: int, port: int, nbytes: int, runs: int, slow_ms: float, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    delay = slow_ms / 1000.0 if rank == world - 1 else 0.0
    with process_group_session():
        dist.init_process_group("gloo", rank=rank, world_size=world)
        rows = []
        for _ in range(runs):
            dist.barrier()
            started = time.perf_counter()
            result = check_links(rank, world, torch.device("cpu"), nbytes, delay)
            rows.append((time.perf_counter() - started, result))
        results.put((rank, rows))


def measure(world: int, nbytes: int, runs: int, slow_ms: float) -> dict[int, list[Any]]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=worker, args=(rank, world, port, nbytes, runs, slow_ms, results))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    found = dict(results.get(timeout=600) for _ in range(world))
    for process in processes:
        process.join(timeout=60)
    return found


def row(world: int, nbytes: int, runs: int, slow_ms: float) -> str:
    found = measure(world, nbytes, runs, slow_ms)
    walls = [max(found[rank][run][0] for rank in range(world)) for run in range(runs)]
    results = [found[0][run][1] for run in range(runs)]
    agreed = all(found[rank][run][1] == results[run] for rank in range(world) for run in range(runs))
    expected = world - 1 if slow_ms else NO_SLOW_RANK
    named = sum(result.slow_rank == expected for result in results)
    busbw = statistics.median(result.busbw for result in results)
    link_median = statistics.median(statistics.median(result.links) for result in results)
    link_min = statistics.median(min(result.links) for result in results)
    # What the verdict compares with SLOW_FRACTION: the lowest rank over the median rank, worst run.
    margin = min(
        min(ranks) / statistics.median(ranks) for ranks in map(rank_bandwidths, (r.links for r in results))
    )
    what = f"slow rank {world - 1} (+{slow_ms:g} ms)" if slow_ms else "quiet"
    verdict = f"{named}/{runs} name rank {expected}" if slow_ms else f"{runs - named}/{runs} name a rank"
    return (
        f"| {world} | {nbytes / 2**20:g} MiB | {what} | {statistics.median(walls):.3f} | {max(walls):.3f} | "
        f"{busbw / 1e9:.3f} | {link_median / 1e9:.3f} | {link_min / 1e9:.3f} | {margin:.2f} | {verdict} | "
        f"{'yes' if agreed else 'NO'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--sizes", default="2,4,8", help="group sizes, comma-separated")
    parser.add_argument("--bytes", default=str(1 << 20), help="buffer sizes in bytes, comma-separated")
    parser.add_argument("--slow-ms", type=float, default=50.0, help="0: no slow rows")
    options = parser.parse_args()
    sizes = [int(size) for size in options.sizes.split(",")]
    buffers = [int(size) for size in options.bytes.split(",")]
    print(
        f"torch {torch.__version__}, gloo on loopback, {options.runs} checks per row, {os.cpu_count()} CPUs\n"
    )
    print(
        "| ranks | buffer | group | check (s), median | worst (s) | busbw (GB/s) | link median (GB/s) | "
        "link min (GB/s) | lowest rank / median | verdict | ranks agree |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|")
    for world in sizes:
        for nbytes in buffers:
            print(row(world, nbytes, options.runs, 0.0), flush=True)
        if options.slow_ms and world >= 3:
            print(row(world, buffers[0], options.runs, options.slow_ms), flush=True)


if __name__ == "__main__":
    main()
