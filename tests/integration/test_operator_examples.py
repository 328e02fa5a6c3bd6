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
from tests.integration.operator_harness import REPO, Kube, OperatorProcess, running_ranks, wait_for

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
    replicas = int(job["spec"].get("replicas", 1))
    if job["spec"].get("checkpoint"):
        _volume_for(kube, namespace, name, job["spec"]["checkpoint"]["volumeClaimTemplate"])
    kube.run("apply", "-n", namespace, "-f", str(example))
    if job["spec"].get("checkpoint"):
        _bind(kube, namespace, name)

    pods = running_ranks(kube, namespace, name, replicas, attempt=0)
    kube.json("get", "service", name, "-n", namespace)
    wait_phase(kube, namespace, name, "Running")
    trainer = next(c for c in pods[0]["spec"]["containers"] if c["name"] == "trainer")
    resources = trainer.get("resources", {})
    if "nvidia.com/gpu" in {**resources.get("limits", {}), **resources.get("requests", {})}:
        assert {p["spec"]["nodeName"] for p in pods} <= _gpu_nodes(kube)
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        assert env["DDP_BACKEND"] == "nccl"
    if job["spec"].get("checkpoint"):
        kube.json("get", "pvc", f"{name}-checkpoint", "-n", namespace)


def _volume_for(kube: Kube, namespace: str, job: str, claim: dict[str, Any]) -> None:
    """A PersistentVolume reserved for the job's checkpoint claim. The local cluster runs no volume
    binder or provisioner, and rank 0 cannot be scheduled while its claim is unbound: see `_bind`."""
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"{namespace}-{job}"},
        "spec": {
            "capacity": {"storage": claim["resources"]["requests"]["storage"]},
            "accessModes": claim.get("accessModes", ["ReadWriteOnce"]),
            "hostPath": {"path": f"/tmp/{namespace}-{job}"},
            "claimRef": {"namespace": namespace, "name": f"{job}-checkpoint"},
            "persistentVolumeReclaimPolicy": "Retain",
        },
    }
    kube.run("apply", "-f", "-", stdin=yaml.safe_dump(volume))


def _bind(kube: Kube, namespace: str, job: str) -> None:
    """Do the volume binder's work by hand once the operator has created the claim."""
    claim = f"{job}-checkpoint"
    wait_for(
        f"the operator to create {claim}",
        lambda: kube.run("get", "pvc", claim, "-n", namespace, check=False).returncode == 0,
    )
    kube.run(
        "patch",
        "pvc",
        claim,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"volumeName": f"{namespace}-{job}"}}),
    )
    kube.run("annotate", "pvc", claim, "-n", namespace, "pv.kubernetes.io/bind-completed=yes")
    bound = {"status": {"phase": "Bound"}}
    kube.run(
        "patch",
        "pvc",
        claim,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(bound),
    )
    kube.run(
        "patch", "pv", f"{namespace}-{job}", "--subresource=status", "--type=merge", "-p", json.dumps(bound)
    )


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
        replicas = int(job["spec"].get("replicas", 1))

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
