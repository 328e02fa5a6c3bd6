"""The env contract and command line of the trainer (pure, no torch)."""

from __future__ import annotations

import pytest

from ddp_trainer.config import ConfigError, parse_args, parse_env, resolve_backend
from ddp_trainer.exitcodes import EXIT_BAD_CONFIG, EXIT_OK, EXIT_PEER_LOST, EXIT_STOPPED, is_retryable

pytestmark = pytest.mark.unit

BASE = {"MASTER_ADDR": "job-0.job.ns.svc", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(
            {"WORLD_SIZE": "1"},
            {"rank": 0, "nnodes": 1, "node_rank": 0, "launches_workers": False},
            id="single",
        ),
        pytest.param(
            {
                **BASE,
                "WORLD_SIZE": "4",
                "NNODES": "4",
                "NODE_RANK": "2",
                "NPROC_PER_NODE": "1",
                "RANK": "2",
                "LOCAL_RANK": "0",
            },
            {"rank": 2, "nnodes": 4, "node_rank": 2, "launches_workers": False},
            id="operator-one-proc-per-pod",
        ),
        pytest.param(
            {**BASE, "WORLD_SIZE": "4", "NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "2"},
            {"rank": 2, "nnodes": 2, "node_rank": 1, "launches_workers": True},
            id="pod-launches-two-workers",
        ),
        pytest.param(
            {
                **BASE,
                "WORLD_SIZE": "4",
                "NPROC_PER_NODE": "2",
                "RANK": "3",
                "LOCAL_RANK": "1",
                "DDP_TRAINER_WORKER": "1",
            },
            {"rank": 3, "nnodes": 2, "node_rank": 1, "launches_workers": False},
            id="launched-worker",
        ),
        pytest.param(
            {"PET_MASTER_ADDR": "m", "WORLD_SIZE": "2", "PET_NNODES": "2", "PET_NODE_RANK": "1"},
            {"rank": 1, "nnodes": 2, "node_rank": 1, "launches_workers": False},
            id="torchrun-pet-spelling",
        ),
    ],
)
def test_parse_env_accepts_the_contract(env: dict[str, str], expected: dict[str, object]) -> None:
    parsed = parse_env(env)
    assert {key: getattr(parsed, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        pytest.param({}, "WORLD_SIZE", id="world-size-missing"),
        pytest.param({"WORLD_SIZE": "x"}, "WORLD_SIZE", id="world-size-not-numeric"),
        pytest.param({"WORLD_SIZE": "0"}, "WORLD_SIZE", id="world-size-zero"),
        pytest.param({**BASE, "WORLD_SIZE": "2", "RANK": "2"}, "RANK", id="rank-too-big"),
        pytest.param({**BASE, "WORLD_SIZE": "2"}, "RANK", id="rank-missing"),
        pytest.param({"WORLD_SIZE": "1", "DDP_BACKEND": "mpi"}, "DDP_BACKEND", id="unknown-backend"),
        pytest.param({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR", id="master-missing"),
        pytest.param({"WORLD_SIZE": "1", "MASTER_PORT": "0"}, "MASTER_PORT", id="port-zero"),
        pytest.param({"WORLD_SIZE": "1", "DDP_METRICS_PORT": "http"}, "DDP_METRICS_PORT", id="metrics-port"),
        pytest.param(
            {**BASE, "WORLD_SIZE": "4", "NNODES": "3", "NPROC_PER_NODE": "2"},
            "WORLD_SIZE",
            id="world-mismatch",
        ),
        pytest.param(
            {**BASE, "WORLD_SIZE": "2", "NNODES": "2", "NODE_RANK": "2", "RANK": "1"},
            "NODE_RANK",
            id="node-rank",
        ),
    ],
)
def test_parse_env_names_the_bad_variable_and_the_fix(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_env(env)
    assert raised.value.variable == variable
    message = str(raised.value)
    assert message.startswith(f"{variable}: ") and "; fix: " in message and "\n" not in message


@pytest.mark.parametrize(
    ("requested", "cuda", "resolved"),
    [
        pytest.param("auto", True, "nccl", id="auto-gpu"),
        pytest.param("auto", False, "gloo", id="auto-cpu"),
        pytest.param("gloo", True, "gloo", id="explicit-gloo"),
    ],
)
def test_resolve_backend(requested: str, cuda: bool, resolved: str) -> None:
    assert resolve_backend(requested, cuda) == resolved  # type: ignore[arg-type]


def test_cli_defaults_read_the_checkpoint_dir_from_env() -> None:
    config = parse_args([], env={"DDP_CHECKPOINT_DIR": "/ckpt"})
    assert (config.checkpoint_dir, config.workload, config.sync_metrics, config.comm_hook) == (
        "/ckpt",
        "digits",
        "detailed",
        "allreduce",
    )


def test_cli_refuses_light_mode_with_powersgd() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_args(["--sync-metrics", "light", "--comm-hook", "powersgd"], env={})
    assert raised.value.variable == "--sync-metrics"


@pytest.mark.parametrize(
    ("code", "retryable"),
    [
        pytest.param(EXIT_OK, False, id="ok"),
        pytest.param(EXIT_BAD_CONFIG, False, id="bad-config"),
        pytest.param(EXIT_STOPPED, True, id="sigterm"),
        pytest.param(EXIT_PEER_LOST, True, id="peer-lost"),
    ],
)
def test_exit_codes_fall_on_the_right_side_of_the_restart_policy(code: int, retryable: bool) -> None:
    assert is_retryable(code) is retryable
