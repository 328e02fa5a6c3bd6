"""Step time and gradient-sync metrics of the GCN beside the MLP, and what --bucket-cap-mb does to the GCN.

Runs the real trainer (`python -m ddp_trainer`, 2 gloo ranks on loopback, one intra-op thread each)
and reads rank 0's /metrics twice: after --warmup steps and when training is over, so that every
figure is over the steps in between (DDP's first step and bucket rebuild excluded). Set-ups run in
interleaved rounds (every round runs every set-up, in a rotating order); the table shows medians
over the rounds.

  mlp          --workload synthetic: the 8 x 1024 MLP of bench_sync_overhead.py, batch 64 per rank
  gcn cap=...  --workload gcn on the example's generated graph (20,000 nodes, ~192,000 edges), 2 layers,
               hidden 128, each rank's 800 training nodes per step, at several --bucket-cap-mb

    python benchmarks/bench_gcn_sync.py [--rounds 5 --steps 40 --warmup 10]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_operator.local.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
LINGERING = "ddp_trainer: serving /metrics for "
RUN_TIMEOUT = 600.0

GCN = ["--workload", "gcn", "--graph-nodes", "20000", "--gcn-hidden", "128", "--gcn-layers", "2"]
GCN += ["--batch-size", "800", "--lr", "0.2"]
SETUPS: dict[str, list[str]] = {
    "mlp (8 x 1024), cap 25": ["--workload", "synthetic", "--batch-size", "64", "--lr", "0.01"],
    # 58.6 KiB of gradients: one bucket, reduced when the whole backward is done.
    "gcn, cap 25": [*GCN, "--bucket-cap-mb", "25"],
    # 5,242 bytes: the output layer (8,256 bytes, ready first) and the first layer (51,712) apart.
    "gcn, cap 0.005": [*GCN, "--bucket-cap-mb", "0.005"],
    # 104 bytes: output layer, first bias, first weight: three buckets.
    "gcn, cap 0.0001": [*GCN, "--bucket-cap-mb", "0.0001"],
}


def free_port() -> int:
    return free_ports(1)[0]


def scrape(port: int) -> dict[str, float]:
    """Rank 0's samples by name (histograms: their _sum and _count)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^([a-z_]+)(?:\{[^}]*\})?\s+(\S+)$", line)
        if match and 'le="' not in line:
            values[match.group(1)] = float(match.group(2))
    return values


def wait_for(path: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while text not in path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 ended or hung before printing {text!r}:\n{path.read_text()[-3000:]}")
        time.sleep(0.05)


@dataclass(frozen=True)
class Sample:
    step_ms: float
    allreduce_calls: float
    allreduce_kib: float
    allreduce_service_ms: float
    compute_ms: float
    comm_ms: float
    overlap_ms: float
    overlap_ratio: float
    buckets: float


def run_once(args: Sequence[str], steps: int, warmup: int, workdir: Path) -> Sample:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PET_", "DDP", "TORCHELASTIC")) and key not in {"RANK", "WORLD_SIZE"}
    }
    master_port, metrics_port = free_port(), free_port()
    env.update(
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    # --epochs high enough that --max-steps decides (the GCN makes one step per epoch).
    common = [
        *args,
        "--epochs",
        "1000000",
        "--max-steps",
        str(steps),
        "--progress-every",
        str(warmup),
        "--metrics-linger",
        "120",
    ]
    processes, logs = [], []
    for rank in (0, 1):
        log = workdir / f"rank{rank}.log"
        logs.append(log)
        with log.open("wb") as out:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "ddp_trainer", "--metrics-host", "127.0.0.1", *common],
                    env={**env, "RANK": str(rank), "DDP_METRICS_PORT": str(metrics_port if rank == 0 else 0)},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        wait_for(logs[0], f"progress step={warmup} ", processes[0])
        before = scrape(metrics_port)
        wait_for(logs[0], LINGERING, processes[0])
        after = scrape(metrics_port)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            process.wait(timeout=60)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    stepped = delta("ddp_step_duration_seconds_count")
    calls = delta("ddp_allreduce_calls_total")
    return Sample(
        step_ms=delta("ddp_step_duration_seconds_sum") / stepped * 1e3,
        allreduce_calls=calls / stepped,
        allreduce_kib=delta("ddp_allreduce_bytes_total") / stepped / 1024,
        allreduce_service_ms=delta("ddp_allreduce_service_seconds_total") / max(calls, 1) * 1e3,
        compute_ms=after["ddp_backward_compute_seconds"] * 1e3,
        comm_ms=after["ddp_backward_comm_seconds"] * 1e3,
        overlap_ms=after["ddp_backward_overlap_seconds"] * 1e3,
        overlap_ratio=after["ddp_comm_overlap_ratio"],
        buckets=after["ddp_buckets"],
    )


def median(samples: list[Sample], field: str) -> float:
    return float(statistics.median(getattr(sample, field) for sample in samples))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=10, help="steps before the first scrape")
    parser.add_argument("--only", default="", help="comma-separated set-up names to run (default: all)")
    args = parser.parse_args()
    names = [name for name in SETUPS if not args.only or name in args.only.split(",")]
    results: dict[str, list[Sample]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                results[name].append(run_once(SETUPS[name], args.steps, args.warmup, Path(scratch)))
                print(f"round {round_index + 1}: {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    import torch

    print(
        f"torch {torch.__version__}, gloo, 2 ranks x 1 thread, steps {args.warmup + 1}-{args.steps} of "
        f"each run, medians of {args.rounds} interleaved runs"
    )
    print()
    print(
        "| set-up | buckets | step (ms) | step, runs' range (ms) | allreduces/step | KiB/step | service/allreduce (ms) | "
        "backward compute (ms) | backward comm (ms) | overlap (ms) | overlap ratio | comm / step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, samples in results.items():
        step, comm = median(samples, "step_ms"), median(samples, "comm_ms")
        print(
            f"| {name} | {median(samples, 'buckets'):.0f} | {step:.1f} "
            f"| {min(x.step_ms for x in samples):.0f}-{max(x.step_ms for x in samples):.0f} "
            f"| {median(samples, 'allreduce_calls'):.0f} "
            f"| {median(samples, 'allreduce_kib'):.1f} | {median(samples, 'allreduce_service_ms'):.2f} "
            f"| {median(samples, 'compute_ms'):.1f} | {comm:.2f} | {median(samples, 'overlap_ms'):.2f} "
            f"| {median(samples, 'overlap_ratio'):.2f} | {comm / step:.1%} |"
        )


if __name__ == "__main__":
    main()
