"""Standby pods (runPolicy.standbyPods, docs/restarts.md "Standby pods"): policies.standby's plan,
decide() with it, the standby pod the builders make and the spec's refusals."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from tests.unit.kube_factories import at, job_spec, observe, pod, standby_pod, with_run_policy
from tests.unit.test_reconcile import live_status

from ddp_operator import builders, names
from ddp_operator.observe import format_time
from ddp_operator.policies import standby
from ddp_operator.progress.tracker import ProgressObservation
from ddp_operator.reconcile import decide
from ddp_operator.spec import SpecError, parse_job

pytestmark = pytest.mark.unit

CHECKPOINT = {"checkpoint": {"volumeClaimTemplate": {"resources": {"requests": {"storage": "1Gi"}}}}}


def checkpoint(*modes: str) -> dict[str, Any]:
    """spec.checkpoint with a claim of these access modes."""
    claim = {"accessModes": list(modes), "resources": {"requests": {"storage": "1Gi"}}}
    return {"checkpoint": {"volumeClaimTemplate": claim}}


def promoted(number: int, rank: int, replacement: int, assigned: float = 20, **state: Any) -> dict[str, Any]:
    """A standby pod that took ``rank`` at ``assigned``: the rank's labels, its standby number kept."""
    made = standby_pod(number, **state)
    made["metadata"]["annotations"] = {names.ANNOTATION_ASSIGNED_AT: format_time(at(assigned))}
    labels = made["metadata"]["labels"]
    del labels[names.LABEL_ROLE]
    labels |= {names.LABEL_RANK: str(rank), names.LABEL_REPLACEMENT: str(replacement)}
    return made


ONE = with_run_policy(standbyPods=1)


@pytest.mark.parametrize(
    ("spec", "phase", "replacements", "pods", "expected"),
    [
        pytest.param(
            ONE, "Running", [(1, 1)], [standby_pod(1)],
            standby.StandbyPlan(
                promotions=(standby.Promotion("mnist-standby1-0", 1, 1, 2),), create=(2,)
            ),
            id="a-running-standby-takes-the-lost-rank-and-another-starts",
        ),
        pytest.param(
            ONE, "Running", [(1, 1)], [],
            standby.StandbyPlan(replacements=((1, 1),)),
            id="no-standby-a-new-pod-and-no-standby-until-it-is-bound",
        ),
        pytest.param(
            ONE, "Running", [(1, 1)], [standby_pod(1, phase="Pending", scheduled=False)],
            standby.StandbyPlan(replacements=((1, 1),)),
            id="a-standby-not-started-yet-is-not-given-a-rank",
        ),
        pytest.param(
            {**ONE, **CHECKPOINT}, "Running", [(0, 1)], [standby_pod(1)],
            standby.StandbyPlan(promotions=(standby.Promotion("mnist-standby1-0", 0, 1, 2),), create=(2,)),
            id="rank-0-with-a-read-write-once-checkpoint-to-a-standby-on-its-node",
        ),
        pytest.param(
            {**ONE, **checkpoint("ReadWriteMany")}, "Running", [(0, 1)], [standby_pod(1)],
            standby.StandbyPlan(promotions=(standby.Promotion("mnist-standby1-0", 0, 1, 2),), create=(2,)),
            id="rank-0-with-a-read-write-many-checkpoint-to-a-standby",
        ),

        pytest.param(
            ONE, "Running", [(0, 1)], [standby_pod(1)],
            standby.StandbyPlan(promotions=(standby.Promotion("mnist-standby1-0", 0, 1, 2),), create=(2,)),
            id="rank-0-without-a-checkpoint-volume-like-any-other",
        ),
        pytest.param(
            ONE, "Running", [(1, 3), (2, 4)], [standby_pod(1)],
            standby.StandbyPlan(promotions=(standby.Promotion("mnist-standby1-0", 1, 3, 2),), replacements=((2, 4),)),
            id="two-lost-one-standby-the-next-waits-for-the-new-pod",
        ),
        pytest.param(
            ONE, "Running", [], [standby_pod(1, exit_code=1)],
            standby.StandbyPlan(create=(2,), delete=("mnist-standby1-0",)),
            id="an-ended-standby-goes-and-its-number-is-not-reused",
        ),
        pytest.param(
            ONE, "Running", [], [standby_pod(3, attempt=1), promoted(1, 1, 1)],
            standby.StandbyPlan(create=(2,), delete=("mnist-standby3-1",)),
            id="an-older-attempts-standby-goes-numbers-follow-the-promoted-one",
        ),
        pytest.param(
            ONE, "Restarting", [], [standby_pod(1)],
            standby.StandbyPlan(delete=("mnist-standby1-0",)),
            id="the-attempt-ends-its-standbys-go",
        ),
        pytest.param(
            ONE, "Starting", [], [],
            standby.StandbyPlan(),
            id="none-before-every-rank-runs",
        ),
        pytest.param(
            with_run_policy(standbyPods=0), "Running", [], [standby_pod(1), standby_pod(1, deleting_at=5)],
            standby.StandbyPlan(delete=("mnist-standby1-0",)),
            id="no-longer-wanted",
        ),
        pytest.param(
            ONE, "Running", [], [standby_pod(1), standby_pod(2)],
            standby.StandbyPlan(delete=("mnist-standby2-0",)),
            id="one-too-many-the-newest-goes",
        ),
        pytest.param(
            ONE, "Running", [], [pod(0), pod(1, scheduled=False)],
            standby.StandbyPlan(),
            id="none-started-while-a-ranks-pod-waits-for-a-node",
        ),
        pytest.param(
            ONE, "Running", [], [pod(0), pod(1, replacement=1, unschedulable="0/1 nodes are available"), standby_pod(1)],
            standby.StandbyPlan(
                delete=("mnist-standby1-0",),
                yielded=standby.Yield("mnist-1-0r1", 1, "0/1 nodes are available", ("mnist-standby1-0",)),
            ),
            id="a-rank-pod-finds-no-node-every-waiting-standby-yields",
        ),
        pytest.param(
            ONE, "Running", [], [pod(0), pod(1), standby_pod(1, phase="Pending", scheduled=False)],
            standby.StandbyPlan(),
            id="a-pending-standby-is-kept-while-every-rank-is-bound",
        ),
    ],
)  # fmt: skip
def test_the_standby_plan(
    spec: dict[str, Any],
    phase: str,
    replacements: list[tuple[int, int]],
    pods: list[dict[str, Any]],
    expected: standby.StandbyPlan,
) -> None:
    job = job_spec(**spec)
    assert standby.plan(job, phase, 0, replacements, 2, observe(*pods)) == expected


def test_a_lost_pod_is_taken_by_the_running_standby_and_another_is_started() -> None:
    job = job_spec(**ONE)
    lost = pod(1, deleting_at=20)
    decision = decide(job, live_status(restarts=1), observe(pod(0), lost, standby_pod(1)), at(30))
    assert decision.create.promotions == (standby.Promotion("mnist-standby1-0", 1, 1, 2),)
    assert decision.create.replacements == () and decision.create.standbys == (2,)
    assert decision.create.attempt == 0
    [notice] = decision.report.notices
    assert notice.reason == "PodReplaced" and "replaced by standby pod mnist-standby1-0" in notice.message
    record = decision.report.status["lastRestart"]
    assert (
        record["mode"] == "PodReplaced"
        and record["note"] == "rank 1's pod taken by standby pod mnist-standby1-0"
    )
    assert decision.report.status["podReplacements"] == 1


def test_the_promoted_standby_is_its_ranks_pod_from_then_on() -> None:
    """The standby with rank 1's labels supersedes the lost pod: nothing more is replaced."""
    job = job_spec(**ONE)
    status = live_status(restarts=2)
    status["podReplacements"] = 1
    status["lastRestart"] = {"mode": "PodReplaced", "attempt": 0, "groupRestarts": 1, "failureTime": "x"}
    pods = observe(pod(0), pod(1, deleting_at=20), promoted(1, 1, 1), standby_pod(2))
    decision = decide(job, status, pods, at(40))
    assert decision.create.promotions == () and decision.create.replacements == ()
    assert decision.create.standbys == () and "mnist-standby2-0" not in decision.delete.pods


def test_the_standby_pod_has_no_rank_its_assignment_file_and_no_hostname() -> None:
    job = job_spec(**ONE)
    made = builders.build_standby_pod(job, 2, 3)
    labels = made["metadata"]["labels"]
    assert made["metadata"]["name"] == "mnist-standby3-2"
    assert names.LABEL_RANK not in labels and labels[names.LABEL_ROLE] == names.ROLE_STANDBY
    assert labels[names.LABEL_STANDBY] == "3" and labels[names.LABEL_ATTEMPT] == "2"
    assert "hostname" not in made["spec"] and "subdomain" not in made["spec"]
    [trainer] = made["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert not {"NODE_RANK", "PET_NODE_RANK", "RANK", "LOCAL_RANK"} & set(env)
    assert env["DDP_STANDBY_FILE"] == f"{names.PLACEMENT_PATH}/{names.ASSIGNMENT_FILE}"
    assert "DDP_RENDEZVOUS_ENDPOINT" in env and env["DDP_RESTART_MODE"] == "InPlace"
    [placement] = [v for v in made["spec"]["volumes"] if v["name"] == names.PLACEMENT_VOLUME]
    [item] = placement["downwardAPI"]["items"]
    assert item["fieldRef"]["fieldPath"] == f"metadata.annotations['{names.ANNOTATION_ASSIGNMENT}']"
    patch = builders.standby_promotion(1, 4, 2, at(7))
    assert patch["metadata"]["labels"] == {
        names.LABEL_RANK: "1",
        names.LABEL_REPLACEMENT: "4",
        names.LABEL_ROLE: None,
    }
    assert patch["metadata"]["annotations"] == {
        names.ANNOTATION_ASSIGNMENT: "rank=1 budget=2",
        names.ANNOTATION_ASSIGNED_AT: "2025-01-01T12:00:07.000000Z",
    }


def test_a_job_with_a_one_pod_checkpoint_claim_gives_rank_0_to_a_new_pod_and_no_standby_mounts_it() -> None:
    """Only reachable for a job stored before the CRD refused the combination (spec.py refuses it)."""
    job = replace(job_spec(**ONE), checkpoint=job_spec(**checkpoint("ReadWriteOncePod")).checkpoint)
    planned = standby.plan(job, "Running", 0, [(0, 1)], 2, observe(standby_pod(1)))
    assert planned == standby.StandbyPlan(replacements=((0, 1),))
    made = builders.build_standby_pod(job, 0, 1)
    assert names.CHECKPOINT_VOLUME not in {v["name"] for v in made["spec"]["volumes"]}
    assert names.LABEL_CHECKPOINT_MOUNT not in made["metadata"]["labels"]


@pytest.mark.parametrize(
    ("spec", "labels", "problem"),
    [
        pytest.param({"runPolicy": {"standbyPods": 1, "restartMode": "Recreate"}}, {}, "restartMode InPlace", id="recreate"),
        pytest.param({**ONE, "replicas": 1}, {}, "at least 2 pods", id="one-pod"),
        pytest.param(
            {**ONE, "replicas": None, "elastic": {"minReplicas": 1, "maxReplicas": 2}}, {}, "fixed-size", id="elastic"
        ),
        pytest.param(
            {**ONE, "scheduling": {"topology": {"required": "topology.kubernetes.io/rack"}}}, {}, "topology",
            id="topology",
        ),
        pytest.param(ONE, {names.KUEUE_QUEUE_LABEL: "team-a"}, "Kueue", id="kueue"),
        pytest.param({**ONE, **checkpoint("ReadWriteOncePod")}, {}, "ReadWriteOncePod", id="one-pod-checkpoint"),
    ],
)  # fmt: skip
def test_a_standby_needs_what_it_uses(spec: dict[str, Any], labels: dict[str, str], problem: str) -> None:
    from tests.unit.kube_factories import job_object

    body = job_object(**spec)
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    body["metadata"]["labels"] = labels
    with pytest.raises(SpecError, match=r"spec\.runPolicy\.standbyPods") as refused:
        parse_job(body)
    assert problem in str(refused.value)


def test_a_standby_that_took_a_hung_pods_rank_is_not_taken_for_hung_by_the_same_stall() -> None:
    """A frozen pod's rank went to the standby at 100 s; the reads still show the step of 30 s and no
    answer from the new rank 1 (its launcher only now joins). Its rank's taking is the group's change,
    as a new pod's start is: the stall clock starts again there, and nothing is deleted or replaced."""
    job = job_spec(**ONE)
    status = live_status(restarts=1)
    status["podReplacements"] = 1
    status["lastRestart"] = {"mode": "PodReplaced", "attempt": 0, "groupRestarts": 1, "failureTime": "x"}
    progress = ProgressObservation(
        attempt=0, step=120, step_changed_at=at(30), rank_steps={0: 120}, step_seconds=0.2
    )
    pods = observe(pod(0), pod(1, deleting_at=99), promoted(1, 1, 1, assigned=100), standby_pod(2))
    decision = decide(job, status, pods, at(101), observed=progress)
    assert decision.delete.hung_pods == () and decision.create.promotions == ()
    assert decision.create.replacements == () and decision.report.status["phase"] == "Running"


def _spec(*containers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"containers": list(containers), **extra}


def _trainer(requests: dict[str, str] | None = None, limits: dict[str, str] | None = None) -> dict[str, Any]:
    resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v is not None}
    return {"name": "trainer", "resources": resources}


@pytest.mark.parametrize(
    ("pod_spec", "waiting", "expected"),
    [
        pytest.param(_spec(_trainer({"cpu": "250m", "memory": "1Gi"})), "10m", "10m", id="burstable-waits-with-10m"),
        pytest.param(_spec(_trainer({"cpu": "2"}, {"cpu": "4"})), "100m", "100m", id="a-cpu-limit-is-kept-and-still-burstable"),
        pytest.param(_spec(_trainer({"cpu": "250m"})), None, None, id="no-waiting-cpu-keeps-the-ranks"),
        pytest.param(_spec(_trainer({"cpu": "250m"})), "", None, id="empty-waiting-cpu-keeps-the-ranks"),
        pytest.param(_spec(_trainer({"memory": "1Gi"})), "10m", None, id="no-cpu-request-adds-none"),
        pytest.param(_spec(_trainer({"cpu": "10m"})), "10m", None, id="a-request-no-higher-than-waiting"),
        pytest.param(_spec(_trainer({"cpu": "5m"})), "0.01", None, id="a-request-below-waiting-in-cores"),
        pytest.param(
            _spec(_trainer({"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"})), "10m", None,
            id="guaranteed-keeps-its-qos-class",
        ),
        pytest.param(
            _spec(_trainer(None, {"cpu": "1", "memory": "1Gi"})), "10m", None,
            id="guaranteed-by-limits-alone",
        ),
        pytest.param(
            _spec(_trainer({"cpu": "1", "memory": "1Gi"}, {"cpu": "1", "memory": "1Gi"}), {"name": "sidecar"}),
            "10m", "10m", id="a-container-without-limits-makes-it-burstable",
        ),
        pytest.param(
            _spec(_trainer({"cpu": "1"}), resources={"requests": {"cpu": "1"}}), "10m", None,
            id="pod-level-resources-are-left-alone",
        ),
    ],
)  # fmt: skip
def test_a_standby_waits_with_little_cpu_where_a_resize_gives_it_back(
    pod_spec: dict[str, Any], waiting: str | None, expected: str | None
) -> None:
    assert standby.waiting_cpu(pod_spec, waiting) == expected


def test_the_standby_pod_keeps_its_ranks_cpu_request_for_the_resize() -> None:
    resources = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "512Mi"}}
    template = {
        "spec": {"containers": [{"name": "trainer", "image": "ddp-trainer:1", "resources": resources}]}
    }
    job = job_spec(template=template, **ONE)
    made = builders.build_standby_pod(job, 0, 1, waiting_cpu="10m")
    [trainer] = made["spec"]["containers"]
    assert trainer["resources"]["requests"] == {"cpu": "10m", "memory": "512Mi"}
    assert trainer["resources"]["limits"] == {"memory": "512Mi"}
    assert made["metadata"]["annotations"][names.ANNOTATION_RANK_CPU] == "250m"
    # The rank pods keep their request, and so does a standby without a waiting CPU.
    assert builders.build_rank_pod(job, 1, 0)["spec"]["containers"][0]["resources"] == resources
    plain = builders.build_standby_pod(job, 0, 1)
    assert plain["spec"]["containers"][0]["resources"] == resources
    assert names.ANNOTATION_RANK_CPU not in (plain["metadata"].get("annotations") or {})


def waiting_standby(number: int, **state: Any) -> dict[str, Any]:
    """A standby built with a waiting CPU of 10m for a rank that requests 250m."""
    made = standby_pod(number, **state)
    made["metadata"].setdefault("annotations", {})[names.ANNOTATION_RANK_CPU] = "250m"
    made["spec"]["containers"] = [{"name": "trainer", "resources": {"requests": {"cpu": "10m"}}}]
    return made


def resized(made: dict[str, Any], cpu: str) -> dict[str, Any]:
    made["metadata"].setdefault("annotations", {})[names.ANNOTATION_RANK_CPU] = "250m"
    made["spec"]["containers"] = [{"name": "trainer", "resources": {"requests": {"cpu": cpu}}}]
    return made


@pytest.mark.parametrize(
    ("pods", "replacements", "expected"),
    [
        pytest.param([pod(0), pod(1, deleting_at=20), waiting_standby(1)], [(1, 1)], (("mnist-standby1-0", "250m"),), id="promoted-now-resized-now"),
        pytest.param([pod(0), resized(promoted(1, 1, 1), "10m")], [], (("mnist-standby1-0", "250m"),), id="a-resize-not-done-is-asked-again"),
        pytest.param([pod(0), resized(promoted(1, 1, 1), "250m")], [], (), id="resized-already"),
        pytest.param([pod(0), pod(1), waiting_standby(1)], [], (), id="a-waiting-standby-keeps-its-waiting-cpu"),
        pytest.param([pod(0), resized(promoted(1, 1, 1, phase="Failed"), "10m")], [], (), id="an-ended-pod-is-not-resized"),
        pytest.param([pod(0), pod(1, deleting_at=20), standby_pod(1)], [(1, 1)], (), id="a-standby-with-its-ranks-cpu-needs-none"),
    ],
)  # fmt: skip
def test_a_standby_that_takes_a_rank_gets_its_cpu_back(
    pods: list[dict[str, Any]], replacements: list[tuple[int, int]], expected: tuple[tuple[str, str], ...]
) -> None:
    job = job_spec(**ONE)
    assert standby.plan(job, "Running", 0, replacements, 2, observe(*pods)).resize == expected


def test_decide_resizes_the_standby_it_promotes() -> None:
    job = job_spec(**ONE)
    pods = observe(pod(0), pod(1, deleting_at=20), waiting_standby(1))
    decision = decide(job, live_status(restarts=1), pods, at(30))
    assert [p.pod for p in decision.create.promotions] == ["mnist-standby1-0"]
    assert decision.create.resizes == (("mnist-standby1-0", "250m"),)
