"""The operator pulls progress, stragglers and stalls from real trainer processes (issue 12).

kwok's pods never run, but each gets an IP from 10.244.0.0/16. The module's job puts every rank pod's
IP on the loopback device and starts a real trainer per rank (examples/scripts/straggler_ddp.py,
which uses ``ddp_trainer.instrument()``) with the env the operator gave that pod, serving /metrics at
the pod's own IP and port: the operator's GET hits a real endpoint, nothing is mocked. Rank 2 is
slowed in its own forward. The tests share that one job (its trainers take most of the time) and
each checks one thing: status.progress, the straggler, and, last because it stops a rank, the stall.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube
from tests.integration.operator_harness import (
    REPO,
    Kube,
    OperatorProcess,
    ddpjob,
    free_port,
    running_ranks,
    wait_for,
)
from tests.integration.trainer_stand_ins import addresses_on_loopback, container_env, trainer_processes

pytestmark = pytest.mark.integration
__all__ = ["kube"]  # a fixture, imported for pytest

SCRIPT = REPO / "examples" / "scripts" / "straggler_ddp.py"
REPLICAS = 3
SLOW_RANK = 2
TOTAL_STEPS = 5000
STALL_TIMEOUT = 10  # the CRD's minimum
DUMP_HEADER = "the Python stack of every thread follows"


def trainers_for(
    pods: list[dict[str, Any]], logs: Path
) -> contextlib.AbstractContextManager[list[subprocess.Popen[bytes]]]:
    """The straggler script per rank pod: rank 2 slowed in its own forward."""
    argv = [str(SCRIPT), "--steps", str(TOTAL_STEPS), "--exchange-every", "5"]
    argv += ["--step-ms", "20", "--slow-rank", str(SLOW_RANK), "--slow-ms", "40"]
    return trainer_processes(pods, logs, argv)


def printed_columns(kube: Kube, namespace: str, name: str) -> dict[str, str]:
    header, row = kube.run("get", "ddpj", name, "-n", namespace).stdout.splitlines()[:2]
    return dict(zip(header.split(), row.split(), strict=False))


JOB = "watched"


@dataclass(frozen=True)
class WatchedJob:
    """A Running DDPJob whose rank pods are real trainers, and the operator that watches it."""

    kube: Kube
    namespace: str
    pods: list[dict[str, Any]]
    ranks: list[subprocess.Popen[bytes]]
    logs: Path

    def status(self) -> dict[str, Any]:
        return self.kube.status(self.namespace, JOB)

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.kube.events_for(self.namespace, JOB) if e["reason"] == reason]

    def progress(self, after_step: int = 0) -> dict[str, Any]:
        """status.progress once it shows a rate and a step past ``after_step``."""

        def probe() -> dict[str, Any] | None:
            shown: dict[str, Any] = self.status().get("progress", {})
            return shown if shown.get("samplesPerSecond") and shown.get("step", 0) > after_step else None

        return wait_for(f"status.progress past step {after_step}", probe, timeout=120)


@pytest.fixture(scope="module")
def watched(kube: Kube, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WatchedJob]:
    if os.geteuid() != 0:
        pytest.skip("putting the pods' IPs on the loopback device needs root")
    logs = tmp_path_factory.mktemp("progress")
    namespace = kube.create_namespace("op-progress")
    operator = OperatorProcess(
        kube.kubeconfig,
        [namespace],
        logs / "operator.log",
        extra=["--progress-interval", "2", "--straggler-window", "4"],
    ).start()
    try:
        job = ddpjob(
            JOB,
            REPLICAS,
            restart_policy="OnFailure",
            # The ranks here are plain trainer processes standing in for containers, with no launcher to
            # restart anything in place: the gang is recreated (the stopped rank's pod is not replaced
            # alone, which tests/unit/test_progress_stall.py and the kind suite cover).
            run_policy={"stallTimeoutSeconds": STALL_TIMEOUT, "restartMode": "Recreate"},
            pod_spec={"terminationGracePeriodSeconds": 2},  # the stalled attempt's pods go quickly
        )
        job["spec"]["metrics"] = {"port": free_port()}
        kube.apply(job, namespace)
        pods = running_ranks(kube, namespace, JOB, REPLICAS, attempt=0)
        assert container_env(pods[0])["DDP_STALL_TIMEOUT_SECONDS"] == str(STALL_TIMEOUT)
        with (
            addresses_on_loopback([p["status"]["podIP"] for p in pods]),
            trainers_for(pods, logs) as ranks,
        ):
            yield WatchedJob(kube, namespace, pods, ranks, logs)
    finally:
        operator.stop()
        print(f"--- operator log ---\n{operator.log_tail(80)}")
        kube.delete_namespace(namespace)


def test_status_shows_the_progress_of_real_trainers(watched: WatchedJob) -> None:
    first = watched.progress()
    later = watched.progress(after_step=first["step"])
    assert float(later["samplesPerSecond"]) > 0
    assert 0 <= later["percentComplete"] < 100
    assert later["estimatedSecondsRemaining"] > 0
    assert "allreduceP50Seconds" in later and "lastSyncTime" in later
    columns = printed_columns(watched.kube, watched.namespace, JOB)
    assert int(columns["STEP"]) > 0 and float(columns["SAMPLES/S"]) > 0


def test_a_slow_rank_is_named_in_status_with_an_event(watched: WatchedJob) -> None:
    straggler = wait_for("status.straggler", lambda: watched.status().get("straggler"), timeout=90)
    assert straggler["rank"] == SLOW_RANK
    assert straggler["pod"] == watched.pods[SLOW_RANK]["metadata"]["name"]
    assert straggler["node"] == watched.pods[SLOW_RANK]["spec"]["nodeName"]
    assert float(straggler["slowdown"]) > 1.5
    # Its forward sleeps: the others wait for it, and it lost the time in compute.
    assert straggler["phase"] == "compute"
    events = wait_for("a Straggler Event", lambda: watched.events("Straggler"))
    assert straggler["pod"] in str(events)


# Last in the module: it stops a rank of the shared job.
def test_a_stopped_rank_stalls_the_gang_and_the_operator_restarts_it(watched: WatchedJob) -> None:
    stalled_at = watched.progress()["step"]
    # The slow rank stops; its peers wait in the allreduce, no step completes.
    os.kill(watched.ranks[SLOW_RANK].pid, signal.SIGSTOP)
    # The Restarting phase may last less than a poll: its Event is what stays.
    (stalled,) = wait_for("a Stalled restart", lambda: watched.events("Stalled")[:1], timeout=120)
    assert f"no synchronized step for {STALL_TIMEOUT}s" in stalled["message"], stalled
    # The stopped rank's endpoint cannot answer either: it is named first.
    assert f"furthest behind: rank {SLOW_RANK} (its metrics did not answer)" in stalled["message"]
    # Before the operator acted, the ranks still alive wrote their stacks to their logs.
    for rank in (0, 1):
        log = (watched.logs / f"rank{rank}.log").read_text(errors="replace")
        assert log.count(DUMP_HEADER) == 1, log[-3000:]
        assert 'Thread "MainThread"' in log and "straggler_ddp.py" in log
    assert stalled_at > 0
    # These processes stand in for attempt 0's containers, which a real kubelet has killed by now:
    # they must not answer for attempt 1 at reused pod IPs.
    for process in watched.ranks:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def attempt_one_running() -> dict[str, Any] | None:
        status = watched.status()
        return status if status.get("attempt") == 1 and status.get("phase") == "Running" else None

    assert wait_for("attempt 1 Running", attempt_one_running, timeout=180)["restarts"] == 1
