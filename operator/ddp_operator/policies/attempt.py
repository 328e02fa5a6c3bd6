"""The one attempt judge: the failure and success policies together, for the operator and `ddpjob run`.

Any failure decides the attempt (``failure.judge_failures``: the first by when it happened, retried or
not under the restart policy and backoffLimit); without one, the attempt succeeded once every rank
exited 0 (``success``), and is still running otherwise. The operator feeds it pod observations, the
local runner process exits: the rules, reasons and messages are the same.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from ddp_operator import names
from ddp_operator.decision import REASON_HUNG_AFTER_TRAINING, REASON_SUCCEEDED
from ddp_operator.policies import failure, rule, success
from ddp_operator.policies.rule import Attempt, Finish, Restart, Rule

Outcome = Literal["running", "succeeded", "retry", "failed"]


@dataclass(frozen=True)
class AttemptVerdict:
    outcome: Outcome
    reason: str = ""
    message: str = ""
    # A retry that spends backoffLimit (False: a preemption, counted apart).
    counted: bool = True
    # The failure that decided a retry or a failure (for the restart's record).
    failure: failure.RankFailure | None = None


STILL_RUNNING: Final = AttemptVerdict("running")


def judge_attempt(
    restart_policy: str,
    backoff_limit: int,
    restarts: int,
    attempt: int,
    replicas: int,
    failures: Sequence[failure.RankFailure],
    succeeded_ranks: Collection[int],
    *,
    elastic_min: int | None = None,
    running_ranks: Collection[int] = (),
    finish_grace_left: float | None = None,
) -> AttemptVerdict:
    """Succeeded, retry the gang as attempt + 1, failed, or still running.

    An elastic job (``elastic_min``: its minReplicas) succeeded once rank 0 and at least minReplicas
    ranks exited 0 and none of the others still runs: a pod that never started (a replacement still
    waiting for capacity) is not waited for, and one that came too late to join and failed to reach the
    finished group (its host gone) took no part: rank 0's 0 means every member passed the final
    barrier (docs/elastic.md). ``finish_grace_left`` (success.finish_grace_left): once it has run out
    with no failure, the ranks still running are hung after training and the attempt succeeded.
    """
    if elastic_min is not None and success.elastic_group_succeeded(
        elastic_min, succeeded_ranks, running_ranks
    ):
        return AttemptVerdict(
            "succeeded",
            REASON_SUCCEEDED,
            success.elastic_success_message(len(frozenset(succeeded_ranks)), replicas, attempt),
        )
    if failures:
        verdict = failure.judge_failures(restart_policy, backoff_limit, restarts, failures, attempt)
        return AttemptVerdict(
            "retry" if verdict.retry else "failed",
            verdict.reason,
            verdict.message,
            verdict.counted,
            verdict.failure,
        )
    if finish_grace_left is not None and finish_grace_left <= 0:
        hung = frozenset(running_ranks) - frozenset(succeeded_ranks)
        return AttemptVerdict("succeeded", REASON_HUNG_AFTER_TRAINING, success.hung_message(hung, attempt))
    if frozenset(succeeded_ranks) >= frozenset(range(replicas)):
        return AttemptVerdict("succeeded", REASON_SUCCEEDED, success.success_message(replicas, attempt))
    return STILL_RUNNING


# ---- the rule ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Judging:
    """When the attempt is judged: ``window_left``, seconds until its failures are (0: now; None:
    nothing failed); ``finish_grace_left``, those the ranks still running may take after rank 0's
    trainer exited 0 (success.finish_grace_left)."""

    window_left: float | None
    finish_grace_left: float | None


def judging(live: Attempt) -> Judging:
    """Judged at once when every rank reported its end (or its pod is gone); otherwise once the
    decision window has passed since the first failure was seen: the first failure seen is not always
    the first that happened."""
    return Judging(_window_left(live), success.finish_grace_left(live.current, live.now))


def _window_left(live: Attempt) -> float | None:
    if not live.failures:
        return None
    ended = [p for p in live.current if p.ended_badly]
    if not ended:
        return 0.0  # only pods that vanished (deleted under the job): nothing is left to report
    if all(p.reported_end for p in live.current):
        return 0.0  # every rank that still has a pod has told its story
    seen = [p.failure_seen_at or p.finished_at or p.deleted_at or live.now for p in ended]
    left = live.timing.decision_window_seconds - (live.now - min(seen)).total_seconds()
    return max(left, 0.0)


def _judged(live: Attempt, facts: Judging) -> rule.Outcome | None:
    """A failure restarts the gang or fails the job; every rank exited 0: the job succeeded."""
    if facts.window_left:
        return None
    job = live.job
    verdict = judge_attempt(
        job.restart_policy,
        job.run_policy.backoff_limit,
        live.restarts,
        live.attempt,
        job.replicas,
        live.failures,
        success.succeeded_ranks(live.current),
        elastic_min=job.elastic.min_replicas if job.elastic is not None else None,
        running_ranks=frozenset(p.rank for p in live.current if p.rank is not None and p.running),
        finish_grace_left=facts.finish_grace_left,
    )
    if verdict.outcome == "retry":
        return Restart(verdict.reason, verdict.message, verdict.counted, verdict.failure)
    if verdict.outcome == "failed":
        return Finish(names.PHASE_FAILED, verdict.reason, verdict.message)
    if verdict.outcome == "succeeded":
        return Finish(names.PHASE_SUCCEEDED, verdict.reason, verdict.message)
    return None


def _judging_look(live: Attempt, facts: Judging) -> float | None:
    looks = [left for left in (facts.window_left, facts.finish_grace_left) if left is not None]
    return min(looks) if looks else None


RULES: Final = (Rule("judged", 20, judging, _judged, _judging_look),)
