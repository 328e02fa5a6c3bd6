"""Real trainer processes standing in for kwok's rank pods (which never run): each pod's IP goes on the
loopback device and one process per rank runs with the env the operator gave that pod, serving /metrics
at the pod's own IP, so the operator's reads hit real endpoints. Used by test_progress.py and
test_health_replace.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.integration.operator_harness import free_port

from ddp_operator import builders


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
def trainer_processes(
    pods: list[dict[str, Any]], logs: Path, program: list[str], extra_env: dict[str, str] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One real trainer process per rank pod (``python <program...>``), with that pod's env and
    ``extra_env``, serving /metrics at the pod's IP; killed at the end. Where the pods meet at the job's
    rendezvous pod (DDP_RENDEZVOUS_ENDPOINT), its program runs too, as a process on loopback."""
    rendezvous = free_port()
    started: list[subprocess.Popen[bytes]] = []
    try:
        apart = any("DDP_RENDEZVOUS_ENDPOINT" in container_env(pod) for pod in pods)
        if apart:
            store = [sys.executable, "-c", builders.RENDEZVOUS_STORE_PROGRAM, str(rendezvous)]
            with open(logs / "rendezvous.log", "wb") as log:
                started.append(
                    subprocess.Popen(store, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                )
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
                POD_IP=pod["status"]["podIP"],
                GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
                **(extra_env or {}),
            )
            if apart:
                env["DDP_RENDEZVOUS_ENDPOINT"] = env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{rendezvous}"
            with open(logs / f"rank{rank}.log", "wb") as log:
                started.append(
                    subprocess.Popen(
                        [sys.executable, *program],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
