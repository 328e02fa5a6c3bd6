"""The test harness of ddp-operator: a real local Kubernetes control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, and kwok for fake GPU nodes) built from the Go module proxy
and run as local processes, optionally with one real kubelet node.

A development package beside the product: it is in neither the product wheel nor an image, and the
product (ddp_operator, ddp_trainer) never imports it. `ddp-harness cluster up|down|status` is the
command line; tests use `up`, `down` and the LocalCluster handle. Import cost is small: nothing here
imports the kubernetes client.

Layers, each importing only those below it: processes (processes, ports, state records) and hack
(where the developer scripts are); the pure builders (manifests, node_manifests, kwok_stages,
kwok_logs, pki, binaries); netpol_enforcer (the NetworkPolicy enforcer); control_plane and then
real_node; cluster (both together); cli."""

from ddp_harness.binaries import BinariesError, default_bin_dir, ensure_binaries
from ddp_harness.cluster import GANG_SCHEDULING_FLAGS, ClusterOptions, attach, down, status, up
from ddp_harness.control_plane import KubectlError, LocalCluster
from ddp_harness.kwok_stages import (
    EXIT_CODE_ANNOTATION,
    FINISHED_AT_ANNOTATION,
    MESSAGE_ANNOTATION,
    NODE_LOST_ANNOTATION,
    REASON_ANNOTATION,
    ReportLatency,
)
from ddp_harness.manifests import GPU_RESOURCE, NodeShape
from ddp_harness.processes import ClusterError, default_state_dir

__all__ = [
    "EXIT_CODE_ANNOTATION",
    "FINISHED_AT_ANNOTATION",
    "GANG_SCHEDULING_FLAGS",
    "GPU_RESOURCE",
    "MESSAGE_ANNOTATION",
    "NODE_LOST_ANNOTATION",
    "REASON_ANNOTATION",
    "BinariesError",
    "ClusterError",
    "ClusterOptions",
    "KubectlError",
    "LocalCluster",
    "NodeShape",
    "ReportLatency",
    "attach",
    "default_bin_dir",
    "default_state_dir",
    "down",
    "ensure_binaries",
    "status",
    "up",
]
