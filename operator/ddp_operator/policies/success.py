"""When an attempt has succeeded: every rank's trainer exited 0 (an elastic job: every rank that ran).

All ranks, not only rank 0: our trainer's ranks stop together, so a rank still running after rank 0
finished is either about to finish or stuck, and a job reported Succeeded must not have live pods.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Final

from ddp_operator.observe import PodObservation

REASON_SUCCEEDED: Final = "AllRanksSucceeded"


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
