"""In-place restarts, the pure part: who failed, whether to restart, and what the last restart cost.

Every pod runs our supervisor (``ddp_trainer.supervisor.inplace``); when a worker or a pod is lost, every
pod's supervisor joins a new round of the launchers' rendezvous and the survivors re-form in place.
What has to be decided the same way on every pod is decided here, from plain values, without torch:

- the node descriptor address that makes the rendezvous rank of a pod its ``NODE_RANK``, and which
  rank a round may give a pod (an elastic job's smaller rounds shift the pods after a missing one);
- whether a failed worker's code is restarted (retried, within the gang's budget) or ends the pod,
  and whether a healthy group restarts for a pod that waits (an elastic job's grow is free);
- which of the failures the supervisors report is *the* failure of a restart, and its cause;
- the record of the last restart that rank 0's pod exports (docs/metrics.md, "In-place restarts").

See docs/restarts.md for the modes and docs/trainer.md for the env contract.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Final, Literal

from ddp_trainer.exitcodes import COLLATERAL_CODES, is_retryable

# Width of the pod rank in torch's node descriptor: a job has at most 4096 pods (the CRD's bound); six
# digits leave room, and every descriptor has the same width, so the text order is the numeric order.
NODE_RANK_DIGITS: Final = 6
NODE_ADDR_PREFIX: Final = "ddp-node-"

# The causes of a restart (the ``cause`` label of ddp_last_restart_info).
Cause = Literal["ExitCode", "PeerLost", "MemberJoined"]

# What a pod's supervisor does about a failed worker ("stuck": a worker no signal can end).
Decision = Literal["restart", "permanent", "budget-spent", "stuck"]
# What a pod's supervisor does when its workers are healthy and a pod waits to join the next round.
HealthyRestart = Literal["grow", "restart", "budget-spent"]


def node_addr(pod_rank: int, order_key: str | None = None) -> str:
    """This pod's sort key in the rendezvous (``ddp_trainer.supervisor.rendezvous``), which ranks a round's pods by
    sorting their keys as strings: ``10`` would sort before ``2``, so a fixed-width rank makes the sort
    follow ``NODE_RANK``. A job whose ranks follow the topology brings the operator's
    ``order_key`` instead (``ddp_trainer.supervisor.rank_order``), which ends with the same fixed-width rank, so the
    sort follows the topology and the pod rank breaks ties. The launcher gives the workers MASTER_ADDR
    itself, so this address never has to resolve.
    """
    if not 0 <= pod_rank < 10**NODE_RANK_DIGITS:
        raise ValueError(f"pod rank {pod_rank} out of range")
    rank = f"{pod_rank:0{NODE_RANK_DIGITS}d}"
    if order_key is None:
        return f"{NODE_ADDR_PREFIX}{rank}"
    if not order_key.endswith(f"/{rank}"):
        raise ValueError(f"the rank order key {order_key!r} is not the key of NODE_RANK {pod_rank}")
    return f"{NODE_ADDR_PREFIX}{order_key}"


def rank_mismatch(pod_rank: int, group_rank: int, elastic: bool, ordered: bool = False) -> str | None:
    """Why a round's rank for this pod is wrong, or None when it is right.

    A fixed-size job's round has every pod, so group rank k must be pod k. An elastic job's smaller
    round ranks the pods present in ``NODE_RANK`` order (:func:`node_addr`), so a pod after a missing
    one moves down: its group rank is at most its NODE_RANK. A job whose ranks follow the topology
    (``ordered``) ranks them by their order keys, any order but one: pod 0 is always rank 0, as in every
    job: its first worker, global rank 0, holds the checkpoint volume.
    """
    if pod_rank == 0 and group_rank != 0:
        return f"the rendezvous ranked NODE_RANK 0 as group rank {group_rank}: two pods claim NODE_RANK 0"
    if ordered:
        if pod_rank != 0 and group_rank == 0:
            return f"the rendezvous ranked NODE_RANK {pod_rank} as group rank 0: its order key sorts first"
        return None
    if not elastic:
        if group_rank == pod_rank:
            return None
        return (
            f"the rendezvous ranked NODE_RANK {pod_rank} as group rank {group_rank}: two pods claim one "
            "NODE_RANK"
        )
    if group_rank > pod_rank:
        return (
            f"the rendezvous ranked NODE_RANK {pod_rank} as group rank {group_rank}, after pods it should "
            "precede: two pods claim one NODE_RANK"
        )
    return None


def restarts_spent(restarts: int, grows: int) -> int:
    """The restarts that count against DDP_RESTART_BUDGET: every restart of the group but the grows."""
    return max(restarts - grows, 0)


def is_grow(members_before: int, members_after: int, failures: Sequence[Failure]) -> bool:
    """A restart is a grow when the round it left ended with no failure reported and the round it
    formed has more members: a pod joined a healthy group. It is not a failure and is not budgeted."""
    return not failures and members_after > members_before


def healthy_restart(elastic: bool, members: int, pods: int, spent: int, budget: int) -> HealthyRestart:
    """What a pod's supervisor does when a pod waits to join its healthy group.

    In an elastic job whose round has fewer members than the job has ``pods`` (NNODES), the waiting
    pod makes the next round larger: a grow, allowed whatever the budget. Otherwise (a fixed-size job, whose pods wait only to
    replace one that was lost) it is a restart like any other, while ``spent`` is below ``budget``.
    """
    if elastic and members < pods:
        return "grow"
    return "restart" if spent < budget else "budget-spent"


def decide(exit_code: int, restarts_done: int, budget: int) -> Decision:
    """What a pod's supervisor does when its worker failed with ``exit_code``.

    ``restarts_done`` is the gang's count of in-place restarts so far that count against the budget
    (:func:`restarts_spent`: the same on every pod, read from the rendezvous), ``budget`` what
    DDP_RESTART_BUDGET allows in all. A permanent code
    (docs/restarts.md: 1-127) restarts nothing; a retried one restarts while the budget lasts.
    """
    if not is_retryable(exit_code):
        return "permanent"
    if restarts_done >= budget:
        return "budget-spent"
    return "restart"


@dataclass(frozen=True)
class Failure:
    """One pod's report of a failed worker group: the worker whose code decides, as its supervisor saw it."""

    pod_rank: int  # the reporting pod's NODE_RANK
    global_rank: int
    exit_code: int
    time: float  # unix seconds when the supervisor saw the worker's end

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def decode(text: str) -> Failure:
        data = json.loads(text)
        return Failure(
            int(data["pod_rank"]), int(data["global_rank"]), int(data["exit_code"]), float(data["time"])
        )


def first_failure(failures: Iterable[Failure]) -> Failure | None:
    """The failure that caused a restart: a worker's own failure before the collateral ones (a lost
    peer's 170, a stop's 143: docs/trainer.md), then the earliest, then the lowest rank."""
    ordered = sorted(failures, key=lambda f: (f.exit_code in COLLATERAL_CODES, f.time, f.global_rank))
    return ordered[0] if ordered else None


def restart_cause(failure: Failure | None) -> Cause:
    """ExitCode: a worker failed of itself; PeerLost: only collateral failures (a peer or its pod went
    away); MemberJoined: no worker failed, a pod joined (a replacement) and the group re-formed."""
    if failure is None:
        return "MemberJoined"
    return "PeerLost" if failure.exit_code in COLLATERAL_CODES else "ExitCode"


@dataclass(frozen=True)
class RestartRecord:
    """The last in-place restart as rank 0's pod exports it (docs/metrics.md).

    Times are unix seconds. ``resumed`` and ``steps_redone`` arrive later, from rank 0's worker,
    once it has made its first step after the resume.
    """

    restarts: int  # the gang's in-place restarts so far, this one included
    cause: Cause
    failed_rank: int | None
    exit_code: int | None
    failure: float | None  # when the failed worker died (None for MemberJoined)
    stopped: float  # every survivor's workers stopped
    reformed: float  # the new round complete
    steps_before: int | None = None  # rank 0's completed steps when its workers were stopped
    resumed: float | None = None
    resumed_step: int | None = None
    members_before: int | None = None  # members of the round the restart left
    members_after: int | None = None  # members of the round it formed
    grow: bool = False  # a pod joined a healthy group (:func:`is_grow`)

    @property
    def steps_redone(self) -> int | None:
        if self.steps_before is None or self.resumed_step is None:
            return None
        return max(self.steps_before - self.resumed_step, 0)

    def with_resume(self, resumed: float, resumed_step: int) -> RestartRecord:
        return dataclasses.replace(self, resumed=resumed, resumed_step=resumed_step)


def build_record(
    restarts: int,
    failures: Sequence[Failure],
    stopped_times: Sequence[float],
    reformed: float,
    steps_before: int | None,
    members_before: int | None = None,
    members_after: int | None = None,
) -> RestartRecord:
    """Rank 0's record of the restart that led to the round just formed.

    ``stopped_times`` are every pod's "workers stopped" times (a replacement pod has none): the
    survivors are all stopped at the latest of them. ``failures`` are those reported in the round
    the restart left, ``members_before`` and ``members_after`` the members of that round and of the new one.
    """
    failure = first_failure(failures)
    stopped = max(stopped_times) if stopped_times else reformed
    return RestartRecord(
        restarts=restarts,
        cause=restart_cause(failure),
        failed_rank=None if failure is None else failure.global_rank,
        exit_code=None if failure is None else failure.exit_code,
        failure=None if failure is None else failure.time,
        stopped=stopped,
        reformed=reformed,
        steps_before=steps_before,
        members_before=members_before,
        members_after=members_after,
        grow=members_before is not None
        and members_after is not None
        and is_grow(members_before, members_after, failures),
    )


@dataclass(frozen=True)
class ResumeNote:
    """What rank 0's worker leaves for its launcher after its first step following an in-place restart."""

    restarts: int  # DDP_GROUP_RESTARTS of the worker: which restart this resume belongs to
    time: float  # unix seconds at the end of that first step
    resumed_step: int  # the step the worker resumed from (the checkpoint's, or 0)

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def decode(text: str) -> ResumeNote | None:
        try:
            data = json.loads(text)
            note = ResumeNote(int(data["restarts"]), float(data["time"]), int(data["resumed_step"]))
        except (ValueError, KeyError, TypeError):
            return None
        return note if math.isfinite(note.time) else None


@dataclass(frozen=True)
class LedgerState:
    """What the launcher knows of the gang's in-place restarts at one moment, for its /metrics endpoint.

    Immutable: the counts and the record are read together, so a scrape never pairs one round's
    restarts with another round's grows (which would charge a grow to the restart budget).
    """

    restarts: int = 0
    grows: int = 0  # of the restarts, the grows (an elastic job's pod joining a healthy group)
    members: int = 0  # members of the current round (0 before the first one is formed)
    # Of the restarts, those whose round has another number of members than the round before (an
    # elastic group's shrinks and grows), as rank 0 counted them: status.elastic.resizes.
    resizes: int = 0
    record: RestartRecord | None = None  # rank 0's pod: the last restart (None until one)


class RestartLedger:
    """The launcher's :class:`LedgerState`, written by the supervisor's thread, read by the endpoint's.

    ``state`` is replaced whole, in one assignment, and a reader takes it once: it sees one round's
    state or the next, never a mix, and needs no lock.
    """

    def __init__(self) -> None:
        self.state = LedgerState()

    def round_formed(
        self, restarts: int, grows: int, members: int, record: RestartRecord | None, *, resizes: int = 0
    ) -> None:
        """A round is complete: the gang's counts for it and, on rank 0's pod, the record of the
        restart that led to it (None keeps the last record)."""
        state = self.state
        self.state = dataclasses.replace(
            state,
            restarts=restarts,
            grows=grows,
            members=members,
            resizes=resizes,
            record=state.record if record is None else record,
        )
