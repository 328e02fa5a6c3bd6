"""From a killed worker to the first kept step after the resume: in place against a new process.

Local processes on loopback stand for pods (NODE_RANK 0..N-1, one worker each, the digits workload,
a checkpoint every --checkpoint-every steps). When rank 0 reaches --kill-at, rank 1's worker is
SIGKILLed (t0), and the time to rank 0's first training step after the resume is measured two ways,
interleaved run by run so both see the same machine load:

  in-place   DDP_RESTART_MODE=InPlace: every pod's launcher restarts its worker on a new round of the
             c10d rendezvous (docs/restarts.md). Phases from rank 0's restart gauges
             (docs/metrics.md): t0 -> the failed worker's agent saw it (failure) -> every pod's
             workers stopped (stopped) -> the new round complete (reformed) -> rank 0's first step
             after the resume (resumed).
  recreate   DDP_RESTART_MODE=Recreate (one process per pod): every rank exits (137, 170),
             then new processes start at once, as a recreated pod's container would (the operator's
             part - deleting and creating pods, scheduling, the container start - comes on top and is
             not measured here: see docs/benchmarks.md for it on kind). Phases: t0 -> every old process
             exited (stopped) -> the new rank 0 printed `resumed` (group formed, checkpoint loaded)
             -> its first step after it (resumed).

"first step after the resume" is rank 0's first `progress` line after its `resumed` line
(--progress-every 1), seen by this script polling the output file, the same way in both modes.
Also printed: what starting a Python interpreter, importing torch, and importing the trainer cost here
(each a fresh process), the floor of every restart that starts a new process.

    python benchmarks/bench_inplace_restart.py [--runs 5 --pods 2 --kill-at 25]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_operator.local.ports import free_ports

PYTHON = sys.executable
POLL = 0.01


def free_port() -> int:
    return free_ports(1)[0]


def base_env() -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("PET_", "DDP", "TORCHELASTIC", "PROMETHEUS_MULTIPROC"))
        and key not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "NNODES", "NODE_RANK", "NPROC_PER_NODE"}
    }
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        MASTER_ADDR="127.0.0.1",
        DDP_METRICS_HOST="127.0.0.1",
    )
    return env


@dataclass
class Pod:
    node: int
    process: subprocess.Popen[bytes]
    out: Path
    metrics_port: int

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def worker_pid(self) -> int | None:
        """The pid of this pod's worker: the in-place launcher names it in its last `launcher
        event=started` line (its workers are forked by a forkserver); a Recreate pod is its worker."""
        lines = re.findall(r"^launcher event=started .*workers=(\S+)", self.text(), re.MULTILINE)
        if not lines:
            return None
        return int(lines[-1].split(",")[0].split(":")[1])

    def end(self) -> None:
        """SIGKILL the pod: its process group (the launcher, its forkserver and workers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)


def start_pods(
    workdir: Path, pods: int, args: Sequence[str], extra: Mapping[str, str], tag: str, port: int | None = None
) -> list[Pod]:
    port = port or free_port()
    started = []
    for node in range(pods):
        metrics_port = free_port()
        env = {
            **base_env(),
            "WORLD_SIZE": str(pods),
            "NNODES": str(pods),
            "NODE_RANK": str(node),
            "MASTER_PORT": str(port),
            "DDP_METRICS_PORT": str(metrics_port),
            **extra,
        }
        out = workdir / f"{tag}-{node}.out"
        with open(out, "wb") as stdout:
            process = subprocess.Popen(
                [PYTHON, "-m", "ddp_trainer", "--metrics-host", "127.0.0.1", *args],
                env=env,
                stdout=stdout,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        started.append(Pod(node, process, out, metrics_port))
    return started


def wait_for(pod: Pod, pattern: str, timeout: float = 300.0, after: int = 0) -> tuple[re.Match[str], float]:
    """The first match of ``pattern`` in the pod's output beyond offset ``after``, and when it was seen."""
    regex = re.compile(pattern, re.MULTILINE)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = regex.search(pod.text(), after)
        if match:
            return match, time.time()
        time.sleep(POLL)
    raise TimeoutError(f"pod {pod.node} did not print {pattern!r} in {timeout} s:\n{pod.text()[-2000:]}")


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def gauge(text: str, name: str) -> float | None:
    match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def kill_rank1_worker(pod: Pod) -> float:
    """SIGKILL the process that runs global rank 1: in place, the launcher's worker; else the process."""
    worker = pod.worker_pid()
    os.kill(worker if worker is not None else pod.process.pid, signal.SIGKILL)
    return time.time()


def train_args(checkpoints: Path, opts: argparse.Namespace) -> list[str]:
    return [
        "--epochs",
        "10000",
        "--max-steps",
        "1000000",
        "--progress-every",
        "1",
        "--throttle-ms",
        str(opts.throttle_ms),
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        str(opts.checkpoint_every),
        "--seed",
        "3",
    ]


def run_in_place(workdir: Path, opts: argparse.Namespace) -> dict[str, float]:
    args = train_args(workdir / "ckpt", opts)
    pods = start_pods(workdir, opts.pods, args, {"DDP_RESTART_MODE": "InPlace"}, "in-place")
    try:
        wait_for(pods[0], rf"^progress step={opts.kill_at} ")
        t0 = kill_rank1_worker(pods[1])
        resumed, _ = wait_for(pods[0], r"^resumed step=")
        _, first_step_seen = wait_for(pods[0], r"^progress step=", after=resumed.end())
        deadline = time.monotonic() + 30
        while True:  # the launcher reads rank 0's resume note on each scrape
            text = scrape(pods[0].metrics_port)
            if gauge(text, "ddp_last_restart_resumed_timestamp_seconds") is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0's pod never exported the resume time")
            time.sleep(0.05)
        at = {
            name: gauge(text, f"ddp_last_restart_{name}_timestamp_seconds")
            for name in ("failure", "stopped", "reformed", "resumed")
        }
        redone = gauge(text, "ddp_last_restart_steps_redone")
        failure, stopped, reformed, resumed_at = (
            at[k] for k in ("failure", "stopped", "reformed", "resumed")
        )
        if failure is None or stopped is None or reformed is None or resumed_at is None:
            raise RuntimeError(f"rank 0's pod exported an incomplete restart record:\n{text}")
        return {
            "total": first_step_seen - t0,
            "total (gauges)": resumed_at - t0,
            "detected": failure - t0,
            "stopped": stopped - failure,
            "reformed": reformed - stopped,
            "resumed": resumed_at - reformed,
            "steps redone": redone if redone is not None else float("nan"),
        }
    finally:
        for pod in pods:
            pod.end()


def run_recreate(workdir: Path, opts: argparse.Namespace) -> dict[str, float]:
    args = train_args(workdir / "ckpt", opts)
    port = free_port()
    pods = start_pods(workdir, opts.pods, args, {"DDP_RESTART_MODE": "Recreate"}, "recreate-0", port)
    again: list[Pod] = []
    try:
        wait_for(pods[0], rf"^progress step={opts.kill_at} ")
        t0 = kill_rank1_worker(pods[1])
        for pod in pods:
            pod.process.wait(timeout=300)
        stopped = time.time()
        again = start_pods(workdir, opts.pods, args, {"DDP_RESTART_MODE": "Recreate"}, "recreate-1", port)
        resumed, resumed_seen = wait_for(again[0], r"^resumed step=")
        _, first_step_seen = wait_for(again[0], r"^progress step=", after=resumed.end())
        return {
            "total": first_step_seen - t0,
            "stopped": stopped - t0,
            "resumed line": resumed_seen - stopped,
            "first step": first_step_seen - resumed_seen,
        }
    finally:
        for pod in [*pods, *again]:
            pod.end()


def startup_costs(runs: int) -> dict[str, float]:
    """Median seconds of a fresh interpreter doing nothing, importing torch, importing the trainer."""
    programs = {
        "python -c pass": "pass",
        "python -c 'import torch'": "import torch",
        "python -c 'import torch.distributed; import ddp_trainer.training.trainer'": (
            "import torch.distributed; import ddp_trainer.training.trainer"
        ),
    }
    costs = {}
    for label, code in programs.items():
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            subprocess.run([PYTHON, "-c", code], check=True, env=base_env())
            times.append(time.perf_counter() - started)
        costs[label] = statistics.median(times)
    return costs


def table(name: str, runs: list[dict[str, float]]) -> None:
    print(f"\n{name}: {len(runs)} runs, seconds (median, min-max)")
    for key in runs[0]:
        values = [run[key] for run in runs]
        print(f"  {key:16s} {statistics.median(values):7.2f}   ({min(values):.2f}-{max(values):.2f})")
    print("  single runs (total): " + ", ".join(f"{run['total']:.2f}" for run in runs))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pods", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--throttle-ms", type=float, default=20.0)
    opts = parser.parse_args()
    in_place, recreate = [], []
    for run in range(opts.runs):
        for mode, runner, results in (
            ("in-place", run_in_place, in_place),
            ("recreate", run_recreate, recreate),
        ):
            workdir = Path(tempfile.mkdtemp(prefix=f"bench-{mode}-"))
            try:
                result = runner(workdir, opts)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            results.append(result)
            print(
                f"run {run + 1} {mode}: " + ", ".join(f"{k}={v:.2f}" for k, v in result.items()), flush=True
            )
    load = os.getloadavg()[0]
    print(
        f"\n{opts.pods} pods x 1 worker, digits, kill rank 1 at step {opts.kill_at}, checkpoint every "
        f"{opts.checkpoint_every}, load average (1 min) at the end {load:.1f}"
    )
    table("in place", in_place)
    table("recreate (new processes at once; no pod churn counted)", recreate)
    print(
        f"\nin place / recreate (medians of total): "
        f"{statistics.median(r['total'] for r in in_place) / statistics.median(r['total'] for r in recreate):.2f}"
    )
    print("\nfresh interpreter, median of 5 (s):")
    for label, seconds in startup_costs(5).items():
        print(f"  {seconds:6.2f}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
