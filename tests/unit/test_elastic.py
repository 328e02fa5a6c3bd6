"""Elastic DDPJobs (docs/elastic.md), the operator's pure part: the spec, the env and gang the pods get,
how rank 0's reports of resizes are counted and recorded, and what status and Events say."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from tests.unit.kube_factories import at, job_object, observe, pod
from tests.unit.test_reconcile import live_status

from ddp_operator import builders, gang
from ddp_operator.decision import Decision
from ddp_operator.policies import restart_events
from ddp_operator.policies.accounting import GroupRestartReport, account, resize
from ddp_operator.progress.tracker import ProgressObservation
from ddp_operator.reconcile import decide
from ddp_operator.spec import DEFAULT_REPLACEMENT_WAIT_SECONDS, JobSpec, SpecError, parse_job

pytestmark = pytest.mark.unit


def elastic_object(minimum: int = 2, maximum: int = 3, **extra: Any) -> dict[str, Any]:
    body = job_object(**extra)
    del body["spec"]["replicas"]
    body["spec"]["elastic"] = {"minReplicas": minimum, "maxReplicas": maximum}
    return body


def elastic_job(minimum: int = 2, maximum: int = 3, **elastic: Any) -> JobSpec:
    body = elastic_object(minimum, maximum)
    body["spec"]["elastic"].update(elastic)
    return parse_job(body)


# --- the spec --------------------------------------------------------------------------------------


def test_an_elastic_job_asks_for_max_and_trains_on_min() -> None:
    job = elastic_job(2, 4, replacementWaitSeconds=20)
    assert (job.replicas, job.min_replicas, job.world_size) == (4, 2, 4)
    assert job.elastic is not None and job.elastic.replacement_wait_seconds == 20
    assert elastic_job().elastic.replacement_wait_seconds == DEFAULT_REPLACEMENT_WAIT_SECONDS  # type: ignore[union-attr]


def test_a_fixed_size_job_trains_on_all_its_replicas() -> None:
    job = parse_job(job_object(replicas=3))
    assert (job.replicas, job.min_replicas, job.elastic) == (3, 3, None)


def _with(spec: dict[str, Any]) -> dict[str, Any]:
    body = elastic_object()
    body["spec"].update(spec)
    return body


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        pytest.param(_with({"replicas": 3}), "spec.replicas", "remove spec.replicas", id="replicas-too"),
        pytest.param(
            _with({"elastic": {"minReplicas": 4, "maxReplicas": 3}}),
            "spec.elastic.minReplicas",
            "at most spec.elastic.maxReplicas (3)",
            id="min-above-max",
        ),
        pytest.param(
            _with({"elastic": {"maxReplicas": 3}}), "spec.elastic.minReplicas", "required", id="min-missing"
        ),
        pytest.param(
            _with({"elastic": {"minReplicas": 0, "maxReplicas": 3}}),
            "spec.elastic.minReplicas",
            "between 1 and 4096",
            id="min-zero",
        ),
        pytest.param(
            _with({"runPolicy": {"restartMode": "Recreate"}}),
            "spec.runPolicy.restartMode",
            "set it to InPlace",
            id="recreate",
        ),
        pytest.param(
            _with({"elastic": {"minReplicas": 1, "maxReplicas": 2, "replacementWaitSeconds": 0}}),
            "spec.elastic.replacementWaitSeconds",
            "between 1 and 3600",
            id="no-wait",
        ),
    ],
)
def test_bad_elastic_specs_name_the_field_and_the_fix(body: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse_job(body)
    assert raised.value.field == field
    assert words in raised.value.message


# --- what the pods get -------------------------------------------------------------------------------


def _env(job: JobSpec, rank: int) -> dict[str, str]:
    return {e["name"]: e["value"] for e in builders.contract_env(job, rank, 0, 3) if "value" in e}


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        pytest.param(
            elastic_job(2, 3, replacementWaitSeconds=15),
            {
                "NNODES": "3",
                "WORLD_SIZE": "3",
                "DDP_MIN_MEMBERS": "2",
                "DDP_MIN_NODES": "2",
                "DDP_REPLACEMENT_WAIT_SECONDS": "15",
                "PET_NNODES": "2:3",
                "PET_RDZV_CONF": "is_host=0,last_call_timeout=15",
            },
            id="elastic",
        ),
        pytest.param(
            parse_job(job_object(replicas=3)),
            {
                "NNODES": "3",
                "WORLD_SIZE": "3",
                "DDP_MIN_MEMBERS": None,
                "DDP_MIN_NODES": None,
                "DDP_REPLACEMENT_WAIT_SECONDS": None,
                "PET_NNODES": "3",
                "PET_RDZV_CONF": "is_host=0",
            },
            id="fixed-size",
        ),
    ],
)
def test_env_contract_of_an_elastic_pod(job: JobSpec, expected: dict[str, str | None]) -> None:
    env = _env(job, 1)
    assert {key: env.get(key) for key in expected} == expected


@pytest.mark.parametrize(
    ("job", "min_count"),
    [
        pytest.param(elastic_job(2, 5), 2, id="elastic-min"),
        pytest.param(parse_job(job_object(replicas=5)), 5, id="fixed-size-whole-gang"),
    ],
)
def test_the_in_tree_gang_asks_for_the_fewest_pods_the_job_trains_on(job: JobSpec, min_count: int) -> None:
    objects = gang.gang_objects(job, 0, "v1alpha2")
    assert objects is not None
    (template,) = objects.workload["spec"]["podGroupTemplates"]
    assert template["schedulingPolicy"] == {"gang": {"minCount": min_count}}


# --- counting what rank 0 reports --------------------------------------------------------------------


def _report(
    restarts: int, grows: int, before: int, after: int, cause: str, resizes: int | None = None
) -> GroupRestartReport:
    """Rank 0's read; ``resizes`` (ddp_group_resizes_total): every round a resize unless said."""
    return GroupRestartReport(
        restarts=restarts,
        grows=grows,
        resizes=restarts if resizes is None else resizes,
        group_members=after,
        failure_at=at(100).timestamp() if cause != "MemberJoined" else None,
        reformed_at=at(110).timestamp(),
        cause=cause,
        members_before=before,
        members_after=after,
    )


@pytest.mark.parametrize(
    ("last", "report", "added", "sizes"),
    [
        pytest.param(None, _report(1, 0, 3, 2, "PeerLost"), 1, (3, 2), id="shrink-is-a-failure"),
        pytest.param(
            {"attempt": 0, "groupRestarts": 1, "failureTime": "2025-01-01T12:01:40.000000Z"},
            _report(2, 1, 2, 3, "MemberJoined"),
            0,
            (2, 3),
            id="grow-is-not",
        ),
        pytest.param(
            None, _report(2, 1, 2, 3, "MemberJoined"), 1, (2, 3), id="shrink-and-grow-between-reads"
        ),
        pytest.param(None, _report(1, 0, 3, 3, "ExitCode"), 1, None, id="same-size"),
    ],
)
def test_grows_do_not_count_against_backoff_limit(
    last: dict[str, Any] | None, report: GroupRestartReport, added: int, sizes: tuple[int, int] | None
) -> None:
    accounting = account(last, 0, report)
    assert accounting.added == added
    assert accounting.record is not None
    assert resize(accounting.record) == sizes


@pytest.mark.parametrize(
    ("record", "words"),
    [
        pytest.param(
            {"cause": "MemberJoined", "mode": "InPlace", "replicasBefore": 2, "replicasAfter": 3},
            "pods joined: the group grew from 2 to 3 pods in place (not a failure)",
            id="grow",
        ),
        pytest.param(
            {"cause": "PeerLost", "mode": "InPlace", "rank": 2, "replicasBefore": 3, "replicasAfter": 2},
            "PeerLost of rank 2: restarted in place (restart 1 of 3); the group shrank from 3 to 2 pods",
            id="shrink",
        ),
    ],
)
def test_a_resize_says_from_what_to_what(record: dict[str, Any], words: str) -> None:
    assert words in restart_events.describe(record, 1, 3)


# --- decisions ---------------------------------------------------------------------------------------


def run(
    job: JobSpec, status: dict[str, Any], pods: list[dict[str, Any]], report: GroupRestartReport | None
) -> Decision:
    observed = (
        ProgressObservation(attempt=0, step=100, step_changed_at=at(299), restart=report)
        if report is not None
        else None
    )
    return decide(job, status, observe(*pods), at(300), observed=observed)


def test_an_elastic_job_runs_once_min_pods_run_with_rank_0() -> None:
    status = live_status(phase="Starting")
    decision = run(
        elastic_job(2, 3), status, [pod(0), pod(1), pod(2, phase="Pending", scheduled=False)], None
    )
    assert decision.report.status["phase"] == "Running"
    assert "2 of 3 rank pod(s)" in decision.report.status["conditions"][-1]["message"]


def test_without_rank_0_an_elastic_job_is_not_running() -> None:
    status = live_status(phase="Starting")
    pods = [pod(0, phase="Pending", scheduled=False), pod(1), pod(2)]
    assert run(elastic_job(2, 3), status, pods, None).report.status["phase"] != "Running"


def test_a_shrink_shows_in_status_and_a_warning() -> None:
    status = live_status(restarts=0)
    pods = [pod(0), pod(1), pod(2, replacement=1, phase="Pending", scheduled=False)]
    decision = run(elastic_job(2, 3), status, pods, _report(1, 0, 3, 2, "PeerLost"))
    shown = decision.report.status
    assert shown["elastic"] == {"replicas": 2, "minReplicas": 2, "maxReplicas": 3, "resizes": 1}
    assert shown["worldSize"] == 2
    assert shown["restarts"] == 1
    assert (shown["lastRestart"]["replicasBefore"], shown["lastRestart"]["replicasAfter"]) == (3, 2)
    assert [(n.type, n.reason) for n in decision.report.notices] == [("Warning", "Resized")]


def test_a_grow_shows_in_status_and_is_no_restart() -> None:
    status = live_status(restarts=1)
    status["elastic"] = {"replicas": 2, "minReplicas": 2, "maxReplicas": 3, "resizes": 1}
    status["lastRestart"] = {
        "cause": "PeerLost",
        "mode": "InPlace",
        "attempt": 0,
        "groupRestarts": 1,
        "failureTime": "2025-01-01T12:01:40.000000Z",
        "replicasBefore": 3,
        "replicasAfter": 2,
    }
    pods = [pod(0), pod(1), pod(2, replacement=1)]
    decision = run(elastic_job(2, 3), status, pods, _report(2, 1, 2, 3, "MemberJoined"))
    shown = decision.report.status
    assert shown["restarts"] == 1, "a grow spends no restart"
    assert shown["elastic"]["replicas"] == 3 and shown["elastic"]["resizes"] == 2
    assert shown["worldSize"] == 3
    assert [(n.type, n.reason) for n in decision.report.notices] == [("Normal", "Resized")]
    again = run(elastic_job(2, 3), shown, pods, _report(2, 1, 2, 3, "MemberJoined"))
    assert again.report.status["elastic"]["resizes"] == 2, "the same resize read again is not another"
    assert [n.reason for n in again.report.notices] == []


@pytest.mark.parametrize(
    ("shown", "report", "resizes", "notice"),
    [
        # The shrink and the grow both happened between two reads: both counted, the last one told.
        pytest.param(0, _report(2, 1, 2, 3, "MemberJoined"), 2, ("Normal", "Resized"), id="two-rounds-in-one-read"),
        # The group first formed with 2 pods and grew to 3, then an in-place restart kept its size: the
        # count is the launcher's, whatever the last record says.
        pytest.param(0, _report(2, 1, 3, 3, "ExitCode", resizes=1), 1, ("Warning", "RestartedInPlace"), id="resize-then-same-size"),
        # The same rounds read again (status accounts for them): unchanged, and no Event.
        pytest.param(2, _report(2, 1, 2, 3, "MemberJoined"), 2, None, id="read-again"),
        # A new attempt's group counts from 0: the lower count replaces the old attempt's, no Event.
        pytest.param(3, _report(0, 0, 3, 3, "ExitCode"), 0, None, id="a-new-attempt-counts-again"),
        # An older trainer image exports no count: status keeps what it shows.
        pytest.param(1, replace(_report(2, 1, 2, 3, "MemberJoined"), resizes=None), 1, None, id="not-exported"),
    ],
)  # fmt: skip
def test_resizes_are_the_launchers_count_not_the_reads(
    shown: int, report: GroupRestartReport, resizes: int, notice: tuple[str, str] | None
) -> None:
    status = live_status(restarts=0)
    status["elastic"] = {"replicas": 3, "minReplicas": 2, "maxReplicas": 3, "resizes": shown}
    if shown == resizes:
        status["lastRestart"] = {
            "cause": report.cause, "mode": "InPlace", "attempt": 0, "groupRestarts": report.restarts,
            "groupGrows": report.grows, "failureTime": "2025-01-01T12:01:40.000000Z",
            "replicasBefore": report.members_before, "replicasAfter": report.members_after,
            "reformedSeconds": "10.00",
        }  # fmt: skip
    decision = run(elastic_job(2, 3), status, [pod(0), pod(1), pod(2, replacement=1)], report)
    assert decision.report.status["elastic"]["resizes"] == resizes
    notices = [(n.type, n.reason) for n in decision.report.notices]
    assert notices == ([notice] if notice else [])


def test_a_lost_pod_of_an_elastic_job_is_replaced_alone() -> None:
    decision = run(elastic_job(2, 3), live_status(), [pod(0), pod(1), pod(2, deleting_at=20)], None)
    assert decision.create.replacements == ((2, 1),)
    assert decision.report.status["phase"] == "Running"


@pytest.mark.parametrize(
    ("now", "phase"),
    [
        pytest.param(115, "Running", id="within-the-deadline"),
        pytest.param(125, "Failed", id="after-the-deadline"),
    ],
)
def test_below_min_the_startup_deadline_counts_from_the_loss(now: float, phase: str) -> None:
    job = parse_job(
        {
            **elastic_object(),
            "spec": {**elastic_object()["spec"], "runPolicy": {"startupDeadlineSeconds": 20}},
        }
    )
    status = live_status(restarts=2)
    status["lastRestart"] = {
        "cause": "PodDeleted",
        "mode": "PodReplaced",
        "attempt": 0,
        "groupRestarts": 2,
        "failureTime": "2025-01-01T12:01:40.000000Z",  # T0 + 100 s
    }
    pending = {"phase": "Pending", "scheduled": False, "unschedulable": "0/4 nodes are available"}
    pods = [pod(0), pod(1, replacement=1, **pending), pod(2, replacement=2, **pending)]
    decision = decide(job, status, observe(*pods), at(now))
    assert decision.report.status["phase"] == phase
    if phase == "Failed":
        failed = next(c for c in decision.report.status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "Unschedulable"
        assert "fewer than spec.elastic.minReplicas (2) pods run" in failed["message"]
    else:
        assert decision.requeue_after is not None and decision.requeue_after <= 5


def test_a_fixed_size_job_waiting_for_a_replacement_has_no_elastic_startup_clock() -> None:
    job = parse_job(job_object(replicas=3, runPolicy={"startupDeadlineSeconds": 20}))
    status = live_status(restarts=1)
    pending = {"phase": "Pending", "scheduled": False, "unschedulable": "0/4 nodes are available"}
    pods = [pod(0), pod(1), pod(2, replacement=1, **pending)]
    assert decide(job, status, observe(*pods), at(500)).report.status["phase"] == "Running"


WAITING = {"phase": "Pending", "scheduled": False, "unschedulable": "0/4 nodes are available"}


@pytest.mark.parametrize(
    ("pods", "phase"),
    [
        pytest.param(
            [
                pod(0, phase="Succeeded", exit_code=0),
                pod(1, phase="Succeeded", exit_code=0),
                pod(2, replacement=1, **WAITING),
            ],
            "Succeeded",
            id="a-replacement-that-never-started-is-not-waited-for",
        ),
        pytest.param(
            [
                # Rank 0 finished 10 s before the decision: well inside success.FINISH_GRACE_SECONDS.
                pod(0, phase="Succeeded", exit_code=0, finished=290),
                pod(1, phase="Succeeded", exit_code=0, finished=290),
                pod(2, replacement=1),
            ],
            "Running",
            id="a-running-member-is-waited-for",
        ),
        pytest.param(
            [
                pod(0, phase="Succeeded", exit_code=0, finished=100),
                pod(1, phase="Succeeded", exit_code=0, finished=100),
                pod(2, replacement=1),
            ],
            "Succeeded",
            id="a-member-still-running-after-the-finish-grace-is-hung",
        ),
        pytest.param(
            [pod(0, phase="Succeeded", exit_code=0), pod(1, **WAITING), pod(2, **WAITING)],
            "Running",
            id="fewer-than-min-did-not-finish-the-job",
        ),
        pytest.param(
            [
                pod(0, **WAITING),
                pod(1, phase="Succeeded", exit_code=0),
                pod(2, phase="Succeeded", exit_code=0),
            ],
            "Running",
            id="rank-0-must-have-finished",
        ),
    ],
)
def test_when_an_elastic_attempt_succeeded(pods: list[dict[str, Any]], phase: str) -> None:
    decision = decide(elastic_job(2, 3), live_status(), observe(*pods), at(300))
    assert decision.report.status["phase"] == phase


def test_a_late_pod_that_failed_to_join_the_finished_group_is_no_failure_of_it() -> None:
    late = pod(2, replacement=1, phase="Failed", exit_code=170, finished=290)
    pods = [pod(0, phase="Succeeded", exit_code=0), pod(1, phase="Succeeded", exit_code=0), late]
    decision = decide(elastic_job(2, 3), live_status(), observe(*pods, seen_at=290), at(300))
    assert decision.report.status["phase"] == "Succeeded"


def test_a_fixed_size_job_still_fails_on_any_rank() -> None:
    pods = [pod(0, phase="Succeeded", exit_code=0), pod(1, phase="Failed", exit_code=3, finished=290)]
    decision = decide(parse_job(job_object()), live_status(), observe(*pods, seen_at=290), at(300))
    assert decision.report.status["phase"] == "Failed"


# --- after a shrink: the straggler's and the stall's pod come from the round's membership ----------

# Pod rank 1 was lost and its replacement cannot be placed: the group trains on the pods of ranks 0 and
# 2, which the round numbers 0 and 1.
SHRUNK_PODS = (pod(0), pod(1, replacement=1, unschedulable="0/3 nodes are available"), pod(2))
SHRUNK_ROUND = {0: "mnist-0-0", 1: "mnist-2-0"}


def test_a_straggler_after_a_shrink_names_the_pod_and_node_the_round_put_it_on() -> None:
    from ddp_operator.progress.tracker import StragglerSighting

    job = elastic_job(2, 3)
    observation = ProgressObservation(
        attempt=0,
        step=50,
        step_changed_at=at(100),
        straggler=StragglerSighting(rank=1, slowdown=3.0, since=at(0), phase="compute"),
        rank_pods=SHRUNK_ROUND,
    )
    decision = decide(job, live_status(replicas=3), observe(*SHRUNK_PODS), at(100), observed=observation)
    straggler = decision.report.status["straggler"]
    assert (straggler["rank"], straggler["pod"], straggler["node"]) == (1, "mnist-2-0", "node-2")
    (notice,) = [n for n in decision.report.notices if n.reason == "Straggler"]
    assert "mnist-2-0 on node node-2" in notice.message


@pytest.mark.parametrize(
    ("seconds", "stalled"),
    [
        # 60 s without a step is the limit, but the members may wait replacementWaitSeconds (60) for the
        # replacement before the round forms without it: no hang yet.
        pytest.param(161, False, id="within-the-replacement-wait"),
        pytest.param(221, True, id="past-the-limit-and-the-wait"),
    ],
)
def test_a_stall_after_a_shrink_names_the_silent_pod_by_the_rounds_membership(
    seconds: float, stalled: bool
) -> None:
    """The stall is watched while the shrunk group trains (the replacement that cannot be placed is
    outside the round), and the pod that stopped answering is found by the round's numbering."""
    job = parse_job(elastic_object(2, 3, runPolicy={"stallTimeoutSeconds": 60, "backoffLimit": 3}))
    observation = ProgressObservation(
        attempt=0, step=120, step_changed_at=at(100), rank_steps={0: 120}, rank_pods=SHRUNK_ROUND
    )
    decision = decide(job, live_status(replicas=3), observe(*SHRUNK_PODS), at(seconds), observed=observation)
    if not stalled:
        assert decision.report.status["phase"] == "Running"
        assert decision.requeue_after is not None and decision.requeue_after <= 220 - seconds
        return
    # The round's rank 1 (pod rank 2's pod) stopped answering: that pod, not pod rank 1's, is the hung
    # one; deleted at once and replaced alone while the survivor keeps its pod.
    assert decision.report.status["phase"] == "Running"
    assert decision.delete.hung_pods == ("mnist-2-0",)
    assert decision.create.replacements == ((2, 2),)
    (notice,) = [n for n in decision.report.notices if n.reason == "PodReplaced"]
    assert "rank 1 (its metrics did not answer) on node node-2" in notice.message, notice.message
    assert decision.report.status["lastRestart"]["cause"] == "Stalled"
