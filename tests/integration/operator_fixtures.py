"""Fixtures shared by the test_operator_* modules (imported by them; conftest.py belongs to the cluster)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_harness import REPO, Kube, OperatorProcess, wait_for

from ddp_operator import names

# The standby pods' PriorityClass as the chart installs it for a release named ddp-operator
# (templates/priorityclass.yaml): the class the operator gives standbys unless told otherwise.
STANDBY_PRIORITY_CLASS: dict[str, Any] = {
    "apiVersion": "scheduling.k8s.io/v1",
    "kind": "PriorityClass",
    "metadata": {"name": names.DEFAULT_STANDBY_PRIORITY_CLASS},
    "value": -1,
    "globalDefault": False,
    "preemptionPolicy": "Never",
}


@pytest.fixture(scope="session")
def kube(local_cluster: Any) -> Kube:
    """kubectl on the local cluster with the DDPJob CRD installed and established, and the standby
    PriorityClass the chart installs beside the operator."""
    kube = Kube(local_cluster)
    crd_dir = REPO / "crds"
    kube.run("apply", "-f", str(crd_dir))
    kube.run("apply", "-f", "-", stdin=json.dumps(STANDBY_PRIORITY_CLASS))
    kube.cluster.wait_established("ddpjobs.ddp.dev")
    return kube


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> Iterator[str]:
    prefix = "op-" + request.node.name.split("[")[0].removeprefix("test_").replace("_", "-")[:30].rstrip("-")
    name = kube.create_namespace(prefix)
    yield name
    kube.delete_namespace(name)


def _operator(kube: Kube, namespace: str, tmp_path: Path, *extra: str) -> Iterator[OperatorProcess]:
    process = OperatorProcess(kube.kubeconfig, [namespace], tmp_path / "operator.log", extra).start()
    yield process
    process.stop()
    print(f"--- operator log ({process.log_path}) ---\n{process.log_tail(80)}")


@pytest.fixture
def operator(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """An operator watching only this test's namespace; pytest shows its log tail when the test fails."""
    yield from _operator(kube, namespace, tmp_path)


@pytest.fixture
def verbose_operator(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator with debug logging (``-v``): its log has a line per decision
    (``OperatorProcess.decisions``)."""
    yield from _operator(kube, namespace, tmp_path, "-v")


def wait_phase(kube: Kube, namespace: str, name: str, phase: str, timeout: float = 90.0) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        status = kube.status(namespace, name)
        return status if status.get("phase") == phase else None

    try:
        return wait_for(f"{name} phase {phase}", probe, timeout=timeout)
    except AssertionError as error:
        raise AssertionError(f"{error}\nstatus now: {kube.status(namespace, name)}") from None
