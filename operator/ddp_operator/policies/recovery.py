"""Which recovery mends a retried failure: shared by the operator and `ddpjob run`.

Three recovery modes (docs/restarts.md):

- **in place**: a worker process failed and nothing else was lost. Every pod's launcher restarts its
  workers on a new round of the job's rendezvous; no pod is deleted or created. The launchers do
  this on their own, within the gang-wide budget the operator gave them (policies/budget.py); what
  each cost is policies/accounting.py's.
- **one pod replaced**: a pod was lost (deleted, evicted, its node gone): the operator creates a new pod
  for that rank only (policies/replacement.py), and the survivors restart in place and wait for it on
  the next round. The c10d store lives in the attempt's rendezvous pod (``rendezvous_apart``), so rank
  0's pod is replaced alone like any other, an elastic job's too (its survivors wait for the new pod 0
  instead of training without it: only pod 0 mounts the checkpoint volume).
- **whole gang**: every pod deleted and the next attempt created. A launcher gave up (its budget
  spent, or the rendezvous pod gone), Kueue evicted the group, a stall no pod was singled out for, or
  ``runPolicy.restartMode: Recreate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from ddp_operator.decision import (
    REASON_EVICTED,
    REASON_POD_DELETED,
    REASON_PREEMPTED,
    RESTART_POLL_SECONDS,
    Deletes,
    deletable,
    lost_now,
)
from ddp_operator.policies import kueue
from ddp_operator.policies.accounting import MODE_IN_PLACE
from ddp_operator.policies.failure import RankFailure, judge_failures
from ddp_operator.policies.rule import Attempt, Hold, Outcome, ReplaceAlone, Rule, never
from ddp_operator.spec import JobSpec

# A pod that went away with its process (not a process that failed inside a live pod): the only kind
# of failure one new pod can mend.
LOST_POD_REASONS: Final = frozenset({REASON_POD_DELETED, REASON_EVICTED, REASON_PREEMPTED})
# The rank whose pod is special where the store is not apart (``rendezvous_apart``): without a
# rendezvous pod, rank 0's launcher hosts the c10d store, and losing it loses the group's meeting point.
RENDEZVOUS_RANK: Final = 0


def rendezvous_apart(job: JobSpec) -> bool:
    """The job's c10d store lives in a rendezvous pod of its own, not in rank 0's launcher: every job
    whose pods restart in place and that has more than one pod (names.rendezvous_pod_name). Then rank
    0's lost pod is replaced alone like any other, an elastic job's too: its survivors do not train in
    a round without pod 0 (its first worker would be global rank 0 without the checkpoint volume) but
    wait in it for the new pod 0 (docs/elastic.md)."""
    return job.run_policy.restart_mode == MODE_IN_PLACE and job.replicas > 1


def replaceable_ranks(
    restart_mode: str, failures: Sequence[RankFailure], *, rank0: bool = False, replicas: int = 0
) -> tuple[int, ...] | None:
    """The ranks whose lost pods are replaced alone, or None when the attempt takes the whole-gang path.

    Every failure must be a lost pod: deleted, evicted or preempted (its process may have exited, by
    the SIGTERM of the deletion), or killed from outside with its launcher (``launcher_killed``: no
    launcher is left in it to restart anything). A process that exited by its launcher's decision in a
    pod that stays means the launcher gave up (a permanent code, or the gang's budget spent), which the
    attempt's judge decides. A Kueue eviction takes the whole group away. ``rank0``: rank 0's pod may be
    replaced alone too (``rendezvous_apart``). When every one of the ``replicas`` pods is lost, no
    survivor holds the state: the whole gang restarts, from the disk.
    """
    if restart_mode != MODE_IN_PLACE or not failures:
        return None
    for failure in failures:
        if not is_lost_pod(failure) or failure.by_queue:
            return None
        if failure.rank == RENDEZVOUS_RANK and not rank0:
            return None
    ranks = tuple(sorted({f.rank for f in failures}))
    return None if replicas and len(ranks) >= replicas else ranks


def replaceable_hung(
    restart_mode: str, silent: Sequence[int | None], *, queued: bool, rank0: bool = False
) -> tuple[int, ...] | None:
    """The ranks of a stalled attempt's pods to replace alone: those whose metrics stopped answering
    while the others' did (frozen or wedged pods, deleted without a grace period), rank 0's among them
    only where ``rank0`` (``rendezvous_apart``); None: the whole gang restarts (Recreate, no pod singled
    out, or a Kueue group, which would count the hung pod until its deletion is confirmed)."""
    if restart_mode != MODE_IN_PLACE or queued or not silent or any(r is None for r in silent):
        return None
    ranks = tuple(sorted({r for r in silent if r is not None}))
    return None if RENDEZVOUS_RANK in ranks and not rank0 else ranks


def is_lost_pod(failure: RankFailure) -> bool:
    """The failure took the pod away (or left it with no launcher): no process of it restarts in place."""
    return failure.disruption in LOST_POD_REASONS or failure.launcher_killed


def fallback_note(failures: Sequence[RankFailure], *, rank0: bool = False) -> str:
    """Why a lost pod recreates the whole gang under InPlace, for the restart's record and message."""
    if not rank0 and any(f.rank == RENDEZVOUS_RANK and is_lost_pod(f) for f in failures):
        return "rank 0's pod was lost, and it hosted the job's store (the job has no rendezvous pod): the whole gang is recreated"
    return ""


# ---- the rule ------------------------------------------------------------------------------------


def lost_ranks(live: Attempt) -> tuple[int, ...] | None:
    """The ranks whose lost pods are replaced alone (``replaceable_ranks``), None: not this rule's."""
    job = live.job
    rank0 = rendezvous_apart(job)
    return replaceable_ranks(job.run_policy.restart_mode, live.failures, rank0=rank0, replicas=job.replicas)


def _replace_lost(live: Attempt, ranks: tuple[int, ...] | None) -> Outcome | None:
    """InPlace: a lost pod (deleted, evicted, its node gone) is replaced alone (rank 0's too, unless
    ``rendezvous_apart`` says no); its peers restart in place and wait for the new pod on the
    rendezvous's next round."""
    if ranks is None:
        return None
    job = live.job
    verdict = judge_failures(
        job.restart_policy, job.run_policy.backoff_limit, live.restarts, live.failures, live.attempt
    )
    if not verdict.retry:
        return None  # the judge fails the job, with the same verdict
    lost = [p for p in live.pods if p.attempt == live.attempt and p.rank in ranks]
    queued, unconfirmed = job.kueue is not None, live.timing.unconfirmed_deletion_seconds
    counted = kueue.still_counted(lost) if queued else []
    if counted:
        # Kueue still counts the lost pod in the group and would delete its replacement as excess:
        # release it first (its finalizer goes once it ended), then replace (docs/scheduling.md).
        return Hold(kueue.release_stale(counted, live.now, unconfirmed), RESTART_POLL_SECONDS)
    delete = Deletes(pods=deletable([p for p in lost if p.terminal]), lost_pods=lost_now(lost))
    release = kueue.release_replaced(queued, lost, live.now, unconfirmed)
    return ReplaceAlone(ranks, verdict.failure, verdict.reason, verdict.failure.describe(), delete, release)


RULES: Final = (Rule("replace_lost", 10, lost_ranks, _replace_lost, never),)
