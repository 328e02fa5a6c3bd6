"""The in-tree gang API of Kubernetes 1.36 against a real control plane started with its alpha gates:
discovery picks the version gang.py writes, the apiserver accepts gang.py's Workload and PodGroup as
they are, and the scheduler binds a gang whole or not at all.

This module starts a second local control plane of its own, with the flags docs/scheduling.md lists
appended to the apiserver's and scheduler's command lines (GATED_FLAGS, ClusterOptions.extra_flags)."""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from tests.integration.operator_harness import wait_for

from ddp_harness import ClusterOptions, LocalCluster, default_bin_dir, down, up
from ddp_harness.binaries import pinned_versions, stale_binaries
from ddp_operator import builders, gang, names
from ddp_operator.spec import parse_job

pytestmark = pytest.mark.integration

# What a 1.36 control plane needs for scheduling.k8s.io/v1alpha2 (docs/scheduling.md).
GATED_FLAGS: dict[str, list[str]] = {
    "kube-apiserver": [
        "--feature-gates=GenericWorkload=true",
        "--runtime-config=scheduling.k8s.io/v1alpha2=true",
    ],
    "kube-scheduler": ["--feature-gates=GenericWorkload=true,GangScheduling=true"],
}
GPU = names.GPU_RESOURCE


@pytest.fixture(scope="module")
def gated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if shutil.which("openssl") is None:
        pytest.skip("the local control plane needs the `openssl` command for its certificates")
    bin_dir = default_bin_dir()
    if stale_binaries(bin_dir, pinned_versions()) and shutil.which("go") is None:
        pytest.skip(f"no Go toolchain to build the control plane, and {bin_dir} lacks prebuilt binaries")
    state_dir = tmp_path_factory.mktemp("gated-cluster")
    cluster = up(ClusterOptions(state_dir=state_dir, bin_dir=bin_dir, nodes=4, extra_flags=GATED_FLAGS))
    try:
        yield cluster
    finally:
        down(state_dir, keep_state=True)
        shutil.rmtree(cluster.layout.etcd_data_dir, ignore_errors=True)


def group_versions(cluster: LocalCluster) -> list[str]:
    apis = json.loads(cluster.kubectl_run("get", "--raw", "/apis").stdout)
    return [v["groupVersion"] for g in apis["groups"] for v in g["versions"]]


def test_discovery_serves_v1alpha2(gated_cluster: LocalCluster) -> None:
    assert gang.served_version(group_versions(gated_cluster)) == "v1alpha2"
    resources = gated_cluster.kubectl_run("api-resources", "--api-group=scheduling.k8s.io").stdout
    assert "workloads" in resources and "podgroups" in resources, resources


def _job(namespace: str, name: str, replicas: int, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": names.API_GROUP_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
        "spec": {
            "replicas": replicas,
            "scheduling": {"gang": "Workload"},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "ddp-trainer:test",
                            "resources": {"limits": {GPU: str(gpus)}},
                        }
                    ]
                }
            },
        },
    }


def _create_gang(cluster: LocalCluster, namespace: str, name: str, replicas: int, gpus: int) -> None:
    """What phase 2's controller will do for attempt 0: Workload, PodGroup, then the pods (standalone
    here: no DDPJob object exists, so the owner references are dropped)."""
    spec = parse_job(_job(namespace, name, replicas, gpus))
    objects = gang.gang_objects(spec, 0, gang.served_version(group_versions(cluster)))
    assert objects is not None
    children = [objects.workload, objects.pod_group] + [
        builders.build_rank_pod(spec, rank, 0, pod_spec_patch=objects.pod_spec_patch)
        for rank in range(replicas)
    ]
    for child in children:
        del child["metadata"]["ownerReferences"]
    cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": children[:2]})
    cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": children[2:]})


def _bound(cluster: LocalCluster, namespace: str, job: str) -> list[str]:
    pods = cluster.get_json("pods", "-n", namespace, "-l", names.label_selector(job))["items"]
    return [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")]


def test_the_apiserver_accepts_the_adapters_objects_and_the_scheduler_binds_the_gang(
    gated_cluster: LocalCluster,
) -> None:
    namespace = f"gang-{uuid.uuid4().hex[:6]}"
    gated_cluster.create_namespace(namespace)
    _create_gang(gated_cluster, namespace, "fits", replicas=3, gpus=8)
    pod = gated_cluster.get_json("pod", "fits-0-0", "-n", namespace)
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "fits-0"}, "the apiserver kept the field"
    wait_for("all 3 ranks bound", lambda: len(_bound(gated_cluster, namespace, "fits")) == 3, timeout=60)
    pod_group = gated_cluster.get_json("podgroups.scheduling.k8s.io", "fits-0", "-n", namespace)
    assert pod_group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 3}}

    # 4 nodes x 8 GPUs: 3 are taken, so a second gang of 3 x 8 cannot be placed: none of it binds.
    _create_gang(gated_cluster, namespace, "waits", replicas=3, gpus=8)
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        assert _bound(gated_cluster, namespace, "waits") == [], "a gang binds whole or not at all"
        time.sleep(0.5)
    placed, message = gang.pod_group_scheduled(
        gated_cluster.get_json("podgroups.scheduling.k8s.io", "waits-0", "-n", namespace)
    )
    print(f"PodGroup waits-0: scheduled={placed} {message}")
    assert placed is not True

    # The first gang goes: the second is placed whole.
    gated_cluster.kubectl_run(
        "delete", "pods", "-n", namespace, "-l", names.label_selector("fits"), "--wait=false"
    )
    wait_for(
        "the second gang bound whole", lambda: len(_bound(gated_cluster, namespace, "waits")) == 3, timeout=90
    )
    gated_cluster.kubectl_run("delete", "namespace", namespace, "--wait=false")
