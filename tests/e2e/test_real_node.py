"""The e2e tier on real nodes: by default the local control plane plus one real node of this machine
(`ddp-harness cluster up --real-node`: containerd, kubelet, CNI bridge, kube-proxy, CoreDNS), or, with
DDP_E2E_KUBECONFIG=<path>, any cluster with real nodes (kind, ...); our chart and our two images.

What runs here is what a user does: `helm install` the chart (the operator runs in a pod under its
ServiceAccount), `kubectl apply` the digits example with a checkpoint volume in a namespace that enforces
Pod Security "restricted", and watch the DDPJob. The ranks run the trainer image for real, find rank 0
through the headless Service's DNS name, and export metrics that the test reads at each pod IP (on the
local node) or through the apiserver's pod proxy (elsewhere: the pod network may not be reachable from
here, as with kind).

Prerequisites (each missing one skips the module, naming it): root (the node adds a bridge, iptables
rules and mounts), Docker with both images built by hack/build-images.sh, the control plane's and the
node's binaries (hack/build-k8s.sh, hack/build-node-binaries.sh; built here when Go is available) and
Debian's containerd, runc and CNI plugins, and for the node's NetworkPolicy enforcer (kube-router's
firewall, hack/build-kube-router.sh) Debian's ipset and a kernel with ipsets and xt_set. Every job here
runs under its NetworkPolicy, enforced; the module first proves that the enforcer enforces (a deny-all
policy refuses a connection that succeeds without it). Set DDP_E2E_TIMINGS=<file> to record the figures
of docs/real-node.md (the test never asserts on them).

Against another cluster (DDP_E2E_KUBECONFIG) only kubectl and helm are needed here; the cluster must be
able to run DDP_E2E_OPERATOR_IMAGE and DDP_E2E_TRAINER_IMAGE (pullable, or loaded beforehand as with
`kind load docker-image`), bind a checkpoint claim (through its default StorageClass, or the one named
by DDP_E2E_STORAGE_CLASS) and enforce NetworkPolicies (its network plugin's job; the deny-all check
fails the module where nothing does). docs/real-node.md says how."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import pytest
import yaml

from ddp_harness import (
    ClusterError,
    ClusterOptions,
    KubectlError,
    LocalCluster,
    default_bin_dir,
    down,
    netpol_enforcer,
    real_node,
    up,
)
from ddp_harness.binaries import pinned_versions, stale_binaries
from ddp_operator import __version__

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ddp-operator"
EXAMPLE = REPO / "examples" / "digits-cpu.yaml"
TRAINER_IMAGE = os.environ.get("DDP_E2E_TRAINER_IMAGE", f"ddp-trainer:{__version__}")
OPERATOR_IMAGE = os.environ.get("DDP_E2E_OPERATOR_IMAGE", f"ddp-operator:{__version__}")
EXTERNAL_KUBECONFIG = os.environ.get("DDP_E2E_KUBECONFIG")
STORAGE_CLASS = os.environ.get("DDP_E2E_STORAGE_CLASS")  # None: the cluster's default StorageClass
METRICS_PORT = 9400
T = TypeVar("T")


def _progress(message: str) -> None:
    print(f"[real-node] {message}", file=sys.stderr, flush=True)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 300.0, interval: float = 1.0) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last seen: {last!r}")


@dataclass
class Timings:
    """The figures docs/real-node.md reports; written to $DDP_E2E_TIMINGS when set."""

    values: dict[str, float] = field(default_factory=dict)

    def record(self, name: str, seconds: float) -> None:
        self.values[name] = round(seconds, 1)
        _progress(f"timing {name}: {seconds:.1f} s")
        target = os.environ.get("DDP_E2E_TIMINGS")
        if target:
            Path(target).write_text(json.dumps(self.values, indent=2) + "\n")


TIMINGS = Timings()


# ---- the cluster under test -------------------------------------------------------------------------


class Cluster(Protocol):
    """What the tests use of a cluster: LocalCluster (the local node) and ExternalCluster both have it."""

    @property
    def kubeconfig(self) -> Path: ...

    @property
    def kubectl(self) -> Path: ...

    def kubectl_run(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]: ...

    def helm_run(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]: ...

    def apply_json(self, obj: Any, *args: str) -> subprocess.CompletedProcess[str]: ...

    def create_namespace(self, name: str, timeout_s: float = 30.0) -> None: ...


@dataclass(frozen=True)
class ExternalCluster:
    """A cluster with real nodes that this test neither starts nor stops (kind, or any), reached through
    its kubeconfig with our kubectl and helm."""

    kubeconfig: Path
    kubectl: Path
    helm: Path

    def kubectl_run(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        return self._run(self.kubectl, args, check=check, input=input, timeout=timeout)

    def helm_run(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        return self._run(self.helm, args, check=check, input=None, timeout=timeout)

    def _run(
        self, binary: Path, args: tuple[str, ...], *, check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(binary), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def apply_json(self, obj: Any, *args: str) -> subprocess.CompletedProcess[str]:
        return self.kubectl_run("apply", "-f", "-", *args, input=json.dumps(obj))

    def create_namespace(self, name: str, timeout_s: float = 30.0) -> None:
        self.kubectl_run("create", "namespace", name)
        # Pods are refused until the controller-manager has made the namespace's default ServiceAccount.
        wait_for(
            f"the default ServiceAccount of {name}",
            lambda: (
                self.kubectl_run("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0
            ),
            timeout=timeout_s,
        )


def is_local_node(cluster: Cluster) -> bool:
    """The local real node: its pod IPs and hostPath volumes are on this machine."""
    return isinstance(cluster, LocalCluster)


def pod_start_timeout(cluster: Cluster) -> float:
    """The local node has both images before any test starts; another cluster may first pull the trainer
    image (5.8 GB) onto the node a pod lands on."""
    return 180.0 if is_local_node(cluster) else 900.0


# ---- prerequisites ----------------------------------------------------------------------------------


def _docker_image_missing(image: str) -> bool:
    result = subprocess.run(
        ["docker", "image", "inspect", image], capture_output=True, timeout=60, check=False
    )
    return result.returncode != 0


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "a real node needs root: it creates a bridge, iptables rules and mounts"
    if shutil.which("docker") is None:
        return (
            "no docker CLI: the node's images come from `docker save` (hack/build-images.sh installs Docker)"
        )
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60, check=False).returncode != 0:
        return "no Docker daemon answers: hack/build-images.sh starts one"
    for image in (OPERATOR_IMAGE, TRAINER_IMAGE):
        if _docker_image_missing(image):
            return f"image {image} is not in Docker: build it with hack/build-images.sh"
    bin_dir = default_bin_dir()
    if shutil.which("go") is None:
        if stale_binaries(bin_dir, pinned_versions()):
            return f"no Go toolchain to build the control plane, and {bin_dir} lacks prebuilt binaries"
        if any(not os.access(bin_dir / b, os.X_OK) for b in real_node.NODE_BINARIES):
            return f"no Go toolchain to build the node's binaries, and {bin_dir} lacks them"
    return None


def client_tool(name: str) -> Path | None:
    built = default_bin_dir() / name
    if os.access(built, os.X_OK):
        return built
    found = shutil.which(name)
    return Path(found) if found else None


def default_storage_class(cluster: Cluster) -> str | None:
    classes = json.loads(cluster.kubectl_run("get", "storageclass", "-o", "json").stdout)["items"]
    return next(
        (
            c["metadata"]["name"]
            for c in classes
            if (c["metadata"].get("annotations") or {}).get("storageclass.kubernetes.io/is-default-class")
            == "true"
        ),
        None,
    )


# ---- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if EXTERNAL_KUBECONFIG:
        yield external_cluster(Path(EXTERNAL_KUBECONFIG))
    else:
        yield from local_cluster(tmp_path_factory)


def external_cluster(kubeconfig: Path) -> ExternalCluster:
    if not kubeconfig.is_file():
        raise ClusterError(f"DDP_E2E_KUBECONFIG={kubeconfig} is not a file")
    kubectl, helm = client_tool("kubectl"), client_tool("helm")
    if kubectl is None or helm is None:
        pytest.skip(
            "against DDP_E2E_KUBECONFIG the test needs kubectl and helm (hack/build-k8s.sh builds both)"
        )
    _progress(f"using the cluster of {kubeconfig}; images {OPERATOR_IMAGE}, {TRAINER_IMAGE}")
    return ExternalCluster(kubeconfig=kubeconfig, kubectl=kubectl, helm=helm)


def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    bin_dir = default_bin_dir()
    real_node.ensure_node_binaries(bin_dir, build=True)
    missing = real_node.missing_prerequisites(bin_dir, real_node.default_cni_bin_dir())
    missing += netpol_enforcer.missing_prerequisites()
    if missing:
        pytest.skip("a real node cannot run here: " + "; ".join(missing))
    state_dir = tmp_path_factory.mktemp("real-node-cluster")
    # The node enforces NetworkPolicies: network_policy_enforcer below checks that it does.
    node_options = real_node.RealNodeOptions(images=(OPERATOR_IMAGE, TRAINER_IMAGE), network_policy=True)
    options = ClusterOptions(
        state_dir=state_dir,
        bin_dir=bin_dir,
        nodes=0,  # no kwok nodes: every pod must land on the real node
        timeout_s=300.0,
        real_node=node_options,
    )
    started = time.monotonic()
    cluster = up(options, progress=_progress)  # what `ddp-harness cluster up --real-node` runs
    TIMINGS.record("cluster_up_to_ready_node_s", time.monotonic() - started)
    try:
        yield cluster
    finally:
        down(state_dir, keep_state=True, progress=_progress)
        left = cluster.running_components() + [r.name for r in real_node.status(state_dir) if r.running]
        assert not left, f"still running after down: {left}"
        assert not Path(f"/sys/class/net/{node_options.network.bridge}").exists()


@pytest.fixture(scope="module")
def network_policy_enforcer(cluster: Cluster) -> str:
    """What enforces NetworkPolicies on the cluster's nodes, once a deny-all policy is seen to refuse a
    connection that succeeds without it: kube-router's firewall on the local node (started with it);
    another cluster's network plugin. test_kind.py overrides this to start kube-router in kind's node."""
    enforcer = (
        f"kube-router {netpol_enforcer.version()} on the real node"
        if is_local_node(cluster)
        else "the cluster's own"
    )
    assert_network_policies_enforced(cluster, enforcer)
    return enforcer


@pytest.fixture(scope="module")
def operator_release(cluster: Cluster, network_policy_enforcer: str) -> Iterator[str]:
    """The chart, installed once; every job of this module runs under its NetworkPolicy, enforced by
    `network_policy_enforcer`."""
    repository, tag = OPERATOR_IMAGE.rsplit(":", 1)
    release = "ddp"
    cluster.helm_run(
        "install", release, str(CHART), "--namespace", "ddp-system", "--create-namespace", "--wait",
        "--timeout", "5m", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", "image.pullPolicy=IfNotPresent",
        timeout=400,
    )  # fmt: skip
    try:
        yield release
    finally:
        cluster.helm_run("uninstall", release, "--namespace", "ddp-system", check=False)


@pytest.fixture(scope="module")
def checkpoint_storage(cluster: Cluster) -> str | None:
    """The StorageClass of the checkpoint claims; None for the cluster's default. The local node has a
    default class with static hostPath volumes; another cluster needs a default class (kind's provisions
    local volumes) or DDP_E2E_STORAGE_CLASS."""
    if is_local_node(cluster):
        return None
    if STORAGE_CLASS:
        return STORAGE_CLASS
    if default_storage_class(cluster) is None:
        pytest.skip(
            "the cluster has no default StorageClass for the checkpoint claim: set DDP_E2E_STORAGE_CLASS"
        )
    return None


@pytest.fixture
def restricted_namespace(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(name)
    cluster.kubectl_run(
        "label", "namespace", name,
        "pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest",
    )  # fmt: skip
    yield name
    if not is_local_node(cluster):  # the local cluster goes down whole; another one is left as found
        cluster.kubectl_run("delete", "namespace", name, "--wait=false", check=False)


# ---- helpers ----------------------------------------------------------------------------------------


def digits_job(
    name: str, *extra_args: str, storage_class: str | None = None, cpu: str = "500m"
) -> dict[str, Any]:
    """examples/digits-cpu.yaml as a user applies it, with our locally built trainer image, a
    checkpoint volume (of the cluster's default StorageClass unless one is named), and CPU requests two
    ranks and the operator fit in on a 2-core machine."""
    job: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"] = {"name": name}
    claim: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    if storage_class:
        claim["storageClassName"] = storage_class
    job["spec"]["checkpoint"] = {"volumeClaimTemplate": claim}
    trainer = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    trainer["image"] = TRAINER_IMAGE
    trainer["command"] = [*trainer["command"], *extra_args]
    trainer.setdefault("resources", {}).setdefault("requests", {})["cpu"] = cpu
    return job


def get_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl_run("get", *args, "-o", "json").stdout)


def job_status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = get_json(cluster, "ddpjob", name, "-n", namespace).get("status") or {}
    return status


def rank_pods(cluster: Cluster, namespace: str, job: str) -> list[dict[str, Any]]:
    """The job's rank pods (not its rendezvous pod, which carries no rank)."""
    selector = f"ddp.dev/job-name={job},ddp.dev/rank"
    items: list[dict[str, Any]] = get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"]
    return sorted(
        items, key=lambda p: (int(p["metadata"]["labels"]["ddp.dev/attempt"]), p["metadata"]["name"])
    )


def running_ranks(
    cluster: Cluster, namespace: str, job: str, attempt: int, replicas: int
) -> list[dict[str, Any]] | None:
    pods = [
        p
        for p in rank_pods(cluster, namespace, job)
        if p["metadata"]["labels"]["ddp.dev/attempt"] == str(attempt)
        and p["status"].get("phase") == "Running"
        and p["status"].get("podIP")
    ]
    return pods if len(pods) == replicas else None


def wait_phase(cluster: Cluster, namespace: str, job: str, phase: str, timeout: float) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        status = job_status(cluster, namespace, job)
        if status.get("phase") in ("Succeeded", "Failed") and status.get("phase") != phase:
            raise AssertionError(f"{job} ended {status.get('phase')}, not {phase}: {json.dumps(status)}\n"
                                 f"{diagnostics(cluster, namespace, job)}")  # fmt: skip
        return status if status.get("phase") == phase else None

    try:
        return wait_for(f"DDPJob {job} {phase}", probe, timeout=timeout)
    except AssertionError as error:
        raise AssertionError(f"{error}\n{diagnostics(cluster, namespace, job)}") from None


def diagnostics(cluster: Cluster, namespace: str, job: str) -> str:
    pods = cluster.kubectl_run("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
    events = cluster.kubectl_run(
        "get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False
    ).stdout
    logs = cluster.kubectl_run(
        "logs", "-n", namespace, "-l", f"ddp.dev/job-name={job}", "--tail=15", "--prefix", check=False
    )
    return f"pods:\n{pods}\nevents:\n{events[-3000:]}\nlogs:\n{logs.stdout[-3000:]}{logs.stderr[-500:]}"


def read_metrics(cluster: Cluster, pod: dict[str, Any]) -> str | None:
    """A rank's /metrics: at its pod IP on the local node; through the apiserver's pod proxy elsewhere,
    where this machine may not reach the pod network (kind's pods live inside Docker containers)."""
    if is_local_node(cluster):
        try:
            url = f"http://{pod['status']['podIP']}:{METRICS_PORT}/metrics"
            with urllib.request.urlopen(url, timeout=5) as answer:
                return str(answer.read().decode())
        except OSError:
            return None
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    path = f"/api/v1/namespaces/{namespace}/pods/{name}:{METRICS_PORT}/proxy/metrics"
    answer = cluster.kubectl_run("get", "--raw", path, "--request-timeout=10s", check=False, timeout=30)
    return answer.stdout if answer.returncode == 0 else None


def apiserver_version(cluster: Cluster) -> str:
    """What the apiserver's /version must say to a pod: the release we built for the local node, and for
    another cluster what its apiserver tells us."""
    if is_local_node(cluster):
        return pinned_versions()["KUBERNETES_VERSION"]
    return str(json.loads(cluster.kubectl_run("get", "--raw", "/version").stdout)["gitVersion"])


def counter(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and (line[len(name)] in " {")
    )


def status_lines(logs: str, kind: str) -> list[dict[str, str]]:
    found = []
    for line in logs.splitlines():
        words = line.split()
        if words and words[0] == kind:
            found.append(dict(w.split("=", 1) for w in words[1:] if "=" in w))
    return found


class LogFollower:
    """`kubectl logs -f` of a running rank pod, read once the pod has ended: the operator may delete
    finished pods (cleanPodPolicy), and their logs go with them."""

    def __init__(self, cluster: Cluster, namespace: str, pod: str) -> None:
        self.pod = pod
        self.process = subprocess.Popen(
            [str(cluster.kubectl), f"--kubeconfig={cluster.kubeconfig}", "logs", "-f", "-n", namespace, pod,
             "-c", "trainer"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def text(self, timeout: float = 120.0) -> str:
        try:
            out, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return out


# ---- the node itself --------------------------------------------------------------------------------


# A Service reaches its endpoints once kube-proxy has programmed them, a moment after they exist (until
# then its rules refuse the connection): like any client, the script retries for a while, then fails.
SMOKE_SCRIPT = """
import json, socket, ssl, time, urllib.request
def fetch(request, **kwargs):
    for attempt in range(30):
        try:
            return urllib.request.urlopen(request, timeout=10, **kwargs).read()
        except OSError as error:
            print("retrying:", error, flush=True)
            time.sleep(1)
    return urllib.request.urlopen(request, timeout=10, **kwargs).read()
result = {"kubernetes.default": socket.gethostbyname("kubernetes.default")}
result["echo"] = fetch("http://echo:8080/hello.txt").decode().strip()
ctx = ssl.create_default_context(cafile="/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
token = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()
request = urllib.request.Request("https://kubernetes.default.svc/version", headers={"Authorization": "Bearer " + token})
result["apiserver"] = json.loads(fetch(request, context=ctx))["gitVersion"]
print("SMOKE " + json.dumps(result))
"""


@pytest.mark.kind_suite
def test_a_pod_resolves_kubernetes_default_and_reaches_a_cluster_ip_service(
    cluster: Cluster,
) -> None:
    namespace = f"smoke-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(namespace)
    try:
        server = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "echo", "namespace": namespace, "labels": {"app": "echo"}},
            "spec": {
                "containers": [
                    {
                        "name": "http",
                        "image": TRAINER_IMAGE,
                        "command": [
                            "sh",
                            "-c",
                            "mkdir -p /tmp/www && echo hello-from-echo > /tmp/www/hello.txt "
                            "&& exec python3 -m http.server 8080 --directory /tmp/www",
                        ],
                        "ports": [{"containerPort": 8080}],
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                    }
                ]
            },
        }
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "echo", "namespace": namespace},
            "spec": {"selector": {"app": "echo"}, "ports": [{"port": 8080, "targetPort": 8080}]},
        }
        cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": [server, service]})
        wait_for(
            "the echo pod Ready",
            lambda: any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in get_json(cluster, "pod", "echo", "-n", namespace)["status"].get("conditions", [])
            ),
            timeout=pod_start_timeout(cluster),
        )
        client = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "client", "namespace": namespace},
            "spec": {
                "restartPolicy": "Never",
                "containers": [
                    {"name": "client", "image": TRAINER_IMAGE, "command": ["python3", "-c", SMOKE_SCRIPT]}
                ],
            },
        }
        cluster.apply_json(client)
        phase = wait_for(
            "the client pod to finish",
            lambda: (
                get_json(cluster, "pod", "client", "-n", namespace)["status"].get("phase")
                in ("Succeeded", "Failed")
                and get_json(cluster, "pod", "client", "-n", namespace)["status"]["phase"]
            ),
            timeout=pod_start_timeout(cluster),
        )
        logs = cluster.kubectl_run("logs", "-n", namespace, "client", check=False)
        assert phase == "Succeeded", f"client pod {phase}:\n{logs.stdout}{logs.stderr}"
        line = next(line for line in logs.stdout.splitlines() if line.startswith("SMOKE "))
        result = json.loads(line.removeprefix("SMOKE "))
        service_ip = get_json(cluster, "service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
        assert result["kubernetes.default"] == service_ip
        assert result["echo"] == "hello-from-echo"
        assert result["apiserver"] == apiserver_version(cluster)
    finally:
        cluster.kubectl_run("delete", "namespace", namespace, "--wait=false", check=False)


# ---- the user's path --------------------------------------------------------------------------------


@pytest.mark.kind_suite
def test_digits_trains_across_two_pods_with_equal_allreduce_bytes_and_succeeds(
    cluster: Cluster, checkpoint_storage: str | None, operator_release: str, restricted_namespace: str
) -> None:
    namespace = restricted_namespace
    job = "digits"
    applied = time.monotonic()
    cluster.apply_json(
        digits_job(job, "--throttle-ms", "40", "--checkpoint-every", "50", storage_class=checkpoint_storage),
        "-n",
        namespace,
    )
    pods = wait_for("both ranks Running", lambda: running_ranks(cluster, namespace, job, 0, 2), timeout=600)
    TIMINGS.record("apply_to_all_ranks_running_s", time.monotonic() - applied)

    # Rank 0's stable DNS name through the headless Service; the rendezvous store is the attempt's
    # rendezvous pod, published by the same Service, which outlives any rank's pod.
    for pod in pods:
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}
        assert env["MASTER_ADDR"] == f"{job}-0.{job}.{namespace}.svc", env
        assert env["DDP_RENDEZVOUS_ENDPOINT"] == f"{job}-rdzv.{job}.{namespace}.svc:{RENDEZVOUS_PORT}", env
    store = get_json(cluster, "pod", f"{job}-rdzv-0", "-n", namespace)
    assert store["metadata"]["labels"]["ddp.dev/role"] == "rendezvous", store["metadata"]

    rank0 = next(p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "0")
    rank0_log = LogFollower(cluster, namespace, rank0)

    def metrics_after_some_steps() -> list[str] | None:
        texts = [read_metrics(cluster, pod) for pod in pods]
        if all(t and counter(t, "ddp_sync_steps_total") > 0 for t in texts):
            return [t for t in texts if t]
        return None

    first = wait_for("both ranks' /metrics after some sync steps", metrics_after_some_steps, timeout=300)

    def grown() -> list[str] | None:
        texts = metrics_after_some_steps()
        if texts and all(
            counter(t, "ddp_allreduce_bytes_total") > counter(f, "ddp_allreduce_bytes_total")
            and counter(t, "ddp_sync_steps_total") > counter(f, "ddp_sync_steps_total")
            for t, f in zip(texts, first, strict=True)
        ):
            return texts
        return None

    later = wait_for("ddp_allreduce_bytes_total growing on both ranks", grown, timeout=300)

    # `ddpjob top` reads the same endpoints through the apiserver's pod proxy: each rank's row, with
    # the steps its own endpoint counts (at least those of the reads above: they only grow).
    def top_rows() -> dict[str, list[str]] | None:
        shown = subprocess.run(
            [sys.executable, "-m", "ddp_operator", "top", job, "--once", "-n", namespace,
             "--kubeconfig", str(cluster.kubeconfig)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        lines = shown.stdout.splitlines()
        header = next(
            (i for i, line in enumerate(lines) if line.split()[:3] == ["attempt", "rank", "pod"]), None
        )
        if shown.returncode != 0 or header is None:
            return None
        rows = {
            cells[2]: cells for cells in (line.split() for line in lines[header + 2 :]) if len(cells) >= 5
        }
        return rows if len(rows) == 2 and all(cells[4] != "-" for cells in rows.values()) else None

    rows = wait_for("`ddpjob top --once` to show both ranks' figures", top_rows, timeout=120)
    assert set(rows) == {p["metadata"]["name"] for p in pods}, rows
    for pod, text in zip(pods, later, strict=True):
        cells = rows[pod["metadata"]["name"]]
        assert cells[1] == pod["metadata"]["labels"]["ddp.dev/rank"], cells
        assert float(cells[4]) >= counter(text, "ddp_sync_steps_total"), (cells, "steps only grow")
    # Per sync step between two reads (the first step's one-off traffic stays out of it): every rank
    # reduces the same buckets, so the same payload.
    per_step = [
        (counter(t, "ddp_allreduce_bytes_total") - counter(f, "ddp_allreduce_bytes_total"))
        / (counter(t, "ddp_sync_steps_total") - counter(f, "ddp_sync_steps_total"))
        for t, f in zip(later, first, strict=True)
    ]
    assert per_step[0] > 0
    assert per_step[0] == pytest.approx(per_step[1], rel=1e-9), f"bytes per sync step differ: {per_step}"

    status = wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
    TIMINGS.record("apply_to_succeeded_s", time.monotonic() - applied)
    assert status.get("worldSize") == 2
    logs = rank0_log.text()
    final = status_lines(logs, "final")
    assert final, f"rank 0's log has no `final accuracy=...` line:\n{logs[-2000:]}"
    assert 0.5 < float(final[-1]["accuracy"]) <= 1.0, final

    # The namespace enforces "restricted": the rank pods were admitted, a privileged pod is not.
    refused = cluster.kubectl_run(
        "run", "privileged", "-n", namespace, f"--image={TRAINER_IMAGE}", "--restart=Never",
        "--overrides", json.dumps({"spec": {"containers": [{"name": "privileged", "image": TRAINER_IMAGE,
                                                            "securityContext": {"privileged": True}}]}}),
        check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr


LIST_CHECKPOINT_DIR = (
    "import os; root = os.environ['DDP_CHECKPOINT_DIR']; "
    "print('\\n'.join(sorted(f for _, _, files in os.walk(root) for f in files)))"
)


def checkpoint_files(cluster: Cluster, namespace: str, job: str, rank0: str) -> list[str]:
    """The files on the job's checkpoint volume: read on its hostPath volume on the local node; through
    rank 0, which mounts it, elsewhere (a provisioned volume may live on another machine)."""
    if not is_local_node(cluster):
        listed = cluster.kubectl_run(
            "exec", "-n", namespace, rank0, "-c", "trainer", "--", "python3", "-c", LIST_CHECKPOINT_DIR,
            check=False,
        )  # fmt: skip
        return listed.stdout.split() if listed.returncode == 0 else []
    claim = get_json(cluster, "pvc", f"{job}-checkpoint", "-n", namespace)
    volume = claim["spec"].get("volumeName")
    if not volume:
        return []
    path = Path(get_json(cluster, "pv", volume)["spec"]["hostPath"]["path"])
    return sorted(p.name for p in path.rglob("*") if p.is_file())


def test_deleting_a_rank_pod_restarts_the_gang_which_resumes_from_the_checkpoint(
    cluster: Cluster, checkpoint_storage: str | None, operator_release: str, restricted_namespace: str
) -> None:
    namespace = restricted_namespace
    job = "digits-restart"
    manifest = digits_job(
        job, "--throttle-ms", "60", "--checkpoint-every", "20", storage_class=checkpoint_storage
    )
    # The whole-gang path (the in-place ones are the kind suite's: test_kind.py).
    manifest["spec"]["runPolicy"]["restartMode"] = "Recreate"
    cluster.apply_json(manifest, "-n", namespace)
    pods = wait_for("both ranks Running", lambda: running_ranks(cluster, namespace, job, 0, 2), timeout=600)
    rank0 = next(p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "0")
    wait_for(
        "a checkpoint on the volume", lambda: checkpoint_files(cluster, namespace, job, rank0), timeout=300
    )
    victim = next(p["metadata"]["name"] for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "1")
    cluster.kubectl_run("delete", "pod", victim, "-n", namespace, "--wait=false")

    # The whole gang restarts as attempt 1; rank 0 resumes from the newest checkpoint.
    restarted = wait_for(
        "attempt 1 Running", lambda: running_ranks(cluster, namespace, job, 1, 2), timeout=600
    )
    rank0 = next(p["metadata"]["name"] for p in restarted if p["metadata"]["labels"]["ddp.dev/rank"] == "0")
    rank0_log = LogFollower(cluster, namespace, rank0)
    status = wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
    assert status.get("restarts", 0) >= 1, status
    assert status.get("attempt") == 1, status
    logs = rank0_log.text()
    resumed = status_lines(logs, "resumed")
    assert resumed and int(resumed[0]["step"]) > 0, f"attempt 1 did not resume:\n{logs[-2000:]}"
    assert status_lines(logs, "final"), logs[-2000:]


@pytest.mark.kind_suite
def test_a_rank_exiting_1_fails_the_job_with_the_reason(
    cluster: Cluster, checkpoint_storage: str | None, operator_release: str, restricted_namespace: str
) -> None:
    namespace = restricted_namespace
    job = "digits-crash"
    cluster.apply_json(
        digits_job(job, "--inject-fault", "1:step=3:exit=1", storage_class=checkpoint_storage),
        "-n",
        namespace,
    )
    status = wait_phase(cluster, namespace, job, "Failed", timeout=600)
    failed = [
        c for c in status.get("conditions", []) if c.get("type") == "Failed" and c.get("status") == "True"
    ]
    assert failed and failed[0]["reason"] == "ExitCode", status
    assert "rank 1 exited with code 1" in failed[0]["message"], failed[0]
    assert status.get("restarts", 0) == 0, status


def cpu_resized(cluster: Cluster, namespace: str, pod: str, cpu: str) -> dict[str, Any] | None:
    """The pod once its trainer container runs under the CPU limit ``cpu`` (the kubelet applied it)."""
    found = get_json(cluster, "pod", pod, "-n", namespace)
    for status in found["status"].get("containerStatuses", []):
        limits = (status.get("resources") or {}).get("limits") or {}
        if status["name"] == "trainer" and limits.get("cpu") == cpu:
            return dict(found)
    return None


def holds(what: str, probe: Callable[[], object], seconds: float, interval: float = 2.0) -> None:
    """``probe`` stays true for ``seconds``: a promise that something is not done for a time the
    contract names (a policy's window), where no event marks the time's end."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not probe():
            raise AssertionError(f"no longer true: {what}")
        time.sleep(interval)


# Report's thresholds for the straggler test: the smallest the CRD takes, so the time a Replace would
# have acted by is the shortest.
REPORT_SUSTAINED_SECONDS: Final = 60
REPORT_POLICY: Final = {
    "action": "Report",
    "slowdownPercent": 150,
    "sustainedSeconds": REPORT_SUSTAINED_SECONDS,
}


@pytest.mark.kind_suite
def test_a_rank_pod_slowed_by_its_cpu_limit_is_named_the_straggler(
    cluster: Cluster, checkpoint_storage: str | None, operator_release: str, restricted_namespace: str
) -> None:
    """Both ranks train under a CPU limit of a whole CPU; then rank 1's pod is resized in place to 50m,
    as a pod whose node or limit starves it: its gloo threads wait for a CPU inside the collectives and
    rank 0 names it (docs/metrics.md); the operator puts it in status.straggler with its pod and node
    once it stays above the threshold for the window, with one Straggler Event. `stragglerPolicy:
    Report` (the default) does nothing else: past the time the same thresholds under Replace would have
    replaced the pod, every pod is the one the job started with."""
    namespace = restricted_namespace
    job = "digits-straggler"
    manifest = digits_job(job, "--epochs", "1000", "--throttle-ms", "20", storage_class=checkpoint_storage)
    trainer = manifest["spec"]["template"]["spec"]["containers"][0]
    trainer["resources"].setdefault("limits", {})["cpu"] = "1"
    manifest["spec"]["runPolicy"] = {
        **(manifest["spec"].get("runPolicy") or {}),
        "stragglerPolicy": REPORT_POLICY,
    }
    cluster.apply_json(manifest, "-n", namespace)
    pods = wait_for("both ranks Running", lambda: running_ranks(cluster, namespace, job, 0, 2), timeout=600)
    rank0 = next(p for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "0")
    victim = next(p for p in pods if p["metadata"]["labels"]["ddp.dev/rank"] == "1")["metadata"]["name"]

    def exchanged() -> str | None:
        text = read_metrics(cluster, rank0)
        return (
            text
            if text and "ddp_straggler_rank" in text and counter(text, "ddp_sync_steps_total") > 20
            else None
        )

    wait_for("rank 0's exchange under way", exchanged, timeout=300)
    assert "straggler" not in job_status(cluster, namespace, job), "named before any rank was slowed"
    resize = {"spec": {"containers": [{"name": "trainer", "resources": {
        "requests": {"cpu": "50m"}, "limits": {"cpu": "50m"}}}]}}  # fmt: skip
    cluster.kubectl_run(
        "patch", "pod", victim, "-n", namespace, "--subresource", "resize", "-p", json.dumps(resize)
    )
    resized = wait_for("rank 1 resized to 50m", lambda: cpu_resized(cluster, namespace, victim, "50m"), 120)

    def named() -> dict[str, Any] | None:
        straggler = job_status(cluster, namespace, job).get("straggler")
        return straggler if straggler and straggler.get("rank") == 1 else None

    try:
        straggler = wait_for("status.straggler naming rank 1", named, timeout=420)
    except AssertionError as error:
        raise AssertionError(f"{error}\nrank 0:\n{read_metrics(cluster, rank0)}\n"
                             f"{diagnostics(cluster, namespace, job)}") from None  # fmt: skip
    assert straggler["pod"] == victim, straggler
    assert straggler["node"] == resized["spec"]["nodeName"], straggler
    assert float(straggler["slowdown"]) >= 1.5, straggler
    # Where a starved rank loses its time depends on where it wanted a CPU when the limit bit.
    assert straggler.get("phase") in ("data", "compute", "communication"), straggler
    events = get_json(cluster, "events", "-n", namespace, "--field-selector", f"involvedObject.name={job}")
    assert [e for e in events["items"] if e["reason"] == "Straggler" and victim in e["message"]], events
    # Report names the straggler and does nothing else, also once it has been slow past
    # sustainedSeconds (measured from before it was named): a few of the operator's looks more.
    started = {p["metadata"]["uid"] for p in pods}

    def only_named() -> bool:
        status = job_status(cluster, namespace, job)
        replaced = "stragglerReplacements" in status or "podReplacements" in status
        kept = {p["metadata"]["uid"] for p in rank_pods(cluster, namespace, job)} == started
        return kept and not replaced and (status.get("straggler") or {}).get("rank") == 1

    holds("rank 1 named and no pod replaced", only_named, REPORT_SUSTAINED_SECONDS + 20)
    cluster.kubectl_run("delete", "ddpjob", job, "-n", namespace, "--wait=false")


# ---- the job's NetworkPolicy, enforced ---------------------------------------------------------------

# Connects to each host:port given as an argument; prints what happened to each: "open" or the error.
PROBE_SCRIPT = """
import json, socket, sys
results = {}
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=4).close()
        results[target] = "open"
    except OSError as error:
        results[target] = type(error).__name__
print("PROBE " + json.dumps(results))
"""
# The TCP ports a pod listens on from outside itself, read in its own network namespace: listening
# sockets (state 0A) not bound to loopback (127.x is stored little-endian, so its hex ends in 7F).
LISTENING_SCRIPT = """
ports = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        rows = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for row in rows:
        fields = row.split()
        address, port = fields[1].rsplit(":", 1)
        loopback = address.endswith("7F") if len(address) == 8 else address == "0" * 24 + "01000000"
        if fields[3] == "0A" and not loopback:
            ports.add(int(port, 16))
print(" ".join(str(p) for p in sorted(ports)))
"""
# Where the chart lets Prometheus scrape from by default (rankMetrics.allowFrom).
PROMETHEUS_NAMESPACE = "monitoring"
RENDEZVOUS_PORT = 29500
RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
# A port served by the deny-all check's server pod.
CHECK_PORT = 8080


def trainer_pod(
    namespace: str, name: str, command: list[str], labels: dict[str, str] | None = None, **container: Any
) -> dict[str, Any]:
    """A pod of the trainer image (it has Python) under Pod Security "restricted", with no API token."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "probe",
                    "image": TRAINER_IMAGE,
                    "command": command,
                    "securityContext": RESTRICTED_CONTAINER,
                    **container,
                }
            ],
        },
    }


def sleeper(namespace: str, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod that only waits, to probe from with `kubectl exec` (probe_from_running, container `probe`)."""
    return trainer_pod(namespace, name, ["python3", "-c", "import time; time.sleep(3600)"], labels)


def wait_running(cluster: Cluster, namespace: str, names: list[str]) -> None:
    for name in names:
        wait_for(
            f"pod {namespace}/{name} Running",
            lambda n=name: get_json(cluster, "pod", n, "-n", namespace)["status"].get("phase") == "Running",
            timeout=pod_start_timeout(cluster),
        )


def parse_probe(output: str) -> dict[str, str]:
    line = next(line for line in output.splitlines() if line.startswith("PROBE "))
    results: dict[str, str] = json.loads(line.removeprefix("PROBE "))
    return results


def probe_from_running(
    cluster: Cluster, namespace: str, pod: str, targets: list[str], container: str = "trainer"
) -> dict[str, str]:
    """Connect to `targets` from inside a running pod (kubectl exec; a rank's container is `trainer`)."""
    answer = cluster.kubectl_run(
        "exec",
        "-n",
        namespace,
        pod,
        "-c",
        container,
        "--",
        "python3",
        "-c",
        PROBE_SCRIPT,
        *targets,
        timeout=60,
    )
    return parse_probe(answer.stdout)


def peer_ports(cluster: Cluster, namespace: str, pod: str) -> list[int]:
    """The ports a rank listens on besides /metrics and the rendezvous store: gloo's pairs."""
    answer = cluster.kubectl_run(
        "exec", "-n", namespace, pod, "-c", "trainer", "--", "python3", "-c", LISTENING_SCRIPT, timeout=60
    )
    return [int(p) for p in answer.stdout.split() if int(p) not in (METRICS_PORT, RENDEZVOUS_PORT)]


def pod_ready(cluster: Cluster, namespace: str, name: str) -> bool:
    conditions = get_json(cluster, "pod", name, "-n", namespace)["status"].get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def assert_network_policies_enforced(cluster: Cluster, enforcer: str) -> None:
    """Before any "refused" below is believed: in a namespace of its own, a deny-all ingress policy
    refuses a client's connection to a server, and deleting the policy lets the same connection
    through. The server is created after the policy, with a readiness probe: it turns Ready only if
    the kubelet's probes pass the policy, as they must (docs/security.md)."""
    namespace = f"netpol-check-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(namespace)
    try:
        deny_all = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "deny-all", "namespace": namespace},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        }
        cluster.apply_json(deny_all)
        server = trainer_pod(
            namespace, "server", ["python3", "-m", "http.server", str(CHECK_PORT), "--directory", "/tmp"],
            readinessProbe={"tcpSocket": {"port": CHECK_PORT}, "periodSeconds": 1},
        )  # fmt: skip
        cluster.apply_json(
            {"apiVersion": "v1", "kind": "List", "items": [server, sleeper(namespace, "client")]}
        )
        wait_for(
            "the check's server Ready under a deny-all policy (the kubelet's probe admitted)",
            lambda: pod_ready(cluster, namespace, "server"),
            timeout=pod_start_timeout(cluster),
        )
        wait_running(cluster, namespace, ["client"])
        target = f"{get_json(cluster, 'pod', 'server', '-n', namespace)['status']['podIP']}:{CHECK_PORT}"

        def result() -> str:
            return probe_from_running(cluster, namespace, "client", [target], container="probe")[target]

        seen: list[str] = []

        def refusal() -> str | None:
            seen.append(result())
            return seen[-1] if seen[-1] != "open" else None

        try:
            refused = wait_for(f"{enforcer} refusing under deny-all", refusal, timeout=60, interval=2)
        except AssertionError:
            raise AssertionError(
                f"nothing enforces NetworkPolicies here ({enforcer}): under a deny-all policy, the client "
                f"reached {target} in each of {len(seen)} tries over 60 s"
            ) from None
        cluster.kubectl_run("delete", "networkpolicy", "deny-all", "-n", namespace)
        wait_for(
            f"the same connection open once the policy is gone ({enforcer}; it was {refused})",
            lambda: result() == "open",
            timeout=60,
            interval=2,
        )
        _progress(
            f"NetworkPolicies are enforced here ({enforcer}): refused ({refused}) under deny-all, open without"
        )
    finally:
        cluster.kubectl_run("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_jobs_network_policy_fences_its_ranks(
    cluster: Cluster,
    checkpoint_storage: str | None,
    operator_release: str,
    restricted_namespace: str,
    network_policy_enforcer: str,
) -> None:
    """Rank ports are unauthenticated: only the job's own pods reach them, Prometheus's namespace and the
    operator reach /metrics, and the kubelet's probes pass; a pod of another job, of another namespace,
    or of the job's namespace but of no job reaches nothing. A job with `networkPolicy.enabled: false`
    beside it gets no policy, and the same probes reach its ports. The fenced job trains to its accuracy.

    A refusal proves something only when the port listens and the enforcer knows the prober. So the
    probing pods start before the jobs and probe with `kubectl exec`; the one in Prometheus's namespace
    must reach /metrics (retried while the enforcer catches up with new pods) before anyone's refusal
    counts, the ports come from the running ranks, and the ranks reach them after the refusals."""
    namespace = restricted_namespace
    job, open_job = "digits-fenced", "digits-open"
    outsider = f"outsider-{uuid.uuid4().hex[:6]}"
    cluster.create_namespace(outsider)
    created_monitoring = (
        cluster.kubectl_run("get", "namespace", PROMETHEUS_NAMESPACE, check=False).returncode != 0
    )
    if created_monitoring:
        cluster.create_namespace(PROMETHEUS_NAMESPACE)  # waits for its default ServiceAccount
    try:
        probers = {outsider: "intruder", namespace: "neighbour", PROMETHEUS_NAMESPACE: "ddp-e2e-prober"}
        for ns, name in probers.items():
            cluster.apply_json(sleeper(ns, name))
        # Long enough (~100 s of steps at least) that the ranks still listen when the last probe runs.
        fenced = digits_job(job, "--throttle-ms", "200", "--epochs", "20", storage_class=checkpoint_storage)
        # The kubelet probes each rank's /metrics port: the rank turns Ready only if the policy admits it.
        trainer = fenced["spec"]["template"]["spec"]["containers"][0]
        trainer["readinessProbe"] = {"tcpSocket": {"port": METRICS_PORT}, "periodSeconds": 2}
        # Beside it, a job without a policy that trains until it is deleted (CPU requests that still fit).
        unfenced = digits_job(
            open_job, "--throttle-ms", "150", "--epochs", "1000", storage_class=checkpoint_storage, cpu="10m"
        )
        unfenced["spec"]["networkPolicy"] = {"enabled": False}
        for manifest in (fenced, unfenced):
            cluster.apply_json(manifest, "-n", namespace)
        for ns, name in probers.items():
            wait_running(cluster, ns, [name])
        pods = wait_for(
            "both ranks Running", lambda: running_ranks(cluster, namespace, job, 0, 2), timeout=600
        )
        others = wait_for(
            f"both ranks of {open_job} Running",
            lambda: running_ranks(cluster, namespace, open_job, 0, 2),
            timeout=600,
        )
        policy = get_json(cluster, "networkpolicy", job, "-n", namespace)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        no_policy = cluster.kubectl_run("get", "networkpolicy", open_job, "-n", namespace, check=False)
        assert no_policy.returncode != 0 and "NotFound" in no_policy.stderr, no_policy.stdout
        by_rank = {p["metadata"]["labels"]["ddp.dev/rank"]: p for p in pods}
        rank0, rank1 = by_rank["0"], by_rank["1"]
        other0, other1 = ({p["metadata"]["labels"]["ddp.dev/rank"]: p for p in others}[r] for r in "01")
        rank0_log = LogFollower(cluster, namespace, rank0["metadata"]["name"])
        # Training has started once the ranks count sync steps: gloo's pairs are listening by then. (This
        # machine reads /metrics as the node, which the policy admits: docs/security.md.)
        wait_for(
            "all four ranks past their first sync step",
            lambda: all(
                (t := read_metrics(cluster, p)) and counter(t, "ddp_sync_steps_total") > 0
                for p in pods + others
            ),
            timeout=300,
        )
        # The kubelet's readiness probes pass the policy; so does the operator, reading rank 0's /metrics
        # (the chart adds its pods to --metrics-allow-from) for status.progress.
        for name in (p["metadata"]["name"] for p in pods):
            wait_for(
                f"{name} Ready (its readiness probe admitted)",
                lambda n=name: pod_ready(cluster, namespace, n),
            )
        wait_for(
            f"status.progress of {job} (the operator reading rank 0's /metrics through the policy)",
            lambda: job_status(cluster, namespace, job).get("progress"),
            timeout=120,
        )
        ip0, ip1 = rank0["status"]["podIP"], rank1["status"]["podIP"]
        peers = peer_ports(cluster, namespace, rank1["metadata"]["name"])
        other_peers = peer_ports(cluster, namespace, other1["metadata"]["name"])
        assert peers and other_peers, f"rank 1 listens on no collective port: {peers}, {other_peers}"
        # The c10d store listens in each job's rendezvous pod (docs/restarts.md), which the policy fences
        # like a rank.
        store_ip, other_store_ip = (
            get_json(cluster, "pod", f"{name}-rdzv-0", "-n", namespace)["status"]["podIP"]
            for name in (job, open_job)
        )
        rendezvous, peer, metrics0 = (
            f"{store_ip}:{RENDEZVOUS_PORT}",
            f"{ip1}:{peers[0]}",
            f"{ip0}:{METRICS_PORT}",
        )
        fenced_ports = [rendezvous, peer, metrics0]
        open_ports = [
            f"{other_store_ip}:{RENDEZVOUS_PORT}",
            f"{other1['status']['podIP']}:{other_peers[0]}",
        ]

        def probe(ns: str, targets: list[str]) -> dict[str, str]:
            return probe_from_running(cluster, ns, probers[ns], targets, container="probe")

        # Prometheus's namespace reaches /metrics (a scraper retries; so does this, while the enforcer
        # adds the prober to the policy's peers), and nothing else.
        wait_for(
            f"a pod of {PROMETHEUS_NAMESPACE} reaching {metrics0}",
            lambda: probe(PROMETHEUS_NAMESPACE, [metrics0])[metrics0] == "open",
            timeout=60,
            interval=2,
        )
        prometheus = probe(PROMETHEUS_NAMESPACE, fenced_ports)
        # Refused: a pod of another namespace, a pod of the job's namespace that is no rank, and a rank of
        # the other job. The same pods reach the unfenced job's store and collective port.
        outside = probe(outsider, fenced_ports + open_ports)
        neighbour = probe(namespace, fenced_ports + open_ports)
        other_job = probe_from_running(cluster, namespace, other0["metadata"]["name"], fenced_ports)
        # Admitted, after the refusals above: the job's own ranks, to the store and a peer's port.
        inside = probe_from_running(cluster, namespace, rank1["metadata"]["name"], [rendezvous])
        inside |= probe_from_running(cluster, namespace, rank0["metadata"]["name"], [peer])
        _progress(f"fenced {fenced_ports}, unfenced {open_ports}; from {PROMETHEUS_NAMESPACE} {prometheus}; "
                  f"from another namespace {outside}; from the job's namespace {neighbour}; "
                  f"from another job {other_job}; from the job's own ranks {inside}")  # fmt: skip
        assert prometheus[metrics0] == "open", prometheus
        assert prometheus[rendezvous] != "open" and prometheus[peer] != "open", prometheus
        for source, results in (("another namespace", outside), ("the job's namespace", neighbour),
                                ("another job", other_job)):  # fmt: skip
            assert all(results[t] != "open" for t in fenced_ports), (source, results)
        for source, results in (("another namespace", outside), ("the job's namespace", neighbour)):
            assert all(results[t] == "open" for t in open_ports), (source, results)
        assert inside == {rendezvous: "open", peer: "open"}, inside

        cluster.kubectl_run("delete", "ddpjob", open_job, "-n", namespace, "--wait=false")
        # The policy costs the job nothing: it trains to its accuracy.
        wait_phase(cluster, namespace, job, "Succeeded", timeout=900)
        final = status_lines(rank0_log.text(), "final")
        assert final and 0.5 < float(final[-1]["accuracy"]) <= 1.0, final
    finally:
        cluster.kubectl_run("delete", "ddpjob", open_job, "-n", namespace, "--wait=false", check=False)
        cluster.kubectl_run("delete", "namespace", outsider, "--wait=false", check=False)
        if created_monitoring:
            cluster.kubectl_run("delete", "namespace", PROMETHEUS_NAMESPACE, "--wait=false", check=False)
        else:
            cluster.kubectl_run(
                "delete", "pod", "ddp-e2e-prober", "-n", PROMETHEUS_NAMESPACE, "--wait=false", check=False
            )
