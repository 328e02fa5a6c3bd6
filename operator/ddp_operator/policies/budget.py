"""backoffLimit: how many restarts a job has left, and the share its pods' launchers may spend in place.

One comparison for every policy of the operator that asks whether a restart is still allowed (the
failure judge, the launchers' in-place restarts, the budget a new pod's launcher gets).
"""

from __future__ import annotations

from ddp_operator.spec import JobSpec


def restarts_left(backoff_limit: int, restarts: int) -> int:
    """Restarts still allowed after ``restarts`` were spent (below 0: more were made than allowed)."""
    return backoff_limit - restarts


def launcher_budget(job: JobSpec, restarts: int, group_rounds: int = 0) -> int:
    """``DDP_RESTART_BUDGET``: the gang restarts a new pod's launcher may still make in place.

    The launchers hold it against their group's own count of rounds in the attempt (kept in the
    rendezvous store, the same on every pod), so it is backoffLimit less the restarts spent outside
    those rounds: ``restarts`` (``status.restarts`` once the pod is created) less ``group_rounds``
    (the rounds of this attempt's group that ``restarts`` includes and the group's count holds too).
    A new attempt's pods start a group that has counted nothing (0); a pod that replaces a lost one
    joins a group that has made the rounds on record plus the one its joining brings. 0 under
    ``restartPolicy: Never``; never below 0.
    """
    if job.restart_policy == "Never":
        return 0
    return max(0, restarts_left(job.run_policy.backoff_limit, restarts - group_rounds))
