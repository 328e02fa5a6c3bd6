"""The operator's NetworkPolicy per DDPJob on the real control plane: what it selects and admits, that
the apiserver accepts it as built, and that a job that turns it off gets none.

No enforcer runs here (kwok's pods have no network):
tests/e2e/test_real_node.py::test_the_jobs_network_policy_fences_its_ranks proves that the policy is
enforced, under kube-router's firewall on the real node and on kind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube, namespace, operator
from tests.integration.operator_harness import Kube, OperatorProcess, ddpjob, running_ranks, wait_for

from ddp_operator import builders, names

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace", "operator"]  # fixtures, imported for pytest


def _policy(kube: Kube, namespace: str, name: str) -> dict[str, Any] | None:
    result = kube.run("get", "networkpolicy", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _selected_pods(kube: Kube, namespace: str, policy: dict[str, Any]) -> list[str]:
    selector = ",".join(f"{k}={v}" for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
    listed = kube.json("get", "pods", "-n", namespace, "-l", selector)
    return sorted(p["metadata"]["name"] for p in listed["items"])


def test_every_job_gets_a_policy_admitting_its_own_pods_and_prometheus_only(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("fenced", replicas=3), namespace)
    pods = running_ranks(kube, namespace, "fenced", 3, attempt=0)
    job = kube.job(namespace, "fenced")
    assert job is not None
    uid = job["metadata"]["uid"]

    policy = wait_for("the job's NetworkPolicy", lambda: _policy(kube, namespace, "fenced"))
    meta = policy["metadata"]
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "DDPJob",
        "fenced",
        uid,
        True,
    )
    assert meta["labels"] == names.job_selector("fenced")
    assert not meta.get("finalizers")

    # The job object's pods by its UID: its rendezvous pod (no ddp.dev/job-name) is fenced like a rank.
    own = {"matchLabels": {names.LABEL_MANAGED_BY: names.MANAGED_BY_VALUE, names.LABEL_JOB_UID: uid}}
    assert policy["spec"]["podSelector"] == own
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        # The job's own pods, on every port (rendezvous, gloo/NCCL, the elastic agent's store).
        {"from": [{"podSelector": own}]},
        # Prometheus (the default: the namespace `monitoring`) on the metrics port only.
        {"from": list(builders.DEFAULT_METRICS_ALLOW_FROM), "ports": [{"protocol": "TCP", "port": 9400}]},
    ]
    # What the apiserver's own label selection makes of it: exactly the job's rank pods and the attempt's
    # rendezvous pod, whose store the ranks reach.
    expected = [*(p["metadata"]["name"] for p in pods), names.rendezvous_pod_name("fenced", 0)]
    assert _selected_pods(kube, namespace, policy) == sorted(expected)


def test_a_job_that_turns_it_off_gets_no_policy(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    job = ddpjob("open", replicas=2)
    job["spec"]["networkPolicy"] = {"enabled": False}
    kube.apply(job, namespace)
    running_ranks(kube, namespace, "open", 2, attempt=0)
    # The Service is created with the policy, before the pods: once the pods run, a policy would exist.
    assert kube.run("get", "service", "open", "-n", namespace, check=False).returncode == 0
    assert _policy(kube, namespace, "open") is None
    assert kube.json("get", "networkpolicies", "-n", namespace)["items"] == []


def test_metrics_allow_from_and_the_metrics_port_shape_the_policy(
    kube: Kube, namespace: str, tmp_path: Path
) -> None:
    peers = [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]
    process = OperatorProcess(
        kube.kubeconfig,
        [namespace],
        tmp_path / "operator.log",
        extra=["--metrics-allow-from", json.dumps(peers)],
    ).start()
    try:
        custom = ddpjob("custom", replicas=1)
        custom["spec"]["metrics"] = {"port": 9555}
        dark = ddpjob("dark", replicas=1)
        dark["spec"]["metrics"] = {"enabled": False}
        dark["spec"]["runPolicy"] = {"restartMode": "Recreate"}  # in-place restarts are counted from metrics
        kube.apply(custom, namespace)
        kube.apply(dark, namespace)
        custom_policy = wait_for("custom's NetworkPolicy", lambda: _policy(kube, namespace, "custom"))
        dark_policy = wait_for("dark's NetworkPolicy", lambda: _policy(kube, namespace, "dark"))
    finally:
        process.stop()
        print(f"--- operator log ---\n{process.log_tail(60)}")
    assert custom_policy["spec"]["ingress"][1] == {
        "from": peers,
        "ports": [{"protocol": "TCP", "port": 9555}],
    }
    # No metrics endpoint: nothing but the job's own pods.
    assert len(dark_policy["spec"]["ingress"]) == 1
    assert dark_policy["spec"]["ingress"][0]["from"][0]["podSelector"] == dark_policy["spec"]["podSelector"]
