"""A standby pod (``runPolicy.standbyPods``, docs/restarts.md "Standby pods"): a pod started ahead of
any failure, which takes a lost pod's place when the operator assigns it one.

Its launcher does everything a pod's launcher does before it may join a round (the interpreter, the
torch import, the workers' forkserver) and then waits. The operator, once it has decided that a pod
was lost, writes the pod's rank and the gang's restart budget into the standby's annotation
``ddp.dev/assignment`` (``rank=<K> budget=<B>``); a downward API volume shows it to the launcher as the
file ``DDP_STANDBY_FILE``, which the kubelet rewrites within about a second. From then on the launcher
is pod K's, exactly as a new pod created for rank K would be: it joins the survivors' next round and
receives their state over the group. What it saves is the pod's start: scheduling, the sandbox, the
interpreter and the torch import, paid before the failure instead of after it.

The standby learns nothing else: NODE_RANK is absent from its environment (no rank is its own until
assigned), and the assignment is the one place its rank and budget come from.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from ddp_trainer.config import STANDBY_FILE_ENV, DistEnv
from ddp_trainer.progress import launcher_status_line
from ddp_trainer.supervisor.rank_order import read_key

# How often the file is read while no assignment is in it: the kubelet's rewrite is the slower part.
POLL_SECONDS: Final = 0.05
_ASSIGNMENT: Final = re.compile(r"^rank=(\d+) budget=(\d+)$")


class BadAssignmentError(ValueError):
    """The assignment file holds something that is not ``rank=<K> budget=<B>`` for this job."""


@dataclass(frozen=True)
class Assignment:
    rank: int  # the pod rank (NODE_RANK) this standby now holds
    budget: int  # DDP_RESTART_BUDGET for it, as the operator computed it for a new pod of that rank


def parse_assignment(text: str, pods: int) -> Assignment:
    """``rank=<K> budget=<B>`` with 0 <= K < ``pods``; raises BadAssignmentError otherwise."""
    match = _ASSIGNMENT.match(text.strip())
    if match is None:
        raise BadAssignmentError(f"{STANDBY_FILE_ENV} holds {text.strip()!r}, not 'rank=<K> budget=<B>'")
    rank, budget = int(match.group(1)), int(match.group(2))
    if rank >= pods:
        raise BadAssignmentError(f"{STANDBY_FILE_ENV} assigns rank {rank}, but the job has {pods} pod(s)")
    return Assignment(rank=rank, budget=budget)


def wait_for_assignment(
    path: Path,
    pods: int,
    sleep: Callable[[float], None] = time.sleep,
) -> Assignment:
    """The assignment once the file holds one. No deadline: a standby waits as long as the job trains,
    and the operator deletes it when the job ends."""
    while True:
        text = read_key(path)
        if text is not None:
            return parse_assignment(text, pods)
        sleep(POLL_SECONDS)


def assigned_env(env: DistEnv, assignment: Assignment) -> DistEnv:
    """This pod's place in the job once assigned: pod ``assignment.rank`` with its budget."""
    return replace(
        env,
        pod_rank=assignment.rank,
        rank=assignment.rank * env.nproc_per_node,
        local_rank=0,
        restart_budget=assignment.budget,
        standby_file=None,
    )


class ReleasedError(Exception):
    """The standby was stopped (SIGTERM: the job ended, or the operator no longer needs it) unassigned."""


def serve_as_standby(env: DistEnv, sleep: Callable[[float], None] = time.sleep) -> DistEnv | None:
    """Wait, ready, for this pod's assignment; returns the pod's place in the job, or None when it is
    stopped before it gets one. Logs ``launcher event=standby`` when it starts waiting and
    ``launcher event=assigned pod=K budget=B time=T`` when the assignment arrives."""
    assert env.standby_file is not None

    def released(signum: int, frame: object) -> None:
        raise ReleasedError(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, released)
    print(launcher_status_line("standby", {"file": env.standby_file}), flush=True)
    try:
        assignment = wait_for_assignment(Path(env.standby_file), env.pods, sleep=sleep)
    except ReleasedError as why:
        print(launcher_status_line("released", {"signal": why}), flush=True)
        return None
    finally:
        signal.signal(signal.SIGTERM, previous)
    fields = {"pod": assignment.rank, "budget": assignment.budget, "time": f"{time.time():.6f}"}
    print(launcher_status_line("assigned", fields), flush=True)
    return assigned_env(env, assignment)
