"""Create to all Running for one DDPJob admitted three ways, on one local control plane, in one run.

One local control plane started with the in-tree gang API's alpha gates (docs/scheduling.md: apiserver
`--feature-gates=GenericWorkload=true --runtime-config=scheduling.k8s.io/v1alpha2=true`, scheduler
`--feature-gates=GenericWorkload=true,GangScheduling=true`, controller-manager
`--feature-gates=GenericWorkload=true`), fake GPU nodes (8 GPUs each), real Kueue
(tests/integration/kueue_harness.py, `pod` integration, a ClusterQueue far larger than the job) and one
`ddpjob operator` (its own client certificate) watching the three namespaces. Each path is a DDPJob of R
ranks, one GPU per rank:

1. plain: `spec.scheduling.gang: None`, no queue label, in a namespace Kueue does not manage;
2. gang: `spec.scheduling.gang: Workload` (the operator creates the attempt's Workload and PodGroup,
   the scheduler binds the gang whole), in a namespace Kueue does not manage;
3. Kueue: the label `kueue.x-k8s.io/queue-name: <LocalQueue>` on the DDPJob, `gang: None`, in a
   namespace Kueue manages (its webhook gates every pod, Kueue admits the group as one Workload and
   lifts the gates).

Every run creates one job per path in turn, round-robin (the first path rotates from run to run), so the
machine's load falls on all three alike; a warm-up round that is not counted comes first. The clock
starts just before the DDPJob's create; server-side watches on the job's pods and on the DDPJob record
when every rank pod exists, carries no scheduling gate, is bound to a node, and is Running (the headline
figure), and when the DDPJob's `status.phase` became Running. Between runs each job is deleted and its
pods waited out; a Kueue job's Kueue Workload is deleted too, because pods removed by garbage collection
keep Kueue's finalizer until it is (docs/scheduling.md). Medians, minima and maxima over the runs and the
ratio of each path's median to the plain path's are printed as a markdown table. Runs in which a
reconcile of the job failed and was retried (the operator's log says so) are counted per path; a path
with some such runs gets a second row over the others, so a retry's delay is seen apart from the path's
own cost.

The fake nodes report pod changes at once by default (`--kubelet-latency` uses the harness's realistic
per-node latency instead), so the figures are the control plane's own: operator, webhooks, Kueue,
scheduler.

    python benchmarks/bench_gang_admission.py --ranks 64 --runs 5
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_operator_scale import (
    OPERATOR_USER,
    _jobs_path,
    identity_kubeconfig,
    install_crds,
    operator_process,
    wait_until,
)

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # tests.integration.kueue_harness, when run without PYTHONPATH
    sys.path.insert(0, str(REPO))

GPU = "nvidia.com/gpu"
GPUS_PER_NODE = 8
KUEUE_API = "kueue.x-k8s.io/v1beta2"
FLAVOR = "bench-gpu"
CLUSTER_QUEUE = "bench-cq"
LOCAL_QUEUE = "bench-queue"


@dataclass(frozen=True)
class AdmissionPath:
    key: str
    title: str
    namespace: str
    gang: str
    kueue: bool


PATHS = (
    AdmissionPath("plain", "plain (gang None)", "bench-plain", "None", False),
    AdmissionPath("gang", "gang (Workload API)", "bench-gang", "Workload", False),
    AdmissionPath("kueue", "Kueue (gang None)", "bench-kueue", "None", True),
)


@dataclass
class Timing:
    """Seconds from just before the DDPJob's create."""

    created: float  # every rank pod exists
    ungated: float  # every rank pod without scheduling gates (Kueue's admission gate lifted)
    bound: float  # every rank pod bound to a node
    running: float  # every rank pod Running: the headline figure
    phase_running: float  # the DDPJob's status.phase == Running


# ---- watching one job ------------------------------------------------------------------------------


def _watch(api: Any, path: str, query: Mapping[str, Any], timeout_seconds: int = 120) -> Iterator[Any]:
    """Watch events on a collection from the query's resourceVersion (kube_api's pod watch, for any
    path: here the DDPJob's collection with a field selector)."""
    from kubernetes.watch.watch import iter_resp_lines

    response = api._send(
        "GET",
        path,
        query={**query, "watch": "true", "timeoutSeconds": timeout_seconds},
        timeout=(10.0, float(timeout_seconds + 30)),
    )
    try:
        for line in iter_resp_lines(response.response):  # type: ignore[no-untyped-call]
            yield json.loads(line)
    finally:
        response.response.release_conn()


class JobClock:
    """Watches one job's rank pods and the DDPJob itself (server-side selectors, from a list taken before
    the create) and records when every rank pod reached each stage, and when the phase became Running."""

    def __init__(self, api: Any, namespace: str, name: str, replicas: int) -> None:
        from ddp_operator import names

        self.api, self.namespace, self.name, self.replicas = api, namespace, name, replicas
        self.selector = names.label_selector(name)
        self.pods: dict[str, dict[str, bool]] = {}
        self.at: dict[str, float] = {}
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        _, pods_version = api.list_pods_blocking(namespace, self.selector)
        jobs = api.request("GET", _jobs_path(namespace), query={"fieldSelector": f"metadata.name={name}"})
        jobs_version = str(jobs.get("metadata", {}).get("resourceVersion", ""))
        self.started = 0.0
        self._threads = [
            threading.Thread(target=self._guard, args=(self._watch_pods, pods_version), daemon=True),
            threading.Thread(target=self._guard, args=(self._watch_job, jobs_version), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _mark(self, stage: str, now: float) -> None:
        with self._lock:
            if stage not in self.at:
                self.at[stage] = now
            if len(self.at) == len(Timing.__dataclass_fields__):
                self.done.set()

    def _guard(self, target: Any, version: str) -> None:
        try:
            target(version)
        except BaseException as error:  # surfaced by wait()
            self.error = error
            self.done.set()

    def _watch_pods(self, version: str) -> None:
        from ddp_operator import names

        stages = ("created", "ungated", "bound", "running")
        while not self.done.is_set() and not all(s in self.at for s in stages):
            for event in self.api.watch_pods_blocking(self.namespace, self.selector, version, 60):
                obj = event.get("object") or {}
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if event.get("type") not in ("ADDED", "MODIFIED"):
                    continue
                now = time.monotonic()
                spec, status = obj.get("spec") or {}, obj.get("status") or {}
                self.pods[obj["metadata"]["name"]] = {
                    "ungated": not spec.get("schedulingGates"),
                    "bound": bool(spec.get("nodeName")),
                    "running": status.get("phase") == "Running",
                    # Which path the pod took: the in-tree gang, Kueue's webhook (checked by check_path).
                    "grouped": bool(spec.get("schedulingGroup")),
                    "kueue": (obj["metadata"].get("labels") or {}).get(names.KUEUE_MANAGED_LABEL) == "true",
                }
                if len(self.pods) < self.replicas:
                    continue
                self._mark("created", now)
                for stage in stages[1:]:
                    if all(pod[stage] for pod in self.pods.values()):
                        self._mark(stage, now)
                if all(s in self.at for s in stages):
                    return

    def _watch_job(self, version: str) -> None:
        query = {"fieldSelector": f"metadata.name={self.name}", "allowWatchBookmarks": "true"}
        while not self.done.is_set() and "phase_running" not in self.at:
            for event in _watch(self.api, _jobs_path(self.namespace), {**query, "resourceVersion": version}):
                if event.get("type") == "ERROR":
                    raise RuntimeError(f"DDPJob watch: {event.get('object')}")
                obj = event.get("object") or {}
                version = obj.get("metadata", {}).get("resourceVersion", version)
                if (obj.get("status") or {}).get("phase") == "Running":
                    self._mark("phase_running", time.monotonic())
                    return

    def wait(self, timeout: float) -> Timing:
        if not self.done.wait(timeout):
            counts = {
                stage: sum(1 for pod in self.pods.values() if pod[stage])
                for stage in ("ungated", "bound", "running")
            }
            raise TimeoutError(
                f"{self.namespace}/{self.name}: {len(self.pods)} of {self.replicas} pods, {counts}; "
                f"stages reached: {sorted(self.at)}"
            )
        if self.error is not None:
            raise self.error
        return Timing(**{stage: at - self.started for stage, at in self.at.items()})


# ---- one run ---------------------------------------------------------------------------------------


def job_manifest(name: str, replicas: int, path: AdmissionPath) -> dict[str, Any]:
    from ddp_operator import names

    labels = {names.KUEUE_QUEUE_LABEL: LOCAL_QUEUE} if path.kueue else {}
    return {
        "apiVersion": names.API_GROUP_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "scheduling": {"gang": path.gang},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "ddp-trainer:bench",
                            "resources": {
                                "requests": {"cpu": "10m", "memory": "16Mi"},
                                "limits": {GPU: "1"},
                            },
                        }
                    ]
                }
            },
        },
    }


def admission_run(
    admin: Any, name: str, replicas: int, path: AdmissionPath, args: argparse.Namespace
) -> tuple[Timing, float]:
    """(the run's timing, seconds its clean-up took)."""
    from ddp_operator import names

    clock = JobClock(admin, path.namespace, name, replicas)
    clock.started = time.monotonic()
    job = admin.request("POST", _jobs_path(path.namespace), body=job_manifest(name, replicas, path))
    try:
        timing = clock.wait(args.timeout)
        check_path(path, clock.pods)
    finally:
        cleaning = time.monotonic()
        group = names.kueue_pod_group_name(name, job["metadata"]["uid"]) if path.kueue else None
        delete_and_wait(admin, path.namespace, name, group, args.timeout)
    return timing, time.monotonic() - cleaning


def check_path(path: AdmissionPath, pods: Mapping[str, Mapping[str, bool]]) -> None:
    """Every rank pod went the way the path says, and no other: a run that silently fell back to the
    plain path (the gang API not served, a namespace Kueue does not manage) would measure nothing."""
    for flag, wanted in (("grouped", path.gang == "Workload"), ("kueue", path.kueue)):
        wrong = sorted(name for name, pod in pods.items() if pod[flag] != wanted)
        if wrong:
            raise RuntimeError(f"{path.key}: {flag} should be {wanted} on every pod, is not on {wrong[:3]}")


def delete_and_wait(api: Any, namespace: str, name: str, kueue_group: str | None, timeout: float) -> None:
    """Delete the DDPJob (its children go by garbage collection) and, for a Kueue job, the group's Kueue
    Workload, without which the pods stay Terminating under Kueue's finalizer; wait until the pods and
    the DDPJob are gone."""
    from ddp_operator import names

    paths = [_jobs_path(namespace, name)]
    if kueue_group:
        paths.append(f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads/{kueue_group}")
    for path in paths:
        try:
            api.request("DELETE", path, body={"propagationPolicy": "Background"})
        except Exception as error:
            if getattr(error, "status", None) != 404:
                raise
    selector = names.label_selector(name)
    wait_until(f"{name}'s pods to go", lambda: not api.list_pods_blocking(namespace, selector)[0], timeout)
    wait_until(f"{name} to go", lambda: not _exists(api, _jobs_path(namespace, name)), timeout)


def _exists(api: Any, path: str) -> bool:
    try:
        api.request("GET", path)
    except Exception as error:
        if getattr(error, "status", None) == 404:
            return False
        raise
    return True


# ---- the set-up ------------------------------------------------------------------------------------


def start_cluster(args: argparse.Namespace, state_dir: Path) -> Any:
    from ddp_harness import GANG_SCHEDULING_FLAGS, ClusterOptions, ReportLatency, up
    from ddp_harness.manifests import NodeShape

    options = ClusterOptions(
        state_dir=state_dir,
        nodes=args.nodes or 2 * math.ceil(args.ranks / GPUS_PER_NODE),
        node_shape=NodeShape(gpus=GPUS_PER_NODE),
        extra_flags=GANG_SCHEDULING_FLAGS,
        report_latency=ReportLatency() if args.kubelet_latency else None,
    )
    return up(options, progress=lambda message: print(f"[cluster] {message}", file=sys.stderr))


def create_namespace(api: Any, name: str, labels: Mapping[str, str]) -> None:
    api.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name, "labels": dict(labels)}})
    wait_until(
        f"{name}'s default serviceaccount",
        lambda: _exists(api, f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        60,
    )


def create_queues(cluster: Any, ranks: int) -> None:
    """A ResourceFlavor, a ClusterQueue with 4x the job's GPUs (and ample CPU and memory), a LocalQueue
    in the Kueue namespace; returns once the ClusterQueue is Active."""
    quota = [
        {"name": "cpu", "nominalQuota": "1000"},
        {"name": "memory", "nominalQuota": "10Ti"},
        {"name": GPU, "nominalQuota": str(4 * ranks)},
    ]
    objects = [
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
        {
            "apiVersion": KUEUE_API,
            "kind": "ClusterQueue",
            "metadata": {"name": CLUSTER_QUEUE},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": [q["name"] for q in quota],
                        "flavors": [{"name": FLAVOR, "resources": quota}],
                    }
                ],
            },
        },
        {
            "apiVersion": KUEUE_API,
            "kind": "LocalQueue",
            "metadata": {"name": LOCAL_QUEUE, "namespace": PATHS[2].namespace},
            "spec": {"clusterQueue": CLUSTER_QUEUE},
        },
    ]
    cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": objects})

    def active() -> bool:
        queue = cluster.get_json("clusterqueues.kueue.x-k8s.io", CLUSTER_QUEUE)
        return any(
            c["type"] == "Active" and c["status"] == "True"
            for c in (queue.get("status") or {}).get("conditions", [])
        )

    wait_until(f"ClusterQueue {CLUSTER_QUEUE} Active", active, 60)


def gang_api_served(api: Any) -> bool:
    from ddp_operator import gang

    groups = api.request("GET", "/apis").get("groups") or []
    versions = [v["groupVersion"] for g in groups for v in g.get("versions") or []]
    return gang.served_version(versions) is not None


# ---- the table -------------------------------------------------------------------------------------

STAGES = ("created", "ungated", "bound", "running", "phase_running")


def operator_retries(log: Path, namespace: str, name: str) -> int:
    """How many of the job's reconciles failed and were retried (after the operator's error delay)."""
    needle = f"reconcile of {namespace}/{name} failed"
    return sum(1 for line in log.read_text(errors="replace").splitlines() if needle in line)


def summarize(ranks: int, results: Mapping[str, Sequence[tuple[Timing, int]]]) -> list[dict[str, Any]]:
    """One row per path: median, min and max of each stage; the ratio of the medians to plain's. A path
    whose runs were only partly retried by the operator gets a second row, over the runs without one."""
    import statistics

    base = {s: statistics.median(getattr(t, s) for t, _ in results[PATHS[0].key]) for s in STAGES}

    def row(path: AdmissionPath, title: str, runs: Sequence[Timing], retried: int) -> dict[str, Any]:
        summary: dict[str, Any] = {"ranks": ranks, "path": path.key, "title": title}
        summary.update(runs=len(runs), retried=retried)
        for stage in STAGES:
            values = [getattr(t, stage) for t in runs]
            median = statistics.median(values)
            summary[stage] = {
                "median": median,
                "min": min(values),
                "max": max(values),
                "ratio": median / base[stage],
                "extra": median - base[stage],
            }
        return summary

    rows = []
    for path in PATHS:
        everything = results[path.key]
        retried = sum(1 for _, retries in everything if retries)
        rows.append(row(path, path.title, [t for t, _ in everything], retried))
        if 0 < retried < len(everything):
            clean = [t for t, retries in everything if not retries]
            rows.append(row(path, f"{path.title}, runs without a retry", clean, 0))
    return rows


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| R | path | runs (retried) | all Running s: median | min | max | vs plain | DDPJob Running s: median "
        "| vs plain |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        run, phase = row["running"], row["phase_running"]
        lines.append(
            f"| {row['ranks']} | {row['title']} | {row['runs']} ({row['retried']}) | {run['median']:.2f} | {run['min']:.2f} "
            f"| {run['max']:.2f} | {run['ratio']:.2f} ({run['extra']:+.2f}) | {phase['median']:.2f} "
            f"| {phase['ratio']:.2f} ({phase['extra']:+.2f}) |"
        )
    return "\n".join(lines)


def stages_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Where the time goes: the median second at which every rank pod reached each stage."""
    lines = [
        "| R | path | all created s | all ungated s | all bound s | all Running s | DDPJob Running s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = " | ".join(f"{row[s]['median']:.2f}" for s in STAGES)
        lines.append(f"| {row['ranks']} | {row['title']} | {cells} |")
    return "\n".join(lines)


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    parser.add_argument(
        "--nodes", type=int, default=0, help="fake nodes of 8 GPUs (default: twice the job's)"
    )
    parser.add_argument(
        "--kubelet-latency",
        action="store_true",
        help="the fake nodes report late, with jitter (the harness's default ReportLatency)",
    )
    parser.add_argument("--concurrency", type=int, default=32, help="the operator's API requests in flight")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="copy the operator's, Kueue's and the cluster's logs here"
    )
    args = parser.parse_args(argv)

    from tests.integration.kueue_harness import MANAGED_NAMESPACE_LABEL, is_built, kueue_prefix, start_kueue

    from ddp_harness import down
    from ddp_operator.kube_api import KubeApi
    from ddp_operator.workqueue import ERROR_RETRY_SECONDS

    if not is_built(kueue_prefix()):
        print(f"no Kueue build in {kueue_prefix()}: run hack/build-kueue.sh first", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="ddp-bench-gang-"))
    args.workdir = str(workdir)  # operator_process writes nothing there itself; logs go below
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    loads: list[float] = [load_average()]
    kueue = None
    cluster = start_cluster(args, workdir / "cluster")
    try:
        install_crds(cluster)
        admin = KubeApi.connect(str(cluster.kubeconfig), concurrency=args.concurrency)
        if not gang_api_served(admin):
            raise RuntimeError("the control plane does not serve a gang API version gang.py knows")
        kueue = start_kueue(cluster, workdir / "kueue")
        for path in PATHS:
            create_namespace(admin, path.namespace, {MANAGED_NAMESPACE_LABEL: "true"} if path.kueue else {})
        create_queues(cluster, args.ranks)
        kubeconfig = identity_kubeconfig(cluster, OPERATOR_USER, workdir)
        namespaces = [p for path in PATHS[1:] for p in ("--namespace", path.namespace)]
        log = workdir / "operator.log"
        with operator_process(kubeconfig, PATHS[0].namespace, log, args, namespaces):
            results: dict[str, list[tuple[Timing, int]]] = {p.key: [] for p in PATHS}
            for run in range(-args.warmup, args.runs):
                order = PATHS[run % len(PATHS) :] + PATHS[: run % len(PATHS)]
                for path in order:
                    name = f"{path.key}-r{args.ranks}-{'w' if run < 0 else 'n'}{abs(run)}"
                    timing, cleanup = admission_run(admin, name, args.ranks, path, args)
                    retries = operator_retries(log, path.namespace, name)
                    loads.append(load_average())
                    counted = run >= 0
                    if counted:
                        results[path.key].append((timing, retries))
                    raw.append(
                        {
                            "run": run,
                            "path": path.key,
                            "counted": counted,
                            "cleanup": cleanup,
                            "operator_retries": retries,
                            **asdict(timing),
                        }
                    )
                    print(
                        f"[bench] {'run ' + str(run) if counted else 'warm-up'} {path.key}: "
                        + " ".join(f"{s} {getattr(timing, s):.2f}s" for s in STAGES)
                        + f" (operator retries {retries}, clean-up {cleanup:.1f}s, load {loads[-1]:.2f})",
                        file=sys.stderr,
                    )
            rows = summarize(args.ranks, results)
    finally:
        if kueue is not None:
            kueue.stop()
        if args.keep_logs:
            keep = Path(args.keep_logs)
            shutil.copytree(cluster.layout.log_dir, keep / "cluster", dirs_exist_ok=True)
            for log_file in (workdir / "operator.log", workdir / "kueue" / "kueue.log"):
                if log_file.exists():
                    shutil.copy(log_file, keep / log_file.name)
        down(workdir / "cluster", keep_state=False)
        if args.json:
            summary = {"rows": rows, "runs": raw, "load_average": loads}
            Path(args.json).write_text(json.dumps(summary, indent=1))
    print(
        f"\nR = {args.ranks} ranks x 1 GPU; medians, minima and maxima of {args.runs} interleaved run(s) "
        f"after {args.warmup} warm-up round(s); seconds from the DDPJob's create; vs plain = ratio of the "
        f"medians (difference in seconds); (retried) = runs in which a reconcile of the job failed and was "
        f"retried after the operator's {ERROR_RETRY_SECONDS:g} s error delay (its log); fake nodes report "
        f"{'late (harness default latency)' if args.kubelet_latency else 'at once'}; 1-minute load average "
        f"{min(loads):.2f}-{max(loads):.2f} (median {sorted(loads)[len(loads) // 2]:.2f}, "
        f"{len(loads)} samples)\n"
    )
    print(table(rows))
    print()
    print(stages_table(rows))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
