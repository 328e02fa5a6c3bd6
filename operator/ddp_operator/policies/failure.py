"""Which failure of an attempt decides, and whether it is retried: shared by the operator and `ddpjob run`.

A DDP group cannot lose one rank: when one fails, its peers' collectives break and they fail too, a
moment later. So only the first failure of an attempt decides (ordered by when the process ended);
the rest are collateral. The restart policy then says whether the gang is restarted:

- ``ExitCode``: exit codes 1-127 are permanent (the program said it cannot succeed), 128 and above are
  retried (killed by a signal: OOM, SIGTERM, the trainer's lost-peer code 170); evictions,
  preemptions and pods deleted under the job are retried.
- ``OnFailure``: every failure is retried.
- ``Never``: the first failure ends the job.

Every retry counts against ``backoffLimit``; when it is spent the job fails with
``BackoffLimitExceeded``, unless the deciding failure was an OOM kill, which keeps its own reason.
A preemption by a queue (Kueue evicts the whole group, and admits it again later) is the queue's
choice, not the job's failure: it is retried without spending ``backoffLimit`` (counted in
``status.preemptions`` instead), under every restart policy but ``Never``. A preemption by the
scheduler counts like any disruption (nothing brings the job back but the restart itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from ddp_operator.decision import (
    REASON_BACKOFF,
    REASON_EXIT_CODE,
    REASON_OOM,
    REASON_POD_DELETED,
    REASON_POD_FAILED,
    REASON_STALLED,
)
from ddp_operator.observe import PodObservation
from ddp_operator.policies.budget import restarts_left

FIRST_SIGNAL_CODE: Final = 128


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure. ``finish_key`` orders failures: a timestamp in seconds, or a finish sequence."""

    rank: int
    finish_key: float
    exit_code: int | None = None
    # The container's own reason (OOMKilled, Error) when known.
    container_reason: str | None = None
    # Evicted / Preempted / PodDeleted when the pod was disrupted rather than the process failing.
    disruption: str | None = None
    # What the disrupting component said (Kueue's eviction message), shown after the description.
    disruption_message: str | None = None
    # Kueue evicted the group: retried without spending backoffLimit.
    by_queue: bool = False
    # The pod's trainer container was killed from outside, its launcher with it (observe.py's
    # PodObservation.launcher_killed): the pod is lost, however its exit code reads.
    launcher_killed: bool = False

    @property
    def oom_killed(self) -> bool:
        return self.container_reason == REASON_OOM

    @property
    def reason(self) -> str:
        """The job-facing reason when this failure is the deciding one."""
        if self.disruption:
            return self.disruption
        if self.oom_killed:
            return REASON_OOM
        if self.exit_code is not None:
            return REASON_EXIT_CODE
        return REASON_POD_FAILED

    def describe(self) -> str:
        if self.disruption == REASON_POD_DELETED:
            return f"rank {self.rank}'s pod was deleted"
        if self.disruption == REASON_STALLED:
            return f"the gang stalled (rank {self.rank} furthest behind)"
        if self.disruption:
            said = f" ({self.disruption_message})" if self.disruption_message else ""
            return f"rank {self.rank}'s pod was {self.disruption.lower()}{said}"
        if self.launcher_killed:
            oom = ", OOMKilled" if self.oom_killed else ""
            return (
                f"rank {self.rank}'s pod was killed, its launcher with it (exit code {self.exit_code}{oom})"
            )
        if self.exit_code is not None:
            oom = " (OOMKilled)" if self.oom_killed else ""
            return f"rank {self.rank} exited with code {self.exit_code}{oom}"
        return f"rank {self.rank}'s pod failed ({self.container_reason or 'no exit code'})"


def exit_code_of_signal(signum: int) -> int:
    """How a kubelet (and a shell) reports a process ended by signal N: 128 + N."""
    return FIRST_SIGNAL_CODE + signum


def exit_code_from_returncode(returncode: int) -> int:
    """A local process's return code as a container would report it (Popen says -N for signal N)."""
    return exit_code_of_signal(-returncode) if returncode < 0 else returncode


def looks_permanent(failure: RankFailure) -> bool:
    """What the ExitCode policy calls permanent: the program itself exited with 1-127."""
    return (
        failure.disruption is None
        and not failure.oom_killed
        and failure.exit_code is not None
        and 0 < failure.exit_code < FIRST_SIGNAL_CODE
    )


def first_failure(failures: Sequence[RankFailure]) -> RankFailure:
    """The failure that decides an attempt.

    Kubernetes records finishedAt in whole seconds, so a crash and its peers' collateral failures
    often tie. A tie goes to the failure that looks permanent: our trainer maps a lost peer to a
    retryable code, so among simultaneous failures a 1-127 code is the cause, not the collateral.
    """
    if not failures:
        raise ValueError("an attempt without failures has no first failure")
    return min(failures, key=lambda f: (f.finish_key, not looks_permanent(f), f.rank))


def is_retryable(restart_policy: str, failure: RankFailure) -> bool:
    if restart_policy == "Never":
        return False
    if restart_policy == "OnFailure":
        return True
    return not looks_permanent(failure)


@dataclass(frozen=True)
class Verdict:
    """What to do about a failed attempt."""

    retry: bool
    reason: str
    message: str
    failure: RankFailure
    # False for a retry that does not spend backoffLimit (a preemption).
    counted: bool = True


def judge_failures(
    restart_policy: str,
    backoff_limit: int,
    restarts: int,
    failures: Sequence[RankFailure],
    attempt: int,
) -> Verdict:
    """Retry the gang as a new attempt, or fail the job; ``restarts`` is how many retries were spent."""
    failure = first_failure(failures)
    what = f"{failure.describe()} in attempt {attempt}"
    collateral = len(failures) - 1
    if collateral:
        what += f" ({collateral} later failure{'s' if collateral > 1 else ''} of other ranks ignored)"
    if not is_retryable(restart_policy, failure):
        why = (
            "restartPolicy Never"
            if restart_policy == "Never"
            else f"exit code {failure.exit_code} is permanent under restartPolicy ExitCode (1-127)"
        )
        return Verdict(retry=False, reason=failure.reason, message=f"{what}; {why}", failure=failure)
    if failure.by_queue:
        message = (
            f"{what}; restarting the gang as attempt {attempt + 1} "
            "(a preemption does not count against backoffLimit)"
        )
        return Verdict(retry=True, reason=failure.reason, message=message, failure=failure, counted=False)
    if restarts_left(backoff_limit, restarts) <= 0:
        reason = REASON_OOM if failure.oom_killed else REASON_BACKOFF
        message = f"{what}; backoffLimit {backoff_limit} reached after {restarts} restart(s)"
        return Verdict(retry=False, reason=reason, message=message, failure=failure)
    message = (
        f"{what}; restarting the gang as attempt {attempt + 1} (restart {restarts + 1} of {backoff_limit})"
    )
    return Verdict(retry=True, reason=failure.reason, message=message, failure=failure)


def failure_of(pod: PodObservation, now: datetime) -> RankFailure | None:
    """The failure a rank's pod shows, if any: its trainer's exit, or a disruption of the pod (one
    deleted under the job counts as ``PodDeleted`` whatever its trainer then exits with); ``now``
    orders a failure whose pod says no time."""
    assert pod.rank is not None
    if pod.trainer_succeeded:
        return None
    disruption = pod.disruption
    if disruption is None and pod.deleting and not _ended_before_deleted(pod):
        # Deleted under the job: the exit code that follows (143 after the kubelet's SIGTERM) is the
        # deletion's doing, not the process's.
        disruption = REASON_POD_DELETED
    if disruption is None and not pod.trainer_failed:
        return None
    when = pod.finished_at or pod.deleted_at or now
    return RankFailure(
        rank=pod.rank,
        finish_key=when.timestamp(),
        exit_code=pod.exit_code,
        container_reason=pod.reason,
        disruption=disruption,
        disruption_message=pod.disruption_message,
        by_queue=pod.evicted_by_queue,
        launcher_killed=disruption is None and pod.launcher_killed,
    )


def _ended_before_deleted(pod: PodObservation) -> bool:
    """The trainer had ended before the pod's deletion was asked for (a finished pod cleaned up)."""
    if not pod.terminal:
        return False
    if pod.finished_at is None or pod.deleted_at is None:
        return True
    return pod.finished_at < pod.deleted_at
