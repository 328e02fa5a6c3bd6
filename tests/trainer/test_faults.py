"""Stopping together, resuming bit-identically, lost peers, the watchdog, and configuration errors."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from trainer_gang import PYTHON, Gangs, base_env, describe, free_port, wait_all

from ddp_trainer.exitcodes import EXIT_BAD_CONFIG, EXIT_PEER_LOST, EXIT_STOPPED

pytestmark = pytest.mark.trainer

RESUMABLE = ["--max-steps", "60", "--progress-every", "5", "--stop-check-every", "2", "--seed", "7"]


def test_sigterm_to_one_rank_stops_all_and_resume_matches_an_uninterrupted_run(
    gangs: Gangs, tmp_path: Path
) -> None:
    checkpoints = tmp_path / "checkpoints"
    reference = gangs.ranks(2, RESUMABLE, tag="reference")
    interrupted = gangs.ranks(
        2, [*RESUMABLE, "--throttle-ms", "100", "--checkpoint-dir", str(checkpoints)], tag="interrupted"
    )
    interrupted[0].wait_for_stdout(r"^progress step=10 ")
    interrupted[1].signal(signal.SIGTERM)
    assert wait_all(interrupted) == [EXIT_STOPPED, EXIT_STOPPED], describe(interrupted)
    stopped = interrupted[0].wait_for_stdout(r"^stopped step=(\d+) checkpoint=(\S+)$")
    stopped_step = int(stopped.group(1))
    assert 10 <= stopped_step < 60
    assert [p.name for p in checkpoints.iterdir()] == [f"ckpt-{stopped_step:010d}.pt"]

    resumed = gangs.ranks(2, [*RESUMABLE, "--checkpoint-dir", str(checkpoints)], tag="resumed")
    assert wait_all([*reference, *resumed]) == [0, 0, 0, 0], describe([*reference, *resumed])
    resumed[0].wait_for_stdout(rf"^resumed step={stopped_step} ")
    expected = reference[0].digests()[0]
    assert reference[1].digests()[1] == expected
    assert resumed[0].digests()[0] == expected and resumed[1].digests()[1] == expected


def test_sigkill_of_one_rank_makes_the_others_exit_peer_lost(gangs: Gangs) -> None:
    gang = gangs.ranks(
        3, ["--max-steps", "2000", "--throttle-ms", "30", "--progress-every", "5", "--watchdog-timeout", "60"]
    )
    gang[0].wait_for_stdout(r"^progress step=5 ")
    gang[2].signal(signal.SIGKILL)
    assert wait_all(gang[:2], timeout=90) == [EXIT_PEER_LOST, EXIT_PEER_LOST], describe(gang)


@pytest.mark.parametrize("delay", [0.2, 0.5, 1.0], ids=["sigterm-0.2s-later", "0.5s", "1s"])
def test_a_sigterm_after_a_peer_died_keeps_exit_peer_lost(gangs: Gangs, delay: float) -> None:
    # The operator (or `ddpjob run`) stops the collateral ranks of a failed attempt with SIGTERM. It
    # used to land while the rank finalized torch, with Python's handlers already reset: 143, not 170.
    gang = gangs.ranks(2, ["--max-steps", "100000", "--throttle-ms", "5", "--progress-every", "5"])
    gang[0].wait_for_stdout(r"^progress step=5 ")
    gang[1].signal(signal.SIGKILL)
    gang[1].wait()
    time.sleep(delay)
    gang[0].signal(signal.SIGTERM)
    assert gang[0].wait() == EXIT_PEER_LOST, describe(gang)


def test_watchdog_ends_a_rank_stuck_in_a_collective(gangs: Gangs) -> None:
    gang = gangs.ranks(
        2, ["--max-steps", "2000", "--throttle-ms", "30", "--progress-every", "5", "--watchdog-timeout", "4"]
    )
    gang[0].wait_for_stdout(r"^progress step=5 ")
    # A frozen peer keeps its sockets open: only a timeout can notice it.
    gang[1].signal(signal.SIGSTOP)
    assert gang[0].wait(timeout=90) == EXIT_PEER_LOST, describe(gang)
    gang[1].end()


def test_a_local_worker_exit_code_becomes_the_pod_exit_code(gangs: Gangs) -> None:
    pods = gangs.pods(
        1,
        2,
        ["--max-steps", "500", "--throttle-ms", "20", "--inject-fault", "1:step=3:exit=3"],
        with_metrics=False,
    )
    assert pods[0].wait() == 3, describe(pods)


BAD_ENVS = [
    pytest.param({}, "WORLD_SIZE", id="world-size-missing"),
    pytest.param({"WORLD_SIZE": "two"}, "WORLD_SIZE", id="world-size-not-numeric"),
    pytest.param(
        {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1"}, "RANK", id="rank-not-below-world-size"
    ),
    pytest.param({"WORLD_SIZE": "1", "DDP_BACKEND": "mpi"}, "DDP_BACKEND", id="unknown-backend"),
    pytest.param({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR", id="master-addr-missing"),
    pytest.param({"WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT", id="master-port-out-of-range"),
    pytest.param(
        {"WORLD_SIZE": "3", "NPROC_PER_NODE": "2"}, "WORLD_SIZE", id="world-size-not-multiple-of-nproc"
    ),
]


@pytest.mark.parametrize(("env", "variable"), BAD_ENVS)
def test_bad_env_exits_2_with_one_line_naming_the_variable(env: dict[str, str], variable: str) -> None:
    full_env = base_env()
    full_env.pop("MASTER_ADDR")
    full_env.update(env)
    result = subprocess.run(
        [PYTHON, "-m", "ddp_trainer", "--max-steps", "1"],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == EXIT_BAD_CONFIG, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f" {variable}: " in lines[0] and "fix: " in lines[0]


@pytest.mark.parametrize(
    "nproc", [pytest.param(1, id="one-process-per-pod"), pytest.param(2, id="launcher-of-two-workers")]
)
def test_a_taken_metrics_port_exits_2_naming_it(nproc: int) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {
            **base_env(),
            "WORLD_SIZE": str(nproc),
            "NPROC_PER_NODE": str(nproc),
            "DDP_METRICS_PORT": str(port),
            "DDP_METRICS_HOST": "127.0.0.1",
        }
        result = subprocess.run(
            [PYTHON, "-m", "ddp_trainer", "--max-steps", "1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == EXIT_BAD_CONFIG, result.stderr
    assert f"DDP_METRICS_PORT: cannot serve /metrics on 127.0.0.1:{port}" in result.stderr, result.stderr


def test_unreachable_master_fails_within_the_init_timeout_naming_the_endpoint() -> None:
    port = free_port()  # nothing listens there
    env = {**base_env(), "WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": str(port)}
    result = subprocess.run(
        [PYTHON, "-m", "ddp_trainer", "--init-timeout", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_PEER_LOST, result.stderr
    assert f"127.0.0.1:{port}" in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_stop_signal_ends_a_rank_still_waiting_for_its_group(gangs: Gangs, signum: int) -> None:
    # Rank 0 of 2 with no rank 1: it hosts the store and waits in the rendezvous, in C++, for up to
    # --init-timeout (10 minutes here). Nothing is there to checkpoint, so a stop must end it now.
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": str(free_port())}
    lonely = gangs.start("rank0", env, ["--init-timeout", "600"], free_port())
    # The endpoint opens just before the rendezvous: once it answers, the rank is in or near setup().
    deadline = time.monotonic() + 120
    while True:
        try:
            lonely.scrape()
            break
        except OSError:
            assert time.monotonic() < deadline and lonely.process.poll() is None, describe([lonely])
            time.sleep(0.1)
    lonely.signal(signum)
    assert lonely.wait(timeout=120) == -signum, describe([lonely])
