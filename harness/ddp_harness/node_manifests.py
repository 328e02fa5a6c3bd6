"""Pure builders for the local control plane's real node: containerd's config, the kubelet's and
kube-proxy's configurations and command lines, the CNI network, CoreDNS's Corefile, the API objects the
node needs (DNS and apiserver endpoints, RBAC, storage) and the iptables rules it adds.

Nothing here starts a process or writes a file; real_node.py does, from what these return."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_harness.processes import LOCALHOST, StateLayout

# The `kubernetes` Service's ClusterIP and the DNS Service's: both inside the control plane's
# --service-cluster-ip-range (manifests.SERVICE_CLUSTER_IP_RANGE).
KUBERNETES_SERVICE_IP = "10.96.0.1"
CLUSTER_DNS_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
# Tagged with a version, never :latest, so the kubelet never tries to pull it.
PAUSE_IMAGE = "ddp-pause:ddp-1"
# Marks every iptables rule this node adds, so teardown removes exactly those.
IPTABLES_COMMENT = "ddp-real-node"
# Chains that kube-proxy, the kubelet and the CNI plugins create; teardown removes the new ones.
OWNED_CHAIN_PREFIXES = ("KUBE-", "CNI-")
IPTABLES_TABLES = ("filter", "nat", "mangle")
COREDNS_USER = "system:coredns"
KUBE_PROXY_USER = "system:kube-proxy"  # bound to system:node-proxier by the default RBAC policy
STORAGE_CLASS = "ddp-local"
ENDPOINTS_MANAGER = "ddp-real-node"
REAL_NODE_LABEL = "ddp.dev/real-node"


def normalized_image_ref(ref: str) -> str:
    """The name containerd stores a Docker reference under (`ddp-trainer:0.1.0` ->
    `docker.io/library/ddp-trainer:0.1.0`), which is what the CRI looks a pod's image up by."""
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    first = name.split("/", 1)[0]
    has_registry = "/" in name and ("." in first or ":" in first or first == "localhost")
    if not has_registry:
        name = f"docker.io/{name}" if "/" in name else f"docker.io/library/{name}"
    return f"{name}:{tag}"


def image_refs_to_remove(listing: str, name: str) -> list[str]:
    """What must go for containerd to free the image stored as `name`, from `ctr images ls` output:
    the name and every `sha256:<image id>` alias of the same manifest. The CRI plugin adds that alias
    for each image it manages, and the alias alone keeps the content and its unpacked layers alive, so
    removing only the name leaked a whole trainer image (~9 GiB) per rebuild. Other names of the same
    manifest stay: someone chose them."""
    targets: dict[str, str] = {}
    for line in listing.splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 3:
            targets[cols[0]] = cols[2]
    digest = targets.get(name)
    if digest is None:
        return []
    aliases = sorted(r for r, d in targets.items() if d == digest and r.startswith("sha256:"))
    return [name, *aliases]


@dataclass(frozen=True)
class NodeNetwork:
    """The node's private network: a Linux bridge holding the gateway address of the pod CIDR. The
    node's InternalIP, the kubelet, CoreDNS and the apiserver's relay all live on that address, never
    on an outside interface."""

    bridge: str = "ddpbr0"
    pod_cidr: str = "10.85.0.0/24"
    cluster_dns: str = CLUSTER_DNS_IP
    cluster_domain: str = CLUSTER_DOMAIN

    def __post_init__(self) -> None:
        network = ipaddress.ip_network(self.pod_cidr, strict=True)
        if not isinstance(network, ipaddress.IPv4Network) or not network.is_private:
            raise ValueError(f"pod CIDR must be a private IPv4 network, got {self.pod_cidr}")
        if network.prefixlen > 28:
            raise ValueError(f"pod CIDR {self.pod_cidr} is too small for a node (at most /28)")
        if not re.fullmatch(r"[a-zA-Z0-9_-]{1,15}", self.bridge):
            raise ValueError(
                f"bridge name must be a Linux interface name (<= 15 characters), got {self.bridge}"
            )

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.ip_network(self.pod_cidr).hosts()))

    @property
    def gateway_cidr(self) -> str:
        return f"{self.gateway}/{ipaddress.ip_network(self.pod_cidr).prefixlen}"


@dataclass(frozen=True)
class NodePorts:
    """Ports on the bridge address (kubelet, CoreDNS) or loopback (health and metrics)."""

    kubelet: int
    kubelet_healthz: int
    kube_proxy_healthz: int
    kube_proxy_metrics: int
    coredns: int
    coredns_health: int
    coredns_ready: int


@dataclass(frozen=True)
class RealNodeOptions:
    """What `ddp-harness cluster up --real-node` starts (real_node.start)."""

    name: str = "ddp-node"
    network: NodeNetwork = field(default_factory=NodeNetwork)
    images: tuple[str, ...] = ()  # Docker images to load into the node's containerd
    volumes: int = 8  # hostPath PersistentVolumes, one directory each
    image_store: Path | None = None  # None: ~/.cache/ddp-operator/node-containerd
    cni_bin_dir: Path | None = None  # None: Debian's or /opt/cni/bin
    build: bool = True  # build missing node binaries with hack/build-node-binaries.sh
    timeout_s: float = 180.0
    # Enforce NetworkPolicies: kube-router's firewall on the node (netpol_enforcer; test-only).
    network_policy: bool = False


# containerd's socket path must stay short (unix sockets hold 108 bytes), so it lives under /run.
DEFAULT_RUN_DIR = Path("/run/ddp-containerd")


@dataclass(frozen=True)
class NodeLayout(StateLayout):
    """Where the node's files live: under the cluster's state directory, except containerd's socket
    and runtime state (run_dir) and its image store (image_store), which persists across clusters so
    the large trainer image is imported once."""

    state_dir: Path
    image_store: Path
    run_dir: Path = DEFAULT_RUN_DIR

    @property
    def node_dir(self) -> Path:
        return self.state_dir / "node"

    @property
    def state_file(self) -> Path:
        return self.node_dir / "node.json"

    @property
    def pki_dir(self) -> Path:
        return self.node_dir / "pki"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def kubeconfig(self, component: str) -> Path:
        return self.node_dir / f"{component}.kubeconfig"

    @property
    def containerd_config(self) -> Path:
        return self.node_dir / "containerd.toml"

    @property
    def containerd_socket(self) -> Path:
        return self.run_dir / "containerd.sock"

    @property
    def containerd_state(self) -> Path:
        return self.run_dir / "state"

    @property
    def cni_conf_dir(self) -> Path:
        return self.node_dir / "cni" / "net.d"

    @property
    def cni_ipam_dir(self) -> Path:
        return self.node_dir / "cni" / "ipam"

    @property
    def kubelet_dir(self) -> Path:
        return self.node_dir / "kubelet"

    @property
    def kubelet_config(self) -> Path:
        return self.node_dir / "kubelet-config.json"

    @property
    def kube_proxy_config(self) -> Path:
        return self.node_dir / "kube-proxy-config.json"

    @property
    def corefile(self) -> Path:
        return self.node_dir / "Corefile"

    @property
    def resolv_conf(self) -> Path:
        return self.node_dir / "resolv.conf"

    @property
    def volumes_dir(self) -> Path:
        return self.node_dir / "volumes"

    @property
    def pod_logs_dir(self) -> Path:
        return self.node_dir / "pod-logs"

    @property
    def runtime_endpoint(self) -> str:
        return f"unix://{self.containerd_socket}"

    @property
    def owned_dirs(self) -> tuple[Path, ...]:
        """Directories under which every mount the node makes lives (teardown unmounts them)."""
        return (self.node_dir, self.run_dir, self.image_store)


def _toml_string(value: str | Path) -> str:
    return json.dumps(str(value))  # a JSON string of printable text is a TOML basic string


def containerd_config(layout: NodeLayout, network: NodeNetwork, cni_bin_dir: Path) -> str:
    """containerd 1.6/1.7 config (version 2) serving CRI for the kubelet.

    cgroupfs like the kubelet; restrict_oom_score_adj because these machines lack CAP_SYS_RESOURCE;
    the sandbox image is our locally built pause image (there is no registry to pull one from)."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join(
        [
            "version = 2",
            f"root = {_toml_string(layout.image_store)}",
            f"state = {_toml_string(layout.containerd_state)}",
            "oom_score = 0",
            "",
            "[grpc]",
            f"  address = {_toml_string(layout.containerd_socket)}",
            "",
            "[debug]",
            '  level = "warn"',
            "",
            f"[{cri}]",
            f"  sandbox_image = {_toml_string(normalized_image_ref(PAUSE_IMAGE))}",
            "  restrict_oom_score_adj = true",
            "  enable_selinux = false",
            "  disable_apparmor = true",
            "  max_container_log_line_size = 16384",
            "",
            f"[{cri}.containerd]",
            '  snapshotter = "overlayfs"',
            '  default_runtime_name = "runc"',
            "",
            f"[{cri}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            "",
            f"[{cri}.containerd.runtimes.runc.options]",
            "  SystemdCgroup = false",
            "",
            f"[{cri}.cni]",
            f"  bin_dir = {_toml_string(cni_bin_dir)}",
            f"  conf_dir = {_toml_string(layout.cni_conf_dir)}",
            "  max_conf_num = 1",
            "",
        ]
    )


def cni_conflist(network: NodeNetwork, layout: NodeLayout) -> dict[str, Any]:
    """bridge + host-local + portmap; containerd adds the loopback interface itself."""
    return {
        "cniVersion": "1.0.0",
        "name": "ddp-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": network.bridge,
                "isGateway": True,
                "ipMasq": False,  # pods talk to each other and to this host only
                "hairpinMode": True,  # a pod reaching itself through a Service
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": network.pod_cidr, "gateway": network.gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(layout.cni_ipam_dir),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(
    layout: NodeLayout, network: NodeNetwork, ports: NodePorts, client_ca: Path, max_pods: int = 110
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": network.gateway,
        "port": ports.kubelet,
        "readOnlyPort": 0,
        "healthzBindAddress": LOCALHOST,
        "healthzPort": ports.kubelet_healthz,
        "tlsCertFile": str(layout.cert("kubelet-serving")),
        "tlsPrivateKeyFile": str(layout.key("kubelet-serving")),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(client_ca)},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": layout.runtime_endpoint,
        "imageServiceEndpoint": layout.runtime_endpoint,
        # These machines run cgroup v1 (hybrid); kubelet >= 1.35 refuses it unless told otherwise.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "clusterDNS": [network.cluster_dns],
        "clusterDomain": network.cluster_domain,
        "resolvConf": str(layout.resolv_conf),
        "maxPods": max_pods,
        "podLogsDir": str(layout.pod_logs_dir),
        # Imported images cannot be pulled again (no registry): never garbage-collect them, and do
        # not evict pods of a busy developer machine over disk or memory headroom.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "50Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "shutdownGracePeriod": "0s",
        "containerLogMaxSize": "50Mi",
        "serializeImagePulls": False,
        "registerNode": True,
    }


def kubelet_command(
    bin_dir: Path, layout: NodeLayout, network: NodeNetwork, node_name: str, verbosity: int = 1
) -> list[str]:
    return [
        str(bin_dir / "kubelet"),
        f"--config={layout.kubelet_config}",
        f"--kubeconfig={layout.kubeconfig('kubelet')}",
        f"--hostname-override={node_name}",
        f"--node-ip={network.gateway}",
        f"--root-dir={layout.kubelet_dir}",
        f"--cert-dir={layout.pki_dir}",
        f"--node-labels={REAL_NODE_LABEL}=true",
        f"--v={verbosity}",
    ]


def kube_proxy_config(
    layout: NodeLayout, network: NodeNetwork, ports: NodePorts, node_name: str
) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clusterCIDR": network.pod_cidr,
        "hostnameOverride": node_name,
        "bindAddress": LOCALHOST,
        "healthzBindAddress": f"{LOCALHOST}:{ports.kube_proxy_healthz}",
        "metricsBindAddress": f"{LOCALHOST}:{ports.kube_proxy_metrics}",
        "clientConnection": {"kubeconfig": str(layout.kubeconfig("kube-proxy"))},
        # NodePorts only on the bridge address, never on an outside interface or loopback (the latter
        # would need route_localnet).
        "nodePortAddresses": [f"{network.gateway}/32"],
        "iptables": {"localhostNodePorts": False, "minSyncPeriod": "1s", "syncPeriod": "30s"},
        # Zero: leave the host's conntrack sysctls as they are.
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def kube_proxy_command(bin_dir: Path, layout: NodeLayout) -> list[str]:
    return [str(bin_dir / "kube-proxy"), f"--config={layout.kube_proxy_config}", "--v=1"]


def kube_proxy_cleanup_command(bin_dir: Path) -> list[str]:
    return [str(bin_dir / "kube-proxy"), "--cleanup"]


def upstream_nameservers(resolv_conf_text: str) -> list[str]:
    """The host's nameservers, without loopback ones (which a pod cannot reach)."""
    servers = []
    for line in resolv_conf_text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            try:
                address = ipaddress.ip_address(fields[1])
            except ValueError:
                continue
            if not address.is_loopback:
                servers.append(fields[1])
    return servers


def node_resolv_conf(nameservers: Sequence[str]) -> str:
    """The kubelet's resolvConf: the host's nameservers and nothing else, so pods do not inherit the
    host's search domains."""
    return "".join(f"nameserver {s}\n" for s in nameservers) or "options ndots:1\n"


def corefile(network: NodeNetwork, ports: NodePorts, kubeconfig: Path, upstream: Sequence[str]) -> str:
    lines = [
        f".:{ports.coredns} {{",
        f"    bind {network.gateway}",
        "    errors",
        f"    health {LOCALHOST}:{ports.coredns_health}",
        f"    ready {LOCALHOST}:{ports.coredns_ready}",
        f"    kubernetes {network.cluster_domain} in-addr.arpa ip6.arpa {{",
        f"        kubeconfig {kubeconfig}",
        "        pods insecure",
        "        fallthrough in-addr.arpa ip6.arpa",
        "        ttl 5",
        "    }",
    ]
    if upstream:
        lines.append(f"    forward . {' '.join(upstream)}")
    lines += ["    cache 5", "    loadbalance", "}", ""]
    return "\n".join(lines)


def coredns_command(bin_dir: Path, layout: NodeLayout) -> list[str]:
    return [str(bin_dir / "coredns"), "-conf", str(layout.corefile)]


def relay_command(python: str, listen_host: str, port: int, target_host: str) -> list[str]:
    return [
        python,
        "-m",
        "ddp_harness.tcp_relay",
        f"{listen_host}:{port}",
        f"{target_host}:{port}",
    ]


def _endpoint_slice(
    name: str, namespace: str, service: str, address: str, ports: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": ENDPOINTS_MANAGER,
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        "ports": list(ports),
    }


def api_objects(
    network: NodeNetwork, apiserver_port: int, coredns_port: int, volume_dirs: Iterable[Path]
) -> list[dict[str, Any]]:
    """What the node needs in the API: CoreDNS's RBAC, the kube-dns Service and its endpoints on the
    bridge, the `kubernetes` Service's endpoints on the apiserver's relay (the control plane runs with
    --endpoint-reconciler-type=none because its real address is loopback), a default StorageClass and
    one hostPath PersistentVolume per directory."""
    dns_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "kube-dns",
            "namespace": "kube-system",
            "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"},
        },
        "spec": {
            "clusterIP": network.cluster_dns,
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": coredns_port},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": coredns_port},
            ],
        },
    }
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": COREDNS_USER},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": COREDNS_USER},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": COREDNS_USER},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": COREDNS_USER}],
        },
        dns_service,
        _endpoint_slice(
            "kube-dns-real-node",
            "kube-system",
            "kube-dns",
            network.gateway,
            [
                {"name": "dns", "port": coredns_port, "protocol": "UDP"},
                {"name": "dns-tcp", "port": coredns_port, "protocol": "TCP"},
            ],
        ),
        _endpoint_slice(
            "kubernetes-real-node",
            "default",
            "kubernetes",
            network.gateway,
            [{"name": "https", "port": apiserver_port, "protocol": "TCP"}],
        ),
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": "kubernetes.io/no-provisioner",
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        },
    ]
    for path in volume_dirs:
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"ddp-local-{path.name}", "labels": {REAL_NODE_LABEL: "true"}},
                "spec": {
                    "capacity": {"storage": "10Gi"},
                    "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                    # Retain: a released volume is kept (and not reused) until the cluster goes down.
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": STORAGE_CLASS,
                    "hostPath": {"path": str(path), "type": "Directory"},
                },
            }
        )
    return objects


def forward_accept_rules(network: NodeNetwork) -> list[list[str]]:
    """Rule specs (without the chain) that let pod traffic through Docker's FORWARD DROP policy:
    bridged frames traverse iptables (bridge-nf-call-iptables), so even pod-to-pod traffic needs them."""
    comment = ["-m", "comment", "--comment", IPTABLES_COMMENT]
    return [
        ["-s", network.pod_cidr, *comment, "-j", "ACCEPT"],
        ["-d", network.pod_cidr, *comment, "-j", "ACCEPT"],
    ]


_CHAIN_LINE = re.compile(r"^:(\S+) ")


def iptables_chains(save_text: str) -> set[str]:
    """Chain names declared in `iptables-save -t TABLE` output."""
    return {m.group(1) for line in save_text.splitlines() if (m := _CHAIN_LINE.match(line))}


def iptables_cleanup(table: str, save_text: str, chains_before: Iterable[str]) -> list[list[str]]:
    """iptables argument lists that remove what the node's components added to one table: every rule
    carrying our comment, every rule jumping to a KUBE-/CNI- chain that did not exist before the node
    started, then those chains (flushed, then deleted)."""
    before = set(chains_before)
    new_chains = sorted(
        c for c in iptables_chains(save_text) if c.startswith(OWNED_CHAIN_PREFIXES) and c not in before
    )
    commands: list[list[str]] = []
    for line in save_text.splitlines():
        if not line.startswith("-A "):
            continue
        # iptables-save quotes a comment with spaces; -D wants it back as one argument.
        fields = shlex.split(line)
        chain = fields[1]
        if chain in new_chains:
            continue  # goes with its chain's flush
        target = fields[fields.index("-j") + 1] if "-j" in fields else None
        if IPTABLES_COMMENT in line or target in new_chains:
            commands.append(["-t", table, "-D", chain, *fields[2:]])
    commands += [["-t", table, "-F", c] for c in new_chains]
    commands += [["-t", table, "-X", c] for c in new_chains]
    return commands


def mounts_under(mountinfo_text: str, roots: Iterable[Path]) -> list[str]:
    """Mount points (from /proc/self/mountinfo) at or below any of roots, deepest first, so they can
    be unmounted in that order."""
    prefixes = [str(r).rstrip("/") for r in roots]
    found = []
    for line in mountinfo_text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))
