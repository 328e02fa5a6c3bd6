"""A real local Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
and kwok for fake GPU nodes) built from the Go module proxy and run as local processes.

`ddpjob cluster up|down|status` is the command line; tests use `up`, `down` and the LocalCluster handle.
Import cost is small: nothing here imports the kubernetes client."""

from ddp_operator.cluster.binaries import BinariesError, default_bin_dir, ensure_binaries
from ddp_operator.cluster.kwok_stages import EXIT_CODE_ANNOTATION, NODE_LOST_ANNOTATION, REASON_ANNOTATION
from ddp_operator.cluster.manifests import GPU_RESOURCE, NodeShape
from ddp_operator.cluster.runtime import (
    ClusterError,
    ClusterOptions,
    KubectlError,
    LocalCluster,
    attach,
    default_state_dir,
    down,
    status,
    up,
)

__all__ = [
    "EXIT_CODE_ANNOTATION",
    "GPU_RESOURCE",
    "NODE_LOST_ANNOTATION",
    "REASON_ANNOTATION",
    "BinariesError",
    "ClusterError",
    "ClusterOptions",
    "KubectlError",
    "LocalCluster",
    "NodeShape",
    "attach",
    "default_bin_dir",
    "default_state_dir",
    "down",
    "ensure_binaries",
    "status",
    "up",
]
