"""What pulling progress costs one operator: N running jobs, their rank 0 endpoints read every interval.

On the local control plane (kwok runs the pods), create N DDPJobs of 2 ranks, wait until all run, put
every rank 0 pod's IP on the loopback device and serve at each the /metrics of a real trainer's rank 0
(the trainer's own registry, one per endpoint, in this process: N real endpoints at the pods' own IPs,
a stand-in for N trainers, which two cores cannot run). Then, for --window seconds each:
- advancing: every read finds 150 more steps (15 s of training at 10 steps/s, allreduces of about
  2 ms in the histogram), so every read changes what the status shows: one status write per job per
  interval is the most there can be;
- standing: the numbers stand still (no straggler, no stall timeout): reads continue, writes stop.
Measured: the reads the endpoints served, the operator's status patches (from the apiserver's audit
log, its own client certificate) and its CPU seconds (/proc), each per minute. The operator of
--compare-to (default: the last commit with the hand-written exposition parser) and this tree's take
turns, --runs times each, on the same jobs; medians, and the ratio of their CPU. Needs root (ip addr).

    python benchmarks/bench_progress_pull.py --jobs 200 --interval 15 --window 60 --runs 3

With --scrape-cost, no cluster: the CPU the operator spends on one round of answers from N jobs' rank 0
endpoints once fetched (parse, reduce, track, status.progress), on the same trainer expositions,
against the same work by the code of --compare-to (promtext.py and progress.py, read from git),
rounds of the two alternating in one process; medians over --runs rounds each, and their ratio:

    python benchmarks/bench_progress_pull.py --scrape-cost --jobs 200 --runs 15 --world-sizes 2,64
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_operator_scale import (
    OPERATOR_USER,
    _free_port,
    _has_default_sa,
    _proc_usage,
    count_writes,
    identity_kubeconfig,
    job_manifest,
    wait_until,
)

REPLICAS = 2
# Steps of training between two reads of an advancing job: 15 s (the default interval) at 10 steps/s.
STEPS_PER_READ = 150
REPO = Path(__file__).resolve().parents[1]
# The last commit with the hand-written exposition parser (operator/ddp_operator/promtext.py).
BASELINE_COMMIT = "0798f38"


class TrainerRankZero:
    """Rank 0's /metrics of a real trainer (the trainer's own registry), advanced as training would."""

    def __init__(self, world_size: int, seed: int) -> None:
        from prometheus_client import CollectorRegistry

        from ddp_trainer.metrics import create_rank_metrics

        self.random = random.Random(seed)
        self.world_size = world_size
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = create_rank_metrics(
            0, "gloo", "allreduce", "2.15.0", self.registry, per_allreduce=True
        )
        self.metrics.target_steps.set(1_000_000)
        self.advance(steps=self.random.randint(10, 1000))

    def advance(self, steps: int) -> None:
        """``steps`` more steps of one gradient bucket each, allreduces of about 2 ms."""
        metrics, rng = self.metrics, self.random
        metrics.sync_steps.inc(steps)
        metrics.samples.inc(steps * 64)
        metrics.allreduce_bytes.inc(steps * 4_000_000)
        metrics.allreduce_service_seconds.inc(steps * 0.002)
        for _ in range(steps):
            metrics.allreduce_duration.observe(rng.lognormvariate(math.log(0.002), 0.6))
            metrics.step_duration.observe(rng.lognormvariate(math.log(0.05), 0.2))
        metrics.loss.set(rng.random())
        metrics.comm_overlap_ratio.set(rng.random())
        metrics.compute_seconds.set(0.01 + rng.random() / 100)
        metrics.last_sync_timestamp.set(1.7e9 + rng.random() * 1e6)
        assert metrics.straggler is not None
        times = [0.01 + rng.random() / 100 for _ in range(self.world_size)]
        metrics.straggler.show(times, (times.index(max(times)), 1.2))

    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class Endpoints:
    """One /metrics server per pod IP, each serving a real trainer's rank 0 (``TrainerRankZero``);
    while ``advancing`` is set, every read finds ``STEPS_PER_READ`` more steps."""

    def __init__(self, ips: list[str], port: int) -> None:
        self.advancing = threading.Event()
        self.reads = 0
        self._lock = threading.Lock()
        self._trainers = {ip: TrainerRankZero(REPLICAS, seed) for seed, ip in enumerate(ips)}
        self._servers: list[ThreadingHTTPServer] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.exposition(str(self.server.server_address[0])).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        for ip in ips:
            server = ThreadingHTTPServer((ip, port), Handler)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)

    def exposition(self, ip: str) -> str:
        with self._lock:
            self.reads += 1
            trainer = self._trainers[ip]
            if self.advancing.is_set():
                trainer.advance(STEPS_PER_READ)
            return trainer.text()

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()


def _module_from_git(name: str, path: str, commit: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{commit}:{path}"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def baseline_pipeline(commit: str) -> Callable[[], Callable[[str, datetime], object]]:
    """The operator's work on one answer at ``commit``: promtext.parse, reduce_scrape, progress_status."""
    promtext = _module_from_git("ddp_operator.promtext", "operator/ddp_operator/promtext.py", commit)
    progress = _module_from_git("baseline_progress", "operator/ddp_operator/progress.py", commit)

    def job() -> Callable[[str, datetime], object]:
        newest: list[Any] = [None]

        def answer(text: str, now: datetime) -> object:
            scrape = progress.reduce_scrape(promtext.parse(text), now)
            older, newest[0] = newest[0], scrape
            progress.follow_straggler(None, scrape, 1.5)
            return progress.progress_status(scrape, older, REPLICAS, REPLICAS)

        return answer

    return job


def current_job() -> Callable[[str, datetime], object]:
    """This tree's work on one answer: the endpoint's reader, the tracker, status.progress."""
    from ddp_operator.progress import render
    from ddp_operator.progress.exposition import ExpositionReader
    from ddp_operator.progress.tracker import ProgressTracker

    tracker = ProgressTracker(REPLICAS, REPLICAS)
    reader = ExpositionReader()

    def answer(text: str, now: datetime) -> object:
        tracker.record(now, {0: reader.reduce(text)})
        return render.status_progress(tracker.view())

    return answer


def _rounds_of_answers(jobs: int, world_size: int, rounds: int, steps: int) -> list[list[str]]:
    """Each job's rank 0 exposition at each round, ``steps`` steps apart (0: standing still)."""
    endpoints = [TrainerRankZero(world_size, seed) for seed in range(jobs)]
    answers = []
    for _ in range(rounds):
        answers.append([e.text() for e in endpoints])
        for endpoint in endpoints:
            if steps:
                endpoint.advance(steps)
    return answers


def _time_rounds(
    answers: list[list[str]], pipelines: dict[str, list[Callable[[str, datetime], object]]]
) -> dict[str, float]:
    """Median CPU seconds per round of each pipeline, the rounds of the two alternating."""
    seconds: dict[str, list[float]] = {name: [] for name in pipelines}
    start = datetime(2026, 1, 1, tzinfo=UTC)
    for index, texts in enumerate(answers):
        now = start + timedelta(seconds=15 * index)
        for name, jobs in pipelines.items():
            began = time.process_time()
            for answer, text in zip(jobs, texts, strict=True):
                answer(text, now)
            if index:  # the first round of each warms up and is not counted
                seconds[name].append(time.process_time() - began)
    return {name: statistics.median(values) for name, values in seconds.items()}


def scrape_cost(args: argparse.Namespace) -> int:
    baseline_job = baseline_pipeline(args.compare_to)
    print(
        f"\n{args.jobs} jobs' rank 0 answers per round, {args.runs} rounds of each pipeline, alternating; "
        f"baseline: {args.compare_to}; advancing: 150 steps between reads (10 steps/s at the "
        "default 15 s interval)\n"
    )
    print("| world size | phase | lines per answer | baseline ms/round | now ms/round | now / baseline |")
    print("|---:|---|---:|---:|---:|---:|")
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        for phase, steps in (("advancing", STEPS_PER_READ), ("standing", 0)):
            answers = _rounds_of_answers(args.jobs, world_size, args.runs + 1, steps)
            pipelines = {
                "baseline": [baseline_job() for _ in range(args.jobs)],
                "now": [current_job() for _ in range(args.jobs)],
            }
            median = _time_rounds(answers, pipelines)
            base, now = median["baseline"] * 1000, median["now"] * 1000
            lines = answers[0][0].count("\n")
            print(
                f"| {world_size} | {phase} | {lines} | {base:.1f} | {now:.1f} | {now / base:.2f} |",
                flush=True,
            )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--interval", type=float, default=15.0, help="the operator's --progress-interval")
    parser.add_argument("--window", type=float, default=120.0, help="seconds measured per phase")
    parser.add_argument(
        "--scrape-cost", action="store_true", help="measure the work per answer only (no cluster)"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=None,
        help="rounds (--scrape-cost, default 15) or runs (default 3) of each",
    )
    parser.add_argument(
        "--compare-to",
        default=BASELINE_COMMIT,
        metavar="COMMIT",
        help="alternate runs of the operator of this commit with this tree's ('': this tree only)",
    )
    parser.add_argument(
        "--world-sizes", default="2,64", help="--scrape-cost: ranks of each job, comma-separated"
    )
    args = parser.parse_args()
    if args.scrape_cost:
        args.runs = args.runs or 15
        return scrape_cost(args)
    args.runs = args.runs or 3

    return pull_cost(args)


def start_operator(
    code: Path | None, kubeconfig: Path, namespace: str, interval: float, log: Path
) -> subprocess.Popen[bytes]:
    """`ddpjob operator` of this tree, or of the tree at ``code`` (the baseline's, from git)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = str(code / "operator")  # ahead of this tree's editable install
    return subprocess.Popen(
        [
            sys.executable, "-m", "ddp_operator", "operator", "--kubeconfig", str(kubeconfig),
            "--namespace", namespace, "--metrics-port", "0", "--progress-interval", str(interval),
            "--liveness", f"http://127.0.0.1:{_free_port()}/healthz",
        ],
        env=env,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip


def stop_operator(operator: subprocess.Popen[bytes]) -> None:
    operator.terminate()
    operator.wait(timeout=60)


def measure_phase(
    operator: subprocess.Popen[bytes], endpoints: Endpoints, audit_log: Path, window: float
) -> tuple[float, float, float, float, float]:
    """(reads, status writes, all writes) per minute, CPU % of a core and peak RSS MB over ``window``."""
    since = datetime.now(UTC)
    reads0, (_, cpu0), started = endpoints.reads, _proc_usage(operator.pid), time.monotonic()
    time.sleep(window)
    reads1, (rss, cpu1), elapsed = endpoints.reads, _proc_usage(operator.pid), time.monotonic() - started
    time.sleep(2)  # the audit log catches up
    writes = count_writes(audit_log, OPERATOR_USER, since)
    patches = sum(v for k, v in writes.items() if k == "patch ddpjobs/status")
    per_minute = 60.0 / elapsed
    return (
        (reads1 - reads0) * per_minute,
        patches * per_minute,
        sum(writes.values()) * per_minute,
        (cpu1 - cpu0) / elapsed * 100,
        rss,
    )


def pull_cost(args: argparse.Namespace) -> int:
    from ddp_harness import ClusterOptions, down, up
    from ddp_harness.manifests import NodeShape
    from ddp_operator import names
    from ddp_operator.kube_api import KubeApi

    workdir = Path(tempfile.mkdtemp(prefix="ddp-pull-bench-"))
    codes: dict[str, Path | None] = {"now": None}
    if args.compare_to:
        baseline = workdir / "baseline"
        baseline.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.compare_to, "operator"], capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive.stdout, check=True)
        codes = {"baseline": baseline, "now": None}
    pods_per_node = 110
    nodes = -(-(args.jobs * REPLICAS + 16) // pods_per_node)
    cluster = up(
        ClusterOptions(state_dir=workdir / "cluster", nodes=nodes, node_shape=NodeShape(pods=pods_per_node)),
        progress=lambda m: print(f"[cluster] {m}", file=sys.stderr),
    )
    added: list[str] = []
    endpoints: Endpoints | None = None
    operator: subprocess.Popen[bytes] | None = None
    try:
        kubectl = [str(cluster.kubectl), "--kubeconfig", str(cluster.kubeconfig)]
        subprocess.run([*kubectl, "apply", "-f", str(REPO / "crds")], check=True)
        subprocess.run([*kubectl, "wait", "--for=condition=Established", "crd/ddpjobs.ddp.dev"], check=True)
        admin = KubeApi.connect(str(cluster.kubeconfig), concurrency=32)
        namespace = "pull"
        admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
        wait_until("default serviceaccount", lambda: _has_default_sa(admin, namespace), 60)
        metrics_port = _free_port()
        operator_kubeconfig = identity_kubeconfig(cluster, OPERATOR_USER, workdir)
        log = workdir / "operator.log"
        operator = start_operator(None, operator_kubeconfig, namespace, args.interval, log)
        for index in range(args.jobs):
            job = job_manifest(f"j{index}", REPLICAS)
            job["spec"]["metrics"] = {"port": metrics_port}
            admin.request("POST", f"/apis/ddp.dev/v1alpha1/namespaces/{namespace}/ddpjobs", body=job)

        def rank0_ips() -> list[str] | None:
            pods, _ = admin.list_pods_blocking(namespace, f"{names.LABEL_RANK}=0")
            ips = [p["status"].get("podIP") for p in pods if p.get("status", {}).get("phase") == "Running"]
            return [ip for ip in ips if ip] if len(ips) == args.jobs and all(ips) else None

        wait_until(f"{args.jobs} running rank 0 pods", lambda: rank0_ips() is not None, 900)
        stop_operator(operator)
        ips = rank0_ips() or []
        for ip in ips:
            # Another local cluster on this machine (a test) may hold the same pod IP on lo for a while:
            # the endpoint listens there all the same, and only an address added here is removed here.
            if subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], check=False).returncode == 0:
                added.append(ip)
        endpoints = Endpoints(ips, metrics_port)
        print(f"[bench] {args.jobs} jobs running, {len(ips)} endpoints up", file=sys.stderr)
        rows: dict[tuple[str, str], list[tuple[float, float, float, float, float]]] = {}
        for run in range(args.runs):
            for code, path in codes.items():
                operator = start_operator(path, operator_kubeconfig, namespace, args.interval, log)
                # The Lease, the first list and a write to every job's status: none of that is measured.
                time.sleep(2 * args.interval + 15)
                for phase in ("advancing", "standing"):
                    (endpoints.advancing.set if phase == "advancing" else endpoints.advancing.clear)()
                    time.sleep(2 * args.interval)  # the phase's first reads settle
                    row = measure_phase(operator, endpoints, Path(cluster.audit_log), args.window)
                    rows.setdefault((code, phase), []).append(row)
                    print(f"[bench] run {run} {code} {phase}: {row}", file=sys.stderr)
                stop_operator(operator)
                operator = None
        print_pull_cost(args, rows)
    finally:
        if endpoints is not None:
            endpoints.close()
        for ip in added:
            subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], check=False)
        if operator is not None:
            stop_operator(operator)
        down(workdir / "cluster", keep_state=False)
    return 0


def print_pull_cost(
    args: argparse.Namespace, rows: dict[tuple[str, str], list[tuple[float, float, float, float, float]]]
) -> None:
    print(
        f"\n{args.jobs} running jobs x {REPLICAS} ranks, --progress-interval {args.interval:g} s, "
        f"{args.window:g} s per phase, medians of {args.runs} run(s); bound: {args.jobs} x 60 / "
        f"{args.interval:g} = {args.jobs * 60 / args.interval:.0f} reads and at most as many status writes "
        "per minute\n"
    )
    print(
        "| code | phase | reads/min | status writes/min | all writes/min | operator CPU (% of a core) | peak RSS MB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    medians = {
        key: [statistics.median(column) for column in zip(*values, strict=True)]
        for key, values in rows.items()
    }
    for (code, phase), (reads, patches, all_writes, cpu, rss) in medians.items():
        name = args.compare_to if code == "baseline" else "this tree"
        print(
            f"| {name} | {phase} | {reads:.0f} | {patches:.0f} | {all_writes:.0f} | {cpu:.2f} | {rss:.0f} |"
        )
    for phase in ("advancing", "standing"):
        if ("baseline", phase) in medians:
            ratio = medians[("now", phase)][3] / medians[("baseline", phase)][3]
            print(f"\n{phase}: operator CPU, this tree / {args.compare_to} = {ratio:.2f}")


if __name__ == "__main__":
    sys.exit(main())
