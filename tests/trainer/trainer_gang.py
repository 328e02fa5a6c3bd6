"""Running real trainer processes for the trainer tier: gangs of ranks, pods with local workers.

Every process starts in its own session so that a test can end it (and any workers it launched) by
its process-group id; the ``gangs`` fixture ends whatever a test left running.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zygote import ForkedProcess, Zygotes

from ddp_operator.local.ports import free_ports
from ddp_trainer.progress import FinalResult, Progress, parse_final, parse_progress, parse_status_line

PYTHON = sys.executable
# Timeouts bound how long a broken test can hang; no test asserts on elapsed time.
RUN_TIMEOUT = 240.0
# Printed once training is over and /metrics stays up for --metrics-linger: a step boundary for good.
LINGERING = r"^ddp_trainer: serving /metrics for "


class RunsCodeWhenUnpickled:
    """What an attacker with write access to a checkpoint volume or a state slot could leave:
    unpickling it creates a directory (tests assert it never appears)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.makedirs, (str(self.marker),)


def free_port() -> int:
    return free_ports(1)[0]


# The environment the tier started with: tests that run torch in this process change os.environ
# (importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR), and no process may depend on which ran first.
STARTING_ENVIRONMENT = dict(os.environ)


def base_env() -> dict[str, str]:
    env = {
        key: value
        for key, value in STARTING_ENVIRONMENT.items()
        if not key.startswith(("PET_", "DDP", "TORCHELASTIC", "PROMETHEUS_MULTIPROC"))
        and key
        not in {
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "NNODES",
            "NODE_RANK",
            "NPROC_PER_NODE",
            "MASTER_ADDR",
            "MASTER_PORT",
        }
    }
    # Loopback only; one intra-op thread per rank keeps 2-core runs from oversubscribing the CPUs.
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        MASTER_ADDR="127.0.0.1",
        DDP_METRICS_HOST="127.0.0.1",
    )
    return env


@dataclass
class TrainerProcess:
    name: str
    process: subprocess.Popen[bytes] | ForkedProcess
    stdout_path: Path
    stderr_path: Path
    metrics_port: int | None = None
    # What it was started with (``Gangs.start``), so a test can start the same pod again.
    env: Mapping[str, str] = field(default_factory=dict)
    args: Sequence[str] = ()
    program: Sequence[str] | None = None

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        return self.process.wait(timeout=timeout)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def progress(self) -> list[Progress]:
        return [p for line in self.stdout.splitlines() if (p := parse_progress(line)) is not None]

    def final(self) -> FinalResult | None:
        results = [f for line in self.stdout.splitlines() if (f := parse_final(line)) is not None]
        return results[-1] if results else None

    def status_lines(self, kind: str) -> list[dict[str, str]]:
        """The fields of every status line of one kind (e.g. "restart": the in-place launcher's)."""
        found = []
        for line in self.stdout.splitlines():
            parsed = parse_status_line(line)
            if parsed is not None and parsed[0] == kind:
                found.append(parsed[1])
        return found

    def worker_pids(self) -> dict[int, int]:
        """Global rank -> pid of the workers a launcher runs now: the in-place launcher says so in its
        last ``launcher event=started`` line (its workers are forked by a forkserver); torch's static
        launcher's workers are its children (from /proc), keyed by their order."""
        started = [fields for fields in self.status_lines("launcher") if fields["event"] == "started"]
        if started:
            pairs = (item.split(":") for item in started[-1]["workers"].split(","))
            return {int(rank): int(pid) for rank, pid in pairs}
        pid = self.process.pid
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return {}
        return {index: int(child) for index, child in enumerate(children)}

    def digests(self) -> dict[int, str]:
        found = {}
        for line in self.stdout.splitlines():
            parsed = parse_status_line(line)
            if parsed is not None and parsed[0] == "params":
                found[int(parsed[1]["rank"])] = parsed[1]["sha256"]
        return found

    def wait_until_listening(self, port: int, timeout: float = RUN_TIMEOUT) -> None:
        """Until something accepts connections on 127.0.0.1:``port`` (the store this process hosts);
        fails if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"{self.name} exited {self.process.returncode} before listening on {port}:\n{self.stderr[-3000:]}"
                )
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                return
            time.sleep(0.2)
        raise AssertionError(f"{self.name} did not listen on {port} in {timeout:.0f}s")

    def wait_for_stdout(self, pattern: str, timeout: float = RUN_TIMEOUT) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern, re.MULTILINE)
        while time.monotonic() < deadline:
            match = regex.search(self.stdout)
            if match:
                return match
            if self.process.poll() is not None:
                match = regex.search(self.stdout)
                if match:
                    return match
                raise AssertionError(
                    f"{self.name} exited {self.process.returncode} before printing {pattern!r}:\n"
                    f"{self.stdout[-2000:]}\n{self.stderr[-3000:]}"
                )
            time.sleep(0.05)
        raise AssertionError(
            f"{self.name} did not print {pattern!r} within {timeout} s:\n"
            f"{self.stdout[-2000:]}\n{self.stderr[-3000:]}"
        )

    def scrape(self) -> str:
        assert self.metrics_port is not None, "started without a metrics port"
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return str(response.read().decode())

    def end(self) -> None:
        """SIGKILL the whole "pod": the process, and the workers a launcher started (torch starts each
        in a session of its own, so they are not in the process's group)."""
        if self.process.poll() is None:
            for worker in self.worker_pids().values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


@dataclass
class Gangs:
    """Starts trainer processes for one test and ends all of them afterwards: forked from the
    session's zygotes where that is the same process (zygote.py), else fresh."""

    workdir: Path
    zygotes: Zygotes | None = None
    started: list[TrainerProcess] = field(default_factory=list)

    def start(
        self,
        name: str,
        env: Mapping[str, str],
        args: Sequence[str],
        metrics_port: int | None = None,
        program: Sequence[str] | None = None,
    ) -> TrainerProcess:
        """``program`` (default: the built-in trainer on loopback) with ``args``."""
        full_env = base_env()
        full_env.update(env)
        if metrics_port is not None:
            full_env["DDP_METRICS_PORT"] = str(metrics_port)
        out, err = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        argv = [*(program or [PYTHON, "-m", "ddp_trainer", "--metrics-host", "127.0.0.1"]), *args]
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process: subprocess.Popen[bytes] | ForkedProcess | None = None
            if self.zygotes is not None:
                process = self.zygotes.start(argv, full_env, out, err)
            if process is None:
                process = subprocess.Popen(
                    argv, env=full_env, stdout=stdout, stderr=stderr, start_new_session=True
                )
        started = TrainerProcess(name, process, out, err, metrics_port, dict(env), list(args), program)
        self.started.append(started)
        return started

    def ranks(
        self,
        world_size: int,
        args: Sequence[str],
        metrics_ranks: Sequence[int] = (),
        tag: str = "rank",
        env: Mapping[str, str] | None = None,
        program: Sequence[str] | None = None,
    ) -> list[TrainerProcess]:
        """One process per rank (NPROC_PER_NODE 1), as the operator starts them."""
        port = free_port()
        gang = []
        for rank in range(world_size):
            rank_env = {
                "WORLD_SIZE": str(world_size),
                "RANK": str(rank),
                "MASTER_PORT": str(port),
                "LOCAL_RANK": "0",
                **(env or {}),
            }
            metrics_port = free_port() if rank in metrics_ranks else None
            gang.append(self.start(f"{tag}{rank}", rank_env, args, metrics_port, program))
        return gang

    def pods(
        self,
        nnodes: int,
        nproc: int,
        args: Sequence[str],
        with_metrics: bool = True,
        tag: str = "pod",
        env: Mapping[str, str] | None = None,
        start_order: Sequence[int] | None = None,
        per_pod: Mapping[int, Mapping[str, str]] | None = None,
    ) -> list[TrainerProcess]:
        """One launcher per pod, each starting NPROC_PER_NODE local workers; returned by NODE_RANK,
        started in ``start_order`` (default: every NODE_RANK in order; a subset leaves pods out).
        ``per_pod``: more variables for some pods, by NODE_RANK."""
        port = free_port()
        pods: dict[int, TrainerProcess] = {}
        for rank in start_order or range(nnodes):
            pod_env = {
                "WORLD_SIZE": str(nnodes * nproc),
                "NNODES": str(nnodes),
                "NODE_RANK": str(rank),
                "NPROC_PER_NODE": str(nproc),
                "MASTER_PORT": str(port),
                **(env or {}),
                **(per_pod or {}).get(rank, {}),
            }
            metrics_port = free_port() if with_metrics else None
            pods[rank] = self.start(f"{tag}{rank}", pod_env, args, metrics_port)
        return [pods[rank] for rank in sorted(pods)]

    def again(self, pod: TrainerProcess, name: str) -> TrainerProcess:
        """The same pod started again (a replacement: same env, NODE_RANK and metrics port)."""
        return self.start(name, pod.env, pod.args, pod.metrics_port, pod.program)

    def end_all(self) -> None:
        for started in self.started:
            started.end()


def wait_all(processes: Sequence[TrainerProcess], timeout: float = RUN_TIMEOUT) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for process in processes:
        codes.append(process.wait(timeout=max(deadline - time.monotonic(), 1.0)))
    return codes


def events(pod: TrainerProcess, event: str) -> list[dict[str, str]]:
    """The in-place launcher's status lines of one event (``launcher event=EVENT ...``)."""
    return [fields for fields in pod.status_lines("launcher") if fields["event"] == event]


def rounds_of_workers(pod: TrainerProcess) -> list[dict[int, int]]:
    """Every round's workers of a supervised pod (global rank -> pid), from its ``started`` lines."""
    return [
        {int(rank): int(pid) for rank, pid in (item.split(":") for item in fields["workers"].split(","))}
        for fields in pod.status_lines("launcher")
        if fields["event"] == "started"
    ]


def assert_survivors_kept_their_processes(
    pods: Sequence[TrainerProcess], lost: set[int] = frozenset()
) -> int:
    """Every worker a pod ran in its first round, but the ``lost`` pids (killed), runs in its last round
    as the same process (its rank may have changed: an elastic resize), and every worker that was kept
    said so (``kept=``). Returns how many survivors there were."""
    survivors = 0
    for pod in pods:
        rounds = rounds_of_workers(pod)
        assert len(rounds) >= 2, describe([pod])
        first, last = set(rounds[0].values()) - lost, set(rounds[-1].values())
        assert first <= last, (rounds, describe([pod]))
        survivors += len(first)
    return survivors


def finish(pods: Sequence[TrainerProcess]) -> list[str]:
    """Wait until every pod lingers after training, scrape each, then end them; returns the scrapes."""
    for pod in pods:
        pod.wait_for_stdout(LINGERING)
    scrapes = [pod.scrape() for pod in pods]
    for pod in pods:
        pod.signal(signal.SIGTERM)
    assert wait_all(pods) == [0] * len(pods), describe(pods)
    return scrapes


def describe(processes: Sequence[TrainerProcess]) -> str:
    return "\n".join(
        f"--- {p.name} rc={p.process.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-2500:]}" for p in processes
    )


# --- reading the exposition ---------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def samples(text: str, name: str) -> dict[str, float]:
    """The samples of one metric name, keyed by their ``rank`` label."""
    found = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) == name:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            found[labels.get("rank", "")] = float(match.group(3))
    return found


def labelled(text: str, name: str) -> dict[str, str] | None:
    """The labels of the one sample of ``name`` in an exposition, or None."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            inner = line[len(name) + 1 : line.index("}")]
            return dict(part.split("=", 1) for part in inner.replace('"', "").split(",") if part)
    return None


def promtool_check(text: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool is not None
    return subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )


def run_torchrun(
    script: Path, nproc: int = 2, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node N script`` on loopback, as a user starts a plain DDP script."""
    return subprocess.run(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
        ],
        env={**base_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


# --- starving a process of CPU ------------------------------------------------------------------------
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class CpuLimit:
    """A cgroup with a CPU limit, as a pod's ``resources.limits.cpu`` makes one: CFS quota per period.

    cgroup v2 (``cpu.max``) or v1's cpu controller (``cpu.cfs_quota_us``); :func:`cpu_limit` says
    None where this process may not create one (not root, no cpu controller delegated).
    """

    path: Path

    def add(self, pid: int) -> None:
        """Move every thread of process ``pid`` under the limit."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Give its processes back to the parent cgroup and delete it."""
        procs = self.path / "cgroup.procs"
        with contextlib.suppress(OSError):
            for pid in procs.read_text().split():
                with contextlib.suppress(OSError):
                    (self.path.parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def cpu_limit(name: str, cpus: float, period_us: int = 100_000) -> CpuLimit | None:
    """A fresh cgroup allowing ``cpus`` CPUs (e.g. 0.05), or None where none can be made here."""
    quota = max(int(cpus * period_us), 1000)
    v2 = CGROUP_ROOT / "cgroup.controllers"
    candidates = (
        [(CGROUP_ROOT / name, "cpu.max", f"{quota} {period_us}")]
        if v2.exists() and "cpu" in v2.read_text().split()
        else [(CGROUP_ROOT / "cpu" / name, "cpu.cfs_quota_us", str(quota))]
    )
    for path, knob, value in candidates:
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            if knob == "cpu.cfs_quota_us":
                (path / "cpu.cfs_period_us").write_text(str(period_us))
            (path / knob).write_text(value)
        except OSError:
            CpuLimit(path).remove()
            continue
        return CpuLimit(path)
    return None
