"""What pulling progress costs one operator: N running jobs, their rank 0 endpoints read every interval.

On the local control plane (kwok runs the pods), create N DDPJobs of 2 ranks, wait until all run, put
every rank 0 pod's IP on the loopback device and serve a trainer-format /metrics at each (one process,
one HTTP server per IP: N real endpoints at the pods' own IPs; a stand-in for N trainers, which two
cores cannot run). Then, for --window seconds each:
- advancing: every endpoint's step and samples move between two reads, so every read changes what
  the status shows: one status write per job per interval is the most there can be;
- standing: the numbers stand still (no straggler, no stall timeout): reads continue, writes stop.
Measured: the reads the endpoints served, the operator's status patches (from the apiserver's audit
log, its own client certificate) and its CPU seconds (/proc), each per minute. Needs root (ip addr).

    python benchmarks/bench_progress_pull.py --jobs 200 --interval 15 --window 120
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
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


class Endpoints:
    """One /metrics server per pod IP; the exposition moves while ``advancing`` is set."""

    def __init__(self, ips: list[str], port: int) -> None:
        self.advancing = threading.Event()
        self.reads = 0
        self._lock = threading.Lock()
        self._step = 100
        self._servers: list[ThreadingHTTPServer] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.exposition().encode()
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

    def exposition(self) -> str:
        with self._lock:
            self.reads += 1
            if self.advancing.is_set():
                self._step += 1
            step = self._step
        return (
            f'ddp_sync_steps_total{{rank="0"}} {step}\n'
            f'ddp_samples_total{{rank="0"}} {step * 64}\n'
            f'ddp_target_steps{{rank="0"}} 1000000\n'
            'ddp_loss{rank="0"} 0.5\n'
            f'ddp_last_sync_timestamp_seconds{{rank="0"}} {1.7e9 + step}\n'
            'ddp_straggler_rank{rank="0"} 1\n'
            'ddp_straggler_slowdown{rank="0"} 1.05\n'
        )

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--interval", type=float, default=15.0, help="the operator's --progress-interval")
    parser.add_argument("--window", type=float, default=120.0, help="seconds measured per phase")
    args = parser.parse_args()

    from ddp_harness import ClusterOptions, down, up
    from ddp_harness.manifests import NodeShape
    from ddp_operator import names
    from ddp_operator.kube_api import KubeApi

    workdir = Path(tempfile.mkdtemp(prefix="ddp-pull-bench-"))
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
        subprocess.run(
            [*kubectl, "apply", "-f", str(Path(__file__).resolve().parents[1] / "crds")], check=True
        )
        subprocess.run([*kubectl, "wait", "--for=condition=Established", "crd/ddpjobs.ddp.dev"], check=True)
        admin = KubeApi.connect(str(cluster.kubeconfig), concurrency=32)
        namespace = "pull"
        admin.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
        wait_until("default serviceaccount", lambda: _has_default_sa(admin, namespace), 60)
        metrics_port = _free_port()
        liveness = _free_port()
        operator_kubeconfig = identity_kubeconfig(cluster, OPERATOR_USER, workdir)
        operator = subprocess.Popen(
            [
                sys.executable, "-m", "ddp_operator", "operator", "--kubeconfig", str(operator_kubeconfig),
                "--namespace", namespace, "--metrics-port", "0", "--progress-interval", str(args.interval),
                "--liveness", f"http://127.0.0.1:{liveness}/healthz",
            ],
            stdout=(workdir / "operator.log").open("wb"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for index in range(args.jobs):
            job = job_manifest(f"j{index}", REPLICAS)
            job["spec"]["metrics"] = {"port": metrics_port}
            admin.request("POST", f"/apis/ddp.dev/v1alpha1/namespaces/{namespace}/ddpjobs", body=job)

        def rank0_ips() -> list[str] | None:
            pods, _ = admin.list_pods_blocking(namespace, f"{names.LABEL_RANK}=0")
            ips = [p["status"].get("podIP") for p in pods if p.get("status", {}).get("phase") == "Running"]
            return [ip for ip in ips if ip] if len(ips) == args.jobs and all(ips) else None

        wait_until(f"{args.jobs} running rank 0 pods", lambda: rank0_ips() is not None, 900)
        ips = rank0_ips() or []
        for ip in ips:
            subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], check=True)
            added.append(ip)
        endpoints = Endpoints(ips, metrics_port)
        print(f"[bench] {args.jobs} jobs running, {len(ips)} endpoints up", file=sys.stderr)
        time.sleep(2 * args.interval)  # the first reads of every job, and their writes
        rows = []
        for phase in ("advancing", "standing"):
            if phase == "advancing":
                endpoints.advancing.set()
            else:
                endpoints.advancing.clear()
            time.sleep(2 * args.interval)  # the phase's first reads settle
            since = datetime.now(UTC)
            reads0, (_, cpu0), started = endpoints.reads, _proc_usage(operator.pid), time.monotonic()
            time.sleep(args.window)
            reads1, (rss, cpu1), elapsed = (
                endpoints.reads,
                _proc_usage(operator.pid),
                time.monotonic() - started,
            )
            time.sleep(2)  # the audit log catches up
            writes = count_writes(Path(cluster.audit_log), OPERATOR_USER, since)
            patches = sum(v for k, v in writes.items() if k == "patch ddpjobs/status")
            per_minute = 60.0 / elapsed
            rows.append(
                (phase, (reads1 - reads0) * per_minute, patches * per_minute,
                 sum(writes.values()) * per_minute, (cpu1 - cpu0) / elapsed * 100, rss)
            )  # fmt: skip
            print(f"[bench] {phase}: {rows[-1]} {writes}", file=sys.stderr)
        print(
            f"\n{args.jobs} running jobs x {REPLICAS} ranks, --progress-interval {args.interval:g} s, "
            f"{args.window:g} s per phase; bound: {args.jobs} x 60 / {args.interval:g} = "
            f"{args.jobs * 60 / args.interval:.0f} reads and at most as many status writes per minute\n"
        )
        print(
            "| phase | reads/min | status writes/min | all writes/min | operator CPU (% of a core) | peak RSS MB |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for phase, reads, patches, all_writes, cpu, rss in rows:
            print(f"| {phase} | {reads:.0f} | {patches:.0f} | {all_writes:.0f} | {cpu:.1f} | {rss:.0f} |")
    finally:
        if endpoints is not None:
            endpoints.close()
        for ip in added:
            subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], check=False)
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=30)
        down(workdir / "cluster", keep_state=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
