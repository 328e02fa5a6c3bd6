"""The local control plane's pure parts: node manifests, component command lines, kwok stages, versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_harness import manifests
from ddp_harness.binaries import BINARY_VERSION_KEYS, parse_versions, stale_binaries
from ddp_harness.kwok_stages import (
    EXIT_CODE_ANNOTATION,
    FAKE_NODE_ANNOTATION,
    FAKE_NODE_ANNOTATION_VALUE,
    NODE_LOST_ANNOTATION,
    ReportLatency,
    kwok_stages,
)
from ddp_harness.manifests import Layout, NodeShape, Ports

pytestmark = pytest.mark.unit

PORTS = Ports(
    etcd_client=2379, etcd_peer=2380, apiserver=6443, controller_manager=10257, scheduler=10259, kwok=10247
)
LAYOUT = Layout(Path("/state"))
BIN = Path("/bin-dir")


@pytest.mark.parametrize(
    ("shape", "gpus", "memory"),
    [
        pytest.param(NodeShape(), "8", "1024Gi", id="default-8-gpus"),
        pytest.param(NodeShape(gpus=0, memory_gi=64), "0", "64Gi", id="cpu-only-node"),
    ],
)
def test_fake_gpu_node_is_managed_by_kwok_and_declares_its_capacity(
    shape: NodeShape, gpus: str, memory: str
) -> None:
    node = manifests.fake_gpu_node("n0", shape)
    assert node["metadata"]["annotations"][FAKE_NODE_ANNOTATION] == FAKE_NODE_ANNOTATION_VALUE
    for field in ("capacity", "allocatable"):
        assert node["status"][field][manifests.GPU_RESOURCE] == gpus
        assert node["status"][field]["memory"] == memory
        assert node["status"][field]["pods"] == str(shape.pods)
    assert node["status"]["capacity"] is not node["status"]["allocatable"]


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(manifests.etcd_command, id="etcd"),
        pytest.param(manifests.apiserver_command, id="kube-apiserver"),
        pytest.param(manifests.controller_manager_command, id="kube-controller-manager"),
        pytest.param(manifests.scheduler_command, id="kube-scheduler"),
        pytest.param(manifests.kwok_command, id="kwok"),
    ],
)
def test_every_component_listens_on_localhost_only(command: manifests.CommandBuilder) -> None:
    argv = command(BIN, LAYOUT, PORTS)
    assert argv[0].startswith(str(BIN))
    joined = " ".join(argv)
    assert "0.0.0.0" not in joined
    assert manifests.LOCALHOST in joined


def test_kwok_manages_only_annotated_nodes() -> None:
    argv = manifests.kwok_command(BIN, LAYOUT, PORTS)
    assert "--manage-all-nodes=false" in argv
    assert (
        f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}={FAKE_NODE_ANNOTATION_VALUE}" in argv
    )


def test_audit_policy_records_writes_and_drops_reads() -> None:
    rules = manifests.audit_policy()["rules"]
    writes = rules[0]
    assert writes["level"] == "Metadata"
    assert set(writes["verbs"]) == {"create", "update", "patch", "delete", "deletecollection"}
    assert rules[-1] == {"level": "None"}


def test_kwok_stage_set_covers_node_and_pod_lifecycles() -> None:
    stages = kwok_stages()
    by_name = {s["metadata"]["name"]: s for s in stages}
    assert set(by_name) == {
        "node-initialize",
        "node-lost",
        "node-heartbeat",
        "pod-ready",
        "pod-complete-by-annotation",
        "pod-stop-on-delete",
        "pod-delete",
        "pod-delete-stopped",
    }
    assert by_name["pod-delete"]["spec"]["next"] == {"delete": True}
    assert by_name["pod-delete-stopped"]["spec"]["next"] == {"delete": True}
    # A deleted pod that a finalizer keeps ends terminal (SIGTERM), as a kubelet reports it.
    stopped = by_name["pod-stop-on-delete"]["spec"]["next"]["statusTemplate"]
    assert '$code := "143"' in stopped and "phase: Failed" in stopped
    # The two delete stages never both match a pod: kwok would pick one at random.
    plain = by_name["pod-delete"]["spec"]["selector"]["matchExpressions"]
    kept = by_name["pod-delete-stopped"]["spec"]["selector"]["matchExpressions"]
    assert {"key": ".metadata.finalizers", "operator": "DoesNotExist"} in plain
    assert {"key": ".metadata.finalizers", "operator": "Exists"} in kept
    template = by_name["pod-complete-by-annotation"]["spec"]["next"]["statusTemplate"]
    assert EXIT_CODE_ANNOTATION in template
    ready_selector = by_name["pod-ready"]["spec"]["selector"]["matchExpressions"]
    assert {
        "key": f'.metadata.annotations["{EXIT_CODE_ANNOTATION}"]',
        "operator": "DoesNotExist",
    } in ready_selector
    json.dumps(stages)  # written to kwok's config as JSON documents


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("A=1\nB=v2\n", {"A": "1", "B": "v2"}, id="plain"),
        pytest.param("# pinned\n\nA='x'\n", {"A": "x"}, id="comments-blank-quotes"),
        pytest.param("not a pair\nA = y \n", {"A": "y"}, id="junk-and-spaces"),
    ],
)
def test_parse_versions(text: str, expected: dict[str, str]) -> None:
    assert parse_versions(text) == expected


def _install(bin_dir: Path, name: str, version: str) -> None:
    (bin_dir / name).write_text("#!/bin/sh\n")
    (bin_dir / name).chmod(0o755)
    (bin_dir / f".{name}.version").write_text(version + "\n")


@pytest.mark.parametrize(
    ("etcd_built_at", "expected"),
    [
        pytest.param("v3.6.16", [], id="all-current"),
        pytest.param("v3.6.15", ["etcd"], id="etcd-built-at-another-version"),
        pytest.param(None, ["etcd"], id="etcd-missing"),
    ],
)
def test_stale_binaries(tmp_path: Path, etcd_built_at: str | None, expected: list[str]) -> None:
    versions = {
        "KUBERNETES_VERSION": "v1.36.3",
        "ETCD_VERSION": "v3.6.16",
        "KWOK_VERSION": "v0.8.0",
        "HELM_VERSION": "v3.22.0",
    }
    for name, key in BINARY_VERSION_KEYS.items():
        if name != "etcd":
            _install(tmp_path, name, versions[key])
    if etcd_built_at:
        _install(tmp_path, "etcd", etcd_built_at)
    assert stale_binaries(tmp_path, versions) == expected


def test_each_fake_node_reports_after_a_latency_of_its_own_and_a_lost_node_never() -> None:
    nodes = ["n0", "n1", "n2"]
    stages = kwok_stages(nodes=nodes, latency=ReportLatency(step_ms=300, jitter_ms=900))
    by_name = {s["metadata"]["name"]: s for s in stages}
    for index, node in enumerate(nodes):
        for kind in ("pod-ready", "pod-complete-by-annotation"):
            stage = by_name[f"{kind}-{node}"]["spec"]
            assert {"key": ".spec.nodeName", "operator": "In", "values": [node]} in stage["selector"][
                "matchExpressions"
            ]
            assert stage["delay"] == {
                "durationMilliseconds": 300 * index,
                "jitterDurationMilliseconds": 300 * index + 900,
            }
    assert "pod-ready" not in by_name, "with per-node stages no pod is reported without its node's latency"
    # A node created after the cluster (a test's own pool) reports too, after a latency of its own.
    for kind in ("pod-ready", "pod-complete-by-annotation"):
        later = by_name[f"{kind}-later-nodes"]["spec"]
        assert {"key": ".spec.nodeName", "operator": "NotIn", "values": nodes} in later["selector"][
            "matchExpressions"
        ]
        assert later["delay"]["durationMilliseconds"] == 300 * len(nodes)
    lost_pod = {"key": f'.metadata.annotations["{NODE_LOST_ANNOTATION}"]', "operator": "DoesNotExist"}
    for name, stage in by_name.items():
        if name.startswith("pod-"):
            assert lost_pod in stage["spec"]["selector"]["matchExpressions"], name
