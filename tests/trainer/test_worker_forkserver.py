"""The in-place launcher's workers' forkserver is a fork of the launcher (ddp_trainer.supervisor.worker_forkserver),
so a pod imports torch once. Its workers must be what a new interpreter's forkserver would start: two
gangs of the same job, one with each kind (DDP_WORKER_FORKSERVER), are compared on what a worker
inherits (signal dispositions, descriptors, environment-read imports: the workers' series reach the
launcher's endpoint) and on what they train (the parameters' digests).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from trainer_gang import Gangs, TrainerProcess, describe, finish, samples

pytestmark = pytest.mark.trainer

TRAIN = ["--max-steps", "40", "--progress-every", "5", "--seed", "11", "--metrics-linger", "120"]
KINDS = ("fork", "interpreter")


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def signal_masks(pid: int) -> dict[str, str]:
    """The blocked, ignored and caught signal masks of a process (/proc/PID/status)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {
        key: value.strip()
        for key, _, value in (line.partition(":") for line in lines)
        if key in ("SigBlk", "SigIgn", "SigCgt")
    }


def sockets(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def forkserver_of(pod: TrainerProcess) -> tuple[int, int]:
    """(a worker of the pod, the forkserver it was forked from)."""
    worker = min(pod.worker_pids().items())[1]
    return worker, parent(worker)


def test_a_fork_of_the_launcher_serves_the_workers_a_new_interpreter_would(gangs: Gangs) -> None:
    pods = {
        kind: gangs.pods(
            2, 1, TRAIN, tag=kind, env={"DDP_RESTART_MODE": "InPlace", "DDP_WORKER_FORKSERVER": kind}
        )
        for kind in KINDS
    }
    seen: dict[str, dict[str, object]] = {}
    for kind, gang in pods.items():
        launcher = gang[0]
        launcher.wait_for_stdout(r"^progress step=5 ")
        worker, server = forkserver_of(launcher)
        assert parent(server) == launcher.process.pid, describe(gang)
        # What the kind says: the launcher itself, or the interpreter multiprocessing starts.
        started_as = "fork" if cmdline(server) == cmdline(launcher.process.pid) else "interpreter"
        if started_as == "interpreter":
            assert b"multiprocessing.forkserver" in cmdline(server), cmdline(server)
        assert started_as == kind, describe(gang)
        # Neither the server nor a worker holds a socket of the launcher (its rendezvous store, its
        # /metrics listener): a stale copy would keep a port open after the launcher closed it.
        assert not sockets(server) & sockets(launcher.process.pid), describe(gang)
        seen[kind] = {"worker": signal_masks(worker), "server": signal_masks(server)}
        assert "forkserver starts as a new interpreter" not in launcher.stderr, describe(gang)
    assert seen["fork"] == seen["interpreter"], seen

    scrapes = {kind: finish(gang) for kind, gang in pods.items()}
    digests = {kind: {d for pod in gang for d in pod.digests().values()} for kind, gang in pods.items()}
    assert len(digests["fork"]) == 1 and digests["fork"] == digests["interpreter"], digests
    for kind in KINDS:
        # The workers' own series reach rank 0's pod's endpoint (prometheus-client imported under the
        # workers' multiprocess directory in the fork, as in a new interpreter).
        steps = samples(scrapes[kind][0], "ddp_sync_steps_total")
        assert steps == {"0": 40.0}, (kind, steps, re.findall(r"^ddp_sync.*$", scrapes[kind][0], re.M))
