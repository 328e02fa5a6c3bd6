"""The integration tier's shared fixture: one real local control plane for the whole session.

`local_cluster` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (with
4 fake GPU nodes of 8 nvidia.com/gpu each), building the binaries with hack/build-k8s.sh when they are
missing, and stops every process at the end of the session. Its logs stay under pytest's basetemp."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator

import pytest

from ddp_harness import ClusterOptions, LocalCluster, default_bin_dir, down, up
from ddp_harness.binaries import pinned_versions, stale_binaries


def _progress(message: str) -> None:
    print(f"[local_cluster] {message}", file=sys.stderr, flush=True)


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if shutil.which("openssl") is None:
        pytest.skip("the local control plane needs the `openssl` command for its certificates")
    bin_dir = default_bin_dir()
    if stale_binaries(bin_dir, pinned_versions()) and shutil.which("go") is None:
        pytest.skip(f"no Go toolchain to build the control plane, and {bin_dir} lacks prebuilt binaries")
    state_dir = tmp_path_factory.mktemp("local-cluster")
    cluster = up(ClusterOptions(state_dir=state_dir, bin_dir=bin_dir), progress=_progress)
    try:
        yield cluster
    finally:
        # Logs, certificates and the audit log stay for a post-mortem; etcd's data does not.
        down(state_dir, keep_state=True, progress=_progress)
        shutil.rmtree(cluster.layout.etcd_data_dir, ignore_errors=True)
        left = cluster.running_components()
        if left:
            pytest.fail(f"components still running after down: {', '.join(left)}")
