"""Pure builders for the local control plane: fake GPU nodes, the audit policy, kubeconfigs, and the
command line of every component. No process is started and no file is written here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_harness.kwok_logs import LOGS_KIND
from ddp_harness.kwok_stages import FAKE_NODE_ANNOTATION, FAKE_NODE_ANNOTATION_VALUE
from ddp_harness.processes import LOCALHOST as LOCALHOST
from ddp_harness.processes import StateLayout

GPU_RESOURCE = "nvidia.com/gpu"
# The certificate kwok serves its kubelet-like endpoints with (pki.py signs it for the node IP).
KWOK_SERVING_CERT = "kwok-serving"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"

# What kube-controller-manager runs: what the operator and the tests rely on, nothing that needs a kubelet.
CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "job-controller",
    "cronjob-controller",
    "ttl-after-finished-controller",
    "deployment-controller",
    "replicaset-controller",
    "statefulset-controller",
    "daemonset-controller",
    "disruption-controller",
    "resourcequota-controller",
    "pod-garbage-collector-controller",
    # Folds aggregated ClusterRoles (the chart's DDPJob view and edit roles) into view, edit and admin.
    "clusterrole-aggregation-controller",
    # Notices a fake node that stops heartbeating (a test can simulate node loss) and taints it;
    # the taint-eviction controller then evicts pods that do not tolerate the taint.
    "node-lifecycle-controller",
    "taint-eviction-controller",
    # Binds PVCs to PVs (static provisioning; there is no dynamic provisioner), and removes the
    # kubernetes.io/pv-protection and kubernetes.io/pvc-protection finalizers that the
    # StorageObjectInUseProtection admission plugin adds: without them no PVC or PV is ever deleted,
    # nor a namespace that holds one.
    "persistentvolume-binder-controller",
    "persistentvolume-protection-controller",
    "persistentvolumeclaim-protection-controller",
    # With the GenericWorkload gate (a gang-scheduling cluster, docs/scheduling.md) the apiserver puts
    # scheduling.k8s.io/podgroup-protection on every PodGroup and only this controller removes it;
    # without the gate it stays disabled.
    "podgroup-protection-controller",
)


@dataclass(frozen=True)
class NodeShape:
    """The capacity of every fake GPU node."""

    gpus: int = 8
    cpus: int = 96
    memory_gi: int = 1024
    pods: int = 110


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int


@dataclass(frozen=True)
class Layout(StateLayout):
    """Where a cluster's files live, all under one state directory."""

    state_dir: Path

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def etcd_data_dir(self) -> Path:
        return self.state_dir / "etcd"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.log_dir / "audit.log"

    @property
    def audit_policy(self) -> Path:
        return self.state_dir / "audit-policy.json"

    @property
    def kwok_config(self) -> Path:
        return self.state_dir / "kwok.yaml"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "cluster.json"

    @property
    def pod_logs_dir(self) -> Path:
        """The fake pods' container logs, which kwok serves (kwok_logs.py)."""
        return self.state_dir / "pod-logs"

    @property
    def sa_public_key(self) -> Path:
        return self.pki_dir / "sa.pub"

    def component_kubeconfig(self, component: str) -> Path:
        return self.state_dir / f"{component}.kubeconfig"


# (bin_dir, layout, ports) -> argv
CommandBuilder = Callable[[Path, "Layout", "Ports"], list[str]]


def node_name(index: int) -> str:
    return f"gpu-node-{index}"


def fake_gpu_node(name: str, shape: NodeShape) -> dict[str, Any]:
    """A Node object kwok will manage; the apiserver keeps the status given at creation."""
    resources = {
        "cpu": str(shape.cpus),
        "memory": f"{shape.memory_gi}Gi",
        "pods": str(shape.pods),
        GPU_RESOURCE: str(shape.gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {FAKE_NODE_ANNOTATION: FAKE_NODE_ANNOTATION_VALUE},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
        },
        "spec": {},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def audit_policy() -> dict[str, Any]:
    """Record who wrote what (Metadata level: user, verb, object, response code) and nothing else,
    so a benchmark can count one client's writes without the log growing with every read."""
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [
            {"level": "Metadata", "verbs": ["create", "update", "patch", "delete", "deletecollection"]},
            {"level": "None"},
        ],
    }


def kubeconfig(server: str, ca_cert: Path, client_cert: Path, client_key: Path, user: str) -> dict[str, Any]:
    name = "ddp-local"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [
            {"name": user, "user": {"client-certificate": str(client_cert), "client-key": str(client_key)}}
        ],
        "contexts": [{"name": name, "context": {"cluster": name, "user": user, "namespace": "default"}}],
        "current-context": name,
    }


def apiserver_url(ports: Ports) -> str:
    return f"https://{LOCALHOST}:{ports.apiserver}"


def etcd_command(bin_dir: Path, layout: Layout, ports: Ports) -> list[str]:
    client = f"http://{LOCALHOST}:{ports.etcd_client}"
    peer = f"http://{LOCALHOST}:{ports.etcd_peer}"
    return [
        str(bin_dir / "etcd"),
        "--name=ddp-local",
        f"--data-dir={layout.etcd_data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=ddp-local={peer}",
        # Test data is thrown away: skipping fsync makes every write cheap.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_command(bin_dir: Path, layout: Layout, ports: Ports) -> list[str]:
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://{LOCALHOST}:{ports.etcd_client}",
        f"--bind-address={LOCALHOST}",
        f"--advertise-address={LOCALHOST}",
        f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={layout.cert('apiserver')}",
        f"--tls-private-key-file={layout.key('apiserver')}",
        f"--client-ca-file={layout.cert('ca')}",
        f"--kubelet-client-certificate={layout.cert('apiserver-kubelet-client')}",
        f"--kubelet-client-key={layout.key('apiserver-kubelet-client')}",
        f"--kubelet-certificate-authority={layout.cert('ca')}",
        # A real node's hostname does not resolve here; its InternalIP (the node's bridge) does.
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        # Aggregated APIs (metrics-server and the like) trust the apiserver's front-proxy identity.
        f"--requestheader-client-ca-file={layout.cert('ca')}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={layout.cert('front-proxy-client')}",
        f"--proxy-client-key-file={layout.key('front-proxy-client')}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={layout.sa_public_key}",
        f"--service-account-signing-key-file={layout.key('sa')}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        # Node for a real kubelet that may join later (e2e), RBAC for everything else.
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        # That plugin taints every new node not-ready until the node-lifecycle controller sees it Ready
        # (up to its 5 s monitor period); kwok's nodes are born with their status, so skip the wait.
        "--disable-admission-plugins=TaintNodesByCondition",
        # As on OpenShift and hardened clusters: setting blockOwnerDeletion on an ownerReference takes
        # `update` on the owner's finalizers, so the chart's RBAC is proven against it here.
        "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
        # The kubernetes Service cannot point at a loopback address; nothing in-cluster needs it here.
        "--endpoint-reconciler-type=none",
        f"--audit-policy-file={layout.audit_policy}",
        f"--audit-log-path={layout.audit_log}",
        "--audit-log-format=json",
        "--audit-log-maxsize=1024",
        "--profiling=false",
    ]


def _control_loop_base(bin_dir: Path, layout: Layout, name: str, secure_port: int) -> list[str]:
    """The binary and the flags the controller-manager and the scheduler share: their kubeconfig for
    the API, authentication and authorization, and their HTTPS endpoint on loopback."""
    kubeconfig_path = layout.component_kubeconfig(name)
    return [
        str(bin_dir / name),
        f"--kubeconfig={kubeconfig_path}",
        f"--authentication-kubeconfig={kubeconfig_path}",
        f"--authorization-kubeconfig={kubeconfig_path}",
        f"--bind-address={LOCALHOST}",
        f"--secure-port={secure_port}",
    ]


def controller_manager_command(bin_dir: Path, layout: Layout, ports: Ports) -> list[str]:
    return [
        *_control_loop_base(bin_dir, layout, "kube-controller-manager", ports.controller_manager),
        "--leader-elect=false",
        f"--controllers={','.join(CONTROLLERS)}",
        f"--service-account-private-key-file={layout.key('sa')}",
        f"--root-ca-file={layout.cert('ca')}",
        f"--cluster-cidr={POD_CIDR}",
        f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
        # Tests create and delete many objects at once; the default 20 qps makes GC crawl.
        "--kube-api-qps=200",
        "--kube-api-burst=400",
        "--profiling=false",
    ]


def scheduler_command(bin_dir: Path, layout: Layout, ports: Ports) -> list[str]:
    return [
        *_control_loop_base(bin_dir, layout, "kube-scheduler", ports.scheduler),
        "--leader-elect=false",
        "--profiling=false",
    ]


def kwok_command(bin_dir: Path, layout: Layout, ports: Ports) -> list[str]:
    return [
        str(bin_dir / "kwok"),
        f"--kubeconfig={layout.component_kubeconfig('kwok')}",
        f"--config={layout.kwok_config}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}={FAKE_NODE_ANNOTATION_VALUE}",
        f"--server-address={LOCALHOST}:{ports.kwok}",
        # The apiserver reaches a node's "kubelet" at its InternalIP and daemonEndpoints port, over HTTPS
        # verified against the CA, for pod logs (kwok_logs.py): the node-initialize stage writes this port,
        # and kwok serves TLS beside plain HTTP on the same listener.
        f"--node-port={ports.kwok}",
        f"--tls-cert-file={layout.cert(KWOK_SERVING_CERT)}",
        f"--tls-private-key-file={layout.key(KWOK_SERVING_CERT)}",
        # Pod logs come from Logs objects (one per pod, made by the harness), which kwok watches.
        f"--enable-crds={LOGS_KIND}",
        f"--cidr={POD_CIDR}",
        f"--node-ip={LOCALHOST}",
        # No lease renewals: nothing here evicts pods from a node whose lease expires.
        "--node-lease-duration-seconds=0",
    ]
