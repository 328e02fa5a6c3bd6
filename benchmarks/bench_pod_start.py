"""A pod's start, from its launcher's exec to the group's first training step, and the CPU it costs:
the workers' forkserver forked from the launcher (DDP_WORKER_FORKSERVER=fork, the default) against a
new interpreter (interpreter), which imports torch a second time in every pod.

Local in-place launchers on loopback stand for pods (bench_inplace_restart.py's), all started at
once, as the operator's first attempt or a whole-gang recreate starts them. Per run: the wall time
from the start to rank 0's first `progress` line, and the CPU-seconds every process of the gang
(launchers, forkservers, workers) spent until then, read from a cgroup v1 cpuacct group each run
gets (root only; without it, the CPU column is left empty). The two kinds alternate run by run, so
both see the same load. Medians, and each kind's ratio to `interpreter` measured in the same run.

    python benchmarks/bench_pod_start.py [--runs 5 --pods 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inplace_restart import Pod, start_pods, wait_for

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
KINDS = ("fork", "interpreter")
ARGS = ["--max-steps", "3", "--progress-every", "1", "--seed", "3"]


class Group:
    """A cpuacct cgroup that the bench process joins before starting a gang (its children inherit
    it), and leaves right after: the gang's CPU is read from it."""

    def __init__(self) -> None:
        self.path = CPUACCT / f"ddp-bench-{uuid.uuid4().hex[:8]}" if CPUACCT.is_dir() else None
        if self.path is not None:
            try:
                self.path.mkdir()
            except OSError:
                self.path = None

    def __enter__(self) -> Group:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text("0")  # "0": this process
        return self

    def __exit__(self, *_: object) -> None:
        if self.path is not None:
            (self.path.parent / "cgroup.procs").write_text("0")

    def cpu_seconds(self) -> float | None:
        if self.path is None:
            return None
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def remove(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()


def one(workdir: Path, pods: int, kind: str, run: int) -> tuple[float, float | None]:
    group = Group()
    started = time.time()
    with group:
        gang: list[Pod] = start_pods(
            workdir,
            pods,
            ARGS,
            {"DDP_RESTART_MODE": "InPlace", "DDP_WORKER_FORKSERVER": kind},
            f"{kind}{run}",
        )
    try:
        _, seen = wait_for(gang[0], r"^progress step=1 ")
        cpu = group.cpu_seconds()
        for pod in gang:
            if pod.process.wait(timeout=120) != 0:
                raise RuntimeError(
                    f"pod {pod.node} ({kind}) exited {pod.process.returncode}:\n{pod.text()[-2000:]}"
                )
        return seen - started, cpu
    finally:
        for pod in gang:
            pod.end()
        group.remove()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pods", type=int, default=2)
    options = parser.parse_args()
    results: dict[str, list[tuple[float, float | None]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="bench-pod-start-") as tmp:
        for run in range(options.runs):
            for kind in KINDS if run % 2 == 0 else reversed(KINDS):
                results[kind].append(one(Path(tmp), options.pods, kind, run))
                print(
                    f"run {run} {kind}: start {results[kind][-1][0]:.2f} s, cpu {results[kind][-1][1]}",
                    flush=True,
                )
    base_wall = statistics.median(wall for wall, _ in results["interpreter"])
    base_cpus = [cpu for _, cpu in results["interpreter"] if cpu is not None]
    print(f"\n{options.pods} pods, {options.runs} runs each; medians")
    print(f"{'forkserver':<12} {'start s':>8} {'ratio':>6} {'CPU s':>7} {'ratio':>6}")
    for kind in KINDS:
        wall = statistics.median(w for w, _ in results[kind])
        cpus = [cpu for _, cpu in results[kind] if cpu is not None]
        cpu_text = ratio_text = "-"
        if cpus and base_cpus:
            cpu = statistics.median(cpus)
            cpu_text, ratio_text = f"{cpu:.1f}", f"{cpu / statistics.median(base_cpus):.2f}"
        print(f"{kind:<12} {wall:>8.2f} {wall / base_wall:>6.2f} {cpu_text:>7} {ratio_text:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
