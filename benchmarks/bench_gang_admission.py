"""Create to all Running for one DDPJob admitted five ways, on one local control plane, in one run.

One local control plane started with the in-tree gang API's alpha gates and its topology gate
(docs/scheduling.md; ddp_harness.GANG_SCHEDULING_FLAGS: apiserver
`--feature-gates=GenericWorkload=true,TopologyAwareWorkloadScheduling=true
--runtime-config=scheduling.k8s.io/v1alpha2=true`, scheduler
`--feature-gates=GenericWorkload=true,GangScheduling=true,TopologyAwareWorkloadScheduling=true`,
controller-manager `--feature-gates=GenericWorkload=true`), fake GPU nodes (8 GPUs each) in racks, real
Kueue (tests/integration/kueue_harness.py, `pod` integration, two ClusterQueues far larger than the job,
one of them over a topology-aware flavor) and one `ddpjob operator` (its own client certificate) watching
the five namespaces. Each path is a DDPJob of R ranks, one GPU per rank:

1. plain: `spec.scheduling.gang: None`, no queue label, in a namespace Kueue does not manage;
2. gang: `spec.scheduling.gang: Workload` (the operator creates the attempt's Workload and PodGroup,
   the scheduler binds the gang whole), in a namespace Kueue does not manage;
3. Kueue: the label `kueue.x-k8s.io/queue-name: <LocalQueue>` on the DDPJob, `gang: None`, in a
   namespace Kueue manages (its webhook gates every pod, Kueue admits the group as one Workload and
   lifts the gates);
4. gang + topology: as 2, and `spec.scheduling.topology: {required: bench.ddp.dev/rack}`: the attempt's
   PodGroup gets `schedulingConstraints.topology: [{key: bench.ddp.dev/rack}]` and the scheduler binds
   the gang whole inside one rack;
5. Kueue + topology (TAS): as 3, and the same `topology.required`, in a namespace of its own whose
   LocalQueue feeds a ClusterQueue over a ResourceFlavor with `topologyName` (a Kueue `Topology` of
   levels rack, `kubernetes.io/hostname`) and `nodeLabels: {bench.ddp.dev/pool: bench}`: the rank pods
   carry `kueue.x-k8s.io/podset-required-topology`, and Kueue's topology-aware scheduling assigns the
   group one rack, host by host in rank order, before it lifts the gates.

Racks: once the cluster is up, fake node gpu-node-N gets `bench.ddp.dev/rack=rack-<N // P>` with P
nodes per rack (`--nodes-per-rack`; default ceil(R / 8), so a rack holds exactly one job) and
`bench.ddp.dev/pool=bench` (the TAS flavor's node label); the default node count is two racks.

Every run creates one job per path in turn, round-robin (the first path rotates from run to run), so the
machine's load falls on all five alike; a warm-up round that is not counted comes first. The clock
starts just before the DDPJob's create; server-side watches on the job's pods and on the DDPJob record
when every rank pod exists, carries no scheduling gate, is bound to a node, and is Running (the headline
figure), and when the DDPJob's `status.phase` became Running. Between runs each job is deleted and its
pods waited out; a Kueue job's Kueue Workload is deleted too, because pods removed by garbage collection
keep Kueue's finalizer until it is (docs/scheduling.md). After each job is Running, the benchmark checks
that it took its path (and no other): `schedulingGroup` on the gang paths' pods only, Kueue's `managed`
label on the Kueue paths' only, Kueue's topology annotation on the TAS path's only; and, on the topology
paths, that every rank pod is bound to a node of one rack (each node's rack label, read back) and, on
the PodGroup path, that the pods' PodGroup carries the topology constraint. It also counts the racks
each job spans on every path (the unconstrained paths are free to spread). Medians, minima and maxima over the runs and the
ratio of each path's median to the plain path's are printed as a markdown table. Runs in which a
reconcile of the job failed and was retried (the operator's log says so) are counted per path; a path
with some such runs gets a second row over the others, so a retry's delay is seen apart from the path's
own cost. A third table sets each topology path against the same path without the constraint.

The fake nodes report pod changes at once by default (`--kubelet-latency` uses the harness's realistic
per-node latency instead), so the figures are the control plane's own: operator, webhooks, Kueue,
scheduler.

    python benchmarks/bench_gang_admission.py --ranks 64 --runs 5
    python benchmarks/bench_gang_admission.py --ranks 256 --runs 3 --timeout 600
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
# Racks of fake nodes for the topology paths, and what Kueue's topology-aware scheduling needs over them.
RACK_LABEL = "bench.ddp.dev/rack"
POOL_LABEL = "bench.ddp.dev/pool"  # the TAS flavor's nodeLabels: carried by every bench node
POOL = "bench"
HOST_LABEL = "kubernetes.io/hostname"
TOPOLOGY = "bench-racks"
TAS_FLAVOR = "bench-gpu-tas"
TAS_CLUSTER_QUEUE = "bench-tas-cq"
TAS_LOCAL_QUEUE = "bench-tas-queue"


@dataclass(frozen=True)
class AdmissionPath:
    key: str
    title: str
    namespace: str
    gang: str
    queue: str | None  # the LocalQueue the job names (None: not queued)
    without: str | None = None  # the key of the same path without a topology (None: asks for none)

    @property
    def kueue(self) -> bool:
        return self.queue is not None

    @property
    def topology(self) -> bool:
        """`spec.scheduling.topology: {required: RACK_LABEL}`."""
        return self.without is not None


PATHS = (
    AdmissionPath("plain", "plain (gang None)", "bench-plain", "None", None),
    AdmissionPath("gang", "gang (Workload API)", "bench-gang", "Workload", None),
    AdmissionPath("kueue", "Kueue (gang None)", "bench-kueue", "None", LOCAL_QUEUE),
    AdmissionPath("gang-topo", "gang + topology", "bench-gang-topo", "Workload", None, "gang"),
    AdmissionPath("kueue-tas", "Kueue + topology (TAS)", "bench-kueue-tas", "None", TAS_LOCAL_QUEUE, "kueue"),
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
        from ddp_operator.policies.topology import KUEUE_REQUIRED_ANNOTATION

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
                    "tas": (obj["metadata"].get("annotations") or {}).get(KUEUE_REQUIRED_ANNOTATION)
                    == RACK_LABEL,
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

    labels = {names.KUEUE_QUEUE_LABEL: path.queue} if path.queue else {}
    scheduling: dict[str, Any] = {"gang": path.gang}
    if path.topology:
        scheduling["topology"] = {"required": RACK_LABEL}
    return {
        "apiVersion": names.API_GROUP_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "scheduling": scheduling,
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
) -> tuple[Timing, float, int]:
    """(the run's timing, seconds its clean-up took, racks its pods were bound in)."""
    from ddp_operator import names

    clock = JobClock(admin, path.namespace, name, replicas)
    clock.started = time.monotonic()
    job = admin.request("POST", _jobs_path(path.namespace), body=job_manifest(name, replicas, path))
    try:
        timing = clock.wait(args.timeout)
        check_path(path, clock.pods)
        racks = check_placement(admin, path, name, args.gang_version)
    finally:
        cleaning = time.monotonic()
        group = names.kueue_pod_group_name(name, job["metadata"]["uid"]) if path.kueue else None
        delete_and_wait(admin, path.namespace, name, group, args.timeout)
    return timing, time.monotonic() - cleaning, racks


def check_path(path: AdmissionPath, pods: Mapping[str, Mapping[str, bool]]) -> None:
    """Every rank pod went the way the path says, and no other: a run that silently fell back to the
    plain path (the gang API not served, a namespace Kueue does not manage, Kueue's topology annotation
    missing) would measure nothing."""
    flags = (
        ("grouped", path.gang == "Workload"),
        ("kueue", path.kueue),
        ("tas", path.kueue and path.topology),
    )
    for flag, wanted in flags:
        wrong = sorted(name for name, pod in pods.items() if pod[flag] != wanted)
        if wrong:
            raise RuntimeError(f"{path.key}: {flag} should be {wanted} on every pod, is not on {wrong[:3]}")


def check_placement(api: Any, path: AdmissionPath, name: str, gang_version: str) -> int:
    """The number of racks the job's rank pods are bound in (each node's rack label, read back); a
    topology path must have every pod in one, and the PodGroup path's PodGroup must carry the rack
    constraint (an apiserver without TopologyAwareWorkloadScheduling drops it, and the gang could then
    land in one rack by chance)."""
    from ddp_operator import names

    pods, _ = api.list_pods_blocking(path.namespace, names.label_selector(name))
    nodes = api.request("GET", "/api/v1/nodes").get("items") or []
    rack_of = {n["metadata"]["name"]: (n["metadata"].get("labels") or {}).get(RACK_LABEL, "") for n in nodes}
    racks = {rack_of.get(pod["spec"].get("nodeName", ""), "") for pod in pods}
    if path.topology and (len(racks) != 1 or "" in racks):
        raise RuntimeError(f"{path.key}: {name}'s pods are bound in racks {sorted(racks)}, not in one")
    if path.topology and path.gang == "Workload":
        groups = {(pod["spec"].get("schedulingGroup") or {}).get("podGroupName") for pod in pods}
        if len(groups) != 1 or None in groups:
            raise RuntimeError(f"{path.key}: {name}'s pods name PodGroups {sorted(map(str, groups))}")
        group = api.request(
            "GET",
            f"/apis/scheduling.k8s.io/{gang_version}/namespaces/{path.namespace}/podgroups/{groups.pop()}",
        )
        constraints = (group.get("spec") or {}).get("schedulingConstraints")
        if constraints != {"topology": [{"key": RACK_LABEL}]}:
            raise RuntimeError(f"{path.key}: {name}'s PodGroup has schedulingConstraints {constraints}")
    return len(racks)


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
        nodes=args.nodes,
        node_shape=NodeShape(gpus=GPUS_PER_NODE),
        extra_flags=GANG_SCHEDULING_FLAGS,
        report_latency=ReportLatency() if args.kubelet_latency else None,
    )
    return up(options, progress=lambda message: print(f"[cluster] {message}", file=sys.stderr))


def label_racks(cluster: Any, nodes: int, per_rack: int) -> None:
    """Fake node gpu-node-N joins rack `rack-<N // per_rack>`, and every node the TAS flavor's pool."""
    from ddp_harness.manifests import node_name

    racks: dict[str, list[str]] = {}
    for index in range(nodes):
        racks.setdefault(f"rack-{index // per_rack}", []).append(node_name(index))
    for rack, members in racks.items():
        cluster.kubectl_run(
            "label", "--overwrite", "nodes", *members, f"{RACK_LABEL}={rack}", f"{POOL_LABEL}={POOL}"
        )


def create_namespace(api: Any, name: str, labels: Mapping[str, str]) -> None:
    api.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name, "labels": dict(labels)}})
    wait_until(
        f"{name}'s default serviceaccount",
        lambda: _exists(api, f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        60,
    )


def create_queues(cluster: Any, ranks: int) -> None:
    """Two ResourceFlavors, the second topology-aware (a Topology of rack and host, the bench nodes'
    pool label), each under a ClusterQueue with 4x the job's GPUs (and ample CPU and memory), and a
    LocalQueue for each in its Kueue path's namespace; returns once both ClusterQueues are Active."""
    quota = [
        {"name": "cpu", "nominalQuota": "1000"},
        {"name": "memory", "nominalQuota": "10Ti"},
        {"name": GPU, "nominalQuota": str(4 * ranks)},
    ]
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": KUEUE_API,
            "kind": "Topology",
            "metadata": {"name": TOPOLOGY},
            "spec": {"levels": [{"nodeLabel": RACK_LABEL}, {"nodeLabel": HOST_LABEL}]},
        },
        {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": FLAVOR}},
        {
            "apiVersion": KUEUE_API,
            "kind": "ResourceFlavor",
            "metadata": {"name": TAS_FLAVOR},
            "spec": {"nodeLabels": {POOL_LABEL: POOL}, "topologyName": TOPOLOGY},
        },
    ]
    queues = {path.queue: path.namespace for path in PATHS if path.queue}
    cluster_queues = {LOCAL_QUEUE: (CLUSTER_QUEUE, FLAVOR), TAS_LOCAL_QUEUE: (TAS_CLUSTER_QUEUE, TAS_FLAVOR)}
    for local_queue, namespace in queues.items():
        cluster_queue, flavor = cluster_queues[local_queue]
        objects.append(
            {
                "apiVersion": KUEUE_API,
                "kind": "ClusterQueue",
                "metadata": {"name": cluster_queue},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": [q["name"] for q in quota],
                            "flavors": [{"name": flavor, "resources": quota}],
                        }
                    ],
                },
            }
        )
        objects.append(
            {
                "apiVersion": KUEUE_API,
                "kind": "LocalQueue",
                "metadata": {"name": local_queue, "namespace": namespace},
                "spec": {"clusterQueue": cluster_queue},
            }
        )
    cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": objects})

    def active(name: str) -> bool:
        queue = cluster.get_json("clusterqueues.kueue.x-k8s.io", name)
        return any(
            c["type"] == "Active" and c["status"] == "True"
            for c in (queue.get("status") or {}).get("conditions", [])
        )

    for cluster_queue, _ in cluster_queues.values():
        wait_until(f"ClusterQueue {cluster_queue} Active", lambda name=cluster_queue: active(name), 60)


def gang_api_version(api: Any) -> str | None:
    """The gang API version served that gang.py knows (None: none)."""
    from ddp_operator import gang

    groups = api.request("GET", "/apis").get("groups") or []
    versions = [v["groupVersion"] for g in groups for v in g.get("versions") or []]
    return gang.served_version(versions)


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


def topology_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """What the rack constraint adds: each topology path's medians (over all its runs) against the same
    path's without one."""
    by_title = {row["title"]: row for row in rows}
    by_key = {path.key: path for path in PATHS}
    lines = [
        "| R | path | against | all bound s: median | without | topology adds | all Running s: median "
        "| without | topology adds |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in PATHS:
        if path.without is None:
            continue
        row, base = by_title[path.title], by_title[by_key[path.without].title]
        cells = []
        for stage in ("bound", "running"):
            median, without = row[stage]["median"], base[stage]["median"]
            cells.append(
                f"{median:.2f} | {without:.2f} | {median - without:+.2f} s ({median / without:.2f}x)"
            )
        lines.append(f"| {row['ranks']} | {row['title']} | {base['title']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def racks_line(raw: Sequence[Mapping[str, Any]]) -> str:
    """The racks each path's jobs were bound in, over the counted runs."""
    parts = []
    for path in PATHS:
        racks = sorted({run["racks"] for run in raw if run["path"] == path.key and run["counted"]})
        parts.append(f"{path.key} {'/'.join(map(str, racks))}")
    return "racks spanned per job: " + ", ".join(parts)


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
        "--nodes", type=int, default=0, help="fake nodes of 8 GPUs (default: two racks, twice the job's)"
    )
    parser.add_argument(
        "--nodes-per-rack",
        type=int,
        default=0,
        help="fake nodes per rack (default: ceil(ranks / 8), so one rack holds the job exactly)",
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
    args.nodes_per_rack = args.nodes_per_rack or math.ceil(args.ranks / GPUS_PER_NODE)
    args.nodes = args.nodes or 2 * args.nodes_per_rack
    if args.nodes_per_rack * GPUS_PER_NODE < args.ranks or args.nodes < args.nodes_per_rack:
        parser.error(
            f"no rack of {args.nodes_per_rack} nodes x {GPUS_PER_NODE} GPUs holds {args.ranks} ranks"
        )

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
        label_racks(cluster, args.nodes, args.nodes_per_rack)
        admin = KubeApi.connect(str(cluster.kubeconfig), concurrency=args.concurrency)
        args.gang_version = gang_api_version(admin)
        if args.gang_version is None:
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
                    timing, cleanup, racks = admission_run(admin, name, args.ranks, path, args)
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
                            "racks": racks,
                            **asdict(timing),
                        }
                    )
                    print(
                        f"[bench] {'run ' + str(run) if counted else 'warm-up'} {path.key}: "
                        + " ".join(f"{s} {getattr(timing, s):.2f}s" for s in STAGES)
                        + f" (racks {racks}, operator retries {retries}, clean-up {cleanup:.1f}s, "
                        f"load {loads[-1]:.2f})",
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
        f"{'late (harness default latency)' if args.kubelet_latency else 'at once'}; {args.nodes} nodes in "
        f"racks of {args.nodes_per_rack} ({args.nodes_per_rack * GPUS_PER_NODE} GPUs); 1-minute load average "
        f"{min(loads):.2f}-{max(loads):.2f} (median {sorted(loads)[len(loads) // 2]:.2f}, "
        f"{len(loads)} samples)\n"
    )
    print(table(rows))
    print()
    print(stages_table(rows))
    print()
    print(topology_table(rows))
    print()
    print(racks_line(raw))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
