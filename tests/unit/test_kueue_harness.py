"""The pure half of the Kueue harness (tests/integration/kueue_harness.py): Kueue's Configuration, its
webhook configurations rewritten to reach a local process, and the CRD conversion patch."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from tests.integration import kueue_harness as kh

pytestmark = pytest.mark.unit

CA = b"-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n"
BASE = "https://127.0.0.1:9443"


def webhook(name: str, path: str, group: str, resource: str) -> dict[str, Any]:
    return {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": path}},
        "failurePolicy": "Fail",
        "rules": [
            {"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": [resource]}
        ],
        "sideEffects": "None",
    }


MANIFESTS = [
    {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": "mutating-webhook-configuration"},
        "webhooks": [
            webhook("mjob.kb.io", "/mutate-batch-v1-job", "batch", "jobs"),
            webhook("mpod.kb.io", "/mutate--v1-pod", "", "pods"),
            webhook(
                "mworkload.kb.io", "/mutate-kueue-x-k8s-io-v1beta2-workload", "kueue.x-k8s.io", "workloads"
            ),
        ],
    },
    {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "validating-webhook-configuration"},
        "webhooks": [
            webhook("vpod.kb.io", "/validate--v1-pod", "", "pods"),
            webhook("vray.kb.io", "/validate-ray-io-v1-rayjob", "ray.io", "rayjobs"),
        ],
    },
    {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "webhook-service"}},
]


def test_configuration_is_local_and_pod_only(tmp_path: Path) -> None:
    config = kh.render_configuration(kh.KueuePorts(webhook=9443, health=8081), tmp_path)
    assert config["apiVersion"] == "config.kueue.x-k8s.io/v1beta2"
    assert config["integrations"] == {"frameworks": ["pod"]}
    assert config["webhook"] == {"host": "127.0.0.1", "port": 9443, "certDir": str(tmp_path)}
    assert config["health"] == {"healthProbeBindAddress": "127.0.0.1:8081"}
    assert config["metrics"] == {"bindAddress": "0"}
    assert config["leaderElection"] == {"leaderElect": False}
    assert config["internalCertManagement"]["enable"] is True
    assert config["managedJobsNamespaceSelector"] == {"matchLabels": {kh.MANAGED_NAMESPACE_LABEL: "true"}}
    assert config["featureGates"] == {"VisibilityOnDemand": False}


@pytest.mark.parametrize(
    ("kind", "name", "kept"),
    [
        pytest.param(
            "MutatingWebhookConfiguration",
            kh.MUTATING_WEBHOOKS,
            ["mpod.kb.io", "mworkload.kb.io"],
            id="mutating",
        ),
        pytest.param(
            "ValidatingWebhookConfiguration", kh.VALIDATING_WEBHOOKS, ["vpod.kb.io"], id="validating"
        ),
    ],
)
def test_webhooks_reach_the_local_process(kind: str, name: str, kept: list[str]) -> None:
    rendered = {c["kind"]: c for c in kh.render_webhook_configurations(MANIFESTS, BASE, CA)}
    assert set(rendered) == {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
    config = rendered[kind]
    assert config["metadata"] == {"name": name}, "the names Kueue's cert rotator injects the CA into"
    assert [w["name"] for w in config["webhooks"]] == kept, "only what the pod integration serves"
    for hook in config["webhooks"]:
        path = next(w for m in MANIFESTS for w in m.get("webhooks", ()) if w["name"] == hook["name"])[
            "clientConfig"
        ]["service"]["path"]
        assert hook["clientConfig"] == {"url": BASE + path, "caBundle": base64.b64encode(CA).decode()}
        is_pod = hook["rules"][0]["resources"] == ["pods"]
        assert (hook.get("namespaceSelector") == kh.managed_namespace_selector()) is is_pod


def test_rendering_does_not_touch_kueues_manifests() -> None:
    kh.render_webhook_configurations(MANIFESTS, BASE, CA)
    assert MANIFESTS[0]["webhooks"][1]["clientConfig"]["service"]["path"] == "/mutate--v1-pod"
    assert "namespaceSelector" not in MANIFESTS[0]["webhooks"][1]


@pytest.mark.parametrize(
    ("crd", "converts"),
    [
        pytest.param("workloads.kueue.x-k8s.io", True, id="two-versions"),
        pytest.param("localqueues.kueue.x-k8s.io", True, id="localqueues"),
        pytest.param("resourceflavors.kueue.x-k8s.io", False, id="no-conversion-patch-upstream"),
        pytest.param("topologies.kueue.x-k8s.io", False, id="topologies"),
    ],
)
def test_conversion_webhook_only_where_kueue_enables_it(crd: str, converts: bool) -> None:
    source = {"metadata": {"name": crd}, "spec": {"group": "kueue.x-k8s.io"}}
    patched = kh.with_conversion_webhook(source, BASE, CA)
    if converts:
        assert patched["spec"]["conversion"]["strategy"] == "Webhook"
        assert patched["spec"]["conversion"]["webhook"]["clientConfig"]["url"] == f"{BASE}/convert"
    else:
        assert "conversion" not in patched["spec"]
    assert "conversion" not in source["spec"]


def test_command_reads_the_config() -> None:
    assert kh.kueue_command(Path("/k/bin/kueue"), Path("/s/config.yaml"))[:2] == [
        "/k/bin/kueue",
        "--config=/s/config.yaml",
    ]
