"""The planner of `ddpjob run`: operator pod manifests -> local processes (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddp_operator import builders
from ddp_operator.local.plan import (
    Host,
    LocalAddresses,
    PlanError,
    expand,
    local_argv,
    plan_process,
)
from ddp_operator.quantity import parse_quantity
from ddp_operator.spec import JobSpec, parse_job

pytestmark = pytest.mark.unit

HOST = Host(node_name="workstation", cpus=8, memory_bytes=16 * 2**30, python="/venv/bin/python")
ADDRESSES = LocalAddresses(master_port=41000, metrics_port=42000, checkpoint_dir="/tmp/job/checkpoints")


def pod(container: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "demo-1-0", "namespace": "team", "labels": {"ddp.dev/rank": "1"}, **metadata},
        "spec": {"containers": [{"name": "sidecar", "image": "busybox"}, {"name": "trainer", **container}]},
    }


CLUSTER_ENV = [
    {"name": "MASTER_ADDR", "value": "demo-0.demo.team.svc"},
    {"name": "MASTER_PORT", "value": "29500"},
    {"name": "PET_MASTER_ADDR", "value": "demo-0.demo.team.svc"},
    {"name": "PET_MASTER_PORT", "value": "29500"},
    {"name": "WORLD_SIZE", "value": "2"},
    {"name": "DDP_METRICS_PORT", "value": "9400"},
    {"name": "DDP_CHECKPOINT_DIR", "value": "/var/run/ddp/checkpoints"},
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
]


@pytest.mark.parametrize(
    ("text", "variables", "expected"),
    [
        pytest.param("$(A)-$(B)", {"A": "x", "B": "y"}, "x-y", id="two-references"),
        pytest.param("$(MISSING)", {}, "$(MISSING)", id="undefined-stays-as-written"),
        pytest.param("$$(A)", {"A": "x"}, "$(A)", id="double-dollar-escapes"),
        pytest.param("cost $5", {}, "cost $5", id="lone-dollar"),
        pytest.param("$(A", {"A": "x"}, "$(A", id="unclosed"),
        pytest.param("trailing $", {}, "trailing $", id="dollar-at-end"),
    ],
)
def test_expand_follows_kubernetes_rules(text: str, variables: dict[str, str], expected: str) -> None:
    assert expand(text, variables) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("500m", 0.5, id="milli"),
        pytest.param("2", 2.0, id="plain"),
        pytest.param("1Gi", 2.0**30, id="binary"),
        pytest.param("3k", 3000.0, id="decimal"),
    ],
)
def test_parse_quantity(text: str, expected: float) -> None:
    assert parse_quantity(text) == expected


def test_parse_quantity_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity("lots")


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        pytest.param(["python", "train.py"], ("/venv/bin/python", "train.py"), id="python"),
        pytest.param(
            ["/usr/bin/python3.11", "-u", "t.py"], ("/venv/bin/python", "-u", "t.py"), id="image-path"
        ),
        pytest.param(
            ["torchrun", "s.py"], ("/venv/bin/python", "-m", "torch.distributed.run", "s.py"), id="torchrun"
        ),
        pytest.param(["bash", "-c", "echo hi"], ("bash", "-c", "echo hi"), id="other-program-untouched"),
        pytest.param(["pythonic-tool"], ("pythonic-tool",), id="not-an-interpreter"),
    ],
)
def test_local_argv_points_at_this_python(command: list[str], expected: tuple[str, ...]) -> None:
    assert local_argv(command, HOST) == expected


def test_addresses_are_rewritten_for_one_machine() -> None:
    spec = plan_process(pod({"image": "x", "env": CLUSTER_ENV}), 1, ADDRESSES, HOST, {})
    assert {key: spec.env[key] for key in ("MASTER_ADDR", "PET_MASTER_ADDR", "POD_IP")} == dict.fromkeys(
        ("MASTER_ADDR", "PET_MASTER_ADDR", "POD_IP"), "127.0.0.1"
    )
    assert (spec.env["MASTER_PORT"], spec.env["PET_MASTER_PORT"]) == ("41000", "41000")
    assert spec.env["DDP_METRICS_PORT"] == "42000"
    assert spec.env["DDP_CHECKPOINT_DIR"] == "/tmp/job/checkpoints"
    assert spec.env["WORLD_SIZE"] == "2"
    assert (spec.pod_name, spec.rank, spec.metrics_port) == ("demo-1-0", 1, 42000)


def test_checkpoint_dir_is_set_even_without_a_checkpoint_volume() -> None:
    spec = plan_process(pod({"image": "x", "env": []}), 0, ADDRESSES, HOST, {})
    assert spec.env["DDP_CHECKPOINT_DIR"] == "/tmp/job/checkpoints"


def test_no_command_runs_the_trainer_entrypoint_with_args() -> None:
    spec = plan_process(pod({"image": "x", "args": ["--epochs", "3"]}), 0, ADDRESSES, HOST, {})
    assert spec.argv == ("/venv/bin/python", "-m", "ddp_trainer", "--epochs", "3")


def test_an_empty_command_is_no_command_as_in_kubernetes() -> None:
    spec = plan_process(pod({"image": "x", "command": [], "args": ["--epochs", "3"]}), 0, ADDRESSES, HOST, {})
    assert spec.argv == ("/venv/bin/python", "-m", "ddp_trainer", "--epochs", "3")


@pytest.mark.parametrize(
    ("shell", "manifest_env", "expected"),
    [
        pytest.param({}, [], "15", id="machine-default"),
        pytest.param({"DDP_METRICS_LINGER": "30"}, [], "30", id="shell-wins-over-the-default"),
        pytest.param(
            {"DDP_METRICS_LINGER": "30"},
            [{"name": "DDP_METRICS_LINGER", "value": "5"}],
            "5",
            id="manifest-wins-over-the-shell",
        ),
    ],
)
def test_metrics_linger_default(
    shell: dict[str, str], manifest_env: list[dict[str, str]], expected: str
) -> None:
    spec = plan_process(pod({"image": "x", "env": [*CLUSTER_ENV, *manifest_env]}), 0, ADDRESSES, HOST, shell)
    assert spec.env["DDP_METRICS_LINGER"] == expected


def test_command_and_args_expand_pod_variables() -> None:
    container = {
        "image": "x",
        "command": ["torchrun"],
        "args": ["s.py", "--world=$(WORLD_SIZE)", "--master=$(MASTER_ADDR):$(MASTER_PORT)"],
        "env": CLUSTER_ENV,
    }
    spec = plan_process(pod(container), 0, ADDRESSES, HOST, {})
    assert spec.argv[-2:] == ("--world=2", "--master=127.0.0.1:41000")


def test_env_values_refer_to_earlier_variables_with_local_addresses() -> None:
    env = [*CLUSTER_ENV, {"name": "INIT", "value": "tcp://$(MASTER_ADDR):$(MASTER_PORT)"}]
    spec = plan_process(pod({"image": "x", "env": env}), 0, ADDRESSES, HOST, {})
    assert spec.env["INIT"] == "tcp://127.0.0.1:41000"


def test_shell_contract_variables_do_not_leak_into_ranks() -> None:
    shell = {"RANK": "7", "PET_NNODES": "9", "DDP_BACKEND": "nccl", "HOME": "/home/me", "PATH": "/usr/bin"}
    spec = plan_process(pod({"image": "x", "env": CLUSTER_ENV}), 0, ADDRESSES, HOST, shell)
    assert "RANK" not in spec.env and "PET_NNODES" not in spec.env and "DDP_BACKEND" not in spec.env
    assert spec.env["HOME"] == "/home/me"
    assert spec.env["PATH"].split(":") == ["/venv/bin", "/usr/bin"]


def test_user_overrides_win_and_fill_secret_references() -> None:
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    spec = plan_process(pod({"image": "x", "env": env}), 0, ADDRESSES, HOST, {}, overrides={"TOKEN": "abc"})
    assert spec.env["TOKEN"] == "abc"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        pytest.param({"fieldRef": {"fieldPath": "metadata.name"}}, "demo-1-0", id="pod-name"),
        pytest.param({"fieldRef": {"fieldPath": "metadata.namespace"}}, "team", id="namespace"),
        pytest.param({"fieldRef": {"fieldPath": "metadata.labels['ddp.dev/rank']"}}, "1", id="label"),
        pytest.param({"fieldRef": {"fieldPath": "status.hostIP"}}, "127.0.0.1", id="host-ip"),
        pytest.param({"fieldRef": {"fieldPath": "spec.serviceAccountName"}}, "default", id="service-account"),
        pytest.param({"resourceFieldRef": {"resource": "limits.cpu"}}, "3", id="declared-cpu-rounds-up"),
        pytest.param(
            {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}, "512", id="memory-divisor"
        ),
        pytest.param(
            {"resourceFieldRef": {"resource": "requests.cpu"}}, "3", id="request-falls-back-to-limit"
        ),
        pytest.param(
            {"configMapKeyRef": {"name": "c", "key": "k", "optional": True}}, None, id="optional-unset"
        ),
    ],
)
def test_value_from_is_resolved_locally(source: dict[str, Any], expected: str | None) -> None:
    container = {
        "image": "x",
        "resources": {"limits": {"cpu": "2500m", "memory": "512Mi"}},
        "env": [{"name": "VALUE", "valueFrom": source}],
    }
    spec = plan_process(pod(container), 1, ADDRESSES, HOST, {})
    assert spec.env.get("VALUE") == expected


def test_undeclared_cpu_limit_reads_as_the_machine() -> None:
    env = [{"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}]
    spec = plan_process(pod({"image": "x", "env": env}), 0, ADDRESSES, HOST, {})
    assert spec.env["CPUS"] == "8"


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        pytest.param(
            {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            "spec.template.spec.containers[1].env[0].valueFrom.secretKeyRef",
            id="secret-needs-a-cluster",
        ),
        pytest.param(
            {"name": "T", "valueFrom": {"fieldRef": {"fieldPath": "spec.bogus"}}},
            "spec.template.spec.containers[1].env[0].valueFrom.fieldRef.fieldPath",
            id="unknown-field",
        ),
        pytest.param(
            {"name": "T", "valueFrom": {"resourceFieldRef": {"resource": "limits.nvidia.com/gpu"}}},
            "spec.template.spec.containers[1].env[0].valueFrom.resourceFieldRef.resource",
            id="unsupported-resource",
        ),
    ],
)
def test_unresolvable_references_name_the_field(entry: dict[str, Any], field: str) -> None:
    with pytest.raises(PlanError) as raised:
        plan_process(pod({"image": "x", "env": [entry]}), 0, ADDRESSES, HOST, {})
    assert raised.value.field == field
    assert str(raised.value).startswith(field)


def test_env_from_is_reported_not_fatal() -> None:
    container = {"image": "x", "envFrom": [{"configMapRef": {"name": "settings"}}]}
    spec = plan_process(pod(container), 0, ADDRESSES, HOST, {})
    assert len(spec.notes) == 1 and "settings" in spec.notes[0]


def test_a_pod_without_trainer_is_refused() -> None:
    with pytest.raises(PlanError, match="trainer"):
        plan_process({"metadata": {}, "spec": {"containers": [{"name": "main"}]}}, 0, ADDRESSES, HOST, {})


def demo_job(**spec: Any) -> JobSpec:
    """The DDPJob `demo` with ``spec`` beside a one-container template."""
    template = {"spec": {"containers": [{"name": "trainer", "image": "trainer:1"}]}}
    return parse_job(
        {
            "apiVersion": "ddp.dev/v1alpha1",
            "kind": "DDPJob",
            "metadata": {"name": "demo"},
            "spec": {**spec, "template": template},
        }
    )


def test_the_operators_own_pod_plans_to_a_local_rank() -> None:
    job = demo_job(replicas=3, nprocPerNode=2)
    spec = plan_process(builders.build_rank_pod(job, 2, 4), 2, ADDRESSES, HOST, {})
    assert spec.argv == ("/venv/bin/python", "-m", "ddp_trainer")
    picked = {
        k: spec.env[k] for k in ("NODE_RANK", "NNODES", "NPROC_PER_NODE", "WORLD_SIZE", "DDPJOB_ATTEMPT")
    }
    assert picked == {
        "NODE_RANK": "2",
        "NNODES": "3",
        "NPROC_PER_NODE": "2",
        "WORLD_SIZE": "6",
        "DDPJOB_ATTEMPT": "4",
    }
    assert (spec.env["PET_MASTER_ADDR"], spec.env["PET_MASTER_PORT"]) == ("127.0.0.1", "41000")
    assert spec.pod_name == "demo-2-4"


@pytest.mark.parametrize(("rank", "host"), [(0, "is_host=1"), (1, "is_host=0")])
def test_a_local_gang_meets_at_rank_0_not_at_a_rendezvous_pod(rank: int, host: str) -> None:
    """`ddpjob run` has no rendezvous pod: rank 0's launcher hosts the store on loopback."""
    pod_manifest = builders.build_rank_pod(demo_job(replicas=2), rank, 0)
    assert "DDP_RENDEZVOUS_ENDPOINT" in {e["name"] for e in pod_manifest["spec"]["containers"][0]["env"]}
    spec = plan_process(pod_manifest, rank, ADDRESSES, HOST, {})
    assert spec.env["DDP_RENDEZVOUS_ENDPOINT"] == "", "empty: unset to the trainer"
    assert spec.env["PET_RDZV_ENDPOINT"] == "127.0.0.1:41000"
    assert spec.env["PET_RDZV_CONF"] == host


def test_machine_defaults_share_the_cores_and_stay_on_loopback() -> None:
    spec = plan_process(pod({"image": "x", "env": CLUSTER_ENV}), 0, ADDRESSES, HOST, {})
    assert (spec.env["OMP_NUM_THREADS"], spec.env["GLOO_SOCKET_IFNAME"]) == ("4", "lo")
    assert int(spec.env["DDP_METRICS_LINGER"]) > 0


@pytest.mark.parametrize(
    ("manifest_env", "shell", "expected"),
    [
        pytest.param([{"name": "OMP_NUM_THREADS", "value": "3"}], {}, "3", id="manifest-wins"),
        pytest.param([], {"OMP_NUM_THREADS": "5"}, "5", id="shell-wins"),
    ],
)
def test_machine_defaults_never_override(
    manifest_env: list[dict[str, str]], shell: dict[str, str], expected: str
) -> None:
    spec = plan_process(pod({"image": "x", "env": CLUSTER_ENV + manifest_env}), 0, ADDRESSES, HOST, shell)
    assert spec.env["OMP_NUM_THREADS"] == expected


def test_a_topology_manifest_runs_locally_with_ranks_in_pod_order(tmp_path: Path) -> None:
    """Every local rank shares this machine: `ddpjob run` plans no rank order file (a launcher would
    wait for a key nobody writes) and the rendezvous ranks the pods by NODE_RANK."""
    import io

    from ddp_operator.local.console import Console
    from ddp_operator.local.runner import LocalJobRunner, RunOptions, StopRequest

    job = demo_job(replicas=2, scheduling={"topology": {"preferred": "topology.kubernetes.io/rack"}})
    runner = LocalJobRunner(
        job, RunOptions(workdir=tmp_path), Console(io.StringIO(), live=False), StopRequest()
    )
    specs = runner.plan(0, tmp_path / "checkpoints")
    assert [spec.env["DDP_RESTART_MODE"] for spec in specs] == ["InPlace", "InPlace"]
    assert not any("DDP_RANK_ORDER_FILE" in spec.env for spec in specs)
