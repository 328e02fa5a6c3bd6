"""How fast rank 0 names a straggler, and whether its slowdown means what it says.

Three gloo ranks on this machine train a small MLP (``instrument()`` with its default exchange every
10 steps, every rank sleeping --step-ms per step as a data loader waits). After --quiet-steps steps
rank 2 turns slow, one scenario per row: late by --late-ms in its forward (compute), before it (data)
or before each collective it starts (communication), or starved by a CPU limit (a cgroup allowing
--cpu of a CPU, as a pod's ``limits.cpu``; root only, skipped elsewhere). Rank 0 keeps what every
exchange said. Reported per scenario:

- detection: steps and seconds (rank 0's clock) from the slowdown's start to the first exchange that
  names rank 2 at or above --threshold (the operator and `ddpjob run` then wait their window);
- the slowdown rank 0 estimated (median over the second half of the slow steps) against the real one
  (the job's mean step time while slow over its mean step time while quiet), and the phase;
- in the quiet steps, the highest slowdown rank 0 estimated (the margin below the threshold).

    python benchmarks/bench_straggler.py [--quiet-steps 300 --slow-steps 300 --step-ms 10 --late-ms 30]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_operator.progress.tracker import STRAGGLER_THRESHOLD
from ddp_trainer import instrument, process_group_session

SCENARIOS = ("compute", "data", "communication", "cpu-limit")
SLOW_RANK = 2
CGROUP_ROOT = Path("/sys/fs/cgroup")


class Delay(nn.Module):
    """Sleeps in forward while ``seconds`` > 0 (compute that takes longer)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.seconds > 0:
            time.sleep(self.seconds)
        return inputs


def limit_this_process(cpus: float) -> bool:
    """Put this process under a CPU limit of ``cpus`` CPUs (cgroup v1 cpu or v2), if allowed."""
    period = 100_000
    quota = max(int(cpus * period), 1000)
    name = f"bench-straggler-{os.getpid()}"
    for path, knobs in (
        (CGROUP_ROOT / "cpu" / name, {"cpu.cfs_period_us": str(period), "cpu.cfs_quota_us": str(quota)}),
        (CGROUP_ROOT / name, {"cpu.max": f"{quota} {period}"}),
    ):
        try:
            path.mkdir()
            for knob, value in knobs.items():
                (path / knob).write_text(value)
            (path / "cgroup.procs").write_text(str(os.getpid()))
            return True
        except OSError:
            continue
    return False


def worker(rank: int, world: int, port: int, scenario: str, args: argparse.Namespace, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    with process_group_session():
        dist.init_process_group("gloo", rank=rank, world_size=world)
        run(rank, scenario, args, results)


def run(rank: int, scenario: str, args: argparse.Namespace, results: Any) -> None:
    torch.manual_seed(0)
    delay = Delay()
    model = DistributedDataParallel(nn.Sequential(delay, nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))
    metrics = instrument(model, port=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(32, 64), torch.randint(0, 4, (32,))
    issue = dist.all_reduce
    late = args.late_ms / 1000.0
    step_ends: list[float] = []
    said: list[tuple[int, float, int, float, str]] = []  # step, time, rank, slowdown, phase
    limited = True
    for step in range(args.quiet_steps + args.slow_steps):
        if step == args.quiet_steps and rank == SLOW_RANK:
            if scenario == "compute":
                delay.seconds = late
            elif scenario == "communication":

                def late_issue(*a: Any, **k: Any) -> Any:
                    time.sleep(late)
                    return issue(*a, **k)

                dist.all_reduce = late_issue
            elif scenario == "cpu-limit":
                limited = limit_this_process(args.cpu)
        if scenario == "data" and rank == SLOW_RANK and step >= args.quiet_steps:
            time.sleep(late)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        metrics.step(len(targets))
        step_ends.append(time.perf_counter())
        found = metrics.straggler
        if rank == 0 and (step + 1) % metrics.exchange_every == 0 and found is not None:
            said.append((step + 1, time.perf_counter(), found.rank, found.slowdown, found.phase))
        time.sleep(args.step_ms / 1000.0)
    dist.all_reduce = issue
    flag = torch.tensor([0.0 if limited else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if rank == 0:
        results[scenario] = {"ends": step_ends, "said": said, "limited": flag.item() == 0.0}


def summarize(data: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ends, said = data["ends"], data["said"]
    start = args.quiet_steps
    settle = args.slow_steps // 2

    def mean_step(first: int, last: int) -> float:
        return (ends[last] - ends[first]) / (last - first)

    quiet = mean_step(20, start - 1)
    slow = mean_step(start + settle, len(ends) - 1)
    named = next((s for s in said if s[0] > start and s[2] == SLOW_RANK and s[3] >= args.threshold), None)
    late = [s for s in said if s[0] > start + settle]
    return {
        "quiet_ms": quiet * 1e3,
        "slow_ms": slow * 1e3,
        "real": slow / quiet,
        "estimated": statistics.median(s[3] for s in late) if late else float("nan"),
        "phase": statistics.mode(s[4] for s in late) if late else "-",
        "named_share": sum(s[2] == SLOW_RANK for s in late) / len(late) if late else 0.0,
        "detect_steps": None if named is None else named[0] - start,
        "detect_s": None if named is None else named[1] - ends[start - 1],
        "quiet_max": max((s[3] for s in said if 50 < s[0] <= start), default=float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quiet-steps", type=int, default=300)
    parser.add_argument("--slow-steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=10.0, help="every rank sleeps this long per step")
    parser.add_argument("--late-ms", type=float, default=30.0, help="how late rank 2 is per step")
    parser.add_argument("--cpu", type=float, default=0.05, help="rank 2's CPU limit (cpu-limit)")
    parser.add_argument(
        "--threshold", type=float, default=STRAGGLER_THRESHOLD, help="the operator's --straggler-threshold"
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    manager = mp.Manager()
    results = manager.dict()
    for scenario in args.scenarios.split(","):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.spawn(worker, args=(3, port, scenario, args, results), nprocs=3)
        for leftover in [*CGROUP_ROOT.glob("bench-straggler-*"), *CGROUP_ROOT.glob("cpu/bench-straggler-*")]:
            leftover.rmdir()  # empty now that its process has exited
    print(
        f"torch {torch.__version__}, gloo, 3 ranks, {args.quiet_steps} quiet then {args.slow_steps} slow steps, "
        f"every rank sleeping {args.step_ms:g} ms per step; rank 2 late by {args.late_ms:g} ms or under "
        f"{args.cpu:g} CPU; exchange every 10 steps; threshold {args.threshold:g}"
    )
    print()
    print(
        "| rank 2 slowed in | quiet step (ms) | slow step (ms) | real slowdown | estimated | phase | "
        "exchanges naming rank 2 | detected after (steps / s) | quiet max estimate |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for scenario in args.scenarios.split(","):
        data = results[scenario]
        if scenario == "cpu-limit" and not data["limited"]:
            print("| cpu-limit | (no cgroup could be made here) | | | | | | | |")
            continue
        row = summarize(data, args)
        detected = (
            "never" if row["detect_steps"] is None else f"{row['detect_steps']} / {row['detect_s']:.2f}"
        )
        print(
            f"| {scenario} | {row['quiet_ms']:.1f} | {row['slow_ms']:.1f} | {row['real']:.2f} | "
            f"{row['estimated']:.2f} | {row['phase']} | {row['named_share']:.0%} | {detected} | "
            f"{row['quiet_max']:.2f} |"
        )


if __name__ == "__main__":
    main()
