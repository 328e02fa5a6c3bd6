"""The operator pulls progress, stragglers and stalls from real trainer processes (issue 12).

kwok's pods never run, but each gets an IP from 10.244.0.0/16. The test puts every rank pod's IP on
the loopback device and starts a real trainer per rank (examples/scripts/straggler_ddp.py, which uses
``ddp_trainer.instrument()``) with the env the operator gave that pod, serving /metrics at the pod's
own IP and port: the operator's GET hits a real endpoint, nothing is mocked. Rank 2 is slowed in its
own forward, so rank 0 names it and the operator puts it in status.straggler; then rank 2 is
SIGSTOPped, no step completes any more, the other ranks dump their stacks and, after
runPolicy.stallTimeoutSeconds, the operator restarts the gang with reason Stalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube, namespace
from tests.integration.operator_harness import (
    REPO,
    Kube,
    OperatorProcess,
    ddpjob,
    free_port,
    running_ranks,
    wait_for,
)

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace"]  # fixtures, imported for pytest

SCRIPT = REPO / "examples" / "scripts" / "straggler_ddp.py"
REPLICAS = 3
SLOW_RANK = 2
TOTAL_STEPS = 5000
STALL_TIMEOUT = 10  # the CRD's minimum
DUMP_HEADER = "the Python stack of every thread follows"


def container_env(pod: dict[str, Any]) -> dict[str, str]:
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    return {e["name"]: e["value"] for e in trainer.get("env", []) if "value" in e}


@contextlib.contextmanager
def addresses_on_loopback(ips: list[str]) -> Iterator[None]:
    added: list[str] = []
    try:
        for ip in ips:
            subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], check=True, capture_output=True)
            added.append(ip)
        yield
    finally:
        for ip in added:
            subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], check=False, capture_output=True)


@contextlib.contextmanager
def trainers_for(pods: list[dict[str, Any]], logs: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One real trainer process per rank pod, with that pod's env, serving /metrics at its IP."""
    rendezvous = free_port()
    started: list[subprocess.Popen[bytes]] = []
    try:
        for pod in pods:
            env_contract = container_env(pod)
            rank = env_contract["RANK"]
            env = {
                key: value
                for key, value in os.environ.items()
                if not key.startswith(("DDP", "PET_", "TORCHELASTIC")) and key not in ("RANK", "WORLD_SIZE")
            }
            env.update(env_contract)
            env.update(
                MASTER_ADDR="127.0.0.1",  # the pod's DNS name resolves nowhere here
                MASTER_PORT=str(rendezvous),
                LOCAL_RANK="0",
                DDP_METRICS_HOST=pod["status"]["podIP"],
                GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
            )
            argv = [sys.executable, str(SCRIPT), "--steps", str(TOTAL_STEPS), "--exchange-every", "5"]
            argv += ["--step-ms", "20", "--slow-rank", str(SLOW_RANK), "--slow-ms", "40"]
            with open(logs / f"rank{rank}.log", "wb") as log:
                started.append(
                    subprocess.Popen(
                        argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)


def printed_columns(kube: Kube, namespace: str, name: str) -> dict[str, str]:
    header, row = kube.run("get", "ddpj", name, "-n", namespace).stdout.splitlines()[:2]
    return dict(zip(header.split(), row.split(), strict=False))


def test_status_shows_progress_and_the_straggler_and_a_stall_restarts_the_gang(
    kube: Kube, namespace: str, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("putting the pods' IPs on the loopback device needs root")
    operator = OperatorProcess(
        kube.kubeconfig,
        [namespace],
        tmp_path / "operator.log",
        extra=["--progress-interval", "2", "--straggler-window", "4"],
    ).start()
    try:
        job = ddpjob(
            "watched",
            REPLICAS,
            restart_policy="OnFailure",
            run_policy={"stallTimeoutSeconds": STALL_TIMEOUT},
            pod_spec={"terminationGracePeriodSeconds": 2},  # the stalled attempt's pods go quickly
        )
        job["spec"]["metrics"] = {"port": free_port()}
        kube.apply(job, namespace)
        pods = running_ranks(kube, namespace, "watched", REPLICAS, attempt=0)
        assert container_env(pods[0])["DDP_STALL_TIMEOUT_SECONDS"] == str(STALL_TIMEOUT)
        with (
            addresses_on_loopback([p["status"]["podIP"] for p in pods]),
            trainers_for(pods, tmp_path) as ranks,
        ):
            first = wait_for(
                "status.progress",
                lambda: (
                    kube.status(namespace, "watched").get("progress", {}).get("samplesPerSecond")
                    and kube.status(namespace, "watched")["progress"]
                ),
                timeout=120,
            )
            later = wait_for(
                "a later step in status.progress",
                lambda: (
                    (p := kube.status(namespace, "watched").get("progress", {})).get("step", 0)
                    > first["step"]
                    and p
                ),
                timeout=60,
            )
            assert float(later["samplesPerSecond"]) > 0
            assert 0 <= later["percentComplete"] < 100
            assert later["estimatedSecondsRemaining"] > 0
            assert "allreduceP50Seconds" in later and "lastSyncTime" in later
            columns = printed_columns(kube, namespace, "watched")
            assert int(columns["STEP"]) > 0 and float(columns["SAMPLES/S"]) > 0

            straggler = wait_for(
                "status.straggler", lambda: kube.status(namespace, "watched").get("straggler"), timeout=90
            )
            assert straggler["rank"] == SLOW_RANK
            assert straggler["pod"] == pods[SLOW_RANK]["metadata"]["name"]
            assert straggler["node"] == pods[SLOW_RANK]["spec"]["nodeName"]
            assert float(straggler["slowdown"]) > 1.5
            wait_for(
                "a Straggler Event",
                lambda: [e for e in kube.events_for(namespace, "watched") if e["reason"] == "Straggler"],
            )

            # A stall: the slow rank stops; its peers wait in the allreduce, no step completes.
            stalled_at = kube.status(namespace, "watched")["progress"]["step"]
            os.kill(ranks[SLOW_RANK].pid, signal.SIGSTOP)
            # The Restarting phase may last less than a poll: its Event is what stays.
            (stalled,) = wait_for(
                "a Stalled restart",
                lambda: [e for e in kube.events_for(namespace, "watched") if e["reason"] == "Stalled"][:1],
                timeout=120,
            )
            assert f"no synchronized step for {STALL_TIMEOUT}s" in stalled["message"], stalled
            # The stopped rank's endpoint cannot answer either: it is named first.
            assert f"furthest behind: rank {SLOW_RANK} (its metrics did not answer)" in stalled["message"]
            # Before the operator acted, the ranks still alive wrote their stacks to their logs.
            for rank in (0, 1):
                log = (tmp_path / f"rank{rank}.log").read_text(errors="replace")
                assert log.count(DUMP_HEADER) == 1, log[-3000:]
                assert 'Thread "MainThread"' in log and "straggler_ddp.py" in log
            assert stalled_at > 0
            # These processes stand in for attempt 0's containers, which a real kubelet has killed by
            # now: they must not answer for attempt 1 at reused pod IPs.
            for process in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        final = wait_for(
            "attempt 1 Running",
            lambda: (
                (st := kube.status(namespace, "watched")).get("attempt") == 1
                and st.get("phase") == "Running"
                and st
            ),
            timeout=180,
        )
        assert final["restarts"] == 1
    finally:
        operator.stop()
        print(f"--- operator log ---\n{operator.log_tail(80)}")
