"""The env contract and command line of the trainer (pure, no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ddp_operator.spec import DEFAULT_REPLACEMENT_WAIT_SECONDS
from ddp_trainer.config import (
    ConfigError,
    InjectedFault,
    parse_args,
    parse_env,
    parse_injected_fault,
    resolve_backend,
)
from ddp_trainer.exitcodes import (
    EXIT_BAD_CONFIG,
    EXIT_OK,
    EXIT_OWN_ERROR,
    EXIT_PEER_LOST,
    EXIT_STOPPED,
    is_retryable,
)
from ddp_trainer.supervisor.standby import BadAssignmentError, assigned_env, parse_assignment

pytestmark = pytest.mark.unit

BASE = {"MASTER_ADDR": "job-0.job.ns.svc", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(
            {"WORLD_SIZE": "1"},
            {"rank": 0, "pods": 1, "pod_rank": 0, "launches_workers": False},
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
            {"rank": 2, "pods": 4, "pod_rank": 2, "launches_workers": False},
            id="operator-one-proc-per-pod",
        ),
        pytest.param(
            {**BASE, "WORLD_SIZE": "4", "NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "2"},
            {"rank": 2, "pods": 2, "pod_rank": 1, "launches_workers": True},
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
            {"rank": 3, "pods": 2, "pod_rank": 1, "launches_workers": False},
            id="launched-worker",
        ),
        pytest.param(
            {"PET_MASTER_ADDR": "m", "WORLD_SIZE": "2", "PET_NNODES": "2", "PET_NODE_RANK": "1"},
            {"rank": 1, "pods": 2, "pod_rank": 1, "launches_workers": False},
            id="torchrun-pet-spelling",
        ),
    ],
)
def test_parse_env_accepts_the_contract(env: dict[str, str], expected: dict[str, object]) -> None:
    parsed = parse_env(env)
    assert {key: getattr(parsed, key) for key in expected} == expected


POD = {
    **BASE,
    "WORLD_SIZE": "2",
    "NNODES": "2",
    "NODE_RANK": "1",
    "DDPJOB_NAME": "digits",
    "DDPJOB_ATTEMPT": "4",
}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(
            POD,
            {
                "restart_mode": "Recreate",
                "launches_workers": False,
                "run_id": "digits-4",
                "restart_budget": 3,
            },
            id="no-variable-is-recreate",
        ),
        pytest.param(
            {**POD, "DDP_RESTART_MODE": "InPlace", "DDP_RESTART_BUDGET": "2", "DDP_RUN_ID": "uid-4"},
            {"restart_mode": "InPlace", "launches_workers": True, "run_id": "uid-4", "restart_budget": 2},
            id="in-place-launches-one-worker",
        ),
        pytest.param(
            {**POD, "DDP_RESTART_MODE": "inplace", "DDP_RESTART_BUDGET": "0"},
            {"restart_mode": "InPlace", "launches_workers": True, "restart_budget": 0},
            id="mode-case-insensitive-budget-zero",
        ),
        pytest.param(
            {**POD, "DDP_RESTART_MODE": "InPlace", "DDP_TRAINER_WORKER": "1", "RANK": "1"},
            {"restart_mode": "InPlace", "launches_workers": False, "rank": 1},
            id="its-worker-trains",
        ),
        pytest.param(
            {**POD, "DDP_RESTART_MODE": "Recreate", "NPROC_PER_NODE": "2", "WORLD_SIZE": "4"},
            {"restart_mode": "Recreate", "launches_workers": True},
            id="recreate-still-launches-several",
        ),
        pytest.param(
            {"WORLD_SIZE": "1", "DDP_RESTART_MODE": "InPlace"},
            {"run_id": "ddp-trainer-0", "launches_workers": True, "rendezvous_endpoint": None},
            id="local-default-run-id",
        ),
        pytest.param(
            {
                **POD,
                "DDP_RESTART_MODE": "InPlace",
                "DDP_RENDEZVOUS_ENDPOINT": "job-rdzv.job.ns.svc:29500",
                "POD_IP": "10.0.0.7",
            },
            {"rendezvous_endpoint": ("job-rdzv.job.ns.svc", 29500), "pod_ip": "10.0.0.7"},
            id="the-rendezvous-pods-store",
        ),
    ],
)
def test_restart_mode_and_budget(env: dict[str, str], expected: dict[str, object]) -> None:
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
        pytest.param(
            {"WORLD_SIZE": "1", "DDP_RESTART_MODE": "Sometimes"}, "DDP_RESTART_MODE", id="restart-mode"
        ),
        pytest.param(
            {"WORLD_SIZE": "1", "DDP_RESTART_BUDGET": "-1"}, "DDP_RESTART_BUDGET", id="budget-negative"
        ),
        pytest.param(
            {"WORLD_SIZE": "1", "DDP_RESTART_BUDGET": "many"}, "DDP_RESTART_BUDGET", id="budget-text"
        ),
        pytest.param(
            {"WORLD_SIZE": "1", "DDP_WORKER_FORKSERVER": "spawn"}, "DDP_WORKER_FORKSERVER", id="forkserver"
        ),
    ],
)
def test_parse_env_names_the_bad_variable_and_the_fix(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_env(env)
    assert raised.value.variable == variable
    message = str(raised.value)
    assert message.startswith(f"{variable}: ") and "; fix: " in message and "\n" not in message


ELASTIC_POD = {
    **BASE,
    "WORLD_SIZE": "3",
    "NNODES": "3",
    "NODE_RANK": "2",
    "DDP_RESTART_MODE": "InPlace",
    "DDP_MIN_MEMBERS": "2",
}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param(
            POD,
            {
                "elastic": False,
                "min_members": None,
                "replacement_wait": DEFAULT_REPLACEMENT_WAIT_SECONDS,
                "pods": 2,
            },
            id="no-variable-is-fixed-size",
        ),
        pytest.param(
            ELASTIC_POD,
            # The trainer's default, for a pod without the variable, is the operator's (one fact).
            {
                "elastic": True,
                "min_members": 2,
                "replacement_wait": DEFAULT_REPLACEMENT_WAIT_SECONDS,
                "pods": 3,
                "world_size": 3,
            },
            id="elastic-pod-default-wait",
        ),
        pytest.param(
            {**ELASTIC_POD, "DDP_MIN_MEMBERS": "3", "DDP_REPLACEMENT_WAIT_SECONDS": "5"},
            {"elastic": True, "min_members": 3, "replacement_wait": 5},
            id="min-equals-max",
        ),
        pytest.param(
            {**ELASTIC_POD, "DDP_MIN_MEMBERS": "1", "DDP_REPLACEMENT_WAIT_SECONDS": "1"},
            {"min_members": 1, "replacement_wait": 1, "launches_workers": True},
            id="min-one-shortest-wait",
        ),
        pytest.param(
            # torch's agent starts a worker of a round of 2 pods: WORLD_SIZE and the group are the
            # round's, NNODES and NODE_RANK the pod's.
            {
                **ELASTIC_POD,
                "WORLD_SIZE": "2",
                "RANK": "1",
                "LOCAL_RANK": "0",
                "GROUP_RANK": "1",
                "GROUP_WORLD_SIZE": "2",
                "DDP_TRAINER_WORKER": "1",
            },
            {"world_size": 2, "pods": 2, "pod_rank": 1, "rank": 1, "launches_workers": False},
            id="worker-of-a-smaller-round",
        ),
        pytest.param(
            {
                **BASE,
                "WORLD_SIZE": "4",
                "NNODES": "3",
                "NODE_RANK": "2",
                "NPROC_PER_NODE": "2",
                "DDP_RESTART_MODE": "InPlace",
                "DDP_MIN_MEMBERS": "1",
                "RANK": "3",
                "LOCAL_RANK": "1",
                "GROUP_RANK": "1",
                "GROUP_WORLD_SIZE": "2",
                "DDP_TRAINER_WORKER": "1",
            },
            {"world_size": 4, "pods": 2, "pod_rank": 1, "rank": 3, "local_rank": 1},
            id="two-workers-per-pod-smaller-round",
        ),
        pytest.param(
            {**POD, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"},
            {"pods": 2, "pod_rank": 1},
            id="group-variables-ignored-outside-a-worker",
        ),
    ],
)
def test_elastic_jobs(env: dict[str, str], expected: dict[str, object]) -> None:
    parsed = parse_env(env)
    assert {key: getattr(parsed, key) for key in expected} == expected


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        pytest.param({**ELASTIC_POD, "DDP_MIN_MEMBERS": "0"}, "must be >= 1", id="min-zero"),
        pytest.param({**ELASTIC_POD, "DDP_MIN_MEMBERS": "4"}, "4 > NNODES=3", id="min-above-nnodes"),
        pytest.param({**ELASTIC_POD, "DDP_MIN_MEMBERS": "two"}, "must be an integer", id="min-text"),
        pytest.param(
            {**ELASTIC_POD, "DDP_RESTART_MODE": "Recreate"}, "needs DDP_RESTART_MODE=InPlace", id="recreate"
        ),
        pytest.param(
            {key: value for key, value in ELASTIC_POD.items() if key != "DDP_RESTART_MODE"},
            "needs DDP_RESTART_MODE=InPlace",
            id="restart-mode-unset",
        ),
    ],
)
def test_ddp_min_members_errors(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_env(env)
    assert raised.value.variable == "DDP_MIN_MEMBERS"
    assert problem in raised.value.problem and "DDP_MIN_MEMBERS" in raised.value.fix


FROM_AN_OLDER_OPERATOR = {key: value for key, value in ELASTIC_POD.items() if key != "DDP_MIN_MEMBERS"}


@pytest.mark.parametrize(
    ("env", "min_members"),
    [
        pytest.param({**FROM_AN_OLDER_OPERATOR, "DDP_MIN_NODES": "2"}, 2, id="deprecated-name-alone"),
        pytest.param({**ELASTIC_POD, "DDP_MIN_NODES": "2"}, 2, id="both-names"),
        pytest.param({**ELASTIC_POD, "DDP_MIN_MEMBERS": "3", "DDP_MIN_NODES": "1"}, 3, id="the-name-wins"),
    ],
)
def test_the_deprecated_ddp_min_nodes_is_read_when_ddp_min_members_is_unset(
    env: dict[str, str], min_members: int
) -> None:
    parsed = parse_env(env)
    assert (parsed.elastic, parsed.min_members) == (True, min_members)


def test_an_error_in_the_deprecated_ddp_min_nodes_names_it() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_env({**FROM_AN_OLDER_OPERATOR, "DDP_MIN_NODES": "4"})
    assert raised.value.variable == "DDP_MIN_NODES"
    assert "4 > NNODES=3" in raised.value.problem


@pytest.mark.parametrize("value", ["0", "-5", "2.5", "soon"], ids=["zero", "negative", "fraction", "text"])
@pytest.mark.parametrize("env", [ELASTIC_POD, POD], ids=["elastic", "fixed-size"])
def test_ddp_replacement_wait_seconds_errors(env: dict[str, str], value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_env({**env, "DDP_REPLACEMENT_WAIT_SECONDS": value})
    assert raised.value.variable == "DDP_REPLACEMENT_WAIT_SECONDS"
    assert "whole seconds" in raised.value.fix


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
        pytest.param(EXIT_OWN_ERROR, False, id="own-error"),
    ],
)
def test_exit_codes_fall_on_the_right_side_of_the_restart_policy(code: int, retryable: bool) -> None:
    assert is_retryable(code) is retryable


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("1:rendezvous:kill", InjectedFault(1, "rendezvous", "kill"), id="kill-at-rendezvous"),
        pytest.param("0:resume:kill", InjectedFault(0, "resume", "kill"), id="kill-at-resume"),
        pytest.param("2:ddp:value-error", InjectedFault(2, "ddp", "value-error"), id="value-error-at-ddp"),
        pytest.param("1:step=3:bad-shape", InjectedFault(1, "step", "bad-shape", step=3), id="bad-shape"),
        pytest.param("1:step=0:exit=3", InjectedFault(1, "step", "exit", step=0, code=3), id="exit-code"),
        pytest.param("1:ddp:crash=3", InjectedFault(1, "ddp", "crash", code=3), id="crash-code"),
        pytest.param(
            "1:final-barrier:kill", InjectedFault(1, "final-barrier", "kill"), id="kill-at-final-barrier"
        ),
        pytest.param(
            "1:step=60:exit=137:once",
            InjectedFault(1, "step", "exit", step=60, code=137, once=True),
            id="exit-in-the-first-run-only",
        ),
    ],
)
def test_injected_fault_parses(text: str, expected: InjectedFault) -> None:
    assert parse_injected_fault(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("1:step:kill", id="step-without-number"),
        pytest.param("1:ddp=2:kill", id="number-on-another-point"),
        pytest.param("1:ddp:exit", id="exit-without-code"),
        pytest.param("1:ddp:kill=3", id="code-on-another-action"),
        pytest.param("1:ddp:bad-shape", id="bad-shape-outside-the-loop"),
        pytest.param("1:ddp:exit=3", id="exit-outside-the-loop"),
        pytest.param("1:step=2:crash", id="crash-without-code"),
        pytest.param("1:startup:kill", id="unknown-point"),
        pytest.param("1:ddp:explode", id="unknown-action"),
        pytest.param("-1:ddp:kill", id="negative-rank"),
        pytest.param("1:ddp", id="two-parts"),
        pytest.param("1:ddp:kill:twice", id="unknown-fourth-part"),
    ],
)
def test_injected_fault_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_injected_fault(text)


def test_injected_fault_matches_only_its_rank_point_and_step() -> None:
    fault = InjectedFault(1, "step", "kill", step=3)
    assert fault.at(1, "step", 3)
    assert not fault.at(0, "step", 3) and not fault.at(1, "step", 4) and not fault.at(1, "ddp")


@pytest.mark.parametrize(
    ("attempt", "restarts", "armed"),
    [
        pytest.param("0", 0, True, id="first-run"),
        pytest.param("0", 1, False, id="after-an-in-place-restart"),
        pytest.param("1", 0, False, id="a-later-attempt"),
    ],
)
def test_a_once_fault_goes_off_in_the_jobs_first_run_only(
    attempt: str, restarts: int, armed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddp_trainer.supervisor.resume import PROGRESS_DIR_ENV, write_restarts
    from ddp_trainer.training import faults

    write_restarts(tmp_path, restarts)
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("DDPJOB_ATTEMPT", attempt)
    once = InjectedFault(1, "step", "value-error", step=3, once=True)
    every = InjectedFault(1, "step", "value-error", step=3)
    if armed:
        with pytest.raises(ValueError):
            faults.inject(once, 1, "step", 3)
    else:
        faults.inject(once, 1, "step", 3)
    with pytest.raises(ValueError):
        faults.inject(every, 1, "step", 3)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param(
            {**POD, "DDP_RENDEZVOUS_ENDPOINT": "job-rdzv:29500"},
            "only DDP_RESTART_MODE=InPlace",
            id="recreate",
        ),
        pytest.param(
            {**POD, "DDP_RESTART_MODE": "InPlace", "DDP_RENDEZVOUS_ENDPOINT": "job-rdzv"},
            "must be host:port",
            id="no-port",
        ),
        pytest.param(
            {**POD, "DDP_RESTART_MODE": "InPlace", "DDP_RENDEZVOUS_ENDPOINT": "job-rdzv:70000"},
            "must be host:port",
            id="not-a-port",
        ),
    ],
)
def test_a_bad_rendezvous_endpoint_names_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match="DDP_RENDEZVOUS_ENDPOINT") as raised:
        parse_env(env)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(None, "fork", id="unset"),
        pytest.param("", "fork", id="empty"),
        pytest.param("Interpreter", "interpreter", id="interpreter-any-case"),
        pytest.param(" fork ", "fork", id="fork-spaced"),
    ],
)
def test_the_workers_forkserver_kind(value: str | None, expected: str) -> None:
    env = {"WORLD_SIZE": "1"} if value is None else {"WORLD_SIZE": "1", "DDP_WORKER_FORKSERVER": value}
    assert parse_env(env).worker_forkserver == expected


STANDBY = {
    **{key: value for key, value in POD.items() if key != "NODE_RANK"},
    "DDP_RESTART_MODE": "InPlace",
    "DDP_RENDEZVOUS_ENDPOINT": "digits-rdzv:29500",
    "DDP_STANDBY_FILE": "/etc/ddp/placement/assignment",
}


def test_a_standby_pod_has_no_rank_of_its_own_until_assigned() -> None:
    env = parse_env(STANDBY)
    assert env.standby_file == "/etc/ddp/placement/assignment" and env.launches_workers
    assigned = assigned_env(env, parse_assignment("rank=1 budget=2\n", env.pods))
    assert (assigned.pod_rank, assigned.rank, assigned.restart_budget, assigned.standby_file) == (
        1,
        1,
        2,
        None,
    )


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param({**STANDBY, "DDP_RESTART_MODE": "Recreate"}, "needs DDP_RESTART_MODE", id="recreate"),
        pytest.param(
            {k: v for k, v in STANDBY.items() if k != "DDP_RENDEZVOUS_ENDPOINT"},
            "needs DDP_RENDEZVOUS_ENDPOINT",
            id="no-rendezvous-pod",
        ),
        pytest.param({**STANDBY, "NODE_RANK": "1"}, "NODE_RANK is set", id="a-rank-of-its-own"),
        pytest.param({**STANDBY, "DDP_MIN_MEMBERS": "1"}, "DDP_MIN_MEMBERS is set", id="elastic"),
        pytest.param(
            {**STANDBY, "DDP_RANK_ORDER_FILE": "/etc/ddp/placement/rank-order"},
            "DDP_RANK_ORDER_FILE is set",
            id="ranks-by-topology",
        ),
    ],
)
def test_a_standby_pod_needs_what_a_standby_uses(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match="DDP_STANDBY_FILE") as raised:
        parse_env(env)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param("rank=2 budget=1", "the job has 2 pod(s)", id="rank-beyond-the-job"),
        pytest.param("rank=1", "not 'rank=<K> budget=<B>'", id="no-budget"),
        pytest.param("rank=-1 budget=1", "not 'rank=<K> budget=<B>'", id="negative"),
    ],
)
def test_a_bad_assignment_is_named(text: str, problem: str) -> None:
    with pytest.raises(BadAssignmentError, match="DDP_STANDBY_FILE") as raised:
        parse_assignment(text, 2)
    assert problem in str(raised.value)
