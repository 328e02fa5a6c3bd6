"""What ``reconcile.decide()`` answers, and the order in which the executor carries it out.

A handler executes a ``Decision``, treating "not found" on delete and "already exists" (of our own
object) on create as success:

- patch ``report.status`` when ``report.changed`` (before or after the creates: both orders are safe,
  reconcile.py says why), and post ``report.event`` when there is one (one per phase change, nothing
  else) and each of ``report.notices``;
- delete ``delete.pods``, and carry out ``kueue`` (policies/kueue.py; a deleted job's groups too);
- create the Service if ``create.service``, the NetworkPolicy if ``create.network_policy`` and the
  checkpoint PVC if ``create.pvc``, then give ``create.promotions`` their ranks (a standby pod that is
  gone by then is marked gone in the pod cache and ``decide`` is asked again: policies.standby's plan
  gives its rank another pod), then create the pods of ``create.ranks``, the
  replacements and the standby pods ``create.standbys`` (attempt ``create.attempt``) concurrently; a child the apiserver refuses for good (403 on a pod, 400/422 on any child) is not
  retried: the executor hands it to the next ``decide`` as a ``CreateRefusal``, which fails the job
  (but a standby pod: the job trains on without it, and ``decide`` holds the standbys back a while);
- post ``events`` (what the executor does without a status change: standbys deleted for a rank);
- write ``rank_orders`` (each bound pod's rendezvous order key) before the status;
- delete the DDPJob when ``delete.job`` (TTL);
- call ``decide`` again after ``requeue_after`` seconds when it is set (deadlines, TTL, restarts).

The reasons below are every Event and condition reason, the operator's and its policies' (which
policy gives each is said beside it): one home, so docs/api.md's tables are checked against one list
(tests/unit/test_events_documented.py ties the two).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from ddp_operator.observe import PodObservation
from ddp_operator.policies import standby as standby_policy
from ddp_operator.progress.tracker import STRAGGLER_WINDOW_SECONDS

REASON_CREATED: Final = "Created"
REASON_RESUMED: Final = "Resumed"
REASON_SCHEDULED: Final = "Scheduled"
REASON_RUNNING: Final = "Running"
REASON_SUSPENDED: Final = "Suspended"
REASON_POD_CREATE_FORBIDDEN: Final = "PodCreateForbidden"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_STRAGGLER: Final = "Straggler"
# runPolicy.stragglerPolicy Replace replaced the straggler's pod; or would, but may not (rank 0's pod,
# maxReplacements reached).
REASON_STRAGGLER_REPLACED: Final = "StragglerReplaced"
REASON_STRAGGLER_NOT_REPLACED: Final = "StragglerNotReplaced"
REASON_QUEUED: Final = "Queued"
# Events of a restart that kept the pods (docs/restarts.md), and of any restart once its cost is known.
REASON_RESTARTED_IN_PLACE: Final = "RestartedInPlace"
# An elastic job's group changed size in place (docs/elastic.md).
REASON_RESIZED: Final = "Resized"
REASON_POD_REPLACED: Final = "PodReplaced"
REASON_RECOVERED: Final = "Recovered"
# Standby pods (policies.standby): deleted because a rank's pod found no node; or refused by the
# apiserver (the job trains on without them); or a standby that took a rank whose CPU request the
# apiserver would not give back in place (the rank trains on with the standby's waiting CPU).
REASON_STANDBY_YIELDED: Final = "StandbyYielded"
REASON_STANDBY_NOT_CREATED: Final = "StandbyNotCreated"
REASON_STANDBY_NOT_RESIZED: Final = "StandbyNotResized"
REASON_RENDEZVOUS_REPLACED: Final = "RendezvousReplaced"
# A rank's failure (policies/failure.py): its exit code, an OOM kill, the backoffLimit spent, a pod
# disrupted or failed, a stall (no synchronized step for the stall limit: retried like a lost peer).
REASON_EXIT_CODE: Final = "ExitCode"
REASON_OOM: Final = "OOMKilled"
REASON_BACKOFF: Final = "BackoffLimitExceeded"
REASON_EVICTED: Final = "Evicted"
REASON_PREEMPTED: Final = "Preempted"
REASON_POD_DELETED: Final = "PodDeleted"
REASON_POD_FAILED: Final = "PodFailed"
REASON_STALLED: Final = "Stalled"
# The deadlines (policies/deadline.py): activeDeadlineSeconds; startupDeadlineSeconds, by what the wait was.
REASON_DEADLINE: Final = "DeadlineExceeded"
REASON_UNSCHEDULABLE: Final = "Unschedulable"
REASON_IMAGE_PULL: Final = "ImagePullFailed"
REASON_STARTUP_TIMEOUT: Final = "StartupTimeout"
# An attempt that ended well (policies/success.py): every rank exited 0, or some hung after training.
REASON_SUCCEEDED: Final = "AllRanksSucceeded"
REASON_HUNG_AFTER_TRAINING: Final = "RanksHungAfterTraining"


# While waiting for old pods to go (an attempt's, or a lost pod Kueue still counts), look again this
# often even without pod events.
RESTART_POLL_SECONDS: Final = 5.0


@dataclass(frozen=True)
class TimingRules:
    """How long the operator waits for reports that a real cluster delivers late or never.

    ``decision_window_seconds``: after the first failure of an attempt is seen, the attempt is judged
    once every rank has reported its end or this long has passed, whichever comes first, so a crash
    reported after its peers' collateral failures still decides (docs/restarts.md). The default covers
    kubelet status reports delayed by a busy node or apiserver; a gang whose ranks all exit at once
    (the usual case: the trainer turns a lost peer into exit 170 within seconds) never waits for it.

    ``unconfirmed_deletion_seconds``: a pod of an old attempt still Terminating this long after its
    grace period ended is on a node that cannot confirm (unreachable, dead); the next attempt starts
    without it (its name, DNS and Service membership are the old attempt's, never the new one's).
    """

    decision_window_seconds: float = 10.0
    unconfirmed_deletion_seconds: float = 30.0
    # A rank named slowest for this long (above the scraper's threshold) is reported as the straggler.
    straggler_window_seconds: float = STRAGGLER_WINDOW_SECONDS


DEFAULT_TIMING: Final = TimingRules()


@dataclass(frozen=True)
class PhaseEvent:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class Report:
    """What the job shows: its new status, and the Events that go with it."""

    status: dict[str, Any]
    changed: bool  # whether ``status`` differs from the old status (a write is due)
    event: PhaseEvent | None = None  # the phase change, when there is one
    # Events that are not phase changes (a straggler appeared), posted once each.
    notices: tuple[PhaseEvent, ...] = ()
    # This status starts a gang restart (for the operator's restart counter).
    gang_restart: bool = False
    # A restart whose cost is now known: (recovery mode, seconds from the failure to training again).
    restart_measured: tuple[str, float] | None = None


@dataclass(frozen=True)
class Creates:
    """The rank pods ``ranks`` of attempt ``attempt``, and the job-level children they need."""

    attempt: int = 0
    ranks: tuple[int, ...] = ()
    # Pods that replace lost ones of their rank alone: (rank, n) for the rank's n-th replacement.
    replacements: tuple[tuple[int, int], ...] = ()
    # Gang restarts the new pods' launchers may still make in place (DDP_RESTART_BUDGET,
    # policies.budget.launcher_budget).
    restart_budget: int = 0
    # Standby pods given a lost pod's rank instead of a new pod (policies.standby), patched before the
    # creates; and the numbers of the attempt's new standby pods, created with the other pods.
    promotions: tuple[standby_policy.Promotion, ...] = ()
    standbys: tuple[int, ...] = ()
    # (pod, CPU): standbys that hold a rank, given the rank's CPU request back in place after the
    # promotions (policies.standby.resizes).
    resizes: tuple[tuple[str, str], ...] = ()
    # The attempt's rendezvous pod to create (policies.rendezvous): its first, or one that replaces a
    # lost one; created before the ranks, which meet at it.
    rendezvous: str | None = None
    service: bool = False
    pvc: bool = False
    network_policy: bool = False


@dataclass(frozen=True)
class Deletes:
    pods: tuple[str, ...] = ()
    # Deleted at once (grace 0): their node stopped reporting, no kubelet is left to honour a grace period.
    lost_pods: tuple[str, ...] = ()
    # Pods of a hung gang whose processes stopped answering: they take no SIGTERM, so no grace period.
    hung_pods: tuple[str, ...] = ()
    job: bool = False  # the DDPJob itself: its TTL after finishing expired


def deletable(pods: Sequence[PodObservation]) -> tuple[str, ...]:
    """The names of ``pods`` to delete: those not being deleted already."""
    return tuple(sorted(p.name for p in pods if not p.deleting))


def lost_now(pods: Sequence[PodObservation]) -> tuple[str, ...]:
    """Pods the taint manager deleted off a node that stopped being Ready: gone at once (grace 0)."""
    return tuple(sorted(p.name for p in pods if p.node_lost and p.deleting and not p.terminal))


@dataclass(frozen=True)
class KueueActions:
    """What the executor does to Kueue's view of a job's group (policies/kueue.py decides it)."""

    # Pods of old attempts whose Kueue finalizer the operator removes, because Kueue would count them
    # in the group and delete the next attempt's pods as excess.
    release_pods: tuple[str, ...] = ()
    # Of those, the ones whose deletion no kubelet confirms: deleted at once (grace 0) so they stop
    # counting (the pod GC does the same for a node that is gone).
    force_delete_pods: tuple[str, ...] = ()
    # The pod annotated retriable-in-group "false" when the job failed for good, so Kueue frees the quota.
    mark_unretriable: tuple[str, ...] = ()
    # Delete the group's Kueue Workload (a suspended job gives its quota back; resuming queues again).
    release_group: bool = False
    # Kueue groups left by a deleted job, (group, the deleted job's UID): their Workloads go, unless a
    # job of that UID still exists (its event not yet seen), so Kueue lets go of their pods and quota.
    release_orphaned: tuple[tuple[str, str], ...] = ()


NO_KUEUE_ACTIONS: Final = KueueActions()


@dataclass(frozen=True)
class Decision:
    """What to do next for one job, grouped by what the executor touches."""

    report: Report
    create: Creates = Creates()
    delete: Deletes = Deletes()
    kueue: KueueActions = NO_KUEUE_ACTIONS
    requeue_after: float | None = None
    # Seconds until the failures seen in the live attempt are judged (TimingRules' decision window;
    # 0: judged now); None: no failure waits. Only the operator's debug line shows it.
    judged_in: float | None = None
    # When the progress scraper must read every pod of the attempt: a stall falling due is judged on
    # a read that late (policies.stall.read_due); None: no stall watched.
    read_every_pod_at: datetime | None = None
    # Events of what the executor does this time without a status change (standbys that yield to a
    # rank), posted after the deletes whether or not a status write is due.
    events: tuple[PhaseEvent, ...] = ()
    # Rendezvous order keys to annotate bound rank pods with, (pod, key) (policies.placement): written
    # before the status write, which may already show the ranks they give; a pod gone by then is skipped.
    rank_orders: tuple[tuple[str, str], ...] = ()

    @property
    def phase(self) -> str:
        return str(self.report.status.get("phase", ""))


@dataclass(frozen=True)
class CreateRefusal:
    """The apiserver refused a child for good: a fact the executor saw, decided on by the next ``decide``.

    Retrying cannot help: the same spec builds the same object. ``forbidden``: a 403 on a rank pod (Pod
    Security admission, a ResourceQuota); otherwise a 400/422 whose message names the invalid field.
    """

    forbidden: bool
    child: str  # which child, e.g. "rank 0's pod", "the Service"
    attempt: int
    message: str
    # A refusal the operator itself found (the cluster lacks what the spec asks for): this reason, and
    # ``message`` as it is.
    reason: str | None = None
