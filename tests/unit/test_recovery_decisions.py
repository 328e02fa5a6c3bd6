"""reconcile.decide under restartMode InPlace (the default): a lost pod replaced alone, in-place restarts
that rank 0 reports counted against backoffLimit, and every restart's record (docs/restarts.md)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from tests.unit.kube_factories import at, job_spec, kueue_job, kueue_managed, observe, pod, with_run_policy
from tests.unit.test_elastic import elastic_object
from tests.unit.test_reconcile import live_status

from ddp_operator.decision import Decision
from ddp_operator.policies.accounting import GroupRestartReport
from ddp_operator.progress.tracker import ProgressObservation
from ddp_operator.reconcile import decide
from ddp_operator.spec import JobSpec, parse_job

pytestmark = pytest.mark.unit


def run(
    job: JobSpec, status: dict[str, Any], pods: list[dict[str, Any]], now: float, **observed: Any
) -> Decision:
    progress = (
        ProgressObservation(attempt=0, step=100, step_changed_at=at(now - 1), **observed)
        if observed
        else None
    )
    return decide(job, status, observe(*pods), at(now), observed=progress)


@pytest.mark.parametrize(
    ("lost", "cause", "deleted", "force_deleted"),
    [
        pytest.param(
            pod(1, phase="Failed", pod_reason="Evicted"), "Evicted", ("mnist-1-0",), (), id="evicted"
        ),
        pytest.param(
            pod(1, disruption="PreemptionByScheduler"), "Preempted", (), (), id="scheduler-preemption"
        ),
        pytest.param(pod(1, deleting_at=20), "PodDeleted", (), (), id="deleted-by-a-user"),
        pytest.param(None, "PodDeleted", (), (), id="vanished"),
        pytest.param(
            pod(1, disruption="DeletionByTaintManager", deleting_at=20),
            "Evicted",
            (),
            ("mnist-1-0",),
            id="node-lost-force-deleted",
        ),
        # The container was killed from outside, launcher and all: nothing in it restarts in place.
        pytest.param(
            pod(1, exit_code=137, finished=20, launcher_killed=True),
            "ExitCode",
            ("mnist-1-0",),
            (),
            id="killed-with-its-launcher",
        ),
        pytest.param(
            pod(1, exit_code=137, reason="OOMKilled", finished=20, launcher_killed=True),
            "OOMKilled",
            ("mnist-1-0",),
            (),
            id="launcher-oom-killed",
        ),
    ],
)
def test_a_lost_pod_is_replaced_alone(
    lost: dict[str, Any] | None, cause: str, deleted: tuple[str, ...], force_deleted: tuple[str, ...]
) -> None:
    pods = [pod(0), *([lost] if lost else [])]
    decision = run(job_spec(), live_status(restarts=1), pods, now=30)
    status = decision.report.status
    assert decision.create.replacements == ((1, 1),)
    assert decision.create.ranks == ()
    assert decision.delete.pods == deleted
    assert decision.delete.lost_pods == force_deleted
    assert "mnist-0-0" not in decision.delete.pods, "the survivor keeps its pod"
    assert status["phase"] == "Running" and not decision.report.gang_restart
    assert status["restarts"] == 2 and status["podReplacements"] == 1
    record = status["lastRestart"]
    assert (record["mode"], record["cause"], record["rank"], record["groupRestarts"]) == (
        "PodReplaced",
        cause,
        1,
        1,
    )
    assert decision.create.restart_budget == 2, "backoffLimit 3 minus the one restart before this attempt"
    assert [n.reason for n in decision.report.notices] == ["PodReplaced"]
    assert "mnist-1-0r1" in decision.report.notices[0].message


@pytest.mark.parametrize(
    ("lost", "elastic"),
    [
        pytest.param(pod(0, deleting_at=20), False, id="deleted"),
        pytest.param(
            pod(0, exit_code=137, finished=20, launcher_killed=True), False, id="killed-with-its-launcher"
        ),
        # Its survivors wait for the new pod 0 instead of training without it (docs/elastic.md).
        pytest.param(pod(0, deleting_at=20), True, id="elastic"),
    ],
)
def test_rank_0s_lost_pod_is_replaced_alone_like_any_other(lost: dict[str, Any], elastic: bool) -> None:
    """The c10d store is the attempt's rendezvous pod's, which outlives rank 0's pod (docs/restarts.md)."""
    job = parse_job(elastic_object(1, 2)) if elastic else job_spec()
    decision = run(job, live_status(restarts=0), [lost, pod(1)], now=30)
    assert decision.create.replacements == ((0, 1),)
    assert "mnist-1-0" not in decision.delete.pods, "the survivor keeps its pod"
    record = decision.report.status["lastRestart"]
    assert (record["mode"], record["rank"], record.get("note")) == ("PodReplaced", 0, None)


def test_the_replacement_supersedes_the_lost_pod() -> None:
    status = live_status(restarts=1, podReplacements=1)
    status["lastRestart"] = {"mode": "PodReplaced", "attempt": 0, "groupRestarts": 1, "failureTime": "x"}
    pods = [pod(0), pod(1, phase="Failed", pod_reason="Evicted"), pod(1, replacement=1, phase="Pending")]
    decision = run(job_spec(), status, pods, now=31)
    assert decision.create.replacements == () and decision.create.ranks == ()
    assert decision.delete.pods == ("mnist-1-0",), "the evicted pod it replaced goes"
    assert decision.report.status["restarts"] == 1
    assert decision.report.status["phase"] == "Running"


def test_a_lost_replacement_gets_a_new_name() -> None:
    status = live_status(restarts=1, podReplacements=1)
    pods = [pod(0), pod(1, deleting_at=20), pod(1, replacement=1, deleting_at=25)]
    decision = run(job_spec(), status, pods, now=30)
    assert decision.create.replacements == ((1, 2),)


@pytest.mark.parametrize(
    ("pods", "restarts", "phase", "reason"),
    [
        pytest.param(
            [pod(0, deleting_at=20), pod(1, deleting_at=21)], 0, "Restarting", "PodDeleted", id="no-survivor"
        ),
        pytest.param(
            [pod(0), pod(1, deleting_at=20)], 3, "Failed", "BackoffLimitExceeded", id="budget-spent"
        ),
        pytest.param(
            [pod(0), pod(1, exit_code=137, finished=20)], 0, "Restarting", "ExitCode", id="launcher-gave-up"
        ),
        pytest.param(
            [pod(0), pod(1, exit_code=3, finished=20)], 0, "Failed", "ExitCode", id="permanent-code"
        ),
        pytest.param(
            [pod(0, exit_code=137, finished=20, launcher_killed=True), pod(1, exit_code=137, finished=21)],
            0,
            "Restarting",
            "ExitCode",
            id="rank-0-killed-with-its-launcher-and-the-other-gave-up",
        ),
    ],
)
def test_what_one_new_pod_cannot_mend(
    pods: list[dict[str, Any]], restarts: int, phase: str, reason: str
) -> None:
    decision = run(job_spec(), live_status(restarts=restarts), pods, now=30)
    assert decision.report.status["phase"] == phase
    assert decision.create.replacements == ()
    assert decision.report.event is not None and decision.report.event.reason == reason
    if phase == "Restarting":
        record = decision.report.status["lastRestart"]
        assert record["mode"] == "WholeGang"
        assert "note" not in record, "rank 0 is not special in a fixed-size job"


@pytest.mark.parametrize(
    "lost",
    [
        pytest.param(pod(1, deleting_at=20), id="deleted"),
        pytest.param(pod(1, exit_code=137, finished=20, launcher_killed=True), id="killed-with-its-launcher"),
    ],
)
def test_recreate_mode_replaces_nothing(lost: dict[str, Any]) -> None:
    job = job_spec(**with_run_policy(restartMode="Recreate"))
    decision = run(job, live_status(), [pod(0), lost], now=30)
    assert decision.report.status["phase"] == "Restarting"
    assert decision.create.replacements == ()


def test_a_killed_pods_replacement_message_says_its_launcher_went_with_it() -> None:
    decision = run(
        job_spec(), live_status(), [pod(0), pod(1, exit_code=137, finished=20, launcher_killed=True)], now=30
    )
    (notice,) = decision.report.notices
    assert "rank 1's pod was killed, its launcher with it (exit code 137)" in notice.message, notice.message


def report(restarts: int, **fields: Any) -> GroupRestartReport:
    base = at(20).timestamp()
    values: dict[str, Any] = {
        "failure_at": base,
        "stopped_at": base + 0.4,
        "reformed_at": base + 1.5,
        "resumed_at": base + 4.0,
        "steps_redone": 3,
        "cause": "ExitCode",
        "failed_rank": 1,
        "exit_code": 137,
        "kept_step_seconds": 24.0,
    }
    values.update(fields)
    return GroupRestartReport(restarts=restarts, **values)


def test_an_in_place_restart_rank_0_reports_is_counted_and_measured() -> None:
    decision = run(job_spec(), live_status(restarts=1), [pod(0), pod(1)], now=30, restart=report(1))
    status = decision.report.status
    assert status["phase"] == "Running"
    assert status["restarts"] == 2
    assert status["lastRestart"]["mode"] == "InPlace"
    assert status["lastRestart"]["resumedSeconds"] == "4.00"
    assert status["goodput"] == "0.800", "24 s of kept steps in 30 s"
    assert decision.report.restart_measured == ("InPlace", 4.0)
    assert [n.reason for n in decision.report.notices] == ["RestartedInPlace"]
    assert decision.create.replacements == () and decision.delete.pods == ()


def test_in_place_restarts_beyond_backoff_limit_fail_the_job() -> None:
    decision = run(job_spec(), live_status(restarts=2), [pod(0), pod(1)], now=30, restart=report(2))
    assert decision.report.status["phase"] == "Failed"
    assert decision.report.event is not None and decision.report.event.reason == "BackoffLimitExceeded"
    assert decision.report.status["restarts"] == 4


def test_a_replaced_pods_round_is_measured_not_counted_again() -> None:
    replaced = decide(job_spec(), live_status(), observe(pod(0), pod(1, deleting_at=20)), at(21))
    status = dict(replaced.report.status)
    pods = [pod(0), pod(1, deleting_at=20), pod(1, replacement=1)]
    later = run(job_spec(), status, pods, now=30, restart=report(1, failure_at=at(21).timestamp()))
    assert later.report.status["restarts"] == 1
    record = later.report.status["lastRestart"]
    assert record["mode"] == "PodReplaced"
    # From the deletion the operator saw (at 20), not from when the survivors noticed it (21).
    assert record["resumedSeconds"] == "4.00"
    assert later.report.restart_measured is not None and later.report.restart_measured[0] == "PodReplaced"
    assert [n.reason for n in later.report.notices] == ["Recovered"]


def test_a_whole_gang_restart_is_measured_at_the_next_attempts_first_step() -> None:
    restarting = decide(
        job_spec(), live_status(), observe(pod(0), pod(1, exit_code=137, finished=20)), at(30)
    )
    status = dict(restarting.report.status)
    status.update(phase="Running", attempt=1)
    progress = ProgressObservation(attempt=1, step=5, step_changed_at=at(20) + timedelta(seconds=15))
    decision = decide(job_spec(), status, observe(pod(0, 1), pod(1, 1)), at(40), observed=progress)
    record = decision.report.status["lastRestart"]
    assert (record["mode"], record["resumedSeconds"]) == ("WholeGang", "15.00")
    assert decision.report.restart_measured == ("WholeGang", 15.0)


def test_a_lost_replacement_is_never_recreated_under_its_first_name() -> None:
    """status.replicas may still say 1 (the replaced pod went before its replacement was seen): the rank's
    missing pod was lost, not never created, and the original name is never used again."""
    status = live_status(restarts=1, podReplacements=1, replicas=1)
    status["lastRestart"] = {
        "mode": "PodReplaced",
        "attempt": 0,
        "groupRestarts": 1,
        "failureTime": "x",
        "rank": 1,
    }
    decision = run(job_spec(**with_run_policy(backoffLimit=1)), status, [pod(0)], now=30)
    assert decision.create.ranks == () and decision.create.replacements == ()
    assert decision.report.status["phase"] == "Failed"
    assert decision.report.event is not None and decision.report.event.reason == "BackoffLimitExceeded"


def test_a_deleted_pod_whose_trainer_then_exited_143_is_replaced_alone() -> None:
    """A live kubelet stops a deleted pod's trainer with SIGTERM: the 143 is the deletion's doing."""
    deleted = pod(1, exit_code=143, finished=22, deleting_at=20)
    decision = run(job_spec(), live_status(), [pod(0), deleted], now=30)
    assert decision.create.replacements == ((1, 1),)
    assert decision.report.status["lastRestart"]["cause"] == "PodDeleted"


def test_a_kueue_group_waits_until_kueue_no_longer_counts_the_lost_pod() -> None:
    """Kueue counts a deleted pod until it has stopped (v0.17 counts all but Failed pods) and would delete
    a replacement created meanwhile as excess in the group."""
    job = kueue_job()
    stopping = kueue_managed(pod(1, deleting_at=20))
    decision = run(job, live_status(), [kueue_managed(pod(0)), stopping], now=30)
    assert decision.create.replacements == ()
    assert not decision.report.changed and decision.requeue_after is not None
    stopped = kueue_managed(pod(1, exit_code=143, finished=22, deleting_at=20))
    after = run(job, live_status(), [kueue_managed(pod(0)), stopped], now=31)
    assert after.create.replacements == ((1, 1),)
