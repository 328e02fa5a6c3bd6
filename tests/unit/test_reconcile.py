"""The DDPJob state machine (reconcile.decide): status, restarts, suspend, deadlines, TTL, cleanup."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import at, job_spec, observe, pod, with_run_policy

from ddp_operator import builders, names
from ddp_operator.decision import REASON_HUNG_AFTER_TRAINING, CreateRefusal, Decision
from ddp_operator.observe import format_time
from ddp_operator.policies import success
from ddp_operator.policies.attempt import judge_attempt
from ddp_operator.policies.failure import RankFailure, exit_code_from_returncode
from ddp_operator.reconcile import decide, decide_invalid_spec
from ddp_operator.spec import JobSpec
from ddp_operator.status import failed_status

pytestmark = pytest.mark.unit

CHECKPOINT = {"volumeClaimTemplate": {"resources": {"requests": {"storage": "5Gi"}}}}


def run(job: JobSpec, status: dict[str, Any], pods: list[dict[str, Any]], now: float) -> Decision:
    return decide(job, status, observe(*pods), at(now))


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


def live_status(phase: str = "Running", attempt: int = 0, restarts: int = 0, **extra: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": phase,
        "attempt": attempt,
        "restarts": restarts,
        "replicas": 2,
        "startTime": format_time(at(0)),
        "conditions": [],
    }
    if phase in ("Running", "Restarting"):
        status["conditions"] = [
            {
                "type": phase,
                "status": "True",
                "reason": "Running" if phase == "Running" else "ExitCode",
                "message": "all 2 rank(s) of attempt 0 are running (world size 2)",
                "lastTransitionTime": format_time(at(5)),
            }
        ]
    status.update(extra)
    return status


# --- creating attempts -----------------------------------------------------------------------------


def test_new_job_creates_every_rank_of_attempt_zero() -> None:
    decision = run(job_spec(), {}, [], now=0)
    assert decision.create.ranks == (0, 1)
    assert decision.create.attempt == 0
    assert decision.create.service is True
    assert decision.create.pvc is False
    assert decision.delete.pods == ()
    assert decision.report.status["phase"] == "Pending"
    assert decision.report.status["attempt"] == 0
    assert decision.report.status["worldSize"] == 2
    assert decision.report.status["observedGeneration"] == 1
    assert decision.report.status["startTime"] == format_time(at(0))
    assert decision.report.changed
    assert decision.report.event is not None
    assert (decision.report.event.type, decision.report.event.reason) == ("Normal", "Created")


def test_checkpoint_pvc_is_created_with_the_first_attempt() -> None:
    assert run(job_spec(checkpoint=CHECKPOINT), {}, [], now=0).create.pvc is True


@pytest.mark.parametrize(
    ("spec", "wanted"),
    [
        pytest.param({}, True, id="default-on"),
        pytest.param({"networkPolicy": {"enabled": False}}, False, id="turned-off"),
    ],
)
def test_network_policy_is_created_with_each_attempt_unless_turned_off(
    spec: dict[str, Any], wanted: bool
) -> None:
    assert run(job_spec(**spec), {}, [], now=0).create.network_policy is wanted


def test_interrupted_first_creation_creates_only_the_missing_ranks() -> None:
    decision = run(job_spec(replicas=3), {}, [pod(0), pod(2)], now=1)
    assert decision.create.ranks == (1,)
    assert decision.create.attempt == 0


def built_from(spec: JobSpec, pod_object: dict[str, Any]) -> dict[str, Any]:
    pod_object["metadata"]["labels"][names.LABEL_SPEC_HASH] = builders.spec_hash(spec)
    return pod_object


def test_pods_built_from_an_older_spec_are_replaced_before_the_attempt_starts() -> None:
    # Ranks 0 and 1 were created, then the spec grew to 3 replicas before any phase locked it.
    old_spec, new_spec = job_spec(replicas=2), job_spec(replicas=3)
    pods = [built_from(old_spec, pod(0)), built_from(new_spec, pod(1))]
    decision = run(new_spec, {}, pods, now=1)
    assert decision.delete.pods == ("mnist-0-0",)
    assert decision.create.ranks == () and not decision.report.changed
    assert decision.requeue_after is not None
    # While the old pod terminates its name is taken: still nothing created.
    terminating = [built_from(old_spec, pod(0, deleting_at=1)), built_from(new_spec, pod(1))]
    assert run(new_spec, {}, terminating, now=2).create.ranks == ()
    # Once it is gone, the missing ranks come from the new spec.
    assert run(new_spec, {}, [built_from(new_spec, pod(1))], now=3).create.ranks == (0, 2)


def test_a_running_attempt_is_never_replaced_for_its_spec_hash() -> None:
    # Running, the spec is locked (CEL); a differing hash there means a newer operator, not an edit.
    pods = [built_from(job_spec(replicas=5), pod(rank)) for rank in (0, 1)]
    decision = run(job_spec(), live_status("Running"), pods, now=10)
    assert decision.delete.pods == () and decision.report.status["phase"] == "Running"


def test_missing_ranks_before_all_were_seen_are_created_again() -> None:
    status = live_status("Pending", replicas=1)
    decision = run(job_spec(), status, [pod(0, phase="Pending")], now=1)
    assert decision.create.ranks == (1,)
    assert decision.report.status["phase"] == "Pending"
    assert decision.report.status.get("restarts") == 0


# --- phases and conditions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pods", "phase", "ready"),
    [
        pytest.param(
            [pod(0, phase="Pending", scheduled=False), pod(1, phase="Pending")],
            "Pending",
            0,
            id="unscheduled",
        ),
        pytest.param([pod(0, phase="Pending"), pod(1, phase="Pending")], "Starting", 0, id="scheduled"),
        pytest.param([pod(0), pod(1, phase="Pending")], "Starting", 1, id="one-running"),
        pytest.param([pod(0), pod(1)], "Running", 2, id="all-running"),
        pytest.param([pod(0), pod(1, ready=False)], "Running", 1, id="running-not-ready"),
    ],
)
def test_phase_follows_the_ranks(pods: list[dict[str, Any]], phase: str, ready: int) -> None:
    decision = run(job_spec(), live_status("Pending", replicas=0), pods, now=3)
    assert decision.report.status["phase"] == phase
    assert decision.report.status["readyReplicas"] == ready
    assert decision.report.status["replicas"] == 2
    assert decision.create.ranks == ()
    assert (decision.report.event is not None) is (phase != "Pending")


def test_running_sets_its_condition_and_later_events_keep_its_time() -> None:
    job = job_spec()
    first = run(job, live_status("Starting"), [pod(0), pod(1)], now=10)
    running = condition(first.report.status, "Running")
    assert running is not None
    assert (running["status"], running["lastTransitionTime"]) == ("True", format_time(at(10)))
    assert first.report.event is not None and first.report.event.reason == "Running"

    again = run(job, first.report.status, [pod(0), pod(1)], now=50)
    assert condition(again.report.status, "Running") == running
    assert not again.report.changed
    assert again.report.event is None


def test_success_finishes_the_job_and_flips_conditions() -> None:
    decision = run(job_spec(), live_status(), [pod(0, exit_code=0), pod(1, exit_code=0)], now=100)
    status = decision.report.status
    assert status["phase"] == "Succeeded"
    assert status["completionTime"] == format_time(at(100))
    assert status["succeededReplicas"] == 2
    assert condition(status, "Succeeded") == {
        "type": "Succeeded",
        "status": "True",
        "reason": "AllRanksSucceeded",
        "message": "all 2 rank(s) exited 0 in attempt 0",
        "lastTransitionTime": format_time(at(100)),
    }
    running = condition(status, "Running")
    assert running is not None and running["status"] == "False"
    assert decision.delete.pods == ()
    assert decision.report.event is not None and decision.report.event.type == "Normal"


@pytest.mark.parametrize("clean_pod_policy", ["Running", "None", "All"])
def test_a_rank_hung_after_rank_0_finished_ends_in_success_after_the_grace(clean_pod_policy: str) -> None:
    """Rank 0 exited 0 at t=100 (training is over); rank 1's pod still runs (a wedged exit): the job
    waits FINISH_GRACE_SECONDS for it, then succeeds without it and deletes its pod whatever
    cleanPodPolicy says (a hung pod must not hold its node)."""
    job = job_spec(**with_run_policy(cleanPodPolicy=clean_pod_policy))
    pods = [pod(0, exit_code=0, finished=100), pod(1)]
    grace = success.FINISH_GRACE_SECONDS
    waiting = run(job, live_status(), pods, now=100 + grace - 20)
    assert waiting.report.status["phase"] == "Running" and waiting.delete.pods == ()
    assert waiting.requeue_after is not None and waiting.requeue_after <= 20
    late = run(job, live_status(), pods, now=100 + grace)
    assert late.report.status["phase"] == "Succeeded"
    succeeded = condition(late.report.status, "Succeeded")
    assert succeeded is not None and succeeded["reason"] == REASON_HUNG_AFTER_TRAINING
    assert "rank(s) 1" in succeeded["message"]
    assert late.delete.pods == (("mnist-0-0",) if clean_pod_policy == "All" else ()) + ("mnist-1-0",)


def test_a_failure_after_rank_0_finished_is_still_a_failure() -> None:
    pods = [pod(0, exit_code=0, finished=100), pod(1, exit_code=1, finished=110)]
    decision = run(job_spec(), live_status(), pods, now=100 + success.FINISH_GRACE_SECONDS + 5)
    assert decision.report.status["phase"] != "Succeeded"


def test_observed_generation_follows_the_job() -> None:
    job = job_spec()
    newer = JobSpec(**{**job.__dict__, "generation": 7})
    assert run(newer, live_status(), [pod(0), pod(1)], now=10).report.status["observedGeneration"] == 7


# --- failures and restarts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pods", "restarts", "phase", "reason", "in_message"),
    [
        pytest.param(
            [pod(0, exit_code=170, finished=11), pod(1, exit_code=1, finished=10)],
            0,
            "Failed",
            "ExitCode",
            "rank 1 exited with code 1",
            id="exitcode-1-then-retryable-fails",
        ),
        pytest.param(
            [pod(0, exit_code=137, finished=10), pod(1, exit_code=1, finished=11)],
            0,
            "Restarting",
            "ExitCode",
            "rank 0 exited with code 137",
            id="retryable-then-1-restarts",
        ),
        pytest.param(
            [pod(0), pod(1, exit_code=137, finished=10)],
            0,
            "Restarting",
            "ExitCode",
            "as attempt 1",
            id="exit-137",
        ),
        pytest.param(
            [pod(0), pod(1, exit_code=137, reason="OOMKilled", finished=10)],
            0,
            "Restarting",
            "OOMKilled",
            "OOMKilled",
            id="oom-restarts",
        ),
        pytest.param(
            [pod(0), pod(1, exit_code=137, finished=10)],
            3,
            "Failed",
            "BackoffLimitExceeded",
            "backoffLimit 3",
            id="backoff-spent",
        ),
        pytest.param(
            [pod(0), pod(1, exit_code=137, reason="OOMKilled", finished=10)],
            3,
            "Failed",
            "OOMKilled",
            "backoffLimit 3",
            id="repeated-oom-keeps-reason",
        ),
        pytest.param(
            [pod(0), pod(1, phase="Failed", pod_reason="Evicted")],
            0,
            "Restarting",
            "Evicted",
            "evicted",
            id="evicted",
        ),
        pytest.param(
            [pod(0), pod(1, disruption="PreemptionByScheduler")],
            0,
            "Restarting",
            "Preempted",
            "preempted",
            id="preempted",
        ),
        pytest.param(
            [pod(0), pod(1, deleting_at=20)],
            0,
            "Restarting",
            "PodDeleted",
            "was deleted",
            id="deleted-under-the-job",
        ),
        pytest.param([pod(0)], 0, "Restarting", "PodDeleted", "rank 1's pod was deleted", id="pod-gone"),
        pytest.param(
            [pod(0, exit_code=143, finished=20), pod(1, disruption="DeletionByTaintManager", deleting_at=15)],
            0,
            "Restarting",
            "Evicted",
            "rank 1",
            id="node-loss-before-collateral-sigterm",
        ),
    ],
)
def test_failures(
    pods: list[dict[str, Any]], restarts: int, phase: str, reason: str, in_message: str
) -> None:
    """Under restartMode Recreate every retried failure recreates the gang (InPlace: test_recovery.py)."""
    decision = run(
        job_spec(**with_run_policy(restartMode="Recreate")), live_status(restarts=restarts), pods, now=30
    )
    assert decision.report.status["phase"] == phase
    kind = condition(decision.report.status, phase)
    assert kind is not None
    assert kind["reason"] == reason
    assert in_message in kind["message"]
    assert decision.report.event is not None
    assert (decision.report.event.type, decision.report.event.reason) == ("Warning", reason)
    assert decision.create.ranks == ()
    if phase == "Restarting":
        assert decision.report.gang_restart
        # The scheduler's preemption counts (only a queue's does not: test_kueue_decisions.py).
        assert decision.report.status["restarts"] == restarts + 1
        assert "preemptions" not in decision.report.status
        assert decision.report.status["attempt"] == 0
        alive = {p["metadata"]["name"] for p in pods if "deletionTimestamp" not in p["metadata"]}
        assert set(decision.delete.pods) == alive
    else:
        assert not decision.report.gang_restart
        assert decision.report.status["restarts"] == restarts
        assert decision.report.status["completionTime"] == format_time(at(30))
        # Ranks still up when the job failed are being stopped, not ready: READY reads 0/2.
        assert (decision.report.status["readyReplicas"], decision.report.status["ready"]) == (0, "0/2")


def test_never_policy_fails_on_a_retryable_code() -> None:
    decision = run(job_spec(restartPolicy="Never"), live_status(), [pod(0), pod(1, exit_code=143)], now=30)
    assert decision.report.status["phase"] == "Failed"
    assert decision.delete.pods == ("mnist-0-0",), "cleanPodPolicy Running stops the ranks still running"


def test_on_failure_policy_retries_exit_code_1() -> None:
    decision = run(job_spec(restartPolicy="OnFailure"), live_status(), [pod(0), pod(1, exit_code=1)], now=30)
    assert decision.report.status["phase"] == "Restarting"


def test_restart_waits_until_every_old_pod_is_gone_or_terminal() -> None:
    status = live_status("Restarting", restarts=1)
    pods = [pod(0, deleting_at=20), pod(1, exit_code=137)]
    decision = run(job_spec(), status, pods, now=25)
    assert decision.create.ranks == ()
    assert decision.delete.pods == ("mnist-1-0",), (
        "the terminal pod is deleted too; the deleting one is not again"
    )
    assert not decision.report.changed
    assert decision.requeue_after is not None


def test_restart_creates_the_next_attempt_with_new_names() -> None:
    status = live_status("Restarting", restarts=1)
    pods = [pod(0, exit_code=143, deleting_at=20), pod(1, exit_code=137, deleting_at=20)]
    decision = run(job_spec(), status, pods, now=30)
    assert decision.create.ranks == (0, 1)
    assert decision.create.attempt == 1
    assert decision.report.status["attempt"] == 1
    assert decision.report.status["phase"] == "Pending"
    assert decision.report.status["restarts"] == 1
    assert decision.report.status["startTime"] == format_time(at(0)), (
        "restarts count against activeDeadlineSeconds"
    )
    restarting = condition(decision.report.status, "Restarting")
    assert restarting is not None and restarting["status"] == "False"


def test_new_attempt_after_everything_old_is_gone() -> None:
    decision = run(job_spec(), live_status("Restarting", attempt=2, restarts=2), [], now=30)
    assert (decision.create.ranks, decision.create.attempt) == ((0, 1), 3)


def test_pods_of_older_attempts_are_deleted_while_running() -> None:
    pods = [pod(0, attempt=1), pod(1, attempt=1), pod(0, attempt=0, exit_code=143)]
    decision = run(job_spec(), live_status(attempt=1), pods, now=30)
    assert decision.report.status["phase"] == "Running"
    assert decision.delete.pods == ("mnist-0-0",)


def test_pods_of_another_job_with_the_same_name_are_ignored() -> None:
    pods = [pod(0), pod(1), pod(1, attempt=0, exit_code=1, owner_uid="old-job")]
    decision = run(job_spec(), live_status(), pods, now=30)
    assert decision.report.status["phase"] == "Running"
    assert decision.delete.pods == ()


# --- suspend ---------------------------------------------------------------------------------------


def test_suspend_deletes_the_pods() -> None:
    job = job_spec(**with_run_policy(suspend=True))
    decision = run(job, live_status(), [pod(0), pod(1)], now=30)
    assert decision.report.status["phase"] == "Suspended"
    assert set(decision.delete.pods) == {"mnist-0-0", "mnist-1-0"}
    assert "startTime" not in decision.report.status, "suspended time does not count against the deadline"
    assert decision.report.event is not None and decision.report.event.reason == "Suspended"
    assert decision.create.ranks == ()


def test_a_job_created_suspended_creates_nothing() -> None:
    decision = run(job_spec(**with_run_policy(suspend=True)), {}, [], now=0)
    assert decision.report.status["phase"] == "Suspended"
    assert "attempt" not in decision.report.status
    assert decision.create.ranks == ()


@pytest.mark.parametrize(
    ("status", "pods", "create", "attempt"),
    [
        pytest.param({"phase": "Suspended", "attempt": 0}, [], (0, 1), 1, id="resume-creates-a-new-attempt"),
        pytest.param({"phase": "Suspended"}, [], (0, 1), 0, id="resume-before-any-attempt"),
        pytest.param(
            {"phase": "Suspended", "attempt": 0}, [pod(0, deleting_at=20)], (), 0, id="waits-for-old-pods"
        ),
    ],
)
def test_resume(
    status: dict[str, Any], pods: list[dict[str, Any]], create: tuple[int, ...], attempt: int
) -> None:
    decision = run(job_spec(), status, pods, now=30)
    assert decision.create.ranks == create
    if create:
        assert decision.create.attempt == attempt
        assert decision.report.status["phase"] == "Pending"
        assert decision.report.status["startTime"] == format_time(at(30))
        assert decision.report.event is not None and decision.report.event.reason == "Resumed"


def test_suspend_during_first_creation_does_not_reuse_names_on_resume() -> None:
    suspended = run(job_spec(**with_run_policy(suspend=True)), {}, [pod(0, phase="Pending")], now=1)
    resumed = run(job_spec(), suspended.report.status, [], now=5)
    assert resumed.create.attempt == 1


# --- deadlines and TTL -----------------------------------------------------------------------------


def test_active_deadline_fails_the_job_and_stops_its_pods() -> None:
    job = job_spec(**with_run_policy(activeDeadlineSeconds=60, cleanPodPolicy="None"))
    early = run(job, live_status(), [pod(0), pod(1)], now=20)
    assert early.report.status["phase"] == "Running"
    assert early.requeue_after == 40.0
    late = run(job, live_status(), [pod(0), pod(1)], now=61)
    assert late.report.status["phase"] == "Failed"
    failed = condition(late.report.status, "Failed")
    assert failed is not None and failed["reason"] == "DeadlineExceeded"
    assert set(late.delete.pods) == {"mnist-0-0", "mnist-1-0"}, "a job past its deadline stops even with None"


@pytest.mark.parametrize(
    ("pods", "reason"),
    [
        pytest.param(
            [pod(0), pod(1, unschedulable="0/2 nodes are available")], "Unschedulable", id="unschedulable"
        ),
        pytest.param([pod(0), pod(1, waiting="ImagePullBackOff")], "ImagePullFailed", id="image"),
        pytest.param([pod(0), pod(1, phase="Pending")], "StartupTimeout", id="slow"),
    ],
)
def test_startup_deadline(pods: list[dict[str, Any]], reason: str) -> None:
    job = job_spec(**with_run_policy(startupDeadlineSeconds=120))
    waiting = run(job, live_status("Starting"), pods, now=100)
    assert waiting.report.status["phase"] in ("Pending", "Starting")
    assert waiting.requeue_after == 20.0
    late = run(job, live_status("Starting"), pods, now=121)
    assert late.report.status["phase"] == "Failed"
    failed = condition(late.report.status, "Failed")
    assert failed is not None and failed["reason"] == reason


def test_startup_deadline_does_not_apply_once_running() -> None:
    job = job_spec(**with_run_policy(startupDeadlineSeconds=10))
    assert run(job, live_status(), [pod(0), pod(1)], now=500).report.status["phase"] == "Running"


def finished_status(reason: str = "AllRanksSucceeded", phase: str = "Succeeded") -> dict[str, Any]:
    return {
        "phase": phase,
        "attempt": 0,
        "completionTime": format_time(at(100)),
        "observedGeneration": 1,
        "conditions": [
            {"type": phase, "status": "True", "reason": reason, "message": "", "lastTransitionTime": ""}
        ],
    }


@pytest.mark.parametrize(
    ("now", "delete_job", "requeue"),
    [
        pytest.param(130, False, 30.0, id="waiting"),
        pytest.param(160, True, None, id="due"),
    ],
)
def test_ttl_deletes_the_finished_job(now: float, delete_job: bool, requeue: float | None) -> None:
    job = job_spec(**with_run_policy(ttlSecondsAfterFinished=60))
    decision = run(job, finished_status(), [pod(0, exit_code=0), pod(1, exit_code=0)], now=now)
    assert decision.delete.job is delete_job
    assert decision.requeue_after == requeue
    assert not decision.report.changed


@pytest.mark.parametrize(
    ("policy", "reason", "deleted"),
    [
        pytest.param("Running", "ExitCode", {"mnist-0-0"}, id="running-deletes-live"),
        pytest.param("All", "ExitCode", {"mnist-0-0", "mnist-1-0"}, id="all-deletes-every-pod"),
        pytest.param("None", "ExitCode", set(), id="none-keeps-pods"),
        pytest.param("None", "StartupTimeout", {"mnist-0-0"}, id="none-still-stops-a-timed-out-job"),
    ],
)
def test_clean_pod_policy(policy: str, reason: str, deleted: set[str]) -> None:
    job = job_spec(**with_run_policy(cleanPodPolicy=policy))
    decision = run(job, finished_status(reason, "Failed"), [pod(0), pod(1, exit_code=1)], now=200)
    assert set(decision.delete.pods) == deleted
    assert decision.requeue_after is None, "no TTL set"


def test_clean_pod_policy_running_keeps_ranks_whose_trainer_exited_before_the_phase_turned() -> None:
    job = job_spec(**with_run_policy(cleanPodPolicy="Running"))
    pods = [pod(0, exit_code=0, phase_lags=True), pod(1, exit_code=0)]
    decision = run(job, finished_status(), pods, now=200)
    assert decision.delete.pods == (), "both trainers exited 0: nothing is running, the logs stay"


def test_finished_jobs_do_not_come_back_to_life() -> None:
    decision = run(job_spec(), finished_status(), [pod(0, exit_code=1)], now=200)
    assert decision.report.status["phase"] == "Succeeded"
    assert decision.create.ranks == ()
    assert decision.report.event is None


# --- failures found outside decide -----------------------------------------------------------------


def test_pod_create_forbidden_fails_the_job_with_the_apiservers_message() -> None:
    message = 'pods "mnist-1-0" is forbidden: violates PodSecurity "restricted:latest"'
    refusal = CreateRefusal(forbidden=True, child="rank 1's pod", attempt=0, message=message)
    decision = decide(job_spec(), live_status("Pending"), observe(pod(0, phase="Pending")), at(5), refusal)
    assert decision.report.status["phase"] == "Failed"
    failed = condition(decision.report.status, "Failed")
    assert failed is not None and failed["reason"] == "PodCreateForbidden"
    assert message in failed["message"] and "rank 1" in failed["message"]
    assert decision.report.event is not None and decision.report.event.reason == "PodCreateForbidden"
    after = run(job_spec(), decision.report.status, [pod(0, phase="Pending")], now=6)
    assert after.delete.pods == ("mnist-0-0",), "the ranks that were created are cleaned up"


def test_failed_status_keeps_existing_fields() -> None:
    status = failed_status(live_status(restarts=2), "InvalidSpec", "spec.replicas: bad", at(9))
    assert status["phase"] == "Failed"
    assert status["restarts"] == 2
    assert status["completionTime"] == format_time(at(9))
    running = condition(status, "Running")
    assert running is not None and running["status"] == "False"


# --- the one attempt judge, as the local runner calls it ------------------------------------------


@pytest.mark.parametrize(
    ("exits", "restarts", "outcome", "reason"),
    [
        pytest.param([(0, 0, 1), (1, 0, 2)], 0, "succeeded", "AllRanksSucceeded", id="success"),
        pytest.param([(0, 0, 1)], 0, "running", "", id="a-rank-still-running"),
        pytest.param([(1, 1, 1), (0, 170, 2)], 0, "failed", "ExitCode", id="permanent-first"),
        pytest.param([(0, -9, 1), (1, 1, 2)], 0, "retry", "ExitCode", id="killed-first"),
        pytest.param([(0, 137, 1)], 3, "failed", "BackoffLimitExceeded", id="backoff-spent"),
    ],
)
def test_local_attempts_follow_the_cluster_rules(
    exits: list[tuple[int, int, float]], restarts: int, outcome: str, reason: str
) -> None:
    failures = [
        RankFailure(rank=rank, finish_key=when, exit_code=exit_code_from_returncode(code))
        for rank, code, when in exits
        if code != 0
    ]
    succeeded = [rank for rank, code, _ in exits if code == 0]
    verdict = judge_attempt("ExitCode", 3, restarts, 0, 2, failures, succeeded)
    assert (verdict.outcome, verdict.reason) == (outcome, reason)


def test_a_rank_that_exited_0_is_not_failed_by_a_later_disruption() -> None:
    pods = [pod(0, exit_code=0, disruption="DeletionByPodGC"), pod(1, exit_code=0)]
    assert run(job_spec(), live_status(), pods, now=30).report.status["phase"] == "Succeeded"


def test_a_child_the_apiserver_finds_invalid_fails_the_job_once() -> None:
    message = 'Pod "mnist-0-0" is invalid: metadata.labels: Invalid value: "a b"'
    refusal = CreateRefusal(forbidden=False, child="rank 0's pod", attempt=0, message=message)
    decision = decide(job_spec(), live_status("Pending"), [], at(5), refusal)
    failed = decision.report.status["conditions"][-1]
    assert decision.report.status["phase"] == "Failed" and failed["reason"] == "InvalidSpec"
    assert "rank 0's pod of attempt 0" in failed["message"] and "metadata.labels" in failed["message"]
    assert decision.report.event is not None and decision.report.event.reason == "InvalidSpec"
    assert not decision.create.ranks, "no retry: the same spec builds the same invalid object"


def test_a_spec_the_operator_cannot_parse_fails_the_job_once() -> None:
    decision = decide_invalid_spec(live_status("Pending"), 3, "spec.replicas: must be at least 1", at(7))
    failed = condition(decision.report.status, "Failed")
    assert decision.report.status["phase"] == "Failed" and decision.report.status["observedGeneration"] == 3
    assert failed is not None and failed["reason"] == "InvalidSpec" and "spec.replicas" in failed["message"]
    assert decision.report.event is not None and decision.report.event.type == "Warning"
    again = decide_invalid_spec(decision.report.status, 3, "spec.replicas: must be at least 1", at(9))
    assert not again.report.changed and again.report.event is None


# --- what happened decides, not the order it is reported in (docs/restarts.md) ---------------------


@pytest.mark.parametrize(
    ("pods", "seen_at", "now", "phase", "in_message"),
    [
        pytest.param(
            # The collateral 170 of rank 0 arrived first; rank 1's crash is not reported yet.
            [pod(0, exit_code=170, finished=11), pod(1)],
            10,
            15,
            "Running",
            "",
            id="waits-inside-the-window-for-the-other-ranks",
        ),
        pytest.param(
            # Rank 1's permanent exit 1 happened first and arrived seconds after the collateral 170.
            [pod(0, exit_code=170, finished=11), pod(1, exit_code=1, finished=10)],
            10,
            15,
            "Failed",
            "rank 1 exited with code 1",
            id="a-late-permanent-report-still-decides",
        ),
        pytest.param(
            # Rank 1 hangs (no report ever): the window closes and what was seen decides.
            [pod(0, exit_code=170, finished=11), pod(1)],
            10,
            21,
            "Restarting",
            "rank 0 exited with code 170",
            id="window-closed-decides-with-what-was-seen",
        ),
        pytest.param(
            # Both ranks reported: judged at once, no window.
            [pod(0, exit_code=170, finished=11), pod(1, exit_code=137, finished=11)],
            11,
            11,
            "Restarting",
            "rank 0 exited with code 170",
            id="all-reported-no-wait",
        ),
    ],
)
def test_failures_are_judged_by_what_happened_not_by_report_order(
    pods: list[dict[str, Any]], seen_at: float, now: float, phase: str, in_message: str
) -> None:
    decision = decide(job_spec(), live_status(), observe(*pods, seen_at=seen_at), at(now))
    assert decision.report.status["phase"] == phase
    if phase == "Running":
        assert decision.delete.pods == () and decision.requeue_after == pytest.approx(seen_at + 10 - now)
        # What the operator's debug line shows while it holds the failure.
        assert decision.judged_in == pytest.approx(seen_at + 10 - now)
    else:
        kind = condition(decision.report.status, phase)
        assert kind is not None and in_message in kind["message"]
        assert decision.judged_in == 0.0


def test_a_live_attempt_without_failures_has_nothing_to_judge() -> None:
    decision = decide(job_spec(), live_status(), observe(pod(0), pod(1), seen_at=10), at(15))
    assert decision.report.status["phase"] == "Running" and decision.judged_in is None


def test_a_lost_nodes_terminating_pod_does_not_block_the_next_attempt() -> None:
    restarting = live_status("Restarting", restarts=1)
    # Rank 1's old pod was deleted at t=10 (30 s grace) and its node never confirms.
    stuck = [pod(0, exit_code=143, finished=12), pod(1, deleting_at=10)]
    waiting = run(job_spec(), restarting, stuck, now=50)
    assert waiting.create.ranks == (), "inside the grace period plus margin, the old pod may still confirm"
    assert waiting.requeue_after is not None
    moved_on = run(job_spec(), restarting, stuck, now=71)
    assert moved_on.create.ranks == (0, 1) and moved_on.create.attempt == 1
    assert moved_on.report.status["phase"] == "Pending"


@pytest.mark.parametrize(
    ("policy", "now", "phase", "reason"),
    [
        pytest.param({"activeDeadlineSeconds": 60}, 61, "Failed", "DeadlineExceeded", id="active-deadline"),
        pytest.param({"startupDeadlineSeconds": 20}, 26, "Failed", "StartupTimeout", id="restart-stuck"),
        pytest.param({"startupDeadlineSeconds": 20}, 24, "Restarting", "ExitCode", id="within-limits"),
    ],
)
def test_deadlines_hold_while_restarting(policy: dict[str, Any], now: float, phase: str, reason: str) -> None:
    # An old pod on a node that stays up but never finishes terminating (grace 30 s from t=5).
    restarting = live_status("Restarting", restarts=1)
    decision = run(job_spec(**with_run_policy(**policy)), restarting, [pod(0, deleting_at=5)], now=now)
    assert decision.report.status["phase"] == phase
    kind = condition(decision.report.status, phase)
    assert kind is not None and kind["reason"] == reason
    if phase == "Restarting":
        assert decision.requeue_after is not None and decision.requeue_after <= 1.0


def test_a_root_image_under_run_as_non_root_fails_the_job_instead_of_waiting_forever() -> None:
    message = "container has runAsNonRoot and image will run as root (pod: mnist-1-0, container: trainer)"
    stuck = pod(1, waiting="CreateContainerConfigError")
    stuck["status"]["containerStatuses"][0]["state"]["waiting"]["message"] = message
    decision = run(job_spec(), live_status("Pending"), [pod(0), stuck], now=5)
    failed = condition(decision.report.status, "Failed")
    assert decision.report.status["phase"] == "Failed"
    assert failed is not None and failed["reason"] == "InvalidSpec"
    assert "rank 1" in failed["message"] and "runAsUser" in failed["message"] and message in failed["message"]
    assert decision.delete.pods == ("mnist-0-0", "mnist-1-0"), (
        "nothing of a job that cannot start keeps running"
    )


def test_a_missing_config_map_is_not_judged_permanent() -> None:
    waiting = pod(1, waiting="CreateContainerConfigError")
    waiting["status"]["containerStatuses"][0]["state"]["waiting"]["message"] = 'configmap "cfg" not found'
    assert (
        run(job_spec(), live_status("Pending"), [pod(0), waiting], now=5).report.status["phase"] == "Starting"
    )


def test_a_native_sidecars_brief_termination_is_not_the_ranks_failure() -> None:
    restarting = pod(0)
    restarting["spec"] = {"initContainers": [{"name": "log-shipper", "restartPolicy": "Always"}]}
    restarting["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"waiting": {"reason": "PodInitializing"}}}
    ]
    restarting["status"]["initContainerStatuses"] = [
        {"name": "log-shipper", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}
    ]
    (observation,) = observe(restarting)
    assert not observation.trainer_failed and not observation.terminated
    plain_init = pod(0)
    plain_init["spec"] = {"initContainers": [{"name": "fetch-data"}]}
    plain_init["status"]["initContainerStatuses"] = [
        {"name": "fetch-data", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}
    ]
    plain_init["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"waiting": {"reason": "PodInitializing"}}}
    ]
    (failed,) = observe(plain_init)
    assert failed.trainer_failed and failed.exit_code == 1
