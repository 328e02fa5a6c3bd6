"""How the operator scales with ranks, against a bare-client lower bound, on the local control plane.

For each R (ranks) and each scenario (an empty namespace; the same with N unrelated pods in it), every run:
- operator: start `ddpjob operator` (its own client certificate, so the apiserver's audit log names it),
  create a DDPJob of R ranks, and measure seconds from the create to all R pods created and to all R
  Running; end every pod with exit code 0 (kwok), wait for Succeeded, then count the operator's write
  requests in the audit log and read its peak RSS and CPU seconds from /proc;
- lower bound: create the same Service, NetworkPolicy and R pods (the builders' objects, owned by an idle DDPJob)
  directly with the same client (kube_api) and the same concurrency, and time them the same way.
Medians over the runs, and the operator/lower-bound ratios, are printed as a table.

    python benchmarks/bench_operator_scale.py --ranks 8,64,256,1024 --runs 3 --unrelated 5000
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OPERATOR_USER = "ddp-operator-bench"
BASELINE_USER = "ddp-baseline-bench"
EXIT_CODE_ANNOTATION = "kwok.ddp.dev/exit-code"
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})


@dataclass
class RunResult:
    seconds_to_created: float
    seconds_to_running: float
    writes: int | None = None
    write_breakdown: dict[str, int] = field(default_factory=dict)
    peak_rss_mb: float | None = None
    cpu_seconds: float | None = None


# ---- cluster and identities ------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def identity_kubeconfig(cluster: Any, user: str, directory: Path) -> Path:
    """A client certificate for `user` (system:masters) signed by the local CA, and its kubeconfig."""
    from ddp_harness import manifests

    key, cert = directory / f"{user}.key", directory / f"{user}.crt"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", str(key), "-out", str(cert), "-subj", f"/O=system:masters/CN={user}", "-days", "2",
        "-CA", str(cluster.ca_cert), "-CAkey", str(cluster.ca_key),
        "-addext", "extendedKeyUsage=clientAuth",
    )  # fmt: skip
    path = directory / f"{user}.kubeconfig"
    path.write_text(json.dumps(manifests.kubeconfig(cluster.apiserver, cluster.ca_cert, cert, key, user)))
    return path


def start_cluster(args: argparse.Namespace, state_dir: Path) -> Any:
    from ddp_harness import ClusterOptions, attach, up
    from ddp_harness.manifests import NodeShape

    if args.attach:
        return attach(Path(args.attach))
    # Room for the largest job, the unrelated pods (they run too) and a few system pods.
    nodes = args.nodes or math.ceil((max(args.ranks) + args.unrelated + 16) / args.pods_per_node)
    options = ClusterOptions(state_dir=state_dir, nodes=nodes, node_shape=NodeShape(pods=args.pods_per_node))
    return up(options, progress=lambda message: print(f"[cluster] {message}", file=sys.stderr))


# ---- observing pods --------------------------------------------------------------------------------


class PodClock:
    """Watches one job's pods (server-side selector) and records when R were created and R Running."""

    def __init__(self, api: Any, namespace: str, selector: str, replicas: int) -> None:
        self.api, self.namespace, self.selector, self.replicas = api, namespace, selector, replicas
        self.seen: set[str] = set()
        self.running: set[str] = set()
        self.all_created = threading.Event()
        self.all_running = threading.Event()
        self.created_at = 0.0
        self.running_at = 0.0
        self._stop = False
        _, self._version = api.list_pods_blocking(namespace, selector)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        version = self._version
        while not self._stop and not self.all_running.is_set():
            for event in self.api.watch_pods_blocking(
                self.namespace, self.selector, version, timeout_seconds=60
            ):
                obj = event.get("object") or {}
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    name = obj["metadata"]["name"]
                    self.seen.add(name)
                    if obj.get("status", {}).get("phase") == "Running":
                        self.running.add(name)
                    now = time.monotonic()
                    if len(self.seen) >= self.replicas and not self.all_created.is_set():
                        self.created_at = now
                        self.all_created.set()
                    if len(self.running) >= self.replicas and not self.all_running.is_set():
                        self.running_at = now
                        self.all_running.set()
                        return

    def wait(self, timeout: float) -> None:
        if not self.all_running.wait(timeout):
            raise TimeoutError(f"{len(self.seen)} created, {len(self.running)} running of {self.replicas}")


def _proc_usage(pid: int) -> tuple[float, float]:
    """(peak RSS in MB, user+system CPU seconds) of a live process."""
    peak_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak_kb = int(line.split()[1])
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return peak_kb / 1024, (int(fields[11]) + int(fields[12])) / ticks


def count_writes(audit_log: Path, user: str, since: datetime) -> dict[str, int]:
    """The user's completed write requests since `since`, by 'verb resource'."""
    counts: dict[str, int] = {}
    with audit_log.open() as log:
        for line in log:
            if f'"{user}"' not in line or not line.endswith("\n"):
                continue  # another user's, or the entry the apiserver is still writing
            entry = json.loads(line)
            if entry.get("user", {}).get("username") != user or entry.get("stage") != "ResponseComplete":
                continue
            if entry.get("verb") not in WRITE_VERBS:
                continue
            stamp = datetime.fromisoformat(entry["requestReceivedTimestamp"].replace("Z", "+00:00"))
            if stamp < since:
                continue
            ref = entry.get("objectRef", {})
            resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            key = f"{entry['verb']} {resource}"
            counts[key] = counts.get(key, 0) + 1
    return counts


# ---- one run ---------------------------------------------------------------------------------------


def job_manifest(name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "ddp.dev/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "ddp-trainer:bench",
                            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                        }
                    ]
                }
            },
        },
    }


def _jobs_path(namespace: str, name: str = "") -> str:
    return f"/apis/ddp.dev/v1alpha1/namespaces/{namespace}/ddpjobs" + (f"/{name}" if name else "")


def end_pods(
    api: Any,
    namespace: str,
    names: Sequence[str],
    concurrency: int,
    annotations: Mapping[str, str] | None = None,
    missing_ok: bool = False,
) -> None:
    """Ends fake pods through kwok by annotating them (default: exit code 0), `concurrency` at once;
    with `missing_ok`, a pod already gone is skipped."""
    body = {"metadata": {"annotations": dict(annotations or {EXIT_CODE_ANNOTATION: "0"})}}

    def patch(name: str) -> None:
        try:
            api.request(
                "PATCH",
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                body=body,
                content_type="application/merge-patch+json",
            )
        except Exception as error:
            if not (missing_ok and getattr(error, "status", None) == 404):
                raise

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(patch, names))


def wait_until(what: str, probe: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def delete_job_and_wait(api: Any, namespace: str, name: str, selector: str, timeout: float) -> None:
    try:
        api.request("DELETE", _jobs_path(namespace, name), body={"propagationPolicy": "Background"})
    except Exception as error:
        if getattr(error, "status", None) != 404:
            raise
    wait_until(f"{name}'s pods to go", lambda: not api.list_pods_blocking(namespace, selector)[0], timeout)
    wait_until(
        f"{name}'s service to go",
        lambda: (
            not [
                s
                for s in api.request("GET", f"/api/v1/namespaces/{namespace}/services").get("items", [])
                if s["metadata"]["name"] == name
            ]
        ),
        timeout,
    )


@contextlib.contextmanager
def operator_process(
    kubeconfig: Path, namespace: str, log: Path, args: argparse.Namespace, extra: Sequence[str] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    """`ddpjob operator` watching `namespace` (with `extra` flags), alive (its liveness answers) until the
    block ends; then stopped (SIGTERM, so it releases its Lease for the next one)."""
    liveness = _free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "ddp_operator", "operator", "--kubeconfig", str(kubeconfig),
            "--namespace", namespace, "--metrics-port", "0", "--concurrency", str(args.concurrency),
            "--liveness", f"http://127.0.0.1:{liveness}/healthz", *extra,
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until("the operator's liveness", lambda: _alive(liveness, process), 60)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def operator_run(
    admin: Any,
    cluster: Any,
    kubeconfig: Path,
    namespace: str,
    name: str,
    replicas: int,
    args: argparse.Namespace,
) -> RunResult:
    from datetime import UTC

    from ddp_operator import names

    with operator_process(
        kubeconfig, namespace, Path(args.workdir) / f"operator-{namespace}-{name}.log", args
    ) as process:
        selector = names.label_selector(name)
        clock = PodClock(admin, namespace, selector, replicas)
        since = datetime.now(UTC).replace(microsecond=0)
        started = time.monotonic()
        admin.request("POST", _jobs_path(namespace), body=job_manifest(name, replicas))
        clock.wait(args.timeout)
        result = RunResult(clock.created_at - started, clock.running_at - started)

        end_pods(admin, namespace, sorted(clock.seen), args.concurrency)
        wait_until(
            f"{name} Succeeded",
            lambda: (
                admin.request("GET", _jobs_path(namespace, name)).get("status", {}).get("phase")
                == "Succeeded"
            ),
            args.timeout,
        )
        time.sleep(args.settle)  # the last status write and Event land in the audit log
        result.peak_rss_mb, result.cpu_seconds = _proc_usage(process.pid)
        result.write_breakdown = count_writes(Path(cluster.audit_log), OPERATOR_USER, since)
        result.writes = sum(result.write_breakdown.values())
    delete_job_and_wait(admin, namespace, name, names.label_selector(name), args.timeout)
    return result


def baseline_run(
    admin: Any, client: Any, namespace: str, name: str, replicas: int, args: argparse.Namespace
) -> RunResult:
    import asyncio

    from ddp_operator import builders, names, ownership
    from ddp_operator.spec import parse_job

    selector = names.label_selector(name)
    clock = PodClock(admin, namespace, selector, replicas)
    # The clock starts before the job's create, as in operator_run. The DDPJob stays idle (no operator
    # runs now); it gives the pods the same ownerReference, so they stay.
    started = time.monotonic()
    job_obj = admin.request("POST", _jobs_path(namespace), body=job_manifest(name, replicas))
    job = parse_job(job_obj)
    policy = builders.build_network_policy(job, builders.DEFAULT_METRICS_ALLOW_FROM)
    children = [builders.build_service(job, 0), *([policy] if policy else [])] + [
        builders.build_rank_pod(job, r, 0) for r in range(replicas)
    ]
    report = asyncio.run(
        client.create_children(children, lambda wanted, found: ownership.is_ours(wanted, found, job.uid))
    )
    created_at = time.monotonic()
    if report.error is not None:
        raise report.error
    clock.wait(args.timeout)
    result = RunResult(created_at - started, clock.running_at - started)
    delete_job_and_wait(admin, namespace, name, selector, args.timeout)
    return result


def _free_port() -> int:
    from ddp_operator.local.ports import free_ports

    return free_ports(1)[0]


def _alive(port: int, process: subprocess.Popen[bytes]) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"the operator exited with {process.returncode}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


UNRELATED_SELECTOR = "app=unrelated"


def fill_unrelated(api: Any, namespace: str, count: int, concurrency: int, timeout: float) -> None:
    """`count` pods that are not ours, in the watched namespace, scheduled on the fake nodes and Running
    (kwok keeps their status like any pod's), so they are in every unfiltered watch and list there."""
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"unrelated-{i}", "namespace": namespace, "labels": {"app": "unrelated"}},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "unrelated:bench",
                        "resources": {"requests": {"cpu": "1m", "memory": "1Mi"}},
                    }
                ],
            },
        }
        for i in range(count)
    ]

    def create(pod: dict[str, Any]) -> None:
        try:
            api.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=pod)
        except Exception as error:
            if getattr(error, "status", None) != 409:
                raise

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(create, pods))

    def all_running() -> bool:
        items, _ = api.list_pods_blocking(namespace, UNRELATED_SELECTOR)
        running = sum(1 for pod in items if (pod.get("status") or {}).get("phase") == "Running")
        print(f"[bench] unrelated pods Running: {running} of {count}", file=sys.stderr)
        if running < count:
            time.sleep(3)  # a 5,000-pod LIST is not free: do not poll it at wait_until's pace
        return running >= count

    wait_until(f"{count} unrelated pods Running", all_running, timeout)


# ---- the table -------------------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else float("nan")


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| scenario | R | created s (op) | created s (bound) | ratio | Running s (op) | Running s (bound) | ratio "
        "| writes (R+2) | peak RSS MB | CPU s |"
    )
    lines = [header, "|" + "---|" * 11]
    for row in rows:
        lines.append(
            f"| {row['scenario']} | {row['ranks']} | {row['op_created']:.2f} | {row['bound_created']:.2f} "
            f"| {row['op_created'] / row['bound_created']:.2f} | {row['op_running']:.2f} | {row['bound_running']:.2f} "
            f"| {row['op_running'] / row['bound_running']:.2f} | {row['writes']:.0f} ({row['ranks'] + 2}) "
            f"| {row['rss']:.0f} | {row['cpu']:.1f} |"
        )
    return "\n".join(lines)


def open_cluster(args: argparse.Namespace, prefix: str) -> Any:
    """A fresh work directory (args.workdir: the cluster's state, certificates, operator logs) and the
    cluster, started there or attached with --attach, with our CRDs installed."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    args.workdir = str(workdir)
    cluster = start_cluster(args, workdir / "cluster")
    try:
        install_crds(cluster)
    except BaseException:
        close_cluster(args, {})
        raise
    return cluster


def close_cluster(args: argparse.Namespace, results: Mapping[str, Any]) -> None:
    """Stops the cluster open_cluster started (an attached one stays) and writes --json's results.
    The work directory stays (its operator logs) until the caller, done, removes it."""
    if not args.attach:
        from ddp_harness import down

        down(Path(args.workdir) / "cluster", keep_state=False)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags start_cluster, operator_process and the waits read."""
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--pods-per-node", type=int, default=110)
    parser.add_argument("--nodes", type=int, default=0, help="fake nodes (default: enough for the largest R)")
    parser.add_argument(
        "--attach", help="use the running local cluster with this state dir instead of starting one"
    )
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="also write the raw results here")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 256, 1024])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--unrelated", type=int, default=5000, help="unrelated pods in the crowded scenario (0: skip it)"
    )
    add_cluster_arguments(parser)
    parser.add_argument("--settle", type=float, default=2.0)
    args = parser.parse_args(argv)

    from ddp_operator.kube_api import KubeApi

    cluster = open_cluster(args, "ddp-bench-")
    workdir = Path(args.workdir)
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    try:
        operator_kubeconfig = identity_kubeconfig(cluster, OPERATOR_USER, workdir)
        baseline_kubeconfig = identity_kubeconfig(cluster, BASELINE_USER, workdir)
        admin = KubeApi.connect(str(cluster.kubeconfig), concurrency=args.concurrency)
        bound_client = KubeApi.connect(str(baseline_kubeconfig), concurrency=args.concurrency)
        scenarios = [("empty", 0)] + (
            [(f"+{args.unrelated} unrelated pods", args.unrelated)] if args.unrelated else []
        )
        for scenario, unrelated in scenarios:
            namespace = f"bench-{unrelated}"
            ensure_namespace(admin, namespace)
            if unrelated:
                print(f"[bench] creating {unrelated} unrelated pods in {namespace}", file=sys.stderr)
                fill_unrelated(admin, namespace, unrelated, args.concurrency, args.timeout)
            for ranks in args.ranks:
                ops, bounds = [], []
                for run in range(args.runs):
                    name = f"b{ranks}r{run}"
                    op = operator_run(admin, cluster, operator_kubeconfig, namespace, name, ranks, args)
                    bound = baseline_run(admin, bound_client, namespace, f"{name}lb", ranks, args)
                    print(
                        f"[bench] {scenario} R={ranks} run {run}: operator created {op.seconds_to_created:.2f}s "
                        f"running {op.seconds_to_running:.2f}s writes {op.writes} {op.write_breakdown} "
                        f"rss {op.peak_rss_mb:.0f}MB cpu {op.cpu_seconds:.1f}s | bound created "
                        f"{bound.seconds_to_created:.2f}s running {bound.seconds_to_running:.2f}s",
                        file=sys.stderr,
                    )
                    ops.append(op)
                    bounds.append(bound)
                    raw.append(
                        {
                            "scenario": scenario,
                            "ranks": ranks,
                            "run": run,
                            "operator": op.__dict__,
                            "bound": bound.__dict__,
                        }
                    )
                rows.append(
                    {
                        "scenario": scenario,
                        "ranks": ranks,
                        "op_created": _median([o.seconds_to_created for o in ops]),
                        "bound_created": _median([b.seconds_to_created for b in bounds]),
                        "op_running": _median([o.seconds_to_running for o in ops]),
                        "bound_running": _median([b.seconds_to_running for b in bounds]),
                        "writes": _median([o.writes for o in ops]),
                        "rss": _median([o.peak_rss_mb for o in ops]),
                        "cpu": _median([o.cpu_seconds for o in ops]),
                    }
                )
                print(table(rows), file=sys.stderr)
    finally:
        close_cluster(args, {"rows": rows, "runs": raw})
    print(
        f"\nmedians of {args.runs} run(s); concurrency {args.concurrency}; ratio = operator / bare-client bound\n"
    )
    print(table(rows))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def install_crds(cluster: Any) -> None:
    """Applies the repository's CRDs and waits until they are Established."""
    kubectl = [str(cluster.kubectl), "--kubeconfig", str(cluster.kubeconfig)]
    subprocess.run([*kubectl, "apply", "-f", str(REPO / "crds")], check=True, capture_output=True)
    # An operator started before the CRD is Established waits for kopf's next discovery (~2 s).
    subprocess.run(
        [*kubectl, "wait", "--for=condition=Established", "crd/ddpjobs.ddp.dev", "--timeout=60s"],
        check=True,
        capture_output=True,
    )


def ensure_namespace(api: Any, namespace: str) -> None:
    """The namespace, created if missing, with its default service account (pods need it)."""
    if not _exists(api, namespace):
        api.request("POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
    wait_until("default serviceaccount", lambda: _has_default_sa(api, namespace), 60)


def _exists(api: Any, namespace: str) -> bool:
    try:
        api.request("GET", f"/api/v1/namespaces/{namespace}")
    except Exception:
        return False
    return True


def _has_default_sa(api: Any, namespace: str) -> bool:
    try:
        api.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
    except Exception:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
