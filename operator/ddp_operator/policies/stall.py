"""A stalled gang: no new synchronized step for the stall limit once training started.

The limit is ``runPolicy.stallTimeoutSeconds`` when the job sets it; otherwise it follows the job's own
pace (:func:`limit`): max(30 s, 10x the seconds per step observed in the attempt), so a hung rank (a
frozen process, a dead link, a stuck collective: nothing exits and no socket closes) is found without
configuration, and a slow job is not taken for a hung one.

Shared by the operator (``reconcile._rule_stalled``) and `ddpjob run` (its attempt loop): the same
clock, the same ranks named, and the same failure handed to the failure policy, where a stall is
retried like a lost peer and counts against backoffLimit (docs/restarts.md). The step and the time a
read first showed it come from the progress tracker (``ddp_operator.progress.tracker``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from ddp_operator import names, ranks
from ddp_operator.decision import REASON_STALLED, Deletes
from ddp_operator.policies import elastic, recovery
from ddp_operator.policies.failure import RankFailure, judge_failures
from ddp_operator.policies.rule import Attempt, Finish, Outcome, ReplaceAlone, Restart, Rule

# The ranks named in the message: enough to point at the culprit without listing a whole job.
NAMED_RANKS = 3
# Without stallTimeoutSeconds: no new step for this many observed step times, and never less than the
# floor (a process restart, a checkpoint write or a slow scrape is not a hang).
HANG_STEPS = 10
HANG_FLOOR_SECONDS = 30
# Without stallTimeoutSeconds, a clock last set by a change of the group (a pod of the attempt started, the
# group re-formed) rather than by a step allows at least this: the first step of a new round needs the
# workers' processes to start (python, torch's import, the process group) and the state to arrive, and on
# a loaded 2-core node that alone took over 30 s (a grown elastic group and a straggler's replacement on
# kind were taken for hung ones and recreated).
START_FLOOR_SECONDS = 120
# A pod's metrics endpoint that has not answered a read in this long is silent: a stopped or wedged
# process's kernel still accepts the connection, and nothing ever answers it.
READ_TIMEOUT_SECONDS: Final = 3.0
# A stall is judged on a read of every pod that started at most READ_TIMEOUT_SECONDS before it fell due
# (read_due), so the pods it names are the ones silent or behind then, not at an older read. Without such
# a read (no pod's endpoint could be read at all), it is judged this long after it fell due, on what the
# reads showed last.
READ_GRACE_SECONDS: Final = 15.0


def limit(configured: int | None, step_seconds: float | None) -> int | None:
    """The stall limit in seconds: the job's stallTimeoutSeconds, else max(30, 10 x the observed step
    time); None while neither is known (no step observed yet)."""
    if configured is not None:
        return configured
    if step_seconds is None or step_seconds <= 0:
        return None
    return max(HANG_FLOOR_SECONDS, math.ceil(HANG_STEPS * step_seconds))


def clock(
    configured: int | None,
    step_seconds: float | None,
    step_changed_at: datetime | None,
    *changes: datetime | None,
    allowance: int = 0,
) -> tuple[int | None, datetime | None]:
    """The stall limit and when its clock started: from the newest of the last new step
    (``step_changed_at``) and the group's ``changes``; counted from a change, a limit the job did not
    set is at least START_FLOOR_SECONDS (a set one is the user's override, as it is). ``allowance``:
    seconds added to a watched limit (an elastic group waiting for a pod: policies.elastic)."""
    since = clock_start(step_changed_at, *changes)
    watched = limit(configured, step_seconds)
    if watched is None:
        return None, since
    if configured is None and since is not None and since != step_changed_at:
        watched = max(watched, START_FLOOR_SECONDS)
    return watched + allowance, since


def clock_start(*changes: datetime | None) -> datetime | None:
    """When the stall clock started: the newest of the last new step and the group's last change (a
    re-formed group, a pod of the attempt started); None before any."""
    known = [change for change in changes if change is not None]
    return max(known) if known else None


def seconds_left(
    limit: int | None, step: int, step_changed_at: datetime | None, now: datetime
) -> float | None:
    """Seconds until no new step for ``limit`` is a stall (<= 0: it is); None: not watched."""
    if limit is None or step <= 0 or step_changed_at is None:
        return None  # a stall needs training to have started
    return limit - (now - step_changed_at).total_seconds()


def suspected(limit: int | None, step: int, step_changed_at: datetime | None, now: datetime) -> bool:
    """No new step for half the limit: time to read every rank's step, to name the ranks behind."""
    left = seconds_left(limit, step, step_changed_at, now)
    return left is not None and limit is not None and left <= limit / 2


def read_due(left: float | None, now: datetime) -> datetime | None:
    """When the read of every pod that a stall falling due in ``left`` seconds (seconds_left) is judged
    on must start: early enough for a silent pod's read to have timed out by then. None: not watched."""
    return None if left is None else now + timedelta(seconds=left - READ_TIMEOUT_SECONDS)


def verdict_left(left: float | None, read_at: datetime | None, now: datetime) -> float | None:
    """Seconds until a stall falling due in ``left`` seconds is judged (<= 0: now); None: not watched.

    ``read_at``: when the newest read of every pod started. One that started at read_due or later is
    the one to judge on: then at the deadline. An older one could name no silent pod (a pod frozen
    after it answered) or the wrong one, and a whole gang would be recreated for one hung pod: the
    verdict waits for the next read, and READ_GRACE_SECONDS past the deadline at most.
    """
    due = read_due(left, now)
    if left is None or due is None:
        return None
    return left if read_at is not None and read_at >= due else left + READ_GRACE_SECONDS


def silent_ranks(rank_steps: Mapping[int, int], nodes: Mapping[int, str | None]) -> list[int]:
    """The pods (by first global rank) whose endpoint did not answer while others did: stopped or
    wedged processes, which take no SIGTERM (their pods are deleted without a grace period)."""
    return sorted(r for r in nodes if r not in rank_steps) if rank_steps else []


def stalled(
    limit: int, step: int, rank_steps: Mapping[int, int], nodes: Mapping[int, str | None], now: datetime
) -> tuple[RankFailure, str]:
    """The failure of a stalled attempt and what to say about it.

    ``rank_steps``: every rank's step as its pod's endpoint answered; ``nodes``: each pod's first
    global rank and its node. A pod whose endpoint did not answer while the others did (a SIGSTOPped
    or wedged process) is the likeliest culprit: it comes first, then the ranks furthest behind.
    """
    silent = silent_ranks(rank_steps, nodes)
    behind = (silent + sorted(rank_steps, key=lambda rank: (rank_steps[rank], rank)))[:NAMED_RANKS]
    where = ", ".join(
        f"rank {r} ({f'step {rank_steps[r]}' if r in rank_steps else 'its metrics did not answer'}) "
        f"on node {nodes.get(r) or 'unknown'}"
        for r in behind
    )
    failure = RankFailure(
        rank=behind[0] if behind else 0, finish_key=now.timestamp(), disruption=REASON_STALLED
    )
    detail = f"no synchronized step for {limit}s after step {step}"
    if where:
        detail += f"; furthest behind: {where}"
    return failure, detail


# ---- the operator's rule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Watch:
    """A live attempt's stall watch: the limit and its clock's start (``clock``, with an elastic
    allowance), seconds until no new step is a stall (``left``) and until it is judged
    (``verdict_left``); None: not watched."""

    limit: int | None = None
    since: datetime | None = None
    left: float | None = None
    verdict_left: float | None = None


def watch(live: Attempt) -> Watch:
    progress = live.progress
    if progress is None:
        return Watch()
    # A pod's start (or a replacement's creation, or a standby given its rank) changes the group:
    # the clock starts again there.
    started = [p.assigned_at or p.started_at or p.created_at for p in live.current]
    spec = live.job.elastic
    watched, since = clock(
        live.job.run_policy.stall_timeout_seconds, progress.step_seconds, progress.step_changed_at,
        progress.group_changed_at, *started,
        allowance=0 if spec is None else elastic.stall_allowance(spec, live.current),
    )  # fmt: skip
    # A finished group cannot stall. A fixed-size job's pod not running (a replacement still starting)
    # is the startup deadline's to judge. An elastic group trains on the pods that run: one that cannot
    # be placed is outside the round and holds nothing up, so the round is watched while it can train.
    trains = live.can_train if spec is not None else all(p.running for p in live.current)
    if progress.finished or not trains:
        return Watch(watched, since)
    left = seconds_left(watched, progress.step, since, live.now)
    return Watch(watched, since, left, verdict_left(left, progress.rank_steps_read_at, live.now))


def _stalled(live: Attempt, facts: Watch) -> Outcome | None:
    """No synchronized step for the stall limit (stallTimeoutSeconds, or the job's own pace): the gang
    is hung; retried like a lost peer. Under InPlace, pods whose metrics stopped answering (frozen,
    wedged) are lost pods: replaced alone unless rank 0's is among them (policies.recovery)."""
    progress, job = live.progress, live.job
    if facts.verdict_left is None or facts.verdict_left > 0 or progress is None:
        return None
    # Each pod of the round by its first global rank (ranks.py: an elastic round's own numbering).
    by_rank = ranks.first_ranks(progress.rank_pods, live.current, job.nproc_per_node, job.elastic is not None)
    nodes = {rank: p.node for rank, p in by_rank.items()}
    failure, detail = stalled(facts.limit or 0, progress.step, progress.rank_steps, nodes, live.now)
    silent = [by_rank[r] for r in silent_ranks(progress.rank_steps, nodes)]
    verdict = judge_failures(
        job.restart_policy, job.run_policy.backoff_limit, live.restarts, [failure], live.attempt
    )
    if not verdict.retry:
        return Finish(names.PHASE_FAILED, verdict.reason, f"{detail}; {verdict.message}")
    hung = tuple(p.name for p in silent)
    alone = recovery.replaceable_hung(
        job.run_policy.restart_mode,
        [p.rank for p in silent],
        queued=job.kueue is not None,
        rank0=recovery.rendezvous_apart(job),
    )
    if alone is not None:
        # The pods that stopped answering take no SIGTERM: deleted at once, their ranks replaced alone.
        return ReplaceAlone(alone, failure, REASON_STALLED, detail, Deletes(hung_pods=hung))
    return Restart(REASON_STALLED, f"{detail}; {verdict.message}", failure=failure, hung=hung)


RULES: Final = (Rule("stalled", 70, watch, _stalled, lambda live, facts: facts.verdict_left),)
