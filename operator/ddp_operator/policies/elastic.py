"""An elastic job's group (docs/elastic.md): when it trains, what status shows of it, and how long it may
wait below its minimum.

The launchers shrink and grow the group on their own; rank 0's pod reports its size and resizes
(policies/accounting.py reads them into ``status.lastRestart``). Pure: no API, no kopf.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ddp_operator.observe import PodObservation, int_field, parse_time
from ddp_operator.policies import recovery
from ddp_operator.policies.accounting import GroupRestartReport
from ddp_operator.spec import ElasticSpec


def can_train(spec: ElasticSpec, running: Sequence[PodObservation]) -> bool:
    """The group trains once ``minReplicas`` pods run, rank 0's (the rendezvous' host) among them."""
    return len(running) >= spec.min_replicas and any(p.rank == recovery.RENDEZVOUS_RANK for p in running)


def can_shrink(spec: ElasticSpec | None, running: Sequence[PodObservation]) -> bool:
    """The group keeps ``minReplicas`` without one of its running pods (runPolicy.stragglerPolicy Shrink
    acts only then: below the minimum the survivors could not train on)."""
    return spec is not None and len(running) - 1 >= spec.min_replicas


def stall_allowance(spec: ElasticSpec, pods: Sequence[PodObservation]) -> int:
    """Seconds a group may go without a step beyond the stall limit: while a pod of the attempt does not
    run (a replacement starting, or one that cannot be placed), the members wait up to
    ``replacementWaitSeconds`` for it before the round forms without it, and that wait is no hang."""
    return 0 if all(p.running for p in pods) else spec.replacement_wait_seconds


def below_min_since(last_restart: object, attempt: int, running_since: datetime | None) -> datetime | None:
    """Since when a group below ``minReplicas`` is held to startupDeadlineSeconds: the failure of the
    attempt's latest restart (the loss that took it there), else when the job last turned Running."""
    since = None
    if isinstance(last_restart, Mapping) and last_restart.get("attempt") == attempt:
        since = parse_time(last_restart.get("failureTime"))
    return since or running_since


def group_replicas(report: GroupRestartReport | None) -> int | None:
    """The pods in the training group, as rank 0's launcher last said (None: not said yet)."""
    return report.group_members if report is not None else None


def resizes(report: GroupRestartReport | None, shown: object) -> tuple[int | None, bool]:
    """``status.elastic.resizes`` after a read, and whether the group resized since ``shown`` (the old
    ``status.elastic``): rank 0's launcher's count of the rounds of this attempt that changed the group's
    size (``ddp_group_resizes_total``, counted where the rounds form, so a read that comes late or
    brings several rounds at once still shows every one). None: unchanged, or not reported. A new
    attempt's group counts from 0 again: a lower count replaces the old attempt's, and is no resize."""
    if report is None or report.resizes is None:
        return None, False
    before = int_field(shown.get("resizes") if isinstance(shown, Mapping) else None, 0)
    if report.resizes == before:
        return None, False
    return report.resizes, report.resizes > before


def elastic_status(
    spec: ElasticSpec, replicas: int, shown: object, group: int | None, resized: int | None
) -> dict[str, int]:
    """``status.elastic``: the group's pods now (``replicas``, what the job asks for, until rank 0
    says), the bounds, and the resizes; ``group`` and ``resized`` None: as ``shown`` (the old
    ``status.elastic``) says."""
    previous: Mapping[str, Any] = shown if isinstance(shown, Mapping) else {}
    return {
        "replicas": group or int_field(previous.get("replicas"), replicas),
        "minReplicas": spec.min_replicas,
        "maxReplicas": spec.max_replicas,
        "resizes": resized if resized is not None else int_field(previous.get("resizes"), 0),
    }


def running_message(spec: ElasticSpec, running: int, replicas: int, attempt: int) -> str:
    """The Running condition's message of an elastic job."""
    return (
        f"{running} of {replicas} rank pod(s) of attempt {attempt} are running (elastic: "
        f"trains on {spec.min_replicas} to {spec.max_replicas} pods)"
    )
