"""Start, inspect and stop the local control plane as processes on this machine.

Every component runs in its own process group (so `down` can end it and anything it spawned), listens
on 127.0.0.1 on a free port, and logs to its own file. What was started is recorded in the state
directory's cluster.json, which `status` and `down` read, so they work from another process."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddp_operator.cluster import manifests
from ddp_operator.cluster.binaries import default_bin_dir, ensure_binaries
from ddp_operator.cluster.kwok_stages import kwok_stages
from ddp_operator.cluster.manifests import Layout, NodeShape, Ports
from ddp_operator.cluster.node_manifests import RealNodeOptions
from ddp_operator.cluster.pki import CLIENT_IDENTITIES, generate_pki

Progress = Callable[[str], None]

# Start order; `down` stops them in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
_COMMANDS: dict[str, Callable[[Path, Layout, Ports], list[str]]] = {
    "etcd": manifests.etcd_command,
    "kube-apiserver": manifests.apiserver_command,
    "kube-controller-manager": manifests.controller_manager_command,
    "kube-scheduler": manifests.scheduler_command,
    "kwok": manifests.kwok_command,
}
_POLL_S = 0.1
# Components this process started: polled through Popen, so they are reaped without a ResourceWarning.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
_STOP_GRACE_S = 10.0


class ClusterError(RuntimeError):
    pass


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.stderr or ''}".rstrip()


def default_state_dir() -> Path:
    env = os.environ.get("DDP_CLUSTER_STATE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("DDP_CACHE") or Path.home() / ".cache" / "ddp-operator") / "cluster"


@dataclass(frozen=True)
class ClusterOptions:
    state_dir: Path = field(default_factory=default_state_dir)
    bin_dir: Path | None = None  # None: the build script's output for the pinned versions
    nodes: int = 4
    node_shape: NodeShape = field(default_factory=NodeShape)
    build: bool = True  # build missing binaries with hack/build-k8s.sh
    timeout_s: float = 120.0
    real_node: RealNodeOptions | None = None  # one real kubelet node (real_node.py); needs root


@dataclass(frozen=True)
class ComponentState:
    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat starttime: tells our process from a later one reusing the pid
    ports: dict[str, int]
    log: str
    command: list[str]


@dataclass(frozen=True)
class ClusterState:
    state_dir: str
    bin_dir: str
    kubeconfig: str
    audit_log: str
    apiserver: str
    nodes: list[str]
    components: list[ComponentState]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        raw = json.loads(text)
        raw["components"] = [ComponentState(**c) for c in raw["components"]]
        return cls(**raw)


# ---- processes -------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces; everything after its closing paren splits cleanly.
    return text[text.rindex(")") + 2 :].split()


def _start_ticks(pid: int) -> int:
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else -1


def is_running(component: ComponentState) -> bool:
    child = _CHILDREN.get(component.pid)
    if child is not None:
        if child.poll() is None:
            return True
        del _CHILDREN[component.pid]
        return False
    stat = _proc_stat(component.pid)
    if stat is None or int(stat[19]) != component.start_ticks:
        return False
    if stat[0] == "Z":  # exited, waiting for its parent (us, when we started it) to reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(component.pid, os.WNOHANG)
        return False
    return True


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((manifests.LOCALHOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def log_tail(path: Path | str, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_for(
    what: str,
    check: Callable[[], bool],
    deadline: float,
    watch: Iterable[ComponentState],
    error: type[ClusterError] = ClusterError,
    poll_s: float = _POLL_S,
) -> None:
    """Poll ``check`` until it holds; fail early, with the log's tail, when a watched component exits."""
    watched = list(watch)
    while not check():
        for c in watched:
            if not is_running(c):
                raise error(f"{c.name} exited while waiting for {what}; log {c.log}:\n{log_tail(c.log)}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {c.name} ({c.log}):\n{log_tail(c.log, 10)}" for c in watched)
            raise error(f"timed out waiting for {what}\n{logs}")
        time.sleep(poll_s)


def _signal_and_wait(components: Sequence[ComponentState], sig: signal.Signals, wait_s: float) -> None:
    for c in components:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.pid, sig)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(is_running(c) for c in components):
        time.sleep(_POLL_S)


# Stopped in waves: the apiserver's clients, then the apiserver, then etcd (an apiserver whose etcd is
# gone, or with clients still watching, takes long to shut down).
_STOP_WAVES = (("kwok", "kube-scheduler", "kube-controller-manager"), ("kube-apiserver",), ("etcd",))


def stop_components(components: Sequence[ComponentState], grace_s: float = _STOP_GRACE_S) -> list[str]:
    """SIGTERM each running component's process group, wave by wave, and SIGKILL what is still running
    after grace_s; returns the names of the components that had to be killed."""
    killed = []
    known = {name for wave in _STOP_WAVES for name in wave}
    waves = [*_STOP_WAVES, tuple(c.name for c in components if c.name not in known)]
    for wave in waves:
        running = [c for c in components if c.name in wave and is_running(c)]
        if not running:
            continue
        _signal_and_wait(running, signal.SIGTERM, grace_s)
        stubborn = [c for c in running if is_running(c)]
        killed += [c.name for c in stubborn]
        _signal_and_wait(stubborn, signal.SIGKILL, grace_s)
    return killed


# ---- the API, over plain HTTPS with the admin certificate -------------------------------------------


class ApiClient:
    """Just enough of a Kubernetes client for bringing the cluster up (no dependency on the kubernetes
    package, which the operator extra brings)."""

    def __init__(self, server: str, layout: Layout) -> None:
        self.server = server
        self._ctx = ssl.create_default_context(cafile=str(layout.cert("ca")))
        self._ctx.load_cert_chain(str(layout.cert("admin")), str(layout.key("admin")))

    def request(self, method: str, path: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            status = exc.code
        except (urllib.error.URLError, OSError) as exc:  # not listening yet, reset, timed out
            return 0, str(exc)
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _node_ready(node: dict[str, Any]) -> bool:
    conditions = node.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


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
            time.sleep(_POLL_S)

    def api(self) -> ApiClient:
        return ApiClient(self.apiserver, self.layout)

    def running_components(self) -> list[str]:
        return [c.name for c in self.state.components if is_running(c)]

    def down(self, *, keep_state: bool = False) -> None:
        down(self.state_dir, keep_state=keep_state)


# ---- up / down / status --------------------------------------------------------------------------------


def read_state(state_dir: Path) -> ClusterState | None:
    path = Layout(state_dir).state_file
    if not path.is_file():
        return None
    return ClusterState.from_json(path.read_text())


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _write_config(layout: Layout, ports: Ports) -> None:
    server = manifests.apiserver_url(ports)
    ca = layout.cert("ca")
    _write_json(
        layout.kubeconfig,
        manifests.kubeconfig(server, ca, layout.cert("admin"), layout.key("admin"), "ddp-admin"),
    )
    for identity in CLIENT_IDENTITIES:
        if identity.name in COMPONENTS:
            config = manifests.kubeconfig(
                server, ca, layout.cert(identity.name), layout.key(identity.name), identity.user
            )
            _write_json(layout.component_kubeconfig(identity.name), config)
    layout.kubeconfig.chmod(0o600)
    _write_json(layout.audit_policy, manifests.audit_policy())
    # JSON is YAML: one document per Stage.
    layout.kwok_config.write_text("---\n".join(json.dumps(stage) + "\n" for stage in kwok_stages()))


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

    def __init__(self, layout: Layout, bin_dir: Path, ports: Ports, nodes: list[str]) -> None:
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
        tmp = self.layout.state_file.with_suffix(".tmp")
        tmp.write_text(self.state().to_json())
        tmp.replace(self.layout.state_file)

    def start(self, name: str) -> ComponentState:
        command = _COMMANDS[name](self.bin_dir, self.layout, self.ports)
        log = self.layout.log_file(name)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.layout.state_dir,
                start_new_session=True,  # its own process group: down signals the group
            )
        _CHILDREN[proc.pid] = proc
        component = ComponentState(
            name=name,
            pid=proc.pid,
            start_ticks=_start_ticks(proc.pid),
            ports=_component_ports(name, self.ports),
            log=str(log),
            command=command,
        )
        self.components.append(component)
        self.save()
        return component

    def wait(
        self, what: str, check: Callable[[], bool], deadline: float, watch: Iterable[ComponentState]
    ) -> None:
        wait_for(what, check, deadline, watch)


def up(options: ClusterOptions, progress: Progress = lambda _: None) -> LocalCluster:
    """Bring the control plane up and return a handle; on failure, stop what was started (logs are kept
    in the state directory) and raise ClusterError."""
    state_dir = options.state_dir.resolve()
    existing = read_state(state_dir)
    if existing is not None:
        if any(is_running(c) for c in existing.components):
            raise ClusterError(f"a cluster is already running from {state_dir}: `ddpjob cluster down` first")
        _stop_real_node(state_dir, progress)  # mounts and rules of a node that died with its cluster
        shutil.rmtree(state_dir)
    elif state_dir.exists() and any(state_dir.iterdir()):
        raise ClusterError(
            f"{state_dir} exists and is not a cluster state directory: choose another --state-dir"
        )

    bin_dir = options.bin_dir or default_bin_dir()
    ensure_binaries(bin_dir, build=options.build)

    started = time.monotonic()
    deadline = started + options.timeout_s
    layout = Layout(state_dir)
    layout.log_dir.mkdir(parents=True, exist_ok=True)
    ports = Ports(*_free_ports(6))
    nodes = [manifests.node_name(i) for i in range(options.nodes)]
    starter = _Starter(layout, bin_dir, ports, nodes)
    starter.save()  # from here on the directory is recognisably ours, for `down` and the next `up`
    generate_pki(layout)
    _write_config(layout, ports)

    def step(message: str) -> None:
        progress(f"{message} ({time.monotonic() - started:.1f} s)")

    try:
        etcd = starter.start("etcd")
        etcd_url = f"http://{manifests.LOCALHOST}:{ports.etcd_client}/health"
        starter.wait("etcd", lambda: _http_ok(etcd_url), deadline, [etcd])
        step(f"etcd ready on {manifests.LOCALHOST}:{ports.etcd_client}")

        apiserver = starter.start("kube-apiserver")
        api = ApiClient(manifests.apiserver_url(ports), layout)
        starter.wait(
            "kube-apiserver /readyz",
            lambda: api.request("GET", "/readyz")[0] == 200,
            deadline,
            [etcd, apiserver],
        )
        step(f"kube-apiserver ready on {manifests.apiserver_url(ports)}")

        others = [starter.start(name) for name in COMPONENTS[2:]]
        for name in nodes:
            code, body = api.request(
                "POST", "/api/v1/nodes", manifests.fake_gpu_node(name, options.node_shape)
            )
            if code != 201:
                raise ClusterError(f"creating node {name} failed ({code}): {body}")
        step(f"created {len(nodes)} fake GPU nodes")

        def nodes_ready() -> bool:
            code, body = api.request("GET", "/api/v1/nodes")
            ready = (
                {n["metadata"]["name"] for n in body.get("items", []) if _node_ready(n)}
                if code == 200
                else set()
            )
            return set(nodes) <= ready

        def default_service_account() -> bool:
            return api.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200

        every = starter.components
        starter.wait("the fake nodes to turn Ready (kwok)", nodes_ready, deadline, every)
        step("nodes Ready")
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE  # the components' own self-signed serving certs
        for c in others:
            if "https" in c.ports:
                url = f"https://{manifests.LOCALHOST}:{c.ports['https']}/healthz"
                starter.wait(
                    f"{c.name} /healthz", functools.partial(_http_ok, url, insecure), deadline, every
                )
        starter.wait(
            "the default service account (controller-manager)", default_service_account, deadline, every
        )
        step("controller-manager and scheduler healthy")
        if options.real_node is not None:
            from ddp_operator.cluster import real_node  # it imports this module: import it late

            real_node.start(LocalCluster(starter.state()), options.real_node, progress=progress)
    except BaseException:
        stop_components(starter.components)
        raise
    progress(f"cluster up in {time.monotonic() - started:.1f} s; kubeconfig: {layout.kubeconfig}")
    return LocalCluster(starter.state())


def attach(state_dir: Path | None = None) -> LocalCluster:
    """A handle to a cluster that `up` started, possibly in another process."""
    state = read_state(state_dir or default_state_dir())
    if state is None:
        raise ClusterError(
            f"no cluster state in {state_dir or default_state_dir()}: `ddpjob cluster up` first"
        )
    return LocalCluster(state)


def down(
    state_dir: Path | None = None, *, keep_state: bool = False, progress: Progress = lambda _: None
) -> bool:
    """Stop every component recorded in state_dir and remove the directory; False when there was
    nothing to stop."""
    state_dir = (state_dir or default_state_dir()).resolve()
    state = read_state(state_dir)
    if state is None:
        return False
    node_error = _stop_real_node(state_dir, progress)
    killed = stop_components(state.components)
    for name in killed:
        progress(f"{name} did not stop on SIGTERM and was killed")
    still = [c.name for c in state.components if is_running(c)]
    if still:
        raise ClusterError(f"could not stop {', '.join(still)}; state kept in {state_dir}")
    if node_error is not None:
        raise ClusterError(f"{node_error}\nthe control plane is stopped; state kept in {state_dir}")
    if not keep_state:
        shutil.rmtree(state_dir, ignore_errors=True)
    progress(f"cluster in {state_dir} stopped" + ("" if keep_state else " and removed"))
    return True


def _stop_real_node(state_dir: Path, progress: Progress) -> ClusterError | None:
    """Tear down a real node recorded in state_dir, if any (before the apiserver goes); what could not
    be removed comes back as an error, so the state directory is kept for a post-mortem."""
    from ddp_operator.cluster import real_node

    try:
        real_node.stop(state_dir, progress=progress)
    except ClusterError as exc:
        return exc
    return None


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int
    running: bool
    rss_bytes: int
    ports: dict[str, int]
    log: str


def status(state_dir: Path | None = None) -> tuple[ClusterState, list[ComponentStatus]] | None:
    state = read_state(state_dir or default_state_dir())
    if state is None:
        return None
    rows = []
    for c in state.components:
        running = is_running(c)
        rows.append(
            ComponentStatus(c.name, c.pid, running, rss_bytes(c.pid) if running else 0, c.ports, c.log)
        )
    from ddp_operator.cluster import real_node

    rows += real_node.status(state_dir or default_state_dir())
    return state, rows
