"""What decide() answers about where a live attempt's ranks landed (policies/placement.py), about the
Kueue groups a deleted job left (policies/kueue.orphaned_groups, reconcile.decide_deleted), and about
a standby that was gone when it was given its rank (the controller asks again without it)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import (
    JOB_UID,
    at,
    job_spec,
    kueue_managed,
    observe,
    pod,
    standby_pod,
    with_run_policy,
)
from tests.unit.test_reconcile import live_status

from ddp_operator import names
from ddp_operator.decision import KueueActions
from ddp_operator.policies import kueue as kueue_policy
from ddp_operator.policies import standby
from ddp_operator.reconcile import decide, decide_deleted

pytestmark = pytest.mark.unit

RACK = "example.com/rack"
PREFERRED = {"scheduling": {"topology": {"preferred": RACK}}}
RECREATE = {**PREFERRED, **with_run_policy(restartMode="Recreate")}
KEY_0 = "0/rack-a/node-0/000000"
KEY_1_APART = "3/rack-b/node-1/000001"
KEY_1_TOGETHER = "2/rack-a/node-1/000001"
APART = {"node-0": {RACK: "rack-a"}, "node-1": {RACK: "rack-b"}}
TOGETHER = {"node-0": {RACK: "rack-a"}, "node-1": {RACK: "rack-a"}}


def keyed(rank: int, key: str, **state: Any) -> dict[str, Any]:
    """Rank ``rank``'s pod with its rendezvous order key already written."""
    made = pod(rank, **state)
    made["metadata"].setdefault("annotations", {})[names.ANNOTATION_RANK_ORDER] = key
    return made


def shown(*domains: tuple[str, str], crossings: int, path: str = "Affinity") -> dict[str, Any]:
    return {
        "key": RACK,
        "path": path,
        "domains": [{"name": name, "ranks": ranks} for name, ranks in domains],
        "ringCrossings": crossings,
    }


BOTH = [pod(0), pod(1)]
ORDERS_APART = (("mnist-0-0", KEY_0), ("mnist-1-0", KEY_1_APART))
SHOWN_APART = shown(("rack-a", "0"), ("rack-b", "1"), crossings=2)


@pytest.mark.parametrize(
    ("spec", "pods", "nodes", "orders", "topology"),
    [
        pytest.param(
            PREFERRED, BOTH, APART, ORDERS_APART, SHOWN_APART, id="both-bound-keys-and-placement-shown"
        ),
        pytest.param(
            PREFERRED,
            BOTH,
            TOGETHER,
            (("mnist-0-0", KEY_0), ("mnist-1-0", KEY_1_TOGETHER)),
            shown(("rack-a", "0-1"), crossings=0),
            id="one-rack-no-ring-crossing",
        ),
        pytest.param(
            PREFERRED,
            BOTH,
            {"node-0": APART["node-0"]},
            ORDERS_APART[:1],
            None,
            id="a-node-not-read-is-unbound",
        ),
        pytest.param(
            PREFERRED, BOTH, {"node-1": APART["node-1"]}, (), None, id="no-key-before-rank-0-is-bound"
        ),
        pytest.param(
            PREFERRED,
            [keyed(0, KEY_0), pod(1)],
            APART,
            ORDERS_APART[1:],
            SHOWN_APART,
            id="a-key-is-written-once",
        ),
        pytest.param(RECREATE, BOTH, APART, (), SHOWN_APART, id="recreate-ranks-by-pod-rank-no-keys"),
        pytest.param({}, BOTH, APART, (), None, id="no-topology-asked-nothing-written"),
        pytest.param(
            PREFERRED, [pod(0), pod(1, exit_code=1)], APART, (), None, id="a-failed-attempt-records-none"
        ),
    ],
)
def test_where_the_ranks_landed(
    spec: dict[str, Any],
    pods: list[dict[str, Any]],
    nodes: dict[str, dict[str, str]],
    orders: tuple[tuple[str, str], ...],
    topology: dict[str, Any] | None,
) -> None:
    decision = decide(job_spec(**spec), live_status(), observe(*pods), at(30), nodes=nodes)
    assert decision.rank_orders == orders
    assert decision.report.status.get("topology") == topology
    assert decision.report.changed or topology is None


def test_the_placement_already_shown_is_not_written_again() -> None:
    status = live_status(topology=SHOWN_APART)
    pods = observe(keyed(0, KEY_0), keyed(1, KEY_1_APART))
    decision = decide(job_spec(**PREFERRED), status, pods, at(30), nodes=APART)
    assert decision.rank_orders == ()
    assert decision.report.status["topology"] == SHOWN_APART


OLD_UID = "uid-of-an-earlier-job"
# The Kueue group of the job's pods (kueue_managed names it after the job's UID).
GROUP = names.kueue_pod_group_name("mnist", JOB_UID)


@pytest.mark.parametrize(
    ("pods", "live_uid", "expected"),
    [
        pytest.param(
            [kueue_managed(pod(0, owner_uid=OLD_UID))],
            JOB_UID,
            ((GROUP, OLD_UID),),
            id="an-earlier-jobs-pod-still-held-by-kueue",
        ),
        pytest.param([kueue_managed(pod(0))], JOB_UID, (), id="the-live-jobs-own-group-stays"),
        pytest.param(
            [kueue_managed(pod(0, owner_uid=OLD_UID), finalizer=False)],
            JOB_UID,
            (),
            id="kueue-let-go-already",
        ),
        pytest.param([pod(0, owner_uid=OLD_UID)], JOB_UID, (), id="not-in-a-kueue-group"),
        pytest.param(
            [kueue_managed(pod(0)), kueue_managed(pod(1))],
            None,
            ((GROUP, JOB_UID),),
            id="a-deleted-jobs-group-once-for-all-its-pods",
        ),
    ],
)
def test_the_kueue_groups_a_deleted_job_left(
    pods: list[dict[str, Any]], live_uid: str | None, expected: tuple[tuple[str, str], ...]
) -> None:
    assert kueue_policy.orphaned_groups(observe(*pods), live_uid) == expected


def test_a_deleted_job_leaves_only_its_kueue_groups_to_release() -> None:
    decision = decide_deleted(observe(kueue_managed(pod(0)), pod(1)))
    assert decision.kueue == KueueActions(release_orphaned=((GROUP, JOB_UID),))
    assert not decision.report.changed and decision.create.ranks == () and decision.delete.pods == ()


def test_a_re_created_job_releases_the_group_its_predecessor_left() -> None:
    old_pod = kueue_managed(pod(0, owner_uid=OLD_UID))
    old_pod["metadata"]["name"] = "mnist-0-3"
    decision = decide(job_spec(), live_status(), observe(pod(0), pod(1), old_pod), at(30))
    assert decision.kueue.release_orphaned == ((GROUP, OLD_UID),)


@pytest.mark.parametrize(
    ("standbys", "promotions", "replacements"),
    [
        pytest.param(
            [standby_pod(2)],
            (standby.Promotion("mnist-standby2-0", 1, 1, 2),),
            (),
            id="the-next-running-standby-takes-the-rank",
        ),
        pytest.param([], (), ((1, 1),), id="no-standby-left-a-new-pod-takes-the-rank"),
    ],
)
def test_a_standby_gone_before_its_promotion_is_decided_without(
    standbys: list[dict[str, Any]],
    promotions: tuple[standby.Promotion, ...],
    replacements: tuple[tuple[int, int], ...],
) -> None:
    """The controller drops a standby the apiserver no longer has and asks decide() again: the plan
    gives the lost rank the next standby, or a new pod of that rank as without standbys."""
    job = job_spec(**with_run_policy(standbyPods=2))
    lost = pod(1, deleting_at=20)
    first = decide(job, live_status(restarts=1), observe(pod(0), lost, standby_pod(1), *standbys), at(30))
    assert first.create.promotions[0].pod == "mnist-standby1-0"
    again = decide(job, live_status(restarts=1), observe(pod(0), lost, *standbys), at(30))
    assert again.create.promotions == promotions
    assert again.create.replacements == replacements
