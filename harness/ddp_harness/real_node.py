"""One real node for the local control plane: containerd (CRI), a kubelet, the CNI bridge, kube-proxy
(iptables mode) and CoreDNS, all as processes on this machine, plus a relay that lets pods reach the
loopback-only apiserver through the `kubernetes` Service; with `network_policy`, kube-router's firewall
enforces NetworkPolicies (netpol_enforcer).

`start` needs root (it creates a bridge, iptables rules and mounts) and a running control plane;
`stop` removes every process, pod sandbox, mount, iptables rule and the bridge that `start` added,
and is safe to call on a half-started node. What was added is recorded in <state>/node/node.json as
soon as it exists, so `stop` works from another process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddp_harness import netpol_enforcer
from ddp_harness import node_manifests as nm
from ddp_harness.control_plane import LocalCluster
from ddp_harness.hack import HackDirError, hack_file
from ddp_harness.manifests import SERVICE_CLUSTER_IP_RANGE, kubeconfig
from ddp_harness.node_manifests import RealNodeOptions as RealNodeOptions
from ddp_harness.pki import sign_leaf
from ddp_harness.processes import (
    LOCALHOST,
    ClusterError,
    ComponentsRecord,
    ComponentState,
    ComponentStatus,
    Progress,
    cache_dir,
    component_statuses,
    http_status,
    is_running,
    node_ready,
    spawn,
    stop_components,
    tcp_open,
    unix_socket_alive,
    wait_for,
    write_json,
)
from ddp_operator.local.ports import free_ports

BUILD_SCRIPT = "build-node-binaries.sh"
NODE_BINARIES = ("kubelet", "kube-proxy", "coredns", "crictl", "pause")
HOST_COMMANDS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "iptables-save", "ip")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
_POLL_S = 0.2
_NETNS_DIR = Path("/run/netns")
# Where the node this machine runs is recorded (its cluster's state dir), beside the record in that dir:
# a run killed before its teardown (a CI lane stopped, a SIGKILL) leaves its node behind, and the next
# start finds it here and takes it down, instead of refusing for ever on the bridge it left.
RUNNING_NODE_POINTER = Path("/run/ddp-harness/real-node")


class RealNodeError(ClusterError):
    pass


def default_image_store() -> Path:
    return cache_dir() / "node-containerd"


def default_cni_bin_dir() -> Path:
    for candidate in (Path("/usr/lib/cni"), Path("/opt/cni/bin")):
        if (candidate / "bridge").is_file():
            return candidate
    return Path("/usr/lib/cni")


@dataclass(frozen=True)
class NodeState(ComponentsRecord):
    """What `start` added, in the order it added it; `stop` undoes it."""

    name: str
    bin_dir: str
    image_store: str
    run_dir: str
    bridge: str
    pod_cidr: str
    components: list[ComponentState] = field(default_factory=list)
    bridge_created: bool = False
    iptables_rules: list[list[str]] = field(default_factory=list)  # ["-t", table, chain, *spec]
    chains_before: dict[str, list[str]] = field(default_factory=dict)
    netns_before: list[str] = field(default_factory=list)
    ipsets_before: list[str] = field(default_factory=list)  # with network_policy: kube-router's go after
    sysctls_changed: dict[str, str] = field(default_factory=dict)  # path -> value before


@dataclass(frozen=True)
class RealNode:
    """A started node: its name, network and how long it took to turn Ready."""

    name: str
    network: nm.NodeNetwork
    layout: nm.NodeLayout
    seconds_to_ready: float


# ---- small helpers ----------------------------------------------------------------------------------


def _run(
    cmd: Sequence[str], *, check: bool = True, timeout: float = 120.0, **kw: Any
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if check and result.returncode != 0:
        raise RealNodeError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


# ---- preflight --------------------------------------------------------------------------------------


def _build_script() -> str:
    """How to build the node's binaries, for messages: the script's path, or where to find it."""
    try:
        return str(hack_file(BUILD_SCRIPT))
    except HackDirError as exc:
        return f"hack/{BUILD_SCRIPT} ({exc})"


def missing_prerequisites(bin_dir: Path, cni_bin_dir: Path) -> list[str]:
    """Everything a real node needs that this machine lacks, each with how to get it."""
    build_script = _build_script()
    problems = []
    if os.geteuid() != 0:
        problems.append("root: the node creates a bridge, iptables rules and mounts (run as root)")
    for name in NODE_BINARIES:
        if not os.access(bin_dir / name, os.X_OK):
            problems.append(f"{bin_dir / name}: run {build_script}")
    for command in HOST_COMMANDS:
        if shutil.which(command) is None:
            problems.append(
                f"`{command}` on PATH: {build_script} installs Debian's containerd, runc, iptables"
            )
    for plugin in CNI_PLUGINS:
        if not (cni_bin_dir / plugin).is_file():
            problems.append(f"CNI plugin {cni_bin_dir / plugin}: apt-get install containernetworking-plugins")
    if shutil.which("docker") is None:
        problems.append("`docker`: images are loaded with `docker save` (hack/build-images.sh installs it)")
    if not Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        problems.append("br_netfilter (/proc/sys/net/bridge/bridge-nf-call-iptables): modprobe br_netfilter")
    return problems


def ensure_node_binaries(bin_dir: Path, *, build: bool) -> None:
    missing = [n for n in NODE_BINARIES if not os.access(bin_dir / n, os.X_OK)]
    if not missing:
        return
    if not build:
        raise RealNodeError(f"missing in {bin_dir}: {', '.join(missing)}; run {_build_script()}")
    try:
        build_script = hack_file(BUILD_SCRIPT)
    except HackDirError as exc:
        raise RealNodeError(f"missing in {bin_dir}: {', '.join(missing)}; {exc}") from None
    env = dict(os.environ)
    env.setdefault("DDP_K8S_PREFIX", str(bin_dir.parent))
    if subprocess.run(["bash", str(build_script)], env=env, check=False).returncode != 0:
        raise RealNodeError(f"{build_script} failed; its output above says why")


# ---- the node's record ------------------------------------------------------------------------------


class _Recorder:
    """Keeps node.json current, so a failed start can be undone by `stop` from any process."""

    def __init__(self, layout: nm.NodeLayout, state: NodeState) -> None:
        self.layout = layout
        self.state = state
        self.save()

    def update(self, **changes: Any) -> None:
        self.state = NodeState(
            **{
                **asdict(self.state),
                **changes,
                "components": changes.get("components", self.state.components),
            }
        )
        self.save()

    def save(self) -> None:
        self.state.save(self.layout.state_file)

    def start(self, name: str, command: list[str], ports: dict[str, int]) -> ComponentState:
        component = spawn(name, command, self.layout.log_file(name), ports, self.layout.node_dir)
        self.update(components=[*self.state.components, component])
        return component


def read_state(state_dir: Path) -> NodeState | None:
    return NodeState.load(state_dir / "node" / "node.json")


def _wait(what: str, check: Callable[[], bool], deadline: float, watch: Sequence[ComponentState]) -> None:
    wait_for(what, check, deadline, watch, error=RealNodeError, poll_s=_POLL_S)


# ---- images -----------------------------------------------------------------------------------------


def _ctr(layout: nm.NodeLayout, *args: str) -> list[str]:
    return ["ctr", f"--address={layout.containerd_socket}", "--namespace=k8s.io", *args]


def ensure_pause_image(bin_dir: Path) -> None:
    """The sandbox image: our static pause binary as the only file, imported into Docker."""
    if _run(["docker", "image", "inspect", nm.PAUSE_IMAGE], check=False).returncode == 0:
        return
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        tar.add(str(bin_dir / "pause"), arcname="pause")
    result = subprocess.run(
        ["docker", "import", "--change", 'ENTRYPOINT ["/pause"]', "-", nm.PAUSE_IMAGE],
        input=payload.getvalue(),
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        raise RealNodeError(
            f"docker import of the pause image failed: {result.stderr.decode(errors='replace')}"
        )


def _docker_image_id(ref: str) -> str:
    result = _run(["docker", "image", "inspect", "--format", "{{.Id}}", ref], check=False)
    if result.returncode != 0:
        raise RealNodeError(
            f"image {ref} is not in Docker: build it first (hack/build-images.sh): {result.stderr.strip()}"
        )
    return result.stdout.strip()


def load_images(layout: nm.NodeLayout, refs: Sequence[str], progress: Progress = lambda _: None) -> None:
    """`docker save REF | ctr -n k8s.io images import -` for each image the node's containerd lacks
    (by Docker image ID, remembered next to the image store)."""
    marker = layout.image_store / "ddp-imported.json"
    imported: dict[str, str] = json.loads(marker.read_text()) if marker.is_file() else {}
    listing = _run(_ctr(layout, "images", "ls")).stdout
    for ref in refs:
        image_id = _docker_image_id(ref)
        name = nm.normalized_image_ref(ref)
        stale = nm.image_refs_to_remove(listing, name)
        if imported.get(name) == image_id and stale:
            continue
        if stale:
            # A rebuilt image under the same tag: drop the old one and its CRI alias first,
            # synchronously, so containerd's garbage collector frees its content and unpacked layers.
            _run(_ctr(layout, "images", "rm", "--sync", *stale))
        started = time.monotonic()
        save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        load = subprocess.run(
            _ctr(layout, "images", "import", "-"), stdin=save.stdout, capture_output=True, check=False
        )
        if save.stdout is not None:
            save.stdout.close()
        save_err = save.communicate()[1]
        if save.returncode != 0 or load.returncode != 0:
            raise RealNodeError(
                f"loading {ref} into the node failed: docker save: {save_err.decode(errors='replace').strip()} "
                f"ctr import: {load.stderr.decode(errors='replace').strip()}"
            )
        imported[name] = image_id
        marker.write_text(json.dumps(imported, indent=2))
        progress(f"loaded image {ref} into the node ({time.monotonic() - started:.1f} s)")


# ---- start ------------------------------------------------------------------------------------------


def _read(path: str) -> str:
    return Path(path).read_text().strip()


def _iptables_save(table: str) -> str:
    return _run(["iptables-save", "-t", table]).stdout


def _ipsets() -> list[str]:
    return netpol_enforcer.ipset_names(_run(["ipset", "list", "-n"]).stdout)


def _node_status(cluster: LocalCluster, name: str) -> dict[str, Any] | None:
    code, body = cluster.api().request("GET", f"/api/v1/nodes/{name}")
    return body if code == 200 and isinstance(body, dict) else None


def start(cluster: LocalCluster, options: RealNodeOptions, progress: Progress = lambda _: None) -> RealNode:
    """Start the node against a running control plane and wait for it to be Ready with DNS, Service
    routing and the apiserver relay working; on failure, undo everything and raise RealNodeError."""
    network = options.network
    bin_dir = cluster.bin_dir
    cni_bin_dir = options.cni_bin_dir or default_cni_bin_dir()
    layout = nm.NodeLayout(cluster.state_dir, (options.image_store or default_image_store()).resolve())
    ensure_node_binaries(bin_dir, build=options.build)
    problems = missing_prerequisites(bin_dir, cni_bin_dir)
    if options.network_policy:
        problems += netpol_enforcer.missing_prerequisites()
    if problems:
        raise RealNodeError("a real node cannot start here; missing:\n  " + "\n  ".join(problems))
    if options.network_policy:
        netpol_enforcer.ensure_binary(build=options.build)
    if read_state(cluster.state_dir) is not None:
        raise RealNodeError(f"a real node is already recorded in {layout.state_file}: stop it first")
    _stop_abandoned(progress)
    if Path(f"/sys/class/net/{network.bridge}").exists():
        raise RealNodeError(
            f"interface {network.bridge} exists: another real node runs (or was not torn down): "
            f"`ddp-harness cluster down`, or `ip link del {network.bridge}`"
        )
    if layout.containerd_socket.exists() and unix_socket_alive(layout.containerd_socket):
        raise RealNodeError(f"a containerd already serves {layout.containerd_socket}")

    started = time.monotonic()
    deadline = started + options.timeout_s
    for d in (layout.node_dir, layout.pki_dir, layout.cni_conf_dir, layout.cni_ipam_dir, layout.kubelet_dir,
              layout.volumes_dir, layout.pod_logs_dir, layout.image_store, layout.run_dir, layout.log_dir):  # fmt: skip
        d.mkdir(parents=True, exist_ok=True)
    recorder = _Recorder(
        layout,
        NodeState(
            name=options.name,
            bin_dir=str(bin_dir),
            image_store=str(layout.image_store),
            run_dir=str(layout.run_dir),
            bridge=network.bridge,
            pod_cidr=network.pod_cidr,
            netns_before=sorted(p.name for p in _NETNS_DIR.glob("*")) if _NETNS_DIR.is_dir() else [],
            chains_before={t: sorted(nm.iptables_chains(_iptables_save(t))) for t in nm.IPTABLES_TABLES},
            ipsets_before=_ipsets() if options.network_policy else [],
        ),
    )

    def step(message: str) -> None:
        progress(f"real node: {message} ({time.monotonic() - started:.1f} s)")

    RUNNING_NODE_POINTER.parent.mkdir(parents=True, exist_ok=True)
    RUNNING_NODE_POINTER.write_text(str(cluster.state_dir))

    try:
        seconds_to_ready = _start_node(cluster, options, layout, recorder, cni_bin_dir, deadline, step)
    except BaseException:
        progress("real node: start failed; undoing what was added")
        with contextlib.suppress(Exception):
            stop(cluster.state_dir, progress=progress)
        raise
    return RealNode(options.name, network, layout, seconds_to_ready)


def _start_node(
    cluster: LocalCluster,
    options: RealNodeOptions,
    layout: nm.NodeLayout,
    recorder: _Recorder,
    cni_bin_dir: Path,
    deadline: float,
    step: Progress,
) -> float:
    """Returns the seconds from the first file written to the node's Ready condition."""
    network = options.network
    bin_dir = cluster.bin_dir
    started = time.monotonic()
    apiserver_port = int(cluster.apiserver.rsplit(":", 1)[1])
    ports = nm.NodePorts(*free_ports(7))
    volume_dirs = _write_node_files(cluster, options, layout, ports, cni_bin_dir)
    _open_bridge(network, recorder, step)

    containerd = recorder.start(
        "containerd",
        [shutil.which("containerd") or "containerd", "--config", str(layout.containerd_config)],
        {},
    )
    _wait(
        "containerd's socket",
        lambda: _run(_ctr(layout, "version"), check=False).returncode == 0,
        deadline,
        [containerd],
    )
    step("containerd serving CRI")
    ensure_pause_image(bin_dir)
    load_images(layout, [nm.PAUSE_IMAGE], progress=step)

    kubelet = recorder.start(
        "kubelet",
        nm.kubelet_command(bin_dir, layout, network, options.name),
        {"https": ports.kubelet, "healthz": ports.kubelet_healthz},
    )
    _wait(
        f"node {options.name} to turn Ready",
        lambda: node_ready(_node_status(cluster, options.name)),
        deadline,
        [containerd, kubelet],
    )
    seconds_to_ready = time.monotonic() - started
    _untaint_not_ready(cluster, options.name)
    step(f"node {options.name} Ready")
    # After Ready, so that "time to a Ready node" measures the node alone, not a 6 GB import; the
    # import's time does not count against the timeout either.
    loading = time.monotonic()
    load_images(layout, options.images, progress=step)
    deadline += time.monotonic() - loading

    cluster.apply_json(
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": nm.api_objects(network, apiserver_port, ports.coredns, volume_dirs),
        }
    )
    _start_services(
        bin_dir, options, layout, recorder, ports, apiserver_port, deadline, [containerd, kubelet]
    )
    step("kube-proxy, CoreDNS and the apiserver relay ready")
    if options.network_policy:
        _start_enforcer(cluster, options, layout, recorder, deadline, [containerd, kubelet])
        step("kube-router enforcing NetworkPolicies")
    return seconds_to_ready


def _write_node_files(
    cluster: LocalCluster,
    options: RealNodeOptions,
    layout: nm.NodeLayout,
    ports: nm.NodePorts,
    cni_bin_dir: Path,
) -> list[Path]:
    """The node's certificates, kubeconfigs and configuration files; returns the volumes' directories."""
    network = options.network
    # Certificates and kubeconfigs, signed by the cluster's CA.
    ca_cert, ca = cluster.ca_cert, cluster.layout
    sign_leaf(layout, ca, "kubelet", f"/O=system:nodes/CN=system:node:{options.name}", "clientAuth")
    sign_leaf(
        layout, ca, "kubelet-serving", f"/CN={options.name}", "serverAuth",
        (f"IP:{network.gateway}", f"DNS:{options.name}", f"IP:{LOCALHOST}"),
    )  # fmt: skip
    sign_leaf(layout, ca, "kube-proxy", f"/CN={nm.KUBE_PROXY_USER}", "clientAuth")
    sign_leaf(layout, ca, "coredns", f"/CN={nm.COREDNS_USER}", "clientAuth")
    users = [("kubelet", f"system:node:{options.name}"), ("kube-proxy", nm.KUBE_PROXY_USER),
             ("coredns", nm.COREDNS_USER)]  # fmt: skip
    if options.network_policy:
        sign_leaf(layout, ca, netpol_enforcer.NAME, f"/CN={netpol_enforcer.USER}", "clientAuth")
        users.append((netpol_enforcer.NAME, netpol_enforcer.USER))
    for component, user in users:
        write_json(
            layout.kubeconfig(component),
            kubeconfig(cluster.apiserver, ca_cert, layout.cert(component), layout.key(component), user),
        )
        layout.kubeconfig(component).chmod(0o600)

    host_resolv = Path("/etc/resolv.conf").read_text() if Path("/etc/resolv.conf").is_file() else ""
    upstream = nm.upstream_nameservers(host_resolv)
    layout.resolv_conf.write_text(nm.node_resolv_conf(upstream))
    layout.containerd_config.write_text(nm.containerd_config(layout, network, cni_bin_dir))
    write_json(layout.cni_conf_dir / "10-ddp-pods.conflist", nm.cni_conflist(network, layout))
    write_json(layout.kubelet_config, nm.kubelet_config(layout, network, ports, ca_cert))
    write_json(layout.kube_proxy_config, nm.kube_proxy_config(layout, network, ports, options.name))
    layout.corefile.write_text(nm.corefile(network, ports, layout.kubeconfig("coredns"), upstream))
    volume_dirs = [layout.volumes_dir / f"pv-{i}" for i in range(options.volumes)]
    for d in volume_dirs:
        d.mkdir(exist_ok=True)
        d.chmod(0o1777)  # the trainer runs as a non-root user and hostPath ignores fsGroup
    return volume_dirs


def _open_bridge(network: nm.NodeNetwork, recorder: _Recorder, step: Progress) -> None:
    """The pods' bridge, forwarding on, and FORWARD rules that accept the pods' traffic (recorded)."""
    # The bridge exists before any pod, so the kubelet, CoreDNS and the relay can bind its address.
    _run(["ip", "link", "add", network.bridge, "type", "bridge"])
    recorder.update(bridge_created=True)
    _run(["ip", "addr", "add", network.gateway_cidr, "dev", network.bridge])
    _run(["ip", "link", "set", network.bridge, "up"])
    changed: dict[str, str] = {}
    for path in ("/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/bridge/bridge-nf-call-iptables"):
        before = _read(path)
        if before != "1":
            Path(path).write_text("1")
            changed[path] = before
    recorder.update(sysctls_changed=changed)
    chains = nm.iptables_chains(_iptables_save("filter"))
    chain = "DOCKER-USER" if "DOCKER-USER" in chains else "FORWARD"
    added: list[list[str]] = []
    for spec in nm.forward_accept_rules(network):
        _run(["iptables", "-t", "filter", "-I", chain, "1", *spec])
        added.append(["-t", "filter", chain, *spec])
        recorder.update(iptables_rules=list(added))
    step(f"bridge {network.bridge} {network.gateway_cidr}; FORWARD accepted in {chain}")


def _start_services(
    bin_dir: Path,
    options: RealNodeOptions,
    layout: nm.NodeLayout,
    recorder: _Recorder,
    ports: nm.NodePorts,
    apiserver_port: int,
    deadline: float,
    running: list[ComponentState],
) -> None:
    """kube-proxy, CoreDNS and the apiserver's relay on the bridge, until each answers (``running``:
    the node's processes started before them, watched while waiting)."""
    network = options.network
    proxy = recorder.start(
        "kube-proxy",
        nm.kube_proxy_command(bin_dir, layout),
        {"healthz": ports.kube_proxy_healthz, "metrics": ports.kube_proxy_metrics},
    )
    coredns = recorder.start(
        "coredns",
        nm.coredns_command(bin_dir, layout),
        {"dns": ports.coredns, "health": ports.coredns_health, "ready": ports.coredns_ready},
    )
    relay = recorder.start(
        "apiserver-relay",
        nm.relay_command(sys.executable, network.gateway, apiserver_port, LOCALHOST),
        {"https": apiserver_port},
    )
    every = [*running, proxy, coredns, relay]
    _wait(
        "kube-proxy's first sync",
        lambda: http_status(f"http://{LOCALHOST}:{ports.kube_proxy_healthz}/healthz") == 200,
        deadline,
        every,
    )
    _wait(
        "CoreDNS ready",
        lambda: http_status(f"http://{LOCALHOST}:{ports.coredns_ready}/ready") == 200,
        deadline,
        every,
    )
    _wait("the apiserver relay", lambda: tcp_open(network.gateway, apiserver_port), deadline, every)


def _start_enforcer(
    cluster: LocalCluster,
    options: RealNodeOptions,
    layout: nm.NodeLayout,
    recorder: _Recorder,
    deadline: float,
    running: list[ComponentState],
) -> None:
    """kube-router's firewall for this node's pods, in this host's network namespace, with read-only
    RBAC; returns once its chains are in the filter table (its first sync follows at once)."""
    cluster.apply_json(
        {
            "apiVersion": "v1",
            "kind": "List",
            "items": netpol_enforcer.rbac_objects(netpol_enforcer.user_subject()),
        }
    )
    enforcer = recorder.start(
        netpol_enforcer.NAME,
        netpol_enforcer.command(
            netpol_enforcer.binary_path(),
            kubeconfig=layout.kubeconfig(netpol_enforcer.NAME),
            node_name=options.name,
            service_cidr=SERVICE_CLUSTER_IP_RANGE,
        ),
        {},
    )
    _wait(
        "kube-router's chains in the filter table",
        lambda: netpol_enforcer.enforcing(_iptables_save("filter")),
        deadline,
        [*running, enforcer],
    )


def _untaint_not_ready(cluster: LocalCluster, name: str) -> None:
    """Where the TaintNodesByCondition admission plugin runs, a new node is born tainted
    not-ready:NoSchedule until the node-lifecycle controller (if any) sees it Ready; the kubelet has
    reported Ready, so pods need not wait for that controller's next pass."""
    node = _node_status(cluster, name) or {}
    taints = node.get("spec", {}).get("taints") or []
    kept = [t for t in taints if t.get("key") != "node.kubernetes.io/not-ready"]
    if len(kept) != len(taints):
        cluster.kubectl_run(
            "patch", "node", name, "--type=merge", "-p", json.dumps({"spec": {"taints": kept or None}})
        )


# ---- stop -------------------------------------------------------------------------------------------


def _crictl(state: NodeState, *args: str) -> list[str]:
    endpoint = f"unix://{Path(state.run_dir) / 'containerd.sock'}"
    return [
        str(Path(state.bin_dir) / "crictl"),
        f"--runtime-endpoint={endpoint}",
        f"--image-endpoint={endpoint}",
        "--timeout=30s",
        *args,
    ]


def _revive_containerd(state: NodeState, layout: nm.NodeLayout) -> ComponentState | None:
    """A containerd for teardown when the recorded one died: it reconnects to the shims of the
    containers that still run, so their sandboxes can be removed through CRI."""
    if not layout.containerd_config.is_file():
        return None
    revived = spawn(
        "containerd",
        [shutil.which("containerd") or "containerd", "--config", str(layout.containerd_config)],
        layout.log_file("containerd"),
        {},
    )
    deadline = time.monotonic() + 30
    while _run(_ctr(layout, "version"), check=False).returncode != 0:
        if time.monotonic() > deadline or not is_running(revived):
            stop_components([revived])
            return None
        time.sleep(_POLL_S)
    return revived


def _stop_abandoned(progress: Progress) -> None:
    """Take down the node an earlier run recorded and left (none of its components runs any more)."""
    try:
        state_dir = Path(RUNNING_NODE_POINTER.read_text().strip())
    except OSError:
        return
    state = read_state(state_dir)
    if state is not None and any(is_running(c) for c in state.components if c.name != "containerd"):
        return  # alive: another run's node, which the bridge check below refuses to share
    if state is not None:
        progress(f"real node: one left by an interrupted run ({state_dir}); taking it down first")
        stop(state_dir, progress=progress)
    RUNNING_NODE_POINTER.unlink(missing_ok=True)


def stop(state_dir: Path, *, progress: Progress = lambda _: None) -> bool:
    """Undo what `start` recorded in state_dir; False when no node was recorded. Raises RealNodeError
    (and keeps the record) when something could not be removed. Works without the apiserver: the
    node is taken apart through CRI and the host's own tools."""
    state = read_state(state_dir)
    if state is None:
        return False
    layout = nm.NodeLayout(state_dir, Path(state.image_store), Path(state.run_dir))
    by_name = {c.name: c for c in state.components}
    errors: list[str] = []

    # The kubelet first, so it does not restart what is removed below.
    stop_components([c for c in state.components if c.name != "containerd"])
    containerd = by_name.get("containerd")
    if containerd is not None and not is_running(containerd):
        containerd = _revive_containerd(state, layout)
    if containerd is not None:
        # Stops every container and removes every sandbox (CNI DEL releases its address and veth).
        result = _run(_crictl(state, "rmp", "--all", "--force"), check=False, timeout=180)
        if result.returncode != 0:
            errors.append(f"crictl rmp: {result.stderr.strip()}")
        stop_components([containerd])
    cleanup = _run(nm.kube_proxy_cleanup_command(Path(state.bin_dir)), check=False)
    if cleanup.returncode != 0:
        errors.append(f"kube-proxy --cleanup: {cleanup.stderr.strip()[-300:]}")

    mountinfo = Path("/proc/self/mountinfo").read_text()
    for point in nm.mounts_under(mountinfo, layout.owned_dirs):
        result = _run(["umount", point], check=False)
        if result.returncode != 0:
            result = _run(["umount", "-l", point], check=False)
            if result.returncode != 0:
                errors.append(f"umount {point}: {result.stderr.strip()}")
    if _NETNS_DIR.is_dir():
        for ns in sorted(set(p.name for p in _NETNS_DIR.glob("cni-*")) - set(state.netns_before)):
            path = _NETNS_DIR / ns
            _run(["umount", str(path)], check=False)
            with contextlib.suppress(OSError):
                path.unlink()

    for rule in state.iptables_rules:
        table, chain, spec = rule[1], rule[2], rule[3:]
        while _run(["iptables", "-t", table, "-C", chain, *spec], check=False).returncode == 0:
            _run(["iptables", "-t", table, "-D", chain, *spec], check=False)
    for table in nm.IPTABLES_TABLES:
        for command in nm.iptables_cleanup(table, _iptables_save(table), state.chains_before.get(table, [])):
            result = _run(["iptables", *command], check=False)
            if result.returncode != 0 and "-X" in command:
                errors.append(f"iptables {' '.join(command)}: {result.stderr.strip()}")
    if any(c.name == netpol_enforcer.NAME for c in state.components):
        # kube-router's sets, after the rules above that matched on them.
        for name in netpol_enforcer.sets_to_destroy(_ipsets(), state.ipsets_before):
            result = _run(["ipset", "destroy", name], check=False)
            if result.returncode != 0:
                errors.append(f"ipset destroy {name}: {result.stderr.strip()}")
    if state.bridge_created and Path(f"/sys/class/net/{state.bridge}").exists():
        result = _run(["ip", "link", "del", state.bridge], check=False)
        if result.returncode != 0:
            errors.append(f"ip link del {state.bridge}: {result.stderr.strip()}")
    for sysctl, value in state.sysctls_changed.items():
        with contextlib.suppress(OSError):
            Path(sysctl).write_text(value)

    still = [c.name for c in state.components if is_running(c)]
    if still:
        errors.append(f"still running: {', '.join(still)}")
    left = nm.mounts_under(Path("/proc/self/mountinfo").read_text(), layout.owned_dirs)
    if left:
        errors.append(f"still mounted: {', '.join(left)}")
    if errors:
        raise RealNodeError("real node teardown incomplete:\n  " + "\n  ".join(errors))
    shutil.rmtree(layout.run_dir, ignore_errors=True)
    layout.state_file.unlink()
    with contextlib.suppress(OSError):
        if RUNNING_NODE_POINTER.read_text().strip() == str(state_dir):
            RUNNING_NODE_POINTER.unlink()
    progress("real node: stopped; its sandboxes, mounts, iptables rules, ipsets and bridge removed")
    return True


def status(state_dir: Path) -> list[ComponentStatus]:
    """The node's components as `ddp-harness cluster status` lists them; empty without a node."""
    state = read_state(state_dir)
    return [] if state is None else component_statuses(state.components)
