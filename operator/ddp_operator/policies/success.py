"""When an attempt has succeeded: every rank's trainer exited 0.

All ranks, not only rank 0: our trainer's ranks stop together, so a rank still running after rank 0
finished is either about to finish or stuck, and a job reported Succeeded must not have live pods.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from ddp_operator.observe import PodObservation

REASON_SUCCEEDED: Final = "AllRanksSucceeded"


def succeeded_ranks(pods: Iterable[PodObservation]) -> frozenset[int]:
    return frozenset(p.rank for p in pods if p.rank is not None and p.trainer_succeeded)


def attempt_succeeded(replicas: int, pods: Iterable[PodObservation]) -> bool:
    return succeeded_ranks(pods) >= frozenset(range(replicas))


def success_message(replicas: int, attempt: int) -> str:
    return f"all {replicas} rank(s) exited 0 in attempt {attempt}"
