"""Standby pods never block a rank and take any rank, rank 0 included (docs/restarts.md, "Standby
pods"): the PriorityClass the builders give them, the checkpoint claim they mount by its access mode,
the node a ReadWriteOnce claim keeps them on, what decide() does while a refused standby is held back,
and the Events that say so."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

import pytest
from tests.unit.kube_factories import at, job_spec, observe, pod, standby_pod, with_run_policy
from tests.unit.test_reconcile import live_status

from ddp_operator import builders, names, standbys
from ddp_operator.commands import operator as operator_command
from ddp_operator.decision import REASON_STANDBY_NOT_CREATED, REASON_STANDBY_YIELDED
from ddp_operator.policies import standby
from ddp_operator.reconcile import decide

pytestmark = pytest.mark.unit

ONE = with_run_policy(standbyPods=1)


def claim(*modes: str) -> dict[str, Any]:
    template: dict[str, Any] = {"resources": {"requests": {"storage": "1Gi"}}}
    if modes:
        template["accessModes"] = list(modes)
    return {"checkpoint": {"volumeClaimTemplate": template}}


def volumes(made: dict[str, Any]) -> set[str]:
    return {v["name"] for v in made["spec"]["volumes"]}


def required_pod_affinity(made: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = made["spec"].get("affinity", {}).get("podAffinity", {})
    terms: list[dict[str, Any]] = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    return terms


@pytest.mark.parametrize(
    ("template", "given", "expected"),
    [
        pytest.param({}, names.DEFAULT_STANDBY_PRIORITY_CLASS, names.DEFAULT_STANDBY_PRIORITY_CLASS, id="the-operators-class"),
        pytest.param({"priorityClassName": "team-a-high", "priority": 1000, "preemptionPolicy": "PreemptLowerPriority"},
                     "spares", "spares", id="replaces-the-templates-class-and-what-admission-derives-from-it"),
        pytest.param({"priorityClassName": "team-a-high"}, "", "team-a-high", id="none-configured-keeps-the-templates"),
        pytest.param({}, None, None, id="none-configured-no-class"),
    ],
)  # fmt: skip
def test_a_standby_runs_at_the_standby_class_and_the_ranks_at_the_templates(
    template: dict[str, Any], given: str | None, expected: str | None
) -> None:
    job = job_spec(
        **ONE, template={"spec": {"containers": [{"name": "trainer", "image": "t:1"}], **template}}
    )
    made = builders.build_standby_pod(job, 0, 1, priority_class=given)
    assert made["spec"].get("priorityClassName") == expected
    if given:
        assert "priority" not in made["spec"] and "preemptionPolicy" not in made["spec"]
    rank = builders.build_rank_pod(job, 1, 0)
    assert rank["spec"].get("priorityClassName") == template.get("priorityClassName")
    assert rank["spec"].get("priority") == template.get("priority")


@pytest.mark.parametrize(
    ("spec", "mount", "pinned"),
    [
        pytest.param({}, standby.MOUNT_NONE, False, id="no-checkpoint"),
        pytest.param(claim(), standby.MOUNT_ON_NODE, True, id="default-read-write-once"),
        pytest.param(claim("ReadWriteOnce"), standby.MOUNT_ON_NODE, True, id="read-write-once"),
        pytest.param(claim("ReadWriteMany"), standby.MOUNT_ANYWHERE, False, id="read-write-many"),
        pytest.param(claim("ReadOnlyMany", "ReadWriteMany"), standby.MOUNT_ANYWHERE, False, id="many-modes"),
    ],
)  # fmt: skip
def test_a_standby_mounts_the_checkpoint_claim_where_its_access_mode_lets_it(
    spec: dict[str, Any], mount: str, pinned: bool
) -> None:
    job = job_spec(**ONE, **spec)
    assert standby.checkpoint_mount(job) == mount and standby.takes_rank0(job)
    made = builders.build_standby_pod(job, 3, 1)
    rank0 = builders.build_rank_pod(job, 0, 3)
    rank1 = builders.build_rank_pod(job, 1, 3)
    mounted = mount != standby.MOUNT_NONE
    for holder in (made, rank0):
        assert (names.CHECKPOINT_VOLUME in volumes(holder)) == mounted
        assert (holder["metadata"]["labels"].get(names.LABEL_CHECKPOINT_MOUNT) == "true") == mounted
    assert names.CHECKPOINT_VOLUME not in volumes(rank1) and not required_pod_affinity(rank1)
    if mounted:
        [trainer] = made["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        assert env["DDP_CHECKPOINT_DIR"] == "/var/run/ddp/checkpoints"
        assert {"name": names.CHECKPOINT_VOLUME, "mountPath": "/var/run/ddp/checkpoints"} in trainer[
            "volumeMounts"
        ]
    expected = [
        {
            "labelSelector": {
                "matchLabels": {
                    **names.attempt_selector("mnist", job.uid, 3),
                    names.LABEL_CHECKPOINT_MOUNT: "true",
                }
            },
            "topologyKey": "kubernetes.io/hostname",
        }
    ]
    for holder in (made, rank0):
        assert required_pod_affinity(holder) == (expected if pinned else [])
    # The pod's own labels match its term: the first pod that mounts the claim goes anywhere.
    if pinned:
        own = made["metadata"]["labels"]
        assert expected[0]["labelSelector"]["matchLabels"].items() <= own.items()


def test_rank_0_of_a_job_without_standbys_is_placed_as_before() -> None:
    job = job_spec(**claim("ReadWriteOnce"))
    assert not required_pod_affinity(builders.build_rank_pod(job, 0, 0))


def test_the_templates_pod_affinity_is_kept_beside_the_checkpoint_node() -> None:
    own = {"labelSelector": {"matchLabels": {"app": "data"}}, "topologyKey": "topology.kubernetes.io/zone"}
    template = {
        "spec": {
            "containers": [{"name": "trainer", "image": "t:1"}],
            "affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [own]}},
        }
    }
    made = builders.build_standby_pod(job_spec(**ONE, **claim(), template=template), 0, 1)
    terms = required_pod_affinity(made)
    assert terms[0] == own and terms[1]["topologyKey"] == "kubernetes.io/hostname"


def test_a_refused_standby_is_held_back_and_the_job_is_looked_at_again_when_the_hold_ends() -> None:
    job = job_spec(**ONE)
    pods = observe(pod(0), pod(1))
    assert decide(job, live_status(), pods, at(30)).create.standbys == (1,)
    held = decide(job, live_status(), pods, at(30), standby_held_until=at(90))
    assert held.create.standbys == () and held.requeue_after == pytest.approx(60.0)
    after = decide(job, live_status(), pods, at(90) + timedelta(microseconds=1), standby_held_until=at(90))
    assert after.create.standbys == (1,)


def test_the_refusal_event_says_the_job_trains_on() -> None:
    event = standbys.refused("mnist-standby1-0", "no PriorityClass with name ddp-operator-standby was found")
    assert (event.type, event.reason) == ("Warning", REASON_STANDBY_NOT_CREATED)
    assert "mnist-standby1-0" in event.message and "no PriorityClass" in event.message
    assert "trains on without it" in event.message and "60 s" in event.message


def with_priority(made: dict[str, Any], priority: int) -> dict[str, Any]:
    made["spec"]["priority"] = priority
    return made


@pytest.mark.parametrize(
    ("standby_priority", "rank_priority", "hint"),
    [
        pytest.param(-1, 0, False, id="below-the-rank-no-hint"),
        pytest.param(0, 0, True, id="level-with-the-rank-the-scheduler-could-not-preempt"),
        pytest.param(-1, -100, True, id="the-ranks-class-below-the-standbys"),
        pytest.param(None, None, False, id="priorities-unknown"),
    ],
)
def test_standbys_yield_to_a_rank_pod_that_finds_no_node(
    standby_priority: int | None, rank_priority: int | None, hint: bool
) -> None:
    job = job_spec(**ONE)
    waiting = standby_pod(1)
    blocked = pod(1, replacement=1, unschedulable="0/1 nodes are available: 1 Insufficient cpu.")
    if standby_priority is not None and rank_priority is not None:
        waiting = with_priority(waiting, standby_priority)
        blocked = with_priority(blocked, rank_priority)
    decision = decide(job, live_status(restarts=1), observe(pod(0), blocked, waiting), at(30))
    assert "mnist-standby1-0" in decision.delete.pods and decision.create.standbys == ()
    [event] = decision.events
    assert (event.type, event.reason) == ("Warning", REASON_STANDBY_YIELDED)
    assert "mnist-1-0r1" in event.message and "Insufficient cpu" in event.message
    assert ("not below the rank's" in event.message) == hint


def test_a_standby_already_going_is_not_yielded_twice() -> None:
    job = job_spec(**ONE)
    blocked = pod(1, replacement=1, unschedulable="0/1 nodes are available")
    decision = decide(
        job, live_status(restarts=1), observe(pod(0), blocked, standby_pod(1, deleting_at=20)), at(30)
    )
    assert decision.events == () and decision.create.standbys == ()


def test_the_operator_flag_names_the_class_and_empty_keeps_the_templates() -> None:
    parser = argparse.ArgumentParser()
    operator_command.configure_parser(parser)
    assert parser.parse_args([]).standby_priority_class == names.DEFAULT_STANDBY_PRIORITY_CLASS
    assert parser.parse_args(["--standby-priority-class="]).standby_priority_class == ""
