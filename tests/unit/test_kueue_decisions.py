"""What the state machine does for a job in a Kueue plain-pod group (docs/scheduling.md): Queued while
Kueue gates it, the startup deadline paused meanwhile, a Kueue preemption retried without spending
backoffLimit, old pods Kueue still counts released before the next attempt, and a failed group ended."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import at, job_spec, kueue_job, kueue_managed, observe, pod, with_run_policy

from ddp_operator import kueue, names
from ddp_operator.decision import Decision
from ddp_operator.observe import format_time, observe_pod
from ddp_operator.reconcile import decide
from ddp_operator.spec import JobSpec

pytestmark = pytest.mark.unit

# What Kueue v0.17 writes on a preempted group's pods (a single pod reads plain "WorkloadEvicted").
EVICTED = "WorkloadEvictedDueToPreempted"


def run(
    job: JobSpec,
    status: dict[str, Any],
    pods: list[dict[str, Any]],
    now: float,
    queue: kueue.QueueObservation | None = None,
) -> Decision:
    return decide(job, status, observe(*pods), at(now), queue=queue)


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


def status_of(
    phase: str, *, attempt: int = 0, restarts: int = 0, conditions: list[Any] | None = None
) -> dict[str, Any]:
    return {
        "phase": phase,
        "attempt": attempt,
        "restarts": restarts,
        "replicas": 2,
        "startTime": format_time(at(0)),
        "conditions": conditions
        or [
            {
                "type": phase,
                "status": "True",
                "reason": phase,
                "message": "",
                "lastTransitionTime": format_time(at(1)),
            }
        ],
    }


# ---- queued ------------------------------------------------------------------------------------


QUEUE_SEEN = kueue.QueueObservation(
    workload="mnist-uid1234",
    local_queue="team-a-gpus",
    cluster_queue="gpus",
    message="couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu",
)


@pytest.mark.parametrize(
    ("queue", "in_message"),
    [
        pytest.param(
            None,
            "LocalQueue team-a-gpus: 2 of 2 rank pod(s) of attempt 0 are gated",
            id="before-kueue-is-read",
        ),
        pytest.param(QUEUE_SEEN, "(ClusterQueue gpus)", id="names-the-cluster-queue"),
        pytest.param(QUEUE_SEEN, "insufficient unused quota for nvidia.com/gpu", id="says-why"),
        pytest.param(
            kueue.QueueObservation("mnist-uid1234", "team-a-gpus", missing=True),
            "Kueue has not created Workload mnist-uid1234 yet",
            id="no-kueue-workload-yet",
        ),
    ],
)
def test_a_gated_gang_is_queued_naming_kueue(queue: kueue.QueueObservation | None, in_message: str) -> None:
    pods = [kueue_managed(pod(r, phase="Pending", scheduled=False), gated=True) for r in (0, 1)]
    decision = run(kueue_job(), status_of("Pending"), pods, now=5, queue=queue)
    assert decision.phase == names.PHASE_QUEUED
    queued = condition(decision.report.status, names.PHASE_QUEUED)
    assert queued is not None and queued["status"] == "True" and queued["reason"] == "Queued"
    assert in_message in queued["message"]
    assert decision.report.event is not None and (
        decision.report.event.type,
        decision.report.event.reason,
    ) == ("Normal", "Queued")
    assert decision.requeue_after is not None and decision.requeue_after <= kueue.QUEUED_POLL_SECONDS
    assert decision.create.ranks == () and decision.delete.pods == ()


def test_a_job_without_a_queue_is_never_queued() -> None:
    # Gates of another admission controller are not Kueue's business here.
    pods = [kueue_managed(pod(r, phase="Pending", scheduled=False), gated=True) for r in (0, 1)]
    assert run(job_spec(), status_of("Pending"), pods, now=5).phase == names.PHASE_PENDING


STARTUP = with_run_policy(startupDeadlineSeconds=60)


def queued_then(left_at: float) -> list[dict[str, Any]]:
    return [
        {
            "type": "Queued",
            "status": "False",
            "reason": "Created",
            "message": "",
            "lastTransitionTime": format_time(at(left_at)),
        }
    ]


@pytest.mark.parametrize(
    ("status", "gated", "now", "phase"),
    [
        pytest.param(status_of("Queued"), True, 3600, "Queued", id="an-hour-queued-is-not-late"),
        pytest.param(
            status_of("Queued"), False, 3600, "Pending", id="admitted-after-an-hour-starts-counting"
        ),
        pytest.param(
            status_of("Pending", conditions=queued_then(3600)),
            False,
            3650,
            "Pending",
            id="within-the-deadline-after-admission",
        ),
        pytest.param(
            status_of("Pending", conditions=queued_then(3600)),
            False,
            3661,
            "Failed",
            id="late-after-admission",
        ),
        pytest.param(status_of("Pending"), False, 61, "Failed", id="never-queued-counts-from-creation"),
    ],
)
def test_the_startup_deadline_does_not_run_while_queued(
    status: dict[str, Any], gated: bool, now: float, phase: str
) -> None:
    pods = [
        kueue_managed(
            pod(r, phase="Pending", scheduled=False, unschedulable=None if gated else "0/4 nodes"),
            gated=gated,
        )
        for r in (0, 1)
    ]
    decision = run(kueue_job(**STARTUP), status, pods, now=now)
    assert decision.phase == phase, decision.report.status["conditions"]


# ---- preemption ----------------------------------------------------------------------------------


def preempted(rank: int, stopped_by: str = EVICTED) -> dict[str, Any]:
    return kueue_managed(pod(rank, deleting_at=20), stopped_by=stopped_by)


@pytest.mark.parametrize(
    ("restart_policy", "restarts", "phase", "reason", "spent"),
    [
        pytest.param("ExitCode", 0, "Restarting", "Preempted", 0, id="retried-free"),
        pytest.param("ExitCode", 3, "Restarting", "Preempted", 0, id="even-with-backoff-spent"),
        pytest.param("OnFailure", 3, "Restarting", "Preempted", 0, id="on-failure-too"),
        pytest.param("Never", 0, "Failed", "Preempted", 0, id="never-means-never"),
    ],
)
def test_a_kueue_preemption_does_not_spend_backoff_limit(
    restart_policy: str, restarts: int, phase: str, reason: str, spent: int
) -> None:
    job = kueue_job(restartPolicy=restart_policy, runPolicy={"backoffLimit": 3})
    decision = run(job, status_of("Running", restarts=restarts), [preempted(0), preempted(1)], now=25)
    assert decision.phase == phase
    kind = condition(decision.report.status, phase)
    assert kind is not None and kind["reason"] == reason
    assert "prioritization in the ClusterQueue" in kind["message"], "Kueue's own words are kept"
    assert decision.report.status["restarts"] == restarts + spent
    if phase == "Restarting":
        assert decision.report.status["preemptions"] == 1
        assert "does not count against backoffLimit" in kind["message"]


@pytest.mark.parametrize(
    ("stopped_by", "reason"),
    [
        pytest.param("WorkloadEvicted", "Preempted", id="a-single-pod"),
        pytest.param("WorkloadEvictedDueToPreempted", "Preempted", id="a-group-preempted"),
        pytest.param("WorkloadEvictedDueToPodsReadyTimeout", "Evicted", id="requeued-by-waitForPodsReady"),
    ],
)
def test_every_eviction_by_kueue_is_retried_free(stopped_by: str, reason: str) -> None:
    """Kueue requeues an evicted group itself (with its own backoff): none of it spends ours."""
    pods = [preempted(0, stopped_by), preempted(1, stopped_by)]
    decision = run(kueue_job(runPolicy={"backoffLimit": 0}), status_of("Running"), pods, now=25)
    assert decision.phase == "Restarting"
    kind = condition(decision.report.status, "Restarting")
    assert kind is not None and kind["reason"] == reason
    assert (decision.report.status["restarts"], decision.report.status["preemptions"]) == (0, 1)


def test_a_preemption_by_the_scheduler_still_counts() -> None:
    """Only a queue brings a preempted job back by itself; the scheduler's preemption is a disruption."""
    pods = [kueue_managed(pod(0, disruption="PreemptionByScheduler", deleting_at=20)), old(1, exit_code=143)]
    decision = run(kueue_job(runPolicy={"backoffLimit": 3}), status_of("Running", restarts=3), pods, now=25)
    assert decision.phase == "Failed"
    kind = condition(decision.report.status, "Failed")
    assert kind is not None and kind["reason"] == "BackoffLimitExceeded"


def test_preemptions_add_up_and_survive_the_next_attempt() -> None:
    job = kueue_job()
    first = run(job, status_of("Running"), [preempted(0), preempted(1)], now=25).report.status
    first["preemptions"] = 2  # as if preempted before
    again = run(job, status_of("Running") | {"preemptions": 2}, [preempted(0), preempted(1)], now=25)
    assert again.report.status["preemptions"] == 3
    # Attempt 1 starts once Kueue's pods are gone: the count stays.
    restarting = again.report.status
    started = run(job, restarting, [], now=40)
    assert started.create.attempt == 1 and started.report.status["preemptions"] == 3


def test_a_deleted_kueue_workload_is_a_counted_disruption() -> None:
    pods = [preempted(0, "WorkloadDeleted"), preempted(1, "WorkloadDeleted")]
    decision = run(kueue_job(), status_of("Running"), pods, now=25)
    assert decision.phase == "Restarting"
    assert decision.report.status["restarts"] == 1 and "preemptions" not in decision.report.status
    kind = condition(decision.report.status, "Restarting")
    assert kind is not None and kind["reason"] == "PodDeleted"


# ---- the next attempt and Kueue's count of old pods -----------------------------------------------


def restarting() -> dict[str, Any]:
    return status_of("Restarting", restarts=1)


def old(rank: int, **kwargs: Any) -> dict[str, Any]:
    return kueue_managed(pod(rank, **kwargs))


@pytest.mark.parametrize(
    ("pods", "now", "creates", "release", "force"),
    [
        pytest.param(
            [old(0, exit_code=143, deleting_at=10), old(1, exit_code=143, deleting_at=10)],
            20,
            True,
            (),
            (),
            id="failed-old-pods-do-not-count",
        ),
        pytest.param(
            [old(0, exit_code=0, deleting_at=10), old(1, exit_code=143, deleting_at=10)],
            20,
            False,
            ("mnist-0-0",),
            (),
            id="a-succeeded-old-pod-is-released-first",
        ),
        pytest.param(
            [old(0, deleting_at=10), old(1, exit_code=143, deleting_at=10)],
            50,
            False,
            (),
            (),
            id="a-running-old-pod-is-waited-for",
        ),
        pytest.param(
            # Deleted at 10 with 30 s of grace: overdue 30 s after 40 (the node never confirms).
            [old(0, deleting_at=10), old(1, exit_code=143, deleting_at=10)],
            71,
            False,
            ("mnist-0-0",),
            ("mnist-0-0",),
            id="an-unconfirmed-old-pod-is-force-deleted",
        ),
        pytest.param(
            [
                kueue_managed(pod(0, deleting_at=10), gated=True),
                kueue_managed(pod(1, deleting_at=10), gated=True),
            ],
            20,
            True,
            (),
            (),
            id="gated-old-pods-never-had-a-node",
        ),
    ],
)
def test_old_pods_kueue_still_counts_go_before_the_next_attempt(
    pods: list[dict[str, Any]], now: float, creates: bool, release: tuple[str, ...], force: tuple[str, ...]
) -> None:
    decision = run(kueue_job(), restarting(), pods, now=now)
    assert bool(decision.create.ranks) is creates
    assert decision.kueue.release_pods == release
    assert decision.kueue.force_delete_pods == force


def test_without_kueue_an_unconfirmed_pod_does_not_block_and_is_not_forced() -> None:
    pods = [pod(0, deleting_at=10), pod(1, exit_code=143, deleting_at=10)]
    decision = run(job_spec(), restarting(), pods, now=71)
    assert decision.create.ranks == (0, 1)
    assert decision.kueue.release_pods == () and decision.kueue.force_delete_pods == ()


# ---- ending the group ----------------------------------------------------------------------------


def failed_status() -> dict[str, Any]:
    return status_of("Failed") | {"completionTime": format_time(at(30))}


@pytest.mark.parametrize(
    ("job", "status", "pods", "marked"),
    [
        pytest.param(
            kueue_job(),
            failed_status(),
            [old(0, exit_code=1), old(1, exit_code=170)],
            ("mnist-0-0",),
            id="failed-group-ended",
        ),
        pytest.param(
            kueue_job(),
            failed_status(),
            [kueue_managed(pod(0, exit_code=1), unretriable=True), old(1, exit_code=170)],
            (),
            id="said-once",
        ),
        pytest.param(
            kueue_job(),
            status_of("Succeeded"),
            [old(0, exit_code=0), old(1, exit_code=0)],
            (),
            id="kueue-ends-a-succeeded-group",
        ),
        pytest.param(
            job_spec(), failed_status(), [pod(0, exit_code=1), pod(1, exit_code=170)], (), id="no-kueue"
        ),
        pytest.param(
            kueue_job(),
            failed_status(),
            [kueue_managed(pod(0, exit_code=1), finalizer=False)],
            (),
            id="kueue-does-not-manage-the-namespace",
        ),
    ],
)
def test_a_failed_job_tells_kueue_its_group_failed_for_good(
    job: JobSpec, status: dict[str, Any], pods: list[dict[str, Any]], marked: tuple[str, ...]
) -> None:
    assert run(job, status, pods, now=40).kueue.mark_unretriable == marked


def test_the_judged_failure_marks_the_group_at_once() -> None:
    pods = [old(0, exit_code=1, finished=20), old(1, exit_code=170, finished=21)]
    decision = run(kueue_job(), status_of("Running"), pods, now=25)
    assert decision.phase == "Failed"
    assert decision.kueue.mark_unretriable == ("mnist-0-0",)


# ---- what is read of pods and of Kueue -------------------------------------------------------------


def test_kueue_facts_are_read_from_the_pod() -> None:
    seen = observe_pod(kueue_managed(pod(0, phase="Pending", scheduled=False), gated=True, unretriable=True))
    assert seen.kueue_gated and seen.kueue_finalizer and seen.kueue_unretriable
    assert seen.kueue_group == names.kueue_pod_group_name("mnist", "uid-1234")
    stopped = observe_pod(preempted(0))
    assert stopped.disruption == "Preempted"
    assert stopped.disruption_message is not None and "ClusterQueue" in stopped.disruption_message
    assert observe_pod(pod(0)).kueue_group is None and not observe_pod(pod(0)).kueue_counts_active


WORKLOAD_PENDING = {
    "spec": {"queueName": "team-a-gpus"},
    "status": {
        "conditions": [
            {
                "type": "QuotaReserved",
                "status": "False",
                "reason": "Pending",
                "message": "couldn't assign flavors:\n  insufficient quota",
            }
        ]
    },
}
WORKLOAD_ADMITTED = {
    "status": {
        "admission": {"clusterQueue": "gpus"},
        "conditions": [
            {
                "type": "Admitted",
                "status": "True",
                "reason": "Admitted",
                "message": "The workload is admitted",
            }
        ],
    }
}


@pytest.mark.parametrize(
    ("workload", "local_queue", "expected"),
    [
        pytest.param(
            WORKLOAD_PENDING,
            {"spec": {"clusterQueue": "gpus"}},
            kueue.QueueObservation("w", "q", "gpus", message="couldn't assign flavors: insufficient quota"),
            id="pending-with-its-cluster-queue",
        ),
        pytest.param(
            WORKLOAD_PENDING,
            None,
            kueue.QueueObservation("w", "q", None, message="couldn't assign flavors: insufficient quota"),
            id="local-queue-unreadable",
        ),
        pytest.param(
            WORKLOAD_ADMITTED, None, kueue.QueueObservation("w", "q", "gpus", admitted=True), id="admitted"
        ),
        pytest.param(
            None,
            {"spec": {"clusterQueue": "gpus"}},
            kueue.QueueObservation("w", "q", "gpus", missing=True),
            id="not-created-yet",
        ),
    ],
)
def test_kueue_objects_are_read_into_one_observation(
    workload: dict[str, Any] | None, local_queue: dict[str, Any] | None, expected: kueue.QueueObservation
) -> None:
    assert kueue.observe_queue("w", "q", workload, local_queue) == expected


@pytest.mark.parametrize(
    ("job", "pods", "released"),
    [
        pytest.param(
            kueue_job(runPolicy={"suspend": True}), [old(0), old(1)], True, id="gives-the-quota-back"
        ),
        pytest.param(
            kueue_job(runPolicy={"suspend": True}),
            [kueue_managed(pod(0), finalizer=False)],
            False,
            id="kueue-does-not-manage-it",
        ),
        pytest.param(job_spec(runPolicy={"suspend": True}), [pod(0), pod(1)], False, id="no-kueue"),
        pytest.param(kueue_job(runPolicy={"suspend": True}), [], False, id="nothing-left"),
    ],
)
def test_a_suspended_job_ends_its_kueue_group(
    job: JobSpec, pods: list[dict[str, Any]], released: bool
) -> None:
    decision = run(job, status_of("Running"), pods, now=30)
    assert decision.phase == "Suspended"
    assert decision.kueue.release_group is released


def test_pods_kueue_does_not_manage_are_not_counted_for_it() -> None:
    """The group labels alone (a namespace Kueue does not manage) make nothing wait or be forced."""
    unmanaged = pod(0, exit_code=0, deleting_at=10)
    unmanaged["metadata"]["labels"][names.KUEUE_POD_GROUP_LABEL] = "mnist-uid1234"
    decision = run(kueue_job(), restarting(), [unmanaged, pod(1, exit_code=143, deleting_at=10)], now=20)
    assert decision.create.ranks == (0, 1)
    assert decision.kueue.release_pods == () and decision.kueue.force_delete_pods == ()
