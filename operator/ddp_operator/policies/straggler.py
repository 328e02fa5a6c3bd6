"""What to do about a straggler (docs/restarts.md, "Stragglers"): runPolicy.stragglerPolicy, shared by
the operator and `ddpjob run`. Pure: the sighting (progress.tracker), the pod that hosts the rank
(ranks.pod_of_rank) and the job's record in, a verdict out.

Report (the default) names the rank and does nothing else. Replace replaces the slow rank's pod alone
once it has slowed every step by ``slowdownPercent`` for ``sustainedSeconds``, or at once when the gang
health check (``DDP_HEALTH_CHECK=on``) found its links far below the group's median, placed away from its node
(the node joins ``status.avoidedNodes``, which every later pod of the job avoids). Shrink, an elastic
job's, does the same but its later pods may not land on an avoided node at all: without another free
node the group trains on without the slow pod, and grows back when one is free; it acts only while
the group can lose a pod and keep ``elastic.minReplicas``. A replacement for
slowness spends no backoffLimit (nothing failed), but at most ``maxReplacements`` are made a job: when
every node is slow (a shared network, a noisy cluster), replacing pods cannot help, and the bound keeps
it from churning them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from ddp_operator import ranks
from ddp_operator.decision import (
    REASON_STRAGGLER,
    REASON_STRAGGLER_NOT_REPLACED,
    REASON_STRAGGLER_REPLACED,
    Deletes,
    PhaseEvent,
)
from ddp_operator.observe import API_TIME_RESOLUTION_SECONDS, PodObservation
from ddp_operator.policies import elastic, recovery
from ddp_operator.policies.failure import RankFailure
from ddp_operator.policies.rule import Attempt, Outcome, ReplaceAlone, Rule
from ddp_operator.progress.exposition import HealthCheck
from ddp_operator.progress.render import describe_slow_rank, shown_straggler
from ddp_operator.progress.tracker import StragglerSighting, persistence_left
from ddp_operator.spec import STRAGGLER_MOVES, STRAGGLER_SHRINK, StragglerPolicy

# The rendezvous' host: its pod is not replaced alone (policies.recovery), so neither for slowness.
RENDEZVOUS_RANK: Final = 0
# The status fields that record the policy's acts.
STATUS_REPLACEMENTS: Final = "stragglerReplacements"
STATUS_AVOIDED_NODES: Final = "avoidedNodes"
# The CRD's bound on status.avoidedNodes: the oldest are forgotten past it.
MAX_AVOIDED_NODES: Final = 100


@dataclass(frozen=True)
class StragglerVerdict:
    """``replace``: the pod to replace alone (None: none now), and ``text``: why; ``held``: why a due
    replacement is not made (rank 0's pod, the bound reached), for the job's Event; ``left``: seconds
    until one could be due (None: none is in sight)."""

    replace: PodObservation | None = None
    held: str | None = None
    left: float | None = None
    text: str = ""  # why ``replace`` is replaced, for the Event


NONE: Final = StragglerVerdict()


def replaced_so_far(status: Any) -> int:
    value = status.get(STATUS_REPLACEMENTS) if hasattr(status, "get") else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def avoided_nodes(status: Any) -> tuple[str, ...]:
    value = status.get(STATUS_AVOIDED_NODES) if hasattr(status, "get") else None
    return tuple(str(n) for n in value if isinstance(n, str) and n) if isinstance(value, list) else ()


def verdict(
    policy: StragglerPolicy,
    sighting: StragglerSighting | None,
    pod: PodObservation | None,
    now: datetime,
    replaced: int,
    check: HealthCheck | None = None,
    check_pod: PodObservation | None = None,
    *,
    rank0: bool = False,
    shrinkable: bool = True,
) -> StragglerVerdict:
    """Whether the straggler's pod (``pod``), or the pod of the rank the last health check found slow
    (``check_pod``), is due for a replacement now. ``rank0``: rank 0's pod may be replaced alone too
    (policies.recovery.rendezvous_apart). ``shrinkable``: the group keeps elastic.minReplicas without
    one pod (what Shrink needs, policies.elastic)."""
    if policy.action not in STRAGGLER_MOVES:
        return NONE
    # A Shrink's new pod may not land on the avoided node, and an elastic group does not train without
    # pod 0: with no other node free it would wait for a pod 0 that cannot start.
    rank0 = rank0 and policy.action != STRAGGLER_SHRINK
    slow = _sighting_verdict(policy, sighting, pod, now, replaced, rank0)
    if slow.replace is None and slow.held is None and check is not None:
        found = _check_verdict(policy, check, check_pod, replaced, rank0)
        if found.replace is not None or found.held is not None:
            slow = found
    if slow.replace is not None and policy.action == STRAGGLER_SHRINK and not shrinkable:
        return StragglerVerdict(
            held=f"the group would fall below elastic.minReplicas without {slow.replace.name}: the "
            "straggler is reported only (runPolicy.stragglerPolicy Shrink)"
        )
    return slow


def _sighting_verdict(
    policy: StragglerPolicy,
    sighting: StragglerSighting | None,
    pod: PodObservation | None,
    now: datetime,
    replaced: int,
    rank0: bool,
) -> StragglerVerdict:
    if sighting is None or sighting.slowdown < policy.slowdown:
        return NONE
    # Slow for long enough in this pod: a replacement is judged from its own start, not its
    # predecessor's sighting (rank 0 names the rank, whichever pod hosts it).
    since = sighting.since
    began = (pod.started_at or pod.created_at) if pod is not None else None
    if began is not None:
        since = max(since, began)
        if not measured(sighting, pod):
            return StragglerVerdict(left=float(policy.sustained_seconds))
        since = max(since, sighting.group_since or since)
    left = policy.sustained_seconds - (now - since).total_seconds()
    if left > 0:
        return StragglerVerdict(left=left)
    if pod is None or pod.rank is None or pod.deleting or pod.phase != "Running":
        return NONE
    return _bounded(policy, sighting.rank, pod, replaced, replacement_text(policy, sighting, pod), rank0)


def measured(sighting: StragglerSighting, pod: PodObservation | None) -> bool:
    """Whether rank 0's sighting measured ``pod`` (the pod that hosts the sighted rank now; None:
    unknown). A replacement is in the group once a round formed with it: until the reads see one that
    formed after it started (its start kept to the whole second by the API), rank 0's windows, and the
    gauges its worker left, are its predecessor's. The verdict waits for them, and status.straggler
    does not name the new pod for them."""
    if pod is None or not pod.replacement:
        return True
    began = pod.started_at or pod.created_at
    if began is None:
        return True
    return (
        sighting.group_since is not None
        and sighting.group_since.timestamp() >= began.timestamp() + API_TIME_RESOLUTION_SECONDS
    )


def _check_verdict(
    policy: StragglerPolicy, check: HealthCheck, pod: PodObservation | None, replaced: int, rank0: bool
) -> StragglerVerdict:
    """The health check measured the links before the group trained: a rank far below the median is
    acted on at once. A check that ended before the rank's pod started measured an earlier pod of that
    rank (the one replaced): the new pod is judged by the check its joining brings."""
    if check.slow_rank is None or pod is None or pod.rank is None or pod.deleting or pod.phase != "Running":
        return NONE
    began = pod.started_at or pod.created_at
    # The API keeps a pod's start to the whole second: a check that ended within that second may have
    # ended before the pod began. It did not measure the pod (a pod takes seconds to join a check).
    if began is not None and check.checked_at < began.timestamp() + API_TIME_RESOLUTION_SECONDS:
        return NONE
    text = (
        f"the gang health check found rank {check.slow_rank}'s links far below the group's median "
        f'({pod.name} on node {pod.node or "unknown"}; docs/trainer.md, "Health check"; runPolicy.'
        f"stragglerPolicy {policy.action}); {moved(policy)}"
    )
    return _bounded(policy, check.slow_rank, pod, replaced, text, rank0)


def _bounded(
    policy: StragglerPolicy, rank: int, pod: PodObservation, replaced: int, text: str, rank0: bool
) -> StragglerVerdict:
    """Replace ``pod``, unless it is rank 0's where that is not replaced alone, or the job's bound is
    reached (then say why not)."""
    if pod.rank == RENDEZVOUS_RANK and not rank0:
        return StragglerVerdict(
            held=f"rank {rank}'s pod {pod.name} is rank 0's, which is not replaced alone for slowness under "
            "Shrink (the group waits for pod 0 and its new pod may not land on the avoided node) or without a "
            "rendezvous pod: the straggler is reported only"
        )
    if replaced >= policy.max_replacements:
        return StragglerVerdict(
            held=f"the job has replaced {replaced} straggler pod(s), runPolicy.stragglerPolicy.maxReplacements: "
            "the straggler is reported only (when every node is slow, a new pod does not help)"
        )
    return StragglerVerdict(replace=pod, text=text)


def with_note(
    shown: Mapping[str, Any] | None, before: Any, held: str | None
) -> tuple[Mapping[str, Any] | None, str | None]:
    """``status.straggler`` with why Replace does not act (``held``) as its ``note``, and the text of
    the Event that says so when the old status (``before``) did not: said once while it lasts."""
    if shown is None or held is None:
        return shown, None
    said = isinstance(before, Mapping) and before.get("note") == held
    return {**shown, "note": held}, None if said else held


def replacement_text(policy: StragglerPolicy, sighting: StragglerSighting, pod: PodObservation) -> str:
    """Why the straggler's pod is replaced, for the Event (the replaced pods are named after it)."""
    return (
        f"{describe_slow_rank(sighting.rank, sighting.slowdown, sighting.phase)} ({pod.name} on node "
        f"{pod.node or 'unknown'}) for {policy.sustained_seconds}s or more (runPolicy.stragglerPolicy "
        f"{policy.action}, slowdownPercent {policy.slowdown_percent}); {moved(policy)}"
    )


def moved(policy: StragglerPolicy) -> str:
    """What becomes of the slow rank's pod under ``policy``, for the Event."""
    if policy.action == STRAGGLER_SHRINK:
        return (
            "its pod goes, and its replacement may not land on that node: the group trains on without it "
            "until another node is free"
        )
    return "its pod is replaced away from that node"


def status_after(status: Any, node: str) -> dict[str, Any]:
    """The status.py Transition fields a straggler replacement on ``node`` writes."""
    return {
        "straggler_replacements": replaced_so_far(status) + 1,
        "avoided_nodes": with_node(avoided_nodes(status), node),
    }


def with_node(avoided: Sequence[str], node: str) -> tuple[str, ...]:
    """``status.avoidedNodes`` once ``node`` joins it (no duplicates; the newest kept within the bound)."""
    kept = [n for n in avoided if n != node] + ([node] if node else [])
    return tuple(kept[-MAX_AVOIDED_NODES:])


# The highest weight a preferred scheduling term may have: the scheduler weighs it above the
# template's own preferences (1..100) when it can.
AVOID_WEIGHT: Final = 100


def avoid_expression(avoided: Iterable[str]) -> dict[str, Any] | None:
    """The node selector requirement that keeps a pod off ``avoided`` (None: no node to avoid)."""
    nodes = sorted(set(avoided))
    if not nodes:
        return None
    return {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": nodes}


def require_off(node_affinity: dict[str, Any], avoided: Iterable[str]) -> None:
    """Shrink: ``node_affinity`` (a pod's, changed in place) requires a node outside ``avoided``. The
    required terms are ORed and each term's expressions ANDed, so the requirement joins every term the
    template has (or makes the only one)."""
    expression = avoid_expression(avoided)
    if expression is None:
        return
    required = node_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault("matchExpressions", []).append(dict(expression))


def avoid_term(avoided: Iterable[str]) -> dict[str, Any] | None:
    """A preferred node affinity term that steers a pod off ``avoided`` (None: no node to avoid)."""
    expression = avoid_expression(avoided)
    if expression is None:
        return None
    return {"weight": AVOID_WEIGHT, "preference": {"matchExpressions": [expression]}}


# ---- the rule ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sighted:
    """The slowest rank as the progress reads name it (None: none above the threshold), seconds until
    it has been slow for the straggler window (``left``; 0: it has), the pod that hosts it, and
    runPolicy.stragglerPolicy's verdict on it."""

    sighting: StragglerSighting | None
    left: float | None
    pod: PodObservation | None
    verdict: StragglerVerdict


def _pod_of(live: Attempt, rank: int | None) -> PodObservation | None:
    """The pod that hosts global rank ``rank`` now (ranks.pod_of_rank), None without one."""
    if rank is None or live.progress is None:
        return None
    read, elastic_job = live.progress.rank_pods, live.job.elastic is not None
    return ranks.pod_of_rank(rank, read, live.current, live.job.nproc_per_node, elastic_job)


def sighted(live: Attempt) -> Sighted:
    sighting = live.progress.straggler if live.progress is not None else None
    left = persistence_left(sighting, live.timing.straggler_window_seconds, live.now)
    pod = _pod_of(live, sighting.rank if sighting is not None else None)
    check = live.progress.health if live.progress is not None else None
    judged = verdict(
        live.job.run_policy.straggler,
        sighting,
        pod,
        live.now,
        replaced_so_far(live.old),
        check,
        _pod_of(live, check.slow_rank if check is not None else None),
        rank0=recovery.rendezvous_apart(live.job),
        shrinkable=elastic.can_shrink(live.job.elastic, live.running),
    )
    return Sighted(sighting, left, pod, judged)


def report(live: Attempt) -> tuple[Mapping[str, Any] | None, tuple[PhaseEvent, ...]]:
    """status.straggler (progress.render.shown_straggler), and its Warnings: the rank is new, or its
    pod may not be replaced."""
    facts = live.facts(sighted)
    before = live.old.get("straggler")
    sighting = facts.sighting
    if sighting is not None and not measured(sighting, facts.pod):
        sighting = None  # the windows of the pod it replaced: a replacement is not named for them
    window = live.timing.straggler_window_seconds
    named, notice = shown_straggler(sighting, facts.left, facts.pod, before, window)
    notices: tuple[PhaseEvent, ...] = ()
    if notice is not None:
        notices = (PhaseEvent(type="Warning", reason=REASON_STRAGGLER, message=notice),)
    shown, held = with_note(named, before, facts.verdict.held)
    if held is not None:
        notices += (PhaseEvent(type="Warning", reason=REASON_STRAGGLER_NOT_REPLACED, message=held),)
    return shown, notices


def _replace(live: Attempt, facts: Sighted) -> Outcome | None:
    """runPolicy.stragglerPolicy Replace: the straggler's pod, slow for long enough, is replaced alone
    away from its node, without spending backoffLimit."""
    pod = facts.verdict.replace
    if pod is None or pod.rank is None:
        return None
    slow = RankFailure(rank=pod.rank, finish_key=live.now.timestamp())
    what, deletes = facts.verdict.text, Deletes(pods=(pod.name,))
    return ReplaceAlone((pod.rank,), slow, REASON_STRAGGLER_REPLACED, what, deletes, slow_node=pod.node)


def _look(live: Attempt, facts: Sighted) -> float | None:
    looks = [left for left in (facts.left, facts.verdict.left) if left is not None]
    return min(looks) if looks else None


RULES: Final = (Rule("straggler", 80, sighted, _replace, _look),)
