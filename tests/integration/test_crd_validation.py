"""The CRD on the real apiserver: `kubectl apply` refuses invalid DDPJobs naming the field, accepts the
examples, applies defaults, guards the fields of a running job, and `kubectl explain` documents it."""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddp_operator.spec import DEFAULT_REPLACEMENT_WAIT_SECONDS

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "ddp.dev_ddpjobs.yaml"
# Unique per run: a namespace deleted by an earlier run may still be terminating.
NAMESPACE = f"crd-validation-{uuid.uuid4().hex[:6]}"


def valid_job(name: str = "valid") -> dict[str, Any]:
    return {
        "apiVersion": "ddp.dev/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "ddp-trainer:test"}]}},
        },
    }


Mutation = Callable[[dict[str, Any]], None]


def setting(path: str, value: Any) -> Mutation:
    """A mutation that sets a dotted path (creating objects on the way) to a value."""

    def mutate(job: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = job
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def containers(*items: dict[str, Any]) -> Mutation:
    return setting("spec.template.spec.containers", list(items))


def dropping(path: str) -> Mutation:
    def mutate(job: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = job
        for key in parents:
            node = node[key]
        del node[leaf]

    return mutate


def elastic(bounds: dict[str, Any], restart_mode: str | None = None) -> Mutation:
    """An elastic job instead of a fixed-size one (spec.replicas left out)."""

    def mutate(job: dict[str, Any]) -> None:
        del job["spec"]["replicas"]
        job["spec"]["elastic"] = bounds
        if restart_mode is not None:
            setting("spec.runPolicy.restartMode", restart_mode)(job)

    return mutate


def standby_with(*others: Mutation) -> Mutation:
    """runPolicy.standbyPods 1 with what it cannot go with."""

    def mutate(job: dict[str, Any]) -> None:
        for other in others:
            other(job)
        setting("spec.runPolicy.standbyPods", 1)(job)

    return mutate


INVALID = [
    pytest.param(setting("spec.replicas", 0), "spec.replicas", id="replicas-zero"),
    pytest.param(setting("spec.replicas", 4097), "spec.replicas", id="replicas-too-many"),
    pytest.param(setting("spec.nprocPerNode", 0), "spec.nprocPerNode", id="nproc-zero"),
    pytest.param(setting("spec.backend", "mpi"), "spec.backend", id="backend-unknown"),
    pytest.param(setting("spec.restartPolicy", "Always"), "spec.restartPolicy", id="restart-policy-unknown"),
    pytest.param(
        setting("spec.runPolicy.cleanPodPolicy", "Some"), "spec.runPolicy.cleanPodPolicy", id="clean-unknown"
    ),
    pytest.param(
        setting("spec.runPolicy.backoffLimit", -1), "spec.runPolicy.backoffLimit", id="backoff-negative"
    ),
    pytest.param(
        setting("spec.runPolicy.activeDeadlineSeconds", 0),
        "spec.runPolicy.activeDeadlineSeconds",
        id="deadline-zero",
    ),
    pytest.param(
        setting("spec.runPolicy.startupDeadlineSeconds", -10),
        "spec.runPolicy.startupDeadlineSeconds",
        id="startup-deadline-negative",
    ),
    pytest.param(
        setting("spec.runPolicy.ttlSecondsAfterFinished", -1),
        "spec.runPolicy.ttlSecondsAfterFinished",
        id="ttl-negative",
    ),
    pytest.param(setting("spec.rendezvousPort", 0), "spec.rendezvousPort", id="rendezvous-port-zero"),
    pytest.param(setting("spec.metrics.port", 70000), "spec.metrics.port", id="metrics-port-too-big"),
    pytest.param(setting("spec.metrics.port", 29500), "spec.metrics.port", id="metrics-port-clashes"),
    pytest.param(
        setting("spec.metrics.enabled", False),
        "spec.metrics.enabled",
        id="metrics-off-with-in-place-restarts",
    ),
    pytest.param(setting("metadata.name", "1digits"), "metadata.name", id="name-starts-with-digit"),
    pytest.param(setting("metadata.name", "d" * 59), "metadata.name", id="name-too-long-for-hostname"),
    pytest.param(dropping("spec.template"), "spec.template", id="template-missing"),
    pytest.param(dropping("spec.template.spec"), "spec.template.spec", id="template-without-pod-spec"),
    pytest.param(
        containers({"name": "main", "image": "i"}), "spec.template.spec.containers", id="no-trainer-container"
    ),
    pytest.param(containers({"name": "trainer"}), "spec.template.spec.containers[0].image", id="no-image"),
    pytest.param(
        containers({"name": "trainer", "image": "i"}, {"name": "trainer", "image": "j"}),
        "spec.template.spec.containers[1]",
        id="duplicate-container-name",
    ),
    pytest.param(
        containers({"name": "trainer", "image": "i"}, *({"name": f"c{i}", "image": "i"} for i in range(16))),
        "spec.template.spec.containers",
        id="too-many-containers",
    ),
    pytest.param(
        setting("spec.checkpoint", {"volumeClaimTemplate": {"resources": {"requests": {}}}}),
        "spec.checkpoint.volumeClaimTemplate.resources.requests.storage",
        id="checkpoint-without-size",
    ),
    pytest.param(setting("spec.replica", 2), "spec.replica", id="typo-refused-by-strict-field-validation"),
    pytest.param(
        setting("spec.elastic", {"minReplicas": 2, "maxReplicas": 3}),
        "spec.replicas",
        id="elastic-and-replicas",
    ),
    pytest.param(
        elastic({"minReplicas": 3, "maxReplicas": 2}), "spec.elastic.minReplicas", id="elastic-min-above-max"
    ),
    pytest.param(elastic({"maxReplicas": 2}), "spec.elastic.minReplicas", id="elastic-without-min"),
    pytest.param(
        elastic({"minReplicas": 1, "maxReplicas": 2}, restart_mode="Recreate"),
        "spec.runPolicy.restartMode",
        id="elastic-needs-in-place",
    ),
    pytest.param(
        setting("spec.runPolicy.stragglerPolicy", {"action": "Shrink"}),
        "spec.runPolicy.stragglerPolicy.action",
        id="straggler-shrink-needs-elastic",
    ),
    pytest.param(
        setting("spec.runPolicy", {"restartMode": "Recreate", "stragglerPolicy": {"action": "Replace"}}),
        "spec.runPolicy.stragglerPolicy.action",
        id="straggler-replace-needs-in-place",
    ),
    pytest.param(
        setting("spec.runPolicy.standbyPods", 9), "spec.runPolicy.standbyPods", id="standby-too-many"
    ),
    pytest.param(
        standby_with(setting("spec.runPolicy.restartMode", "Recreate")),
        "spec.runPolicy.standbyPods",
        id="standby-needs-in-place",
    ),
    pytest.param(
        standby_with(elastic({"minReplicas": 1, "maxReplicas": 2})),
        "spec.runPolicy.standbyPods",
        id="standby-not-elastic",
    ),
    pytest.param(
        standby_with(setting("spec.replicas", 1)), "spec.runPolicy.standbyPods", id="standby-one-pod"
    ),
    pytest.param(
        standby_with(setting("spec.scheduling.topology", {"required": "topology.kubernetes.io/rack"})),
        "spec.runPolicy.standbyPods",
        id="standby-not-with-topology",
    ),
    pytest.param(
        standby_with(
            setting(
                "spec.checkpoint",
                {
                    "volumeClaimTemplate": {
                        "accessModes": ["ReadWriteOncePod"],
                        "resources": {"requests": {"storage": "1Gi"}},
                    }
                },
            )
        ),
        "spec.checkpoint.volumeClaimTemplate.accessModes ReadWriteOncePod",
        id="standby-not-with-a-one-pod-checkpoint-claim",
    ),
]


@pytest.fixture(scope="module")
def kubectl(local_cluster: Any) -> Iterator[Callable[..., Any]]:
    def run(*args: str, check: bool = True, input: str | None = None) -> Any:
        return local_cluster.kubectl_run(*args, check=check, input=input)

    run("apply", "-f", str(CRD))
    local_cluster.wait_established("ddpjobs.ddp.dev")
    run("create", "namespace", NAMESPACE)
    yield run
    run("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def apply(kubectl: Callable[..., Any], obj: dict[str, Any], *args: str) -> Any:
    return kubectl("apply", "-f", "-", *args, check=False, input=json.dumps(obj))


@pytest.mark.parametrize(("mutate", "field"), INVALID)
def test_invalid_manifest_is_refused_naming_the_field(
    kubectl: Callable[..., Any], mutate: Mutation, field: str
) -> None:
    job = valid_job("invalid")
    mutate(job)
    result = apply(kubectl, job)
    assert result.returncode != 0, f"accepted: {json.dumps(job)}"
    assert field in result.stderr, result.stderr
    kubectl("delete", "ddpjob", "invalid", "-n", NAMESPACE, "--ignore-not-found", check=False)


def test_valid_job_is_accepted_with_defaults(kubectl: Callable[..., Any]) -> None:
    job = valid_job("defaults")
    result = apply(kubectl, job)
    assert result.returncode == 0, result.stderr
    stored = json.loads(kubectl("get", "ddpjob", "defaults", "-n", NAMESPACE, "-o", "json").stdout)
    spec = stored["spec"]
    assert spec["nprocPerNode"] == 1
    assert spec["backend"] == "auto"
    assert spec["restartPolicy"] == "ExitCode"
    assert spec["runPolicy"] == {
        "backoffLimit": 3,
        "cleanPodPolicy": "Running",
        "suspend": False,
        "restartMode": "InPlace",
        "standbyPods": 0,
    }
    assert spec["rendezvousPort"] == 29500
    assert spec["metrics"] == {"enabled": True, "port": 9400}


def test_an_elastic_job_is_accepted_and_keeps_its_size_while_it_runs(kubectl: Callable[..., Any]) -> None:
    job = valid_job("elastic")
    del job["spec"]["replicas"]
    job["spec"]["elastic"] = {"minReplicas": 2, "maxReplicas": 4}
    job["spec"]["runPolicy"] = {"stragglerPolicy": {"action": "Shrink"}}  # an elastic job's to ask for
    result = apply(kubectl, job)
    assert result.returncode == 0, result.stderr
    stored = json.loads(kubectl("get", "ddpjob", "elastic", "-n", NAMESPACE, "-o", "json").stdout)["spec"]
    assert "replicas" not in stored, "no schema default: left out, as an elastic job must"
    assert stored["elastic"] == {
        "minReplicas": 2,
        "maxReplicas": 4,
        "replacementWaitSeconds": DEFAULT_REPLACEMENT_WAIT_SECONDS,
    }
    set_phase(kubectl, "elastic", "Running")
    resized = copy.deepcopy(job)
    resized["spec"]["elastic"]["maxReplicas"] = 5
    refused = apply(kubectl, resized)
    assert refused.returncode != 0
    assert "spec.elastic" in refused.stderr


def test_unknown_fields_are_pruned_without_strict_validation(kubectl: Callable[..., Any]) -> None:
    job = valid_job("pruned")
    job["spec"]["replica"] = 7
    result = apply(kubectl, job, "--validate=false")
    assert result.returncode == 0, result.stderr
    stored = json.loads(kubectl("get", "ddpjob", "pruned", "-n", NAMESPACE, "-o", "json").stdout)
    assert "replica" not in stored["spec"]
    assert stored["spec"]["replicas"] == 2


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.yaml")))
def test_examples_are_accepted(kubectl: Callable[..., Any], example: str) -> None:
    docs = [d for d in yaml.safe_load_all((REPO / "examples" / example).read_text()) if d]
    jobs = [d for d in docs if d.get("kind") == "DDPJob"]
    assert jobs, f"examples/{example} holds no DDPJob: every example is a manifest a user can apply"
    for job in jobs:
        result = apply(kubectl, job, "-n", NAMESPACE, "--dry-run=server")
        assert result.returncode == 0, result.stderr


def set_phase(kubectl: Callable[..., Any], name: str, phase: str) -> None:
    patch = json.dumps({"status": {"phase": phase}})
    kubectl("patch", "ddpjob", name, "-n", NAMESPACE, "--subresource=status", "--type=merge", "-p", patch)


def test_fields_of_a_running_job_are_immutable(kubectl: Callable[..., Any]) -> None:
    job = valid_job("immutable")
    assert apply(kubectl, job).returncode == 0
    set_phase(kubectl, "immutable", "Running")

    resized = copy.deepcopy(job)
    resized["spec"]["replicas"] = 3
    refused = apply(kubectl, resized)
    assert refused.returncode != 0
    assert "spec.replicas" in refused.stderr

    retemplated = copy.deepcopy(job)
    retemplated["spec"]["template"]["spec"]["containers"][0]["image"] = "ddp-trainer:other"
    refused = apply(kubectl, retemplated)
    assert refused.returncode != 0
    assert "spec.template" in refused.stderr

    remetered = copy.deepcopy(job)
    remetered["spec"]["metrics"] = {"enabled": True, "port": 9999}
    refused = apply(kubectl, remetered)
    assert refused.returncode != 0
    assert "spec.metrics" in refused.stderr

    suspended = copy.deepcopy(job)
    suspended["spec"]["runPolicy"] = {"suspend": True, "activeDeadlineSeconds": 600}
    result = apply(kubectl, suspended)
    assert result.returncode == 0, f"runPolicy stays mutable while running: {result.stderr}"

    set_phase(kubectl, "immutable", "Suspended")
    result = apply(kubectl, resized)
    assert result.returncode == 0, f"a suspended job may be resized: {result.stderr}"


def test_kubectl_explain_documents_the_run_policy(kubectl: Callable[..., Any]) -> None:
    # The apiserver publishes a new CRD's OpenAPI a moment after it is established.
    deadline = time.monotonic() + 60
    while True:
        result = kubectl("explain", "ddpjob.spec.runPolicy", check=False)
        if result.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert result.returncode == 0, result.stderr
    for field in (
        "backoffLimit",
        "activeDeadlineSeconds",
        "startupDeadlineSeconds",
        "ttlSecondsAfterFinished",
    ):
        assert field in result.stdout
    assert "BackoffLimitExceeded" in result.stdout


def test_printer_columns(kubectl: Callable[..., Any]) -> None:
    job = valid_job("columns")
    assert apply(kubectl, job).returncode == 0
    status = {
        "phase": "Running",
        "ready": "1/2",
        "restarts": 1,
        "worldSize": 2,
        "progress": {"step": 420, "samplesPerSecond": "1536"},
    }
    patch = json.dumps({"status": status})
    kubectl(
        "patch", "ddpjob", "columns", "-n", NAMESPACE, "--subresource=status", "--type=merge", "-p", patch
    )
    table = kubectl("get", "ddpj", "columns", "-n", NAMESPACE).stdout
    header, row = table.strip().splitlines()
    assert header.split() == ["NAME", "PHASE", "READY", "RESTARTS", "WORLD", "STEP", "SAMPLES/S", "AGE"]
    assert row.split()[:7] == ["columns", "Running", "1/2", "1", "2", "420", "1536"]


def test_the_checkpoint_of_a_running_job_is_immutable(kubectl: Callable[..., Any]) -> None:
    job = valid_job("ckpt-immutable")
    job["spec"]["checkpoint"] = {"volumeClaimTemplate": {"resources": {"requests": {"storage": "1Gi"}}}}
    assert apply(kubectl, job).returncode == 0
    set_phase(kubectl, "ckpt-immutable", "Running")
    resized = copy.deepcopy(job)
    resized["spec"]["checkpoint"]["volumeClaimTemplate"]["resources"]["requests"]["storage"] = "500Gi"
    refused = apply(kubectl, resized)
    assert refused.returncode != 0
    assert "spec.checkpoint" in refused.stderr


@pytest.mark.parametrize("modes", [["ReadWriteOnce"], ["ReadWriteMany"], None], ids=["rwo", "rwx", "default"])
def test_standbys_are_accepted_with_a_checkpoint_claim_they_can_mount(
    kubectl: Callable[..., Any], modes: list[str] | None
) -> None:
    """A standby may take rank 0, so it mounts the checkpoint claim: any access mode but ReadWriteOncePod."""
    job = valid_job("standby-claim")
    claim: dict[str, Any] = {"resources": {"requests": {"storage": "1Gi"}}}
    if modes is not None:
        claim["accessModes"] = modes
    job["spec"]["checkpoint"] = {"volumeClaimTemplate": claim}
    job["spec"]["runPolicy"] = {"standbyPods": 1}
    result = apply(kubectl, job, "--dry-run=server")
    assert result.returncode == 0, result.stderr
