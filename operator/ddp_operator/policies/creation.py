"""Which rank pods of an attempt are still to create, and which were lost (the operator's).

Until every rank's pod of the attempt has been observed once (``status.ranksCreated`` records it), a
missing pod is (re)created, which is idempotent: that is how an operator killed mid-create finishes the
attempt. After that, a missing pod was deleted under the job and fails its rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ddp_operator.decision import REASON_POD_DELETED
from ddp_operator.observe import PodObservation, int_field
from ddp_operator.policies.accounting import MODE_POD_REPLACED
from ddp_operator.policies.failure import RankFailure
from ddp_operator.spec import JobSpec


def ranks_created(
    job: JobSpec, old: Mapping[str, Any], attempt: int, current: Sequence[PodObservation]
) -> bool:
    """Every rank's pod of ``attempt`` has existed: all are observed now, or status.ranksCreated
    recorded it the first time they were."""
    if {p.rank for p in current} >= set(range(job.replicas)):
        return True
    recorded = old.get("ranksCreated")
    if recorded is None:
        # A status written before status.ranksCreated existed: inferred as it was then, from
        # status.replicas (a counter that lags) and a replacement (which needs every pod to have
        # existed). The first decision that finds every rank's pod created records the field, and
        # from then on the record answers.
        return int_field(old.get("replicas"), 0) >= job.replicas or _replaced_in(old, current)
    return int_field(recorded, -1) >= attempt


def _replaced_in(old: Mapping[str, Any], current: Sequence[PodObservation]) -> bool:
    """A pod of this attempt was replaced, which only happens once every rank's pod existed (the last
    restart's record says so until a later restart overwrites it; a replacement pod, while it is seen)."""
    last = old.get("lastRestart")
    replaced_here = (
        isinstance(last, Mapping)
        and last.get("mode") == MODE_POD_REPLACED
        and last.get("attempt") == old.get("attempt")
    )
    return replaced_here or any(p.replacement for p in current)


def missing_ranks(
    job: JobSpec, current: Sequence[PodObservation], created: bool, now: datetime
) -> tuple[tuple[int, ...], list[RankFailure]]:
    """Ranks of the current attempt without a pod: still to create, or deleted under the job.

    Until every rank's pod has been observed once (``created``), a missing pod may never have been
    created (an operator stopped mid-create) or not yet be in the watch cache; creating it again is
    idempotent. After that, a missing pod was deleted (node loss, a user) and fails its rank like any
    other disruption.
    """
    present = {p.rank for p in current}
    missing = tuple(r for r in range(job.replicas) if r not in present)
    if not missing:
        return (), []
    if not created:
        return missing, []
    return (), [
        RankFailure(rank=r, finish_key=now.timestamp(), disruption=REASON_POD_DELETED) for r in missing
    ]
