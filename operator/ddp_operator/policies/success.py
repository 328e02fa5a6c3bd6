"""When an attempt has succeeded: every rank's trainer exited 0 (an elastic job: every rank that ran).

All ranks, not only rank 0: our trainer's ranks stop together, so a rank still running after rank 0
finished is either about to finish or stuck, and a job reported Succeeded must not have live pods.
Stuck is bounded: rank 0's exit 0 says training is over (its last step's allreduce needed every rank,
and its launcher left torch's exit barrier), so a rank whose pod still runs ``FINISH_GRACE_SECONDS``
later is hung after training (a wedged exit, a frozen launcher): the job succeeds without it and its pod
is deleted, whatever cleanPodPolicy says, rather than the job staying Running for ever.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime
from typing import Final

from ddp_operator.observe import PodObservation

# Ranks stop within seconds of each other; the grace covers a slow final checkpoint or log flush.
FINISH_GRACE_SECONDS: Final = 120


def succeeded_ranks(pods: Iterable[PodObservation]) -> frozenset[int]:
    return frozenset(p.rank for p in pods if p.rank is not None and p.trainer_succeeded)


def attempt_succeeded(replicas: int, pods: Iterable[PodObservation]) -> bool:
    return succeeded_ranks(pods) >= frozenset(range(replicas))


def success_message(replicas: int, attempt: int) -> str:
    return f"all {replicas} rank(s) exited 0 in attempt {attempt}"


def elastic_group_succeeded(min_replicas: int, succeeded: Collection[int], running: Collection[int]) -> bool:
    """An elastic job's group finished: rank 0 (the group's first rank, always in it) and at least
    ``min_replicas`` ranks exited 0, and no other rank's pod still runs. A pod that never started (its
    replacement waits for capacity) took no part, and a job must not wait on it for ever."""
    done = frozenset(succeeded)
    return 0 in done and len(done) >= min_replicas and not (frozenset(running) - done)


def elastic_success_message(succeeded: int, replicas: int, attempt: int) -> str:
    if succeeded == replicas:
        return success_message(replicas, attempt)
    return (
        f"the elastic group finished in attempt {attempt}: {succeeded} of {replicas} rank(s) exited 0, "
        "the others took no part"
    )


def finish_grace_left(pods: Iterable[PodObservation], now: datetime) -> float | None:
    """Seconds the ranks still running may take to end after rank 0's trainer exited 0 (when the kubelet
    says it finished); None while rank 0's has not, or once no other rank runs."""
    current = list(pods)
    first = next((p for p in current if p.rank == 0 and p.trainer_succeeded), None)
    if (
        first is None
        or first.finished_at is None
        or not any(p.running and not p.terminated for p in current if p.rank != 0)
    ):
        return None
    return FINISH_GRACE_SECONDS - (now - first.finished_at).total_seconds()


def hung_message(running: Collection[int], attempt: int) -> str:
    ranks = ", ".join(str(r) for r in sorted(running))
    return (
        f"rank 0 exited 0 in attempt {attempt} (training is over) and rank(s) {ranks} still ran "
        f"{FINISH_GRACE_SECONDS} s later: hung after training, stopped"
    )
