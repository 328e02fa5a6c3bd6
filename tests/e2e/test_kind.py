"""The e2e suite on kind: a single-node kind cluster from our own node image (hack/build-kind.sh: no
registry involved), our two images loaded with `kind load docker-image`, the chart installed with helm.

The tests are the real-node suite's (tests/e2e/test_real_node.py), run here against the kind cluster:
DNS and a ClusterIP Service from a pod, the digits example across two ranks with a checkpoint volume
from the default StorageClass (local-path-provisioner), metrics scraped from both ranks through the
apiserver's pod proxy, a deleted rank pod restarting the gang from its checkpoint, and a rank exiting 1
failing the job with its reason. Not here: the NetworkPolicy test, since this node image has no
NetworkPolicy enforcer (kube-network-policies needs CONFIG_NFT_QUEUE, which these machines' kernel
lacks: docs/kind.md).

Prerequisites: Docker with both images (hack/build-images.sh), kind and the node image
(hack/build-kind.sh; `make kind` builds both), kubectl and helm (hack/build-k8s.sh). A missing one
fails the module in CI (DDP_CI_STRICT=1), since `make test-e2e` builds them all.

Environment: KIND_NODE_IMAGE (default: the image hack/build-kind.sh built), DDP_E2E_KIND_CLUSTER
(the cluster's name, ddp-e2e), DDP_E2E_KEEP_CLUSTER=1 (leave it for a look: `kind delete cluster
--name ddp-e2e` afterwards). Set DDP_E2E_KUBECONFIG to run test_real_node.py against any cluster instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# pytest imports test modules by their basename (tests/ has no packages): the same module object.
import test_real_node as suite
from test_real_node import (  # noqa: F401  (fixtures and tests that run here on kind)
    checkpoint_storage,
    network_policy_enforcer,
    operator_release,
    restricted_namespace,
    test_a_pod_resolves_kubernetes_default_and_reaches_a_cluster_ip_service,
    test_a_rank_exiting_1_fails_the_job_with_the_reason,
    test_deleting_a_rank_pod_restarts_the_gang_which_resumes_from_the_checkpoint,
    test_digits_trains_across_two_pods_with_equal_allreduce_bytes_and_succeeds,
)

pytestmark = [pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
BUILD_KIND = REPO / "hack" / "build-kind.sh"
KIND_CONFIG = REPO / "hack" / "kind" / "cluster.yaml"
KIND_CLUSTER = os.environ.get("DDP_E2E_KIND_CLUSTER", "ddp-e2e")


def _progress(message: str) -> None:
    print(f"[kind] {message}", file=sys.stderr, flush=True)


def _print(flag: str) -> str:
    return subprocess.run(
        [str(BUILD_KIND), flag], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()


def _docker_has(image: str) -> bool:
    inspected = subprocess.run(
        ["docker", "image", "inspect", image], capture_output=True, timeout=60, check=False
    )
    return inspected.returncode == 0


def kind_unavailable_reason(kind: str, node_image: str) -> str | None:
    if not os.access(kind, os.X_OK):
        return f"no kind at {kind}: build it with hack/build-kind.sh (make kind)"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60, check=False).returncode != 0:
        return "no Docker daemon answers: hack/build-images.sh starts one"
    for image in (node_image, suite.OPERATOR_IMAGE, suite.TRAINER_IMAGE):
        if not _docker_has(image):
            return f"image {image} is not in Docker: build it with hack/build-images.sh / hack/build-kind.sh"
    return None


def _kind(kind: str, *args: str, timeout: float = 600) -> None:
    result = subprocess.run([kind, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise AssertionError(f"kind {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[suite.ExternalCluster]:
    kind = _print("--print-kind")
    node_image = os.environ.get("KIND_NODE_IMAGE") or _print("--print-node-image")
    reason = kind_unavailable_reason(kind, node_image)
    if reason:
        pytest.skip(reason)
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    # A cluster left by an interrupted run would make `create` fail.
    subprocess.run(
        [kind, "delete", "cluster", "--name", KIND_CLUSTER], capture_output=True, timeout=300, check=False
    )
    started = time.monotonic()
    _kind(
        kind, "create", "cluster", "--name", KIND_CLUSTER, "--image", node_image, "--config", str(KIND_CONFIG),
        "--kubeconfig", str(kubeconfig), "--wait", "180s",
    )  # fmt: skip
    suite.TIMINGS.record("kind_create_cluster_s", time.monotonic() - started)
    try:
        started = time.monotonic()
        for image in (suite.OPERATOR_IMAGE, suite.TRAINER_IMAGE):
            _kind(kind, "load", "docker-image", image, "--name", KIND_CLUSTER, timeout=1200)
        suite.TIMINGS.record("kind_load_images_s", time.monotonic() - started)
        cluster = suite.external_cluster(kubeconfig)
        # One CoreDNS replica is plenty for one node, and its 100m CPU request is what two 500m ranks,
        # the operator and the control plane need to fit on a 2-core machine.
        cluster.kubectl_run("scale", "deployment", "coredns", "-n", "kube-system", "--replicas=1")
        yield cluster
    finally:
        if os.environ.get("DDP_E2E_KEEP_CLUSTER"):
            _progress(f"keeping the cluster: kind delete cluster --name {KIND_CLUSTER}")
        else:
            subprocess.run(
                [kind, "delete", "cluster", "--name", KIND_CLUSTER],
                capture_output=True,
                timeout=300,
                check=False,
            )
