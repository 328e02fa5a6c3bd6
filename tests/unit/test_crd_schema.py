"""The CRD documents every field, and agrees with the parser's defaults, enums and bounds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddp_operator import names, spec

pytestmark = pytest.mark.unit

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "ddp.dev_ddpjobs.yaml"


def load_crd() -> dict[str, Any]:
    crd: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
    return crd


def root_schema() -> dict[str, Any]:
    (version,) = load_crd()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def walk(schema: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, child in (schema.get("properties") or {}).items():
        yield from walk(child, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def field(path: str) -> dict[str, Any]:
    node = root_schema()
    for part in path.split("."):
        node = node["properties"][part]
    return node


def test_every_field_has_a_description() -> None:
    undocumented = [
        path
        for path, node in walk(root_schema(), "")
        # Values of label/annotation maps are plain strings, described by their map.
        if not str(node.get("description", "")).strip() and not path.endswith("{}")
    ]
    assert undocumented == []


def test_names_match_the_constants() -> None:
    crd = load_crd()
    assert crd["metadata"]["name"] == names.CRD_NAME
    assert crd["spec"]["group"] == names.API_GROUP
    assert crd["spec"]["names"]["kind"] == names.KIND
    assert crd["spec"]["names"]["plural"] == names.PLURAL
    assert crd["spec"]["names"]["shortNames"] == [names.SHORT_NAME]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == names.API_VERSION
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Phase", "Ready", "Restarts", "World", "Step", "Samples/s", "Age"]


@pytest.mark.parametrize(
    ("path", "default"),
    [
        pytest.param(
            "spec.elastic.replacementWaitSeconds",
            spec.DEFAULT_REPLACEMENT_WAIT_SECONDS,
            id="replacement-wait",
        ),
        pytest.param("spec.nprocPerNode", spec.DEFAULT_NPROC_PER_NODE, id="nproc"),
        pytest.param("spec.backend", "auto", id="backend"),
        pytest.param("spec.restartPolicy", spec.DEFAULT_RESTART_POLICY, id="restart-policy"),
        pytest.param("spec.runPolicy.backoffLimit", spec.DEFAULT_BACKOFF_LIMIT, id="backoff"),
        pytest.param("spec.runPolicy.cleanPodPolicy", spec.DEFAULT_CLEAN_POD_POLICY, id="clean"),
        pytest.param("spec.runPolicy.suspend", False, id="suspend"),
        pytest.param("spec.checkpoint.mountPath", spec.DEFAULT_CHECKPOINT_MOUNT_PATH, id="mount-path"),
        pytest.param("spec.rendezvousPort", spec.DEFAULT_RENDEZVOUS_PORT, id="rendezvous"),
        pytest.param("spec.metrics.enabled", True, id="metrics-enabled"),
        pytest.param("spec.metrics.port", spec.DEFAULT_METRICS_PORT, id="metrics-port"),
    ],
)
def test_defaults_agree_with_the_parser(path: str, default: Any) -> None:
    assert field(path)["default"] == default


def test_replicas_has_no_schema_default() -> None:
    """The CRD's CEL tells a left-out spec.replicas (an elastic job's) from one set: a schema default
    would make it always present. The parser defaults it instead."""
    assert "default" not in field("spec.replicas")
    assert (
        spec.parse_job(
            {
                "metadata": {"name": "j"},
                "spec": {"template": {"spec": {"containers": [{"name": "trainer", "image": "i"}]}}},
            }
        ).replicas
        == spec.DEFAULT_REPLICAS
    )


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        pytest.param("spec.backend", spec.BACKENDS, id="backend"),
        pytest.param("spec.restartPolicy", spec.RESTART_POLICIES, id="restart-policy"),
        pytest.param("spec.runPolicy.cleanPodPolicy", spec.CLEAN_POD_POLICIES, id="clean"),
    ],
)
def test_enums_agree_with_the_parser(path: str, allowed: tuple[str, ...]) -> None:
    assert set(field(path)["enum"]) == set(allowed)


@pytest.mark.parametrize(
    ("path", "minimum", "maximum"),
    [
        pytest.param("spec.replicas", 1, names.MAX_REPLICAS, id="replicas"),
        pytest.param("spec.elastic.minReplicas", 1, names.MAX_REPLICAS, id="elastic-min"),
        pytest.param("spec.elastic.maxReplicas", 1, names.MAX_REPLICAS, id="elastic-max"),
        pytest.param(
            "spec.elastic.replacementWaitSeconds", 1, spec.MAX_REPLACEMENT_WAIT_SECONDS, id="replacement-wait"
        ),
        pytest.param("spec.nprocPerNode", 1, spec.MAX_NPROC_PER_NODE, id="nproc"),
        pytest.param("spec.runPolicy.backoffLimit", 0, spec.MAX_BACKOFF_LIMIT, id="backoff"),
        pytest.param("spec.runPolicy.activeDeadlineSeconds", 1, None, id="active-deadline"),
        pytest.param("spec.runPolicy.startupDeadlineSeconds", 1, None, id="startup-deadline"),
        pytest.param("spec.runPolicy.ttlSecondsAfterFinished", 0, None, id="ttl"),
        pytest.param("spec.rendezvousPort", 1, 65535, id="rendezvous"),
        pytest.param("spec.metrics.port", 1, 65535, id="metrics-port"),
    ],
)
def test_bounds_agree_with_the_parser(path: str, minimum: int, maximum: int | None) -> None:
    node = field(path)
    assert node["minimum"] == minimum
    assert node.get("maximum") == maximum


def test_container_limit_and_name_rule_agree_with_the_parser() -> None:
    containers = field("spec.template.spec.containers")
    assert containers["maxItems"] == spec.MAX_CONTAINERS
    rules = [r["rule"] for r in root_schema()["x-kubernetes-validations"]]
    assert any(names.JOB_NAME_PATTERN in rule for rule in rules)
    assert any(f"<= {names.MAX_JOB_NAME_LENGTH}" in rule for rule in rules)


def test_crd_stays_small_enough_for_client_side_apply() -> None:
    # kubectl's last-applied annotation is capped at 256 KiB; stay far below it.
    assert CRD_PATH.stat().st_size < 64 * 1024
