"""Every manifest in examples/ applied with kubectl gets its Service and Running rank pods; Pod Security.

The multi-GPU example asks for nvidia.com/gpu, which only the fake GPU nodes offer, so its pods being
Running proves they were scheduled there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.integration.operator_fixtures import kube, namespace, operator, wait_phase
from tests.integration.operator_harness import (
    REPO,
    Kube,
    OperatorProcess,
    checkpoint_volume,
    running_ranks,
    wait_for,
)
from tests.integration.topology_nodes import ranks_by_order, ranks_of

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace", "operator"]  # fixtures, imported for pytest


def _examples() -> list[Any]:
    params = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "DDPJob"]
        if docs:
            params.append(pytest.param(path, id=path.stem))
    return params or [
        pytest.param(None, id="no-examples", marks=pytest.mark.skip(reason="examples/ has no DDPJob yet"))
    ]


def _the_job(path: Path) -> dict[str, Any]:
    jobs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "DDPJob"]
    job: dict[str, Any] = jobs[0]
    return job


def _gpu_nodes(kube: Kube) -> set[str]:
    nodes = kube.json("get", "nodes")["items"]
    return {n["metadata"]["name"] for n in nodes if n["status"].get("allocatable", {}).get("nvidia.com/gpu")}


@pytest.mark.parametrize("example", _examples())
def test_example_gets_its_service_and_running_rank_pods(
    kube: Kube, namespace: str, operator: OperatorProcess, example: Path
) -> None:
    job = _the_job(example)
    name = job["metadata"]["name"]
    replicas = int(job["spec"].get("replicas") or job["spec"].get("elastic", {}).get("maxReplicas", 1))
    checkpoint = job["spec"].get("checkpoint")
    volume = (
        checkpoint_volume(kube, namespace, name, checkpoint["volumeClaimTemplate"]) if checkpoint else None
    )
    try:
        kube.run("apply", "-n", namespace, "-f", str(example))
        if volume is not None:
            # The controller-manager's volume binder binds the operator's claim to the volume reserved
            # for it; rank 0 mounts the claim, so the scheduler places it only once that is done.
            _wait_bound(kube, namespace, f"{name}-checkpoint", volume)

        pods = running_ranks(kube, namespace, name, replicas, attempt=0)
        kube.json("get", "service", name, "-n", namespace)
        wait_phase(kube, namespace, name, "Running")
        trainer = next(c for c in pods[0]["spec"]["containers"] if c["name"] == "trainer")
        resources = trainer.get("resources", {})
        if "nvidia.com/gpu" in {**resources.get("limits", {}), **resources.get("requests", {})}:
            assert {p["spec"]["nodeName"] for p in pods} <= _gpu_nodes(kube)
            env = {e["name"]: e.get("value") for e in trainer["env"]}
            assert env["DDP_BACKEND"] == "nccl"
        asked = (job["spec"].get("scheduling") or {}).get("topology")
        if asked:
            _check_placement_shown(kube, namespace, name, asked, pods)
    finally:
        if volume is not None:
            # pv-protection holds the volume until its claim goes with the namespace.
            kube.run("delete", "pv", volume, "--wait=false", check=False)


def _check_placement_shown(
    kube: Kube, namespace: str, name: str, asked: dict[str, str], pods: list[dict[str, Any]]
) -> None:
    """status.topology names, for every rank, the topology label's value on the node its pod is on."""
    key = asked.get("required") or asked.get("preferred")
    shown = wait_for("status.topology", lambda: kube.status(namespace, name).get("topology"), timeout=30)
    labels = {
        n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in kube.json("get", "nodes")["items"]
    }
    domain_of_node = {node: node_labels.get(key, "") for node, node_labels in labels.items()}
    bound = [kube.json("get", "pod", p["metadata"]["name"], "-n", namespace) for p in pods]
    # The ranks the rendezvous gives (an InPlace job's follow the topology: the pods' order keys).
    actual = dict(enumerate(ranks_by_order(bound, domain_of_node)))
    listed = {rank: domain["name"] for domain in shown["domains"] for rank in ranks_of(domain["ranks"])}
    assert (shown["key"], listed) == (key, actual), shown


def _wait_bound(kube: Kube, namespace: str, claim: str, volume: str) -> None:
    def bound() -> bool:
        result = kube.run("get", "pvc", claim, "-n", namespace, "-o", "json", check=False)
        if result.returncode != 0:
            return False
        pvc = json.loads(result.stdout)
        return bool(pvc.get("status", {}).get("phase") == "Bound" and pvc["spec"].get("volumeName") == volume)

    wait_for(f"the volume binder to bind {claim} to {volume}", bound, timeout=60)
    pv = kube.json("get", "pv", volume)
    assert pv["status"]["phase"] == "Bound" and pv["spec"]["claimRef"]["name"] == claim, pv


@pytest.fixture
def restricted_namespace(kube: Kube) -> Iterator[str]:
    name = kube.create_namespace(
        "op-restricted",
        labels={
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        },
    )
    yield name
    kube.delete_namespace(name)


@pytest.mark.parametrize("example", _examples())
def test_example_pods_are_admitted_under_pod_security_restricted(
    kube: Kube, restricted_namespace: str, tmp_path: Path, example: Path
) -> None:
    process = OperatorProcess(kube.kubeconfig, [restricted_namespace], tmp_path / "operator.log").start()
    try:
        job = _the_job(example)
        name = job["metadata"]["name"]
        kube.run("apply", "-n", restricted_namespace, "-f", str(example))
        replicas = int(job["spec"].get("replicas") or job["spec"].get("elastic", {}).get("maxReplicas", 1))

        def created_or_refused() -> Any:
            phase = kube.status(restricted_namespace, name).get("phase")
            if phase == "Failed":
                return kube.status(restricted_namespace, name)
            return len(kube.pods(restricted_namespace, name)) == replicas

        outcome = wait_for(f"{name}'s pods to be created", created_or_refused, timeout=90)
        assert outcome is True, f"refused under Pod Security restricted: {outcome}"
    finally:
        process.stop()
        print(process.log_tail(60))
