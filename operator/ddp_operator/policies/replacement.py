"""Replacing lost pods alone (the recovery mode "one pod replaced"): the new pods' numbers, the restart's
record and count, and the new pods' launcher budget."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ddp_operator.observe import int_field
from ddp_operator.policies.accounting import MODE_POD_REPLACED, new_record
from ddp_operator.policies.budget import launcher_budget
from ddp_operator.policies.failure import RankFailure
from ddp_operator.spec import JobSpec


@dataclass(frozen=True)
class PodReplacement:
    """The bookkeeping of replacing lost pods alone (``replace_pods``)."""

    # (rank, n): each rank's new pod, its n-th replacement (the ``r<n>`` of its name).
    replacements: tuple[tuple[int, int], ...]
    record: dict[str, Any]  # the new status.lastRestart (mode PodReplaced)
    restarts: int  # status.restarts with this restart
    pod_replacements: int  # status.podReplacements with these pods
    restart_budget: int  # the new pods' DDP_RESTART_BUDGET


def replace_pods(
    job: JobSpec,
    ranks: Sequence[int],
    failure: RankFailure,
    cause: str,
    attempt: int,
    restarts: int,
    last: object,
    read: Mapping[str, Any] | None,
    replaced: object,
    numbers: Iterable[int],
    *,
    charged: bool = True,
) -> PodReplacement:
    """Replace the lost pods of ``ranks`` alone: one restart against backoffLimit (none when not
    ``charged``: a straggler's pod, which did not fail), after which the survivors re-form once more.

    ``failure`` and ``cause``: what decided it; ``restarts``: status.restarts before it; ``last``:
    status.lastRestart; ``read``: the record this read of rank 0 brings (None: none); ``replaced``:
    status.podReplacements; ``numbers``: every pod's replacement number (with ``replaced``, a new pod
    never takes a name used before). The record accounts for the round the replacement brings (``groupRestarts`` one past the
    rounds known), so rank 0's report of that round is not counted again.
    """
    used = max([int_field(replaced, 0), *numbers])
    replacements = tuple((rank, used + 1 + i) for i, rank in enumerate(ranks))
    same_attempt = isinstance(last, Mapping) and last.get("attempt") == attempt
    accounted = int_field(last.get("groupRestarts"), 0) if isinstance(last, Mapping) and same_attempt else 0
    known = max(accounted, read.get("groupRestarts", 0) if read else 0)
    record = new_record(
        cause=cause,
        mode=MODE_POD_REPLACED,
        attempt=attempt,
        failure_time=datetime.fromtimestamp(failure.finish_key, UTC),
        rank=failure.rank,
        exit_code=failure.exit_code,
        group_restarts=known + 1,
    )
    # The grows known so far stay accounted: a later read must not take them for failures to count.
    grows = max(
        int_field(last.get("groupGrows"), 0) if isinstance(last, Mapping) and same_attempt else 0,
        int_field(read.get("groupGrows"), 0) if read else 0,
    )
    if grows:
        record["groupGrows"] = grows
    after = restarts + 1 if charged else restarts
    return PodReplacement(
        replacements=replacements,
        record=record,
        restarts=after,
        pod_replacements=used + len(replacements),
        restart_budget=launcher_budget(job, after, accounted + 1),
    )
