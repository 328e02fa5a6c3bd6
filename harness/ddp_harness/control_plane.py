"""The local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok,
started as processes on this machine, and the handle clients use to reach them (with what a kubelet
would serve: ``LocalCluster.write_pod_log`` gives a fake pod a log, which kwok serves, kwok_logs.py).

Every component runs in its own process group, listens on 127.0.0.1 on a free port, and logs to its
own file. What was started is recorded in the state directory's cluster.json, which `status` and
`down` read, so they work from another process. cluster.py puts this and the real node together."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_harness import kwok_logs, manifests, processes
from ddp_harness.kwok_stages import NODE_LOST_ANNOTATION, ReportLatency, kwok_stages
from ddp_harness.manifests import Layout, NodeShape, Ports
from ddp_harness.pki import CLIENT_IDENTITIES, generate_pki
from ddp_harness.processes import LOCALHOST, ClusterError, ComponentsRecord, ComponentState, Progress
from ddp_operator.local.ports import free_ports

# Start order.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
_COMMANDS: dict[str, Callable[[Path, Layout, Ports], list[str]]] = {
    "etcd": manifests.etcd_command,
    "kube-apiserver": manifests.apiserver_command,
    "kube-controller-manager": manifests.controller_manager_command,
    "kube-scheduler": manifests.scheduler_command,
    "kwok": manifests.kwok_command,
}
# Stopped in waves: the apiserver's clients, then the apiserver, then etcd (an apiserver whose etcd is
# gone, or with clients still watching, takes long to shut down).
STOP_WAVES = (("kwok", "kube-scheduler", "kube-controller-manager"), ("kube-apiserver",), ("etcd",))


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr or ''}".rstrip()


@dataclass(frozen=True)
class ClusterState(ComponentsRecord):
    state_dir: str
    bin_dir: str
    kubeconfig: str
    audit_log: str
    apiserver: str
    nodes: list[str]
    components: list[ComponentState]


# ---- the API, over plain HTTPS with the admin certificate -------------------------------------------


class ApiClient:
    """Just enough of a Kubernetes client for bringing the cluster up (no dependency on the kubernetes
    package, which the operator extra brings)."""

    def __init__(self, server: str, layout: Layout) -> None:
        self.server = server
        self._ctx = ssl.create_default_context(cafile=str(layout.cert("ca")))
        self._ctx.load_cert_chain(str(layout.cert("admin")), str(layout.key("admin")))

    def request(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
        status, raw = self._send(method, path, body, timeout)
        if isinstance(raw, str):
            return status, raw
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def read_text(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        """GET a path whose answer is text (a pod's log): the status and the body as it came."""
        status, raw = self._send("GET", path, None, timeout)
        return status, raw if isinstance(raw, str) else raw.decode(errors="replace")

    def _send(self, method: str, path: str, body: Any, timeout: float) -> tuple[int, bytes | str]:
        """The status and the raw body; (0, the error) when the apiserver could not be reached."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except (urllib.error.URLError, OSError) as exc:  # not listening yet, reset, timed out
            return 0, str(exc)


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    return processes.http_status(url, ctx) == 200


def _append(path: Path, data: str) -> None:
    """Append in as few writes as the OS allows, so a concurrent reader rarely sees half a line (a
    follow stream waits for the rest of a line; a plain read would return the half)."""
    payload = data.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while payload:
            payload = payload[os.write(fd, payload) :]
    finally:
        os.close(fd)


def _version_of(obj: dict[str, Any]) -> dict[str, str]:
    return {"resourceVersion": obj["metadata"]["resourceVersion"]}


def _install_kwok_crds(api: ApiClient, deadline: float, watch: Sequence[ComponentState]) -> None:
    """Serve the CRD of kwok's Logs (pod logs, kwok_logs.py) before kwok starts: kwok watches those
    objects from its start, and an informer whose first list failed backs off for a while."""
    crd = kwok_logs.logs_crd()
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    code, answer = api.request("POST", crds, crd)
    if code not in (201, 409):
        raise ClusterError(f"creating the CRD {kwok_logs.LOGS_CRD_NAME} failed ({code}): {answer}")

    def established() -> bool:
        code, found = api.request("GET", f"{crds}/{kwok_logs.LOGS_CRD_NAME}")
        conditions = (found.get("status") or {}).get("conditions") or [] if code == 200 else []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    processes.wait_for(f"the CRD {kwok_logs.LOGS_CRD_NAME} to be established", established, deadline, watch)


# ---- the handle --------------------------------------------------------------------------------------


class LocalCluster:
    """A running local control plane: paths for clients, and kubectl bound to its kubeconfig."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    @property
    def state_dir(self) -> Path:
        return Path(self.state.state_dir)

    @property
    def bin_dir(self) -> Path:
        return Path(self.state.bin_dir)

    @property
    def kubeconfig(self) -> Path:
        return Path(self.state.kubeconfig)

    @property
    def audit_log(self) -> Path:
        return Path(self.state.audit_log)

    @property
    def kubectl(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def helm(self) -> Path:
        return self.bin_dir / "helm"

    @property
    def layout(self) -> Layout:
        return Layout(self.state_dir)

    @property
    def ca_cert(self) -> Path:
        return self.layout.cert("ca")

    @property
    def ca_key(self) -> Path:
        return self.layout.key("ca")

    @property
    def apiserver(self) -> str:
        return self.state.apiserver

    @property
    def node_names(self) -> list[str]:
        return list(self.state.nodes)

    def env(self) -> dict[str, str]:
        """os.environ with KUBECONFIG pointing at this cluster and its binaries first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def wait_established(self, *crds: str, timeout: float = 60.0) -> None:
        """Until each CRD (by name) is Established. `kubectl wait` fails at once, rather than waiting,
        when it reads a CRD before the apiserver wrote any condition on it ("accessor error: <nil>"): seen
        on a loaded machine right after an apply. That read is retried, like one of a CRD not there yet."""
        deadline = time.monotonic() + timeout
        targets = [f"crd/{name}" for name in crds]
        while True:
            result = self.kubectl_run(
                "wait", "--for=condition=Established", "--timeout=10s", *targets, check=False
            )
            if result.returncode == 0:
                return
            early = "accessor error" in result.stderr or "NotFound" in result.stderr
            if not early or time.monotonic() > deadline:
                raise KubectlError(result.returncode, result.args, result.stdout, result.stderr)
            time.sleep(0.5)

    def kubectl_run(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster; with check, a non-zero exit raises KubectlError (stderr in
        its message)."""
        cmd = [str(self.kubectl), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def helm_run(
        self, *args: str, check: bool = True, timeout: float = 120.0
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.helm), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env=self.env()
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def get_json(self, *args: str) -> Any:
        """`kubectl get ARGS -o json`, parsed."""
        return json.loads(self.kubectl_run("get", *args, "-o", "json").stdout)

    def apply_json(self, obj: Any, *args: str) -> subprocess.CompletedProcess[str]:
        """`kubectl apply -f -` with the object (or a v1 List) given as a dict."""
        return self.kubectl_run("apply", "-f", "-", *args, input=json.dumps(obj))

    def create_namespace(self, name: str, timeout_s: float = 30.0) -> None:
        """Create a namespace and wait for its default service account, without which the apiserver
        refuses pods (the controller-manager creates it a moment after the namespace)."""
        self.kubectl_run("create", "namespace", name)
        deadline = time.monotonic() + timeout_s
        while self.kubectl_run("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise ClusterError(f"namespace {name} has no default service account after {timeout_s} s")
            time.sleep(processes.POLL_S)

    def api(self) -> ApiClient:
        return ApiClient(self.apiserver, self.layout)

    # ---- what a kubelet serves ---------------------------------------------------------------------

    def write_pod_log(self, namespace: str, pod: str, text: str, timeout_s: float = 30.0) -> Path:
        """The pod's containers print ``text``: it is appended to the pod's log (every container shares
        it) as stdout lines stamped now, a missing final newline implied ("" appends nothing), and every
        log read through the apiserver returns it from then on, follow streams already open included.

        The first write for a pod (by UID) makes the pod's Logs object (kwok_logs.py) and returns once
        kwok serves the file, which needs the pod bound to a fake node; later writes only append. Raises
        ClusterError when the pod does not exist or kwok does not serve its log within ``timeout_s``.
        Returns the log file."""
        api = self.api()
        code, found = api.request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}")
        if code != 200:
            raise ClusterError(f"no pod {namespace}/{pod} to write a log for ({code}): {found}")
        uid = found["metadata"]["uid"]
        log_file = kwok_logs.pod_log_file(self.layout.pod_logs_dir, namespace, pod, uid)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        _append(log_file, kwok_logs.cri_records(text))
        code, logs = api.request("GET", kwok_logs.logs_path(namespace, pod))
        if code != 200 or kwok_logs.logs_target(logs) != (uid, str(log_file)):
            self._serve_pod_log(api, found, log_file, logs if code == 200 else None, timeout_s)
        return log_file

    def _serve_pod_log(
        self, api: ApiClient, pod: dict[str, Any], log_file: Path, stale: Any, timeout_s: float
    ) -> None:
        """Point kwok at the pod's log file (replacing the Logs object of an earlier pod of the same
        name) and wait until a read through the apiserver returns the file's content."""
        meta = pod["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        logs = kwok_logs.pod_logs(namespace, name, meta["uid"], log_file)
        code = 404
        if stale is not None:
            replacing = {**logs, "metadata": {**logs["metadata"], **_version_of(stale)}}
            code, answer = api.request("PUT", kwok_logs.logs_path(namespace, name), replacing)
        if code == 404:  # none yet, or the garbage collector took the earlier pod's meanwhile
            code, answer = api.request("POST", kwok_logs.logs_path(namespace), logs)
        if code not in (200, 201):
            raise ClusterError(
                f"could not point kwok at the log of pod {namespace}/{name} ({code}): {answer}"
            )
        container = pod["spec"]["containers"][0]["name"]
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/log?container={container}"
        expected = kwok_logs.log_text(log_file.read_bytes().decode())
        last: list[tuple[int, str]] = []

        def served() -> bool:
            last[:] = [api.read_text(path)]
            return last[0] == (200, expected)

        kwok = [c for c in self.state.components if c.name == "kwok"]
        try:
            processes.wait_for(
                f"kwok to serve the log of pod {namespace}/{name}", served, time.monotonic() + timeout_s, kwok
            )
        except ClusterError as exc:
            raise ClusterError(f"{exc}\nlast read (a pod bound to no node reads empty): {last}") from None

    def running_components(self) -> list[str]:
        return [c.name for c in self.state.components if processes.is_running(c)]

    # ---- faults a real cluster has ----------------------------------------------------------------

    def _mark_lost(self, node: str, lost: bool) -> None:
        mark = f"{NODE_LOST_ANNOTATION}=true" if lost else f"{NODE_LOST_ANNOTATION}-"
        if not lost:
            self.kubectl_run("annotate", "node", node, "--overwrite", mark)
        # Pods before the node when losing it: the kubelet goes silent before its node is noticed, so
        # no eviction can reach a pod that kwok would still confirm.
        pods = self.get_json("pods", "-A", "--field-selector", f"spec.nodeName={node}")["items"]
        for pod in pods:
            meta = pod["metadata"]
            self.kubectl_run(
                "annotate", "pod", meta["name"], "-n", meta["namespace"], "--overwrite", mark, check=False
            )
        if lost:
            self.kubectl_run("annotate", "node", node, "--overwrite", mark)

    def lose_node(self, node: str) -> None:
        """The node's kubelet goes silent: the node turns Unknown (then tainted, its pods evicted), and
        nothing on it reports again; a pod deleted there stays Terminating until ``restore_node``."""
        self._mark_lost(node, True)

    def restore_node(self, node: str) -> None:
        """The kubelet is back: the node turns Ready and confirms the deletions it missed."""
        self._mark_lost(node, False)

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision (as the apiserver does every 5 minutes):
        a watch that resumes from an older resourceVersion then gets 410 Gone. Returns the revision."""
        etcd = next(c for c in self.state.components if c.name == "etcd")
        base = f"http://{LOCALHOST}:{etcd.ports['client']}/v3/kv"

        def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            request = urllib.request.Request(
                f"{base}/{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                decoded: dict[str, Any] = json.loads(answer.read() or b"{}")
                return decoded

        # The key "/" (base64 "Lw=="): any read answers with the store's current revision.
        revision = int(post("range", {"key": "Lw==", "limit": 1})["header"]["revision"])
        post("compaction", {"revision": revision, "physical": True})
        return revision

    def restart_component(self, name: str, timeout_s: float = 60.0) -> ComponentState:
        """SIGKILL one component and start it again with the same command (an apiserver crash, say)."""
        old = next(c for c in self.state.components if c.name == name)
        processes.kill(old)
        new = processes.spawn(old.name, old.command, Path(old.log), old.ports, self.state_dir)
        self.state = dataclasses.replace(
            self.state, components=[new if c.name == name else c for c in self.state.components]
        )
        self.state.save(self.layout.state_file)
        if name == "kube-apiserver":
            processes.wait_for(
                "kube-apiserver /readyz after its restart",
                lambda: self.api().request("GET", "/readyz")[0] == 200,
                time.monotonic() + timeout_s,
                [new],
            )
        return new


# ---- start / stop ------------------------------------------------------------------------------------


def read_state(state_dir: Path) -> ClusterState | None:
    return ClusterState.load(Layout(state_dir).state_file)


def _write_config(layout: Layout, ports: Ports, nodes: Sequence[str], latency: ReportLatency | None) -> None:
    server = manifests.apiserver_url(ports)
    ca = layout.cert("ca")
    processes.write_json(
        layout.kubeconfig,
        manifests.kubeconfig(server, ca, layout.cert("admin"), layout.key("admin"), "ddp-admin"),
    )
    for identity in CLIENT_IDENTITIES:
        if identity.name in COMPONENTS:
            config = manifests.kubeconfig(
                server, ca, layout.cert(identity.name), layout.key(identity.name), identity.user
            )
            processes.write_json(layout.component_kubeconfig(identity.name), config)
    layout.kubeconfig.chmod(0o600)
    processes.write_json(layout.audit_policy, manifests.audit_policy())
    # JSON is YAML: one document per Stage.
    stages = kwok_stages(nodes=nodes, latency=latency)
    layout.kwok_config.write_text("---\n".join(json.dumps(stage) + "\n" for stage in stages))


def _component_ports(name: str, ports: Ports) -> dict[str, int]:
    return {
        "etcd": {"client": ports.etcd_client, "peer": ports.etcd_peer},
        "kube-apiserver": {"https": ports.apiserver},
        "kube-controller-manager": {"https": ports.controller_manager},
        "kube-scheduler": {"https": ports.scheduler},
        "kwok": {"http": ports.kwok},
    }[name]


class _Starter:
    """Starts components one by one, recording each in the state file as soon as it runs, so a failed
    `up` can still be cleaned by `down`."""

    def __init__(
        self,
        layout: Layout,
        bin_dir: Path,
        ports: Ports,
        nodes: list[str],
        extra_flags: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.extra_flags = dict(extra_flags or {})
        self.layout = layout
        self.bin_dir = bin_dir
        self.ports = ports
        self.components: list[ComponentState] = []
        self.nodes = nodes

    def state(self) -> ClusterState:
        return ClusterState(
            state_dir=str(self.layout.state_dir),
            bin_dir=str(self.bin_dir),
            kubeconfig=str(self.layout.kubeconfig),
            audit_log=str(self.layout.audit_log),
            apiserver=manifests.apiserver_url(self.ports),
            nodes=list(self.nodes),
            components=list(self.components),
        )

    def save(self) -> None:
        self.state().save(self.layout.state_file)

    def start(self, name: str) -> ComponentState:
        command = [*_COMMANDS[name](self.bin_dir, self.layout, self.ports), *self.extra_flags.get(name, ())]
        component = processes.spawn(
            name,
            command,
            self.layout.log_file(name),
            _component_ports(name, self.ports),
            self.layout.state_dir,
        )
        self.components.append(component)
        self.save()
        return component


def start(
    layout: Layout,
    bin_dir: Path,
    node_count: int,
    node_shape: NodeShape,
    deadline: float,
    progress: Progress = lambda _: None,
    latency: ReportLatency | None = None,
    extra_flags: Mapping[str, Sequence[str]] | None = None,
) -> LocalCluster:
    """Start every component in an empty state directory, with node_count fake GPU nodes, and return
    the handle once all are healthy; on failure, stop what was started (logs stay) and raise."""
    started = time.monotonic()
    layout.log_dir.mkdir(parents=True, exist_ok=True)
    ports = Ports(*free_ports(6))
    nodes = [manifests.node_name(i) for i in range(node_count)]
    starter = _Starter(layout, bin_dir, ports, nodes, extra_flags)
    starter.save()  # from here on the directory is recognisably ours, for `down` and the next `up`
    generate_pki(layout)
    _write_config(layout, ports, nodes, latency)

    def step(message: str) -> None:
        progress(f"{message} ({time.monotonic() - started:.1f} s)")

    try:
        etcd = starter.start("etcd")
        etcd_url = f"http://{LOCALHOST}:{ports.etcd_client}/health"
        processes.wait_for("etcd", lambda: _http_ok(etcd_url), deadline, [etcd])
        step(f"etcd ready on {LOCALHOST}:{ports.etcd_client}")

        apiserver = starter.start("kube-apiserver")
        api = ApiClient(manifests.apiserver_url(ports), layout)
        processes.wait_for(
            "kube-apiserver /readyz",
            lambda: api.request("GET", "/readyz")[0] == 200,
            deadline,
            [etcd, apiserver],
        )
        step(f"kube-apiserver ready on {manifests.apiserver_url(ports)}")
        _install_kwok_crds(api, deadline, [etcd, apiserver])

        others = [starter.start(name) for name in COMPONENTS[2:]]
        for name in nodes:
            code, body = api.request("POST", "/api/v1/nodes", manifests.fake_gpu_node(name, node_shape))
            if code != 201:
                raise ClusterError(f"creating node {name} failed ({code}): {body}")
        step(f"created {len(nodes)} fake GPU nodes")

        def nodes_ready() -> bool:
            code, body = api.request("GET", "/api/v1/nodes")
            ready = (
                {n["metadata"]["name"] for n in body.get("items", []) if processes.node_ready(n)}
                if code == 200
                else set()
            )
            return set(nodes) <= ready

        def default_service_account() -> bool:
            return api.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200

        every = starter.components
        processes.wait_for("the fake nodes to turn Ready (kwok)", nodes_ready, deadline, every)
        step("nodes Ready")
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # the components' own self-signed serving certs
        for c in others:
            if "https" in c.ports:
                url = f"https://{LOCALHOST}:{c.ports['https']}/healthz"
                processes.wait_for(
                    f"{c.name} /healthz", functools.partial(_http_ok, url, insecure), deadline, every
                )
        processes.wait_for(
            "the default service account (controller-manager)", default_service_account, deadline, every
        )
        step("controller-manager and scheduler healthy")
    except BaseException:
        processes.stop_components(starter.components, STOP_WAVES)
        raise
    return LocalCluster(starter.state())


def stop(state: ClusterState, progress: Progress = lambda _: None) -> None:
    """Stop every recorded component; raises ClusterError naming those that would not stop."""
    for name in processes.stop_components(state.components, STOP_WAVES):
        progress(f"{name} did not stop on SIGTERM and was killed")
    still = [c.name for c in state.components if processes.is_running(c)]
    if still:
        raise ClusterError(f"could not stop {', '.join(still)}; state kept in {state.state_dir}")
