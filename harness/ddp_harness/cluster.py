"""The local cluster as one thing: the control plane, and optionally one real node on top of it.

`up`, `down` and `status` are what `ddp-harness cluster` and the tests call; they work on a state
directory, so `down` and `status` work from another process than `up`."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddp_harness import control_plane, real_node
from ddp_harness.binaries import default_bin_dir, ensure_binaries
from ddp_harness.control_plane import ClusterState, LocalCluster
from ddp_harness.kwok_stages import ReportLatency
from ddp_harness.manifests import Layout, NodeShape
from ddp_harness.node_manifests import RealNodeOptions
from ddp_harness.processes import (
    ClusterError,
    ComponentStatus,
    Progress,
    component_statuses,
    default_state_dir,
    is_running,
)

# ClusterOptions.extra_flags for the in-tree gang API of Kubernetes 1.36 (scheduling.k8s.io/v1alpha2,
# docs/scheduling.md). The controller-manager's gate runs its podgroup-protection-controller, which
# removes the finalizer the apiserver puts on every PodGroup: without it no PodGroup, nor a namespace
# holding one, can ever be deleted. The kubelets need nothing.
# TopologyAwareWorkloadScheduling: a PodGroup's schedulingConstraints.topology (the apiserver drops the
# field without it; the scheduler places the group in one domain of the key).
GANG_SCHEDULING_FLAGS: Mapping[str, Sequence[str]] = {
    "kube-apiserver": (
        "--feature-gates=GenericWorkload=true,TopologyAwareWorkloadScheduling=true",
        "--runtime-config=scheduling.k8s.io/v1alpha2=true",
    ),
    "kube-scheduler": (
        "--feature-gates=GenericWorkload=true,GangScheduling=true,TopologyAwareWorkloadScheduling=true",
    ),
    "kube-controller-manager": ("--feature-gates=GenericWorkload=true",),
}


@dataclass(frozen=True)
class ClusterOptions:
    state_dir: Path = field(default_factory=default_state_dir)
    bin_dir: Path | None = None  # None: the build script's output for the pinned versions
    nodes: int = 4
    node_shape: NodeShape = field(default_factory=NodeShape)
    build: bool = True  # build missing binaries with hack/build-k8s.sh
    timeout_s: float = 120.0
    real_node: RealNodeOptions | None = None  # one real kubelet node (real_node.py); needs root
    # Each fake node's kubelet reports late, with jitter (kwok_stages.ReportLatency); None: at once.
    report_latency: ReportLatency | None = field(default_factory=ReportLatency)
    # Flags appended to a component's command line, e.g. feature gates: {"kube-apiserver": [...]}.
    extra_flags: Mapping[str, Sequence[str]] = field(default_factory=dict)


def up(options: ClusterOptions, progress: Progress = lambda _: None) -> LocalCluster:
    """Bring the control plane (and the real node, when asked for) up and return a handle; on failure,
    stop what was started (logs are kept in the state directory) and raise ClusterError."""
    state_dir = options.state_dir.resolve()
    existing = control_plane.read_state(state_dir)
    if existing is not None:
        if any(is_running(c) for c in existing.components):
            raise ClusterError(
                f"a cluster is already running from {state_dir}: `ddp-harness cluster down` first"
            )
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
    cluster = control_plane.start(
        layout,
        bin_dir,
        options.nodes,
        options.node_shape,
        deadline,
        progress,
        options.report_latency,
        options.extra_flags,
    )
    if options.real_node is not None:
        try:
            real_node.start(cluster, options.real_node, progress=progress)
        except BaseException:
            with contextlib.suppress(ClusterError):  # the node's own error says more
                control_plane.stop(cluster.state)
            raise
    progress(f"cluster up in {time.monotonic() - started:.1f} s; kubeconfig: {layout.kubeconfig}")
    return cluster


def attach(state_dir: Path | None = None) -> LocalCluster:
    """A handle to a cluster that `up` started, possibly in another process."""
    state = control_plane.read_state(state_dir or default_state_dir())
    if state is None:
        raise ClusterError(
            f"no cluster state in {state_dir or default_state_dir()}: `ddp-harness cluster up` first"
        )
    return LocalCluster(state)


def down(
    state_dir: Path | None = None, *, keep_state: bool = False, progress: Progress = lambda _: None
) -> bool:
    """Stop the real node (if any) and every control-plane component recorded in state_dir, and remove
    the directory; False when there was nothing to stop."""
    state_dir = (state_dir or default_state_dir()).resolve()
    state = control_plane.read_state(state_dir)
    if state is None:
        return False
    node_error = _stop_real_node(state_dir, progress)
    control_plane.stop(state, progress)
    if node_error is not None:
        raise ClusterError(f"{node_error}\nthe control plane is stopped; state kept in {state_dir}")
    if not keep_state:
        shutil.rmtree(state_dir, ignore_errors=True)
    progress(f"cluster in {state_dir} stopped" + ("" if keep_state else " and removed"))
    return True


def _stop_real_node(state_dir: Path, progress: Progress) -> ClusterError | None:
    """Tear down a real node recorded in state_dir, if any (before the apiserver goes); what could not
    be removed comes back as an error, so the state directory is kept for a post-mortem."""
    try:
        real_node.stop(state_dir, progress=progress)
    except ClusterError as exc:
        return exc
    return None


def status(state_dir: Path | None = None) -> tuple[ClusterState, list[ComponentStatus]] | None:
    """The recorded cluster and a row per component, the real node's included; None without a cluster."""
    state_dir = state_dir or default_state_dir()
    state = control_plane.read_state(state_dir)
    if state is None:
        return None
    return state, component_statuses(state.components) + real_node.status(state_dir)
