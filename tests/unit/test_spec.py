"""Parsing a DDPJob: defaults, backend resolution and the errors that name the field to fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.unit.kube_factories import job_object

from ddp_operator.spec import DECLARED_FIELDS, SpecError, parse_job, parse_network_peers, unknown_fields

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.unit


def test_defaults_fill_every_optional_field() -> None:
    job = parse_job(job_object(replicas=None))
    assert (job.replicas, job.nproc_per_node, job.world_size) == (1, 1, 1)
    assert job.restart_policy == "ExitCode"
    assert job.backend == "gloo"
    assert job.run_policy.backoff_limit == 3
    assert job.run_policy.clean_pod_policy == "Running"
    assert job.run_policy.suspend is False
    assert job.run_policy.active_deadline_seconds is None
    assert job.checkpoint is None
    assert (job.rendezvous_port, job.metrics.enabled, job.metrics.port) == (29500, True, 9400)
    assert job.network_policy.enabled is True
    assert (job.namespace, job.uid, job.generation) == ("team-a", "uid-1234", 1)
    assert job.scheduling.gang == "Auto"
    assert job.kueue is None


def test_world_size_is_replicas_times_processes() -> None:
    assert parse_job(job_object(replicas=3, nprocPerNode=8)).world_size == 24


def _gpu_template(section: str, amount: Any) -> dict[str, Any]:
    container = {"name": "trainer", "image": "img", "resources": {section: {"nvidia.com/gpu": amount}}}
    return {"spec": {"containers": [container]}}


@pytest.mark.parametrize(
    ("backend", "template", "expected"),
    [
        pytest.param("auto", _gpu_template("limits", 8), "nccl", id="auto-gpu-limits"),
        pytest.param("auto", _gpu_template("requests", "1"), "nccl", id="auto-gpu-requests"),
        pytest.param("auto", _gpu_template("limits", "0"), "gloo", id="auto-zero-gpus"),
        pytest.param(
            "auto", {"spec": {"containers": [{"name": "trainer", "image": "i"}]}}, "gloo", id="auto-cpu"
        ),
        pytest.param("gloo", _gpu_template("limits", 8), "gloo", id="explicit-gloo-on-gpus"),
        pytest.param(
            "nccl", {"spec": {"containers": [{"name": "trainer", "image": "i"}]}}, "nccl", id="explicit-nccl"
        ),
    ],
)
def test_backend_resolution(backend: str, template: dict[str, Any], expected: str) -> None:
    assert parse_job(job_object(backend=backend, template=template)).backend == expected


def test_gpu_on_a_sidecar_does_not_make_the_trainer_nccl() -> None:
    template = {
        "spec": {
            "containers": [
                {"name": "trainer", "image": "i"},
                {"name": "helper", "image": "i", "resources": {"limits": {"nvidia.com/gpu": 1}}},
            ]
        }
    }
    assert parse_job(job_object(template=template)).backend == "gloo"


def test_checkpoint_defaults_the_mount_path() -> None:
    claim = {"resources": {"requests": {"storage": "1Gi"}}}
    job = parse_job(job_object(checkpoint={"volumeClaimTemplate": claim}))
    assert job.checkpoint is not None
    assert job.checkpoint.mount_path == "/var/run/ddp/checkpoints"
    assert job.checkpoint.volume_claim_template == claim


def _containers(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"template": {"spec": {"containers": list(containers)}}}


INVALID = [
    pytest.param({"replicas": 0}, "spec.replicas", id="replicas-zero"),
    pytest.param({"replicas": 4097}, "spec.replicas", id="replicas-too-many"),
    pytest.param({"replicas": "2"}, "spec.replicas", id="replicas-string"),
    pytest.param({"replicas": True}, "spec.replicas", id="replicas-bool"),
    pytest.param({"nprocPerNode": 0}, "spec.nprocPerNode", id="nproc-zero"),
    pytest.param({"backend": "mpi"}, "spec.backend", id="backend-unknown"),
    pytest.param({"restartPolicy": "Always"}, "spec.restartPolicy", id="restart-policy-unknown"),
    pytest.param({"runPolicy": {"backoffLimit": -1}}, "spec.runPolicy.backoffLimit", id="backoff-negative"),
    pytest.param(
        {"runPolicy": {"activeDeadlineSeconds": 0}},
        "spec.runPolicy.activeDeadlineSeconds",
        id="deadline-zero",
    ),
    pytest.param(
        {"runPolicy": {"startupDeadlineSeconds": -5}},
        "spec.runPolicy.startupDeadlineSeconds",
        id="startup-negative",
    ),
    pytest.param(
        {"runPolicy": {"ttlSecondsAfterFinished": -1}},
        "spec.runPolicy.ttlSecondsAfterFinished",
        id="ttl-negative",
    ),
    pytest.param(
        {"runPolicy": {"cleanPodPolicy": "Some"}}, "spec.runPolicy.cleanPodPolicy", id="clean-unknown"
    ),
    pytest.param({"runPolicy": {"suspend": "yes"}}, "spec.runPolicy.suspend", id="suspend-not-bool"),
    pytest.param({"rendezvousPort": 0}, "spec.rendezvousPort", id="rendezvous-port-zero"),
    pytest.param({"metrics": {"port": 70000}}, "spec.metrics.port", id="metrics-port-too-big"),
    pytest.param({"metrics": {"port": 29500}}, "spec.metrics.port", id="metrics-port-clashes"),
    pytest.param(
        {"metrics": {"enabled": False}}, "spec.metrics.enabled", id="metrics-off-with-in-place-restarts"
    ),
    pytest.param({"networkPolicy": {"enabled": "no"}}, "spec.networkPolicy.enabled", id="netpol-not-bool"),
    pytest.param({"networkPolicy": []}, "spec.networkPolicy", id="netpol-not-object"),
    pytest.param({"scheduling": {"gang": "Always"}}, "spec.scheduling.gang", id="gang-unknown"),
    pytest.param({"scheduling": {"gang": "auto"}}, "spec.scheduling.gang", id="gang-is-case-sensitive"),
    pytest.param({"scheduling": "Workload"}, "spec.scheduling", id="scheduling-not-an-object"),
    pytest.param({"template": None}, "spec.template", id="template-missing"),
    pytest.param(_containers(), "spec.template.spec.containers", id="no-containers"),
    pytest.param(
        _containers({"name": "main", "image": "i"}),
        "spec.template.spec.containers",
        id="no-trainer-container",
    ),
    pytest.param(_containers({"name": "trainer"}), "spec.template.spec.containers[0].image", id="no-image"),
    pytest.param(
        _containers({"name": "trainer", "image": "i"}, {"name": "trainer", "image": "i"}),
        "spec.template.spec.containers[1].name",
        id="duplicate-container",
    ),
    pytest.param(
        {"checkpoint": {"volumeClaimTemplate": {"accessModes": ["ReadWriteOnce"]}}},
        "spec.checkpoint.volumeClaimTemplate.resources.requests.storage",
        id="checkpoint-without-size",
    ),
    pytest.param(
        {
            "checkpoint": {
                "volumeClaimTemplate": {"resources": {"requests": {"storage": "1Gi"}}},
                "mountPath": "ckpt",
            }
        },
        "spec.checkpoint.mountPath",
        id="checkpoint-relative-path",
    ),
]


@pytest.mark.parametrize(("spec", "field"), INVALID)
def test_invalid_spec_names_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_job(job_object(**spec))
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("1job", id="starts-with-digit"),
        pytest.param("Job", id="uppercase"),
        pytest.param("job.v1", id="dot"),
        pytest.param("job-", id="trailing-dash"),
        pytest.param("j" * 59, id="too-long-for-rank-hostname"),
    ],
)
def test_invalid_job_names(name: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_job(job_object(name))
    assert caught.value.field == "metadata.name"


def test_longest_valid_name_leaves_room_for_four_rank_digits() -> None:
    name = "j" * 58
    job = parse_job(job_object(name))
    assert len(f"{job.name}-4095") == 63


@pytest.mark.parametrize(
    ("mutate", "field", "hint"),
    [
        pytest.param(
            lambda m: m["spec"].update(replica=2), "spec.replica", "spec.replicas", id="typo-in-spec"
        ),
        pytest.param(
            lambda m: m["spec"].update(runPolicy={"backofLimit": 2}),
            "spec.runPolicy.backofLimit",
            "spec.runPolicy.backoffLimit",
            id="typo-in-run-policy",
        ),
        pytest.param(
            lambda m: m["spec"].update(metrics={"prot": 1}),
            "spec.metrics.prot",
            "spec.metrics.port",
            id="metrics",
        ),
        pytest.param(
            lambda m: m["spec"].update(networkPolicy={"enable": False}),
            "spec.networkPolicy.enable",
            "spec.networkPolicy.enabled",
            id="network-policy",
        ),
        pytest.param(lambda m: m.update(sepc={}), "sepc", "spec", id="top-level"),
    ],
)
def test_unknown_fields_are_named_with_the_closest_declared_one(
    mutate: Callable[[dict[str, Any]], None], field: str, hint: str
) -> None:
    manifest = job_object()
    mutate(manifest)
    errors = unknown_fields(manifest)
    assert [error.field for error in errors] == [field]
    assert f"did you mean {hint}?" in str(errors[0])


def test_free_form_parts_are_not_checked() -> None:
    manifest = job_object()
    manifest["metadata"]["labels"] = {"team": "a"}
    manifest["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "h200"}
    manifest["spec"]["template"]["metadata"] = {"labels": {"a": "b"}}
    assert unknown_fields(manifest) == []


def test_declared_fields_match_the_crd_schema() -> None:
    crd = yaml.safe_load((REPO / "crds" / "ddp.dev_ddpjobs.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    expected = {"": set(schema["properties"]) | {"metadata"}}
    spec = schema["properties"]["spec"]
    expected["spec"] = set(spec["properties"])
    for name in ("runPolicy", "template", "checkpoint", "metrics", "networkPolicy", "scheduling", "elastic"):
        expected[f"spec.{name}"] = set(spec["properties"][name]["properties"])
    run_policy = spec["properties"]["runPolicy"]["properties"]
    expected["spec.runPolicy.stragglerPolicy"] = set(run_policy["stragglerPolicy"]["properties"])
    scheduling = spec["properties"]["scheduling"]["properties"]
    expected["spec.scheduling.topology"] = set(scheduling["topology"]["properties"])
    assert {path: set(fields) for path, fields in DECLARED_FIELDS.items()} == expected


@pytest.mark.parametrize(
    ("raw", "enabled"),
    [
        pytest.param(None, True, id="absent"),
        pytest.param({}, True, id="empty"),
        pytest.param({"enabled": True}, True, id="on"),
        pytest.param({"enabled": False}, False, id="off"),
    ],
)
def test_network_policy_field(raw: dict[str, Any] | None, enabled: bool) -> None:
    spec = {} if raw is None else {"networkPolicy": raw}
    assert parse_job(job_object(**spec)).network_policy.enabled is enabled


MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


@pytest.mark.parametrize(
    "peers",
    [
        pytest.param([], id="none"),
        pytest.param([MONITORING], id="namespace"),
        pytest.param(
            [
                {
                    "namespaceSelector": {},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                }
            ],
            id="pods-anywhere",
        ),
        pytest.param(
            [{"podSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["prom"]}]}}],
            id="expression",
        ),
        pytest.param([{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}], id="ip-block"),
    ],
)
def test_network_peers_accepted(peers: list[dict[str, Any]]) -> None:
    assert parse_network_peers(peers, "--flag") == tuple(peers)


@pytest.mark.parametrize(
    ("peers", "field"),
    [
        pytest.param({"namespaceSelector": {}}, "--flag", id="not-a-list"),
        pytest.param([{}], "--flag[0]", id="empty-peer"),
        pytest.param(["monitoring"], "--flag[0]", id="peer-not-object"),
        pytest.param([MONITORING, {"namespace": {}}], "--flag[1].namespace", id="unknown-peer-field"),
        pytest.param(
            [{"podSelector": {"labels": {}}}], "--flag[0].podSelector.labels", id="unknown-selector-field"
        ),
        pytest.param(
            [{"podSelector": {"matchLabels": {"app": 1}}}],
            "--flag[0].podSelector.matchLabels",
            id="label-not-string",
        ),
        pytest.param(
            [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Is"}]}}],
            "--flag[0].podSelector.matchExpressions[0].operator",
            id="bad-operator",
        ),
        pytest.param(
            [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}],
            "--flag[0].podSelector.matchExpressions[0].values",
            id="in-without-values",
        ),
        pytest.param([{"ipBlock": {"cidr": "ten"}}], "--flag[0].ipBlock.cidr", id="bad-cidr"),
        pytest.param(
            [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}],
            "--flag[0].ipBlock",
            id="ip-block-and-selector",
        ),
    ],
)
def test_network_peers_refused_naming_the_field(peers: Any, field: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_network_peers(peers, "--flag")
    assert caught.value.field == field
