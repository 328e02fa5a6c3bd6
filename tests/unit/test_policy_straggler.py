"""runPolicy.stragglerPolicy (docs/restarts.md, "Stragglers"): when a straggler's pod is replaced, why
it is not, and what the decision and the replacement pod carry."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import RUNNING_STATUS, at, job_object, job_spec, observe, pod

from ddp_operator import builders
from ddp_operator.observe import PodObservation
from ddp_operator.policies import straggler
from ddp_operator.progress import tracker
from ddp_operator.progress.exposition import HealthCheck
from ddp_operator.reconcile import decide
from ddp_operator.spec import SpecError, StragglerPolicy, parse_job

REPLACE = StragglerPolicy(action="Replace")


def sighting(
    rank: int = 1, slowdown: float = 3.0, since: float = 0.0, group_since: float | None = None
) -> tracker.StragglerSighting:
    regrouped = at(group_since) if group_since is not None else None
    return tracker.StragglerSighting(
        rank=rank, slowdown=slowdown, since=at(since), phase="compute", group_since=regrouped
    )


def running(rank: int) -> PodObservation:
    return observe(pod(rank))[0]


# (policy, sighting, the pod, seconds now, replaced so far) -> (replaced pod's rank or None, held?, left)
VERDICT_CASES = [
    pytest.param(
        StragglerPolicy(), sighting(), running(1), 600, 0, (None, False, None), id="report-never-acts"
    ),
    pytest.param(REPLACE, None, running(1), 600, 0, (None, False, None), id="no-straggler"),
    pytest.param(
        REPLACE, sighting(slowdown=1.8), running(1), 600, 0, (None, False, None), id="below-slowdown"
    ),
    pytest.param(REPLACE, sighting(), running(1), 100, 0, (None, False, 20.0), id="not-yet-sustained"),
    pytest.param(REPLACE, sighting(), running(1), 120, 0, (1, False, None), id="sustained-exactly"),
    pytest.param(REPLACE, sighting(slowdown=2.0), running(1), 600, 0, (1, False, None), id="at-the-slowdown"),
    pytest.param(REPLACE, sighting(rank=0), running(0), 600, 0, (None, True, None), id="rank-0-held"),
    pytest.param(REPLACE, sighting(), running(1), 600, 2, (None, True, None), id="bound-reached-held"),
    pytest.param(
        StragglerPolicy(action="Replace", max_replacements=3),
        sighting(),
        running(1),
        600,
        2,
        (1, False, None),
        id="bound-raised",
    ),
    pytest.param(REPLACE, sighting(), None, 600, 0, (None, False, None), id="pod-unknown"),
    # A replacement is judged from the round that took it in, not its predecessor's sighting.
    pytest.param(
        REPLACE,
        sighting(group_since=505),
        observe(pod(1, replacement=1, created=500))[0],
        600,
        1,
        (None, False, 25.0),
        id="a-replacement-judged-from-the-round-it-joined",
    ),
    # Before the reads see a round with it, rank 0's windows and gauges are its predecessor's: seen on
    # kind, where a replacement still starting was named 14x slow from the old pod's windows.
    pytest.param(
        REPLACE,
        sighting(),
        observe(pod(1, replacement=1, created=500))[0],
        900,
        1,
        (None, False, 120.0),
        id="a-replacement-not-yet-in-a-round-is-not-judged",
    ),
    pytest.param(
        REPLACE,
        sighting(group_since=490),
        observe(pod(1, replacement=1, created=500))[0],
        900,
        1,
        (None, False, 120.0),
        id="a-round-before-the-replacement-started-is-not-its",
    ),
    # The pod's start is kept to the second: a round within it cannot have taken the pod in.
    pytest.param(
        REPLACE,
        sighting(group_since=500.5),
        observe(pod(1, replacement=1, created=500))[0],
        900,
        1,
        (None, False, 120.0),
        id="a-round-within-the-replacements-first-second-is-not-its",
    ),
    pytest.param(
        REPLACE, sighting(), observe(pod(1, deleting_at=1))[0], 600, 0, (None, False, None), id="pod-going"
    ),
]


@pytest.mark.parametrize(("policy", "seen", "host", "now", "replaced", "expected"), VERDICT_CASES)
def test_verdict(
    policy: StragglerPolicy,
    seen: tracker.StragglerSighting | None,
    host: PodObservation | None,
    now: float,
    replaced: int,
    expected: tuple[int | None, bool, float | None],
) -> None:
    verdict = straggler.verdict(policy, seen, host, at(now), replaced)
    got = (verdict.replace.rank if verdict.replace else None, verdict.held is not None, verdict.left)
    assert got == expected


def check(rank: int = 2, checked_at: float = 50.0) -> HealthCheck:
    return HealthCheck(slow_rank=rank, checked_at=at(checked_at).timestamp())


# (policy, the last health check, its rank's pod, the straggler sighting and its pod, replaced so far)
#   -> (replaced pod's rank or None, held?, the Event says the health check?)
CHECK_CASES = [
    pytest.param(REPLACE, check(), running(2), None, None, 0, (2, False, True), id="a-slow-link-replaced-at-once"),
    pytest.param(StragglerPolicy(), check(), running(2), None, None, 0, (None, False, False), id="report-never-acts"),
    # The check ended before this pod of the rank started: it measured the pod it replaced.
    pytest.param(
        REPLACE, check(checked_at=50), observe(pod(2, replacement=1, created=60))[0], None, None, 1,
        (None, False, False), id="a-check-of-the-replaced-pod-is-not-this-one",
    ),
    pytest.param(
        REPLACE, check(checked_at=70), observe(pod(2, replacement=1, created=60))[0], None, None, 1,
        (2, False, True), id="the-replacement-checked-slow-again",
    ),
    # The pod's start is kept to the second (60 stands for 60.0 up to 61.0): a check that ended within
    # it may have ended before the pod began (CI once replaced the replacement for its predecessor's check).
    pytest.param(
        REPLACE, check(checked_at=60.5), observe(pod(2, replacement=1, created=60))[0], None, None, 1,
        (None, False, False), id="a-check-within-the-pods-first-second-is-not-its",
    ),
    pytest.param(REPLACE, check(rank=0), running(0), None, None, 0, (None, True, False), id="rank-0-held"),
    pytest.param(REPLACE, check(), running(2), None, None, 2, (None, True, False), id="bound-reached-held"),
    pytest.param(REPLACE, check(), None, None, None, 0, (None, False, False), id="pod-unknown"),
    # A sustained straggler is acted on first, with its own words.
    pytest.param(REPLACE, check(), running(2), sighting(), running(1), 0, (1, False, False), id="straggler-first"),
    # A straggler not yet sustained does not hold back what the check found.
    pytest.param(
        REPLACE, check(), running(2), sighting(since=590), running(1), 0, (2, False, True), id="check-while-sighting-young"
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "found", "host", "seen", "slow_host", "replaced", "expected"), CHECK_CASES
)
def test_a_rank_the_health_check_found_slow(
    policy: StragglerPolicy,
    found: HealthCheck,
    host: PodObservation | None,
    seen: tracker.StragglerSighting | None,
    slow_host: PodObservation | None,
    replaced: int,
    expected: tuple[int | None, bool, bool],
) -> None:
    verdict = straggler.verdict(policy, seen, slow_host, at(600), replaced, found, host)
    got = (
        verdict.replace.rank if verdict.replace else None,
        verdict.held is not None,
        "health check" in verdict.text,
    )
    assert got == expected


def test_avoided_nodes_keep_order_without_duplicates_within_the_bound() -> None:
    assert straggler.with_node(("a", "b"), "a") == ("b", "a")
    many = tuple(f"n{i}" for i in range(straggler.MAX_AVOIDED_NODES))
    assert straggler.with_node(many, "new") == (*many[1:], "new")


# ---- the spec ------------------------------------------------------------------------------------------

SPEC_ERRORS = [
    pytest.param(
        {"runPolicy": {"stragglerPolicy": {"action": "Move"}}}, "stragglerPolicy.action", id="unknown-action"
    ),
    pytest.param(
        {"runPolicy": {"stragglerPolicy": {"action": "Replace"}, "restartMode": "Recreate"}},
        "restartMode InPlace",
        id="replace-needs-in-place",
    ),
    pytest.param(
        {"runPolicy": {"stragglerPolicy": {"action": "Shrink"}}},
        "needs spec.elastic",
        id="shrink-needs-elastic",
    ),
    pytest.param(
        {"runPolicy": {"stragglerPolicy": {"slowdownPercent": 120}}}, "slowdownPercent", id="slowdown-floor"
    ),
    pytest.param(
        {"runPolicy": {"stragglerPolicy": {"sustainedSeconds": 5}}}, "sustainedSeconds", id="duration-floor"
    ),
    pytest.param(
        {"runPolicy": {"stragglerPolicy": {"maxReplacements": 0}}}, "maxReplacements", id="bound-floor"
    ),
]


@pytest.mark.parametrize(("spec", "named"), SPEC_ERRORS)
def test_a_bad_straggler_policy_names_the_field(spec: dict[str, Any], named: str) -> None:
    with pytest.raises(SpecError) as refused:
        parse_job(job_object(**spec))
    assert named in str(refused.value)


def test_replace_is_refused_for_a_kueue_job() -> None:
    manifest = job_object(runPolicy={"stragglerPolicy": {"action": "Replace"}})
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    with pytest.raises(SpecError, match="Kueue"):
        parse_job(manifest)


def elastic_shrink_job(minimum: int = 2, maximum: int = 3, **spec: Any) -> Any:
    body = job_object(runPolicy={"stragglerPolicy": {"action": "Shrink"}}, **spec)
    del body["spec"]["replicas"]
    body["spec"]["elastic"] = {"minReplicas": minimum, "maxReplicas": maximum}
    return parse_job(body)


def test_shrink_is_an_elastic_jobs_and_refused_for_a_kueue_job() -> None:
    assert elastic_shrink_job().run_policy.straggler.action == "Shrink"
    manifest = job_object(runPolicy={"stragglerPolicy": {"action": "Shrink"}})
    del manifest["spec"]["replicas"]
    manifest["spec"]["elastic"] = {"minReplicas": 2, "maxReplicas": 3}
    manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    with pytest.raises(SpecError, match="Shrink is not available to a job queued by Kueue"):
        parse_job(manifest)


def test_defaults() -> None:
    policy = job_spec(runPolicy={"stragglerPolicy": {"action": "Replace"}}).run_policy.straggler
    assert (policy.action, policy.slowdown, policy.sustained_seconds, policy.max_replacements) == (
        "Replace",
        2.0,
        120,
        2,
    )


# ---- the decision -----------------------------------------------------------------------------------


def observed(seen: tracker.StragglerSighting) -> tracker.ProgressObservation:
    return tracker.ProgressObservation(attempt=0, step=500, step_changed_at=at(599), straggler=seen)


def replace_job(**policy: Any) -> Any:
    return job_spec(replicas=3, runPolicy={"stragglerPolicy": {"action": "Replace", **policy}})


def test_a_sustained_straggler_is_replaced_alone_away_from_its_node_spending_no_restart() -> None:
    status = {**RUNNING_STATUS, "replicas": 3, "restarts": 1}
    decision = decide(
        replace_job(), status, observe(pod(0), pod(1), pod(2)), at(600), observed=observed(sighting())
    )
    assert decision.delete.pods == ("mnist-1-0",)
    assert decision.create.replacements == ((1, 1),)
    written = decision.report.status
    assert written["restarts"] == 1, "a slow pod did not fail: no backoffLimit spent"
    assert (written["stragglerReplacements"], written["avoidedNodes"], written["podReplacements"]) == (
        1,
        ["node-1"],
        1,
    )
    assert written["lastRestart"]["cause"] == "StragglerReplaced" and written["lastRestart"]["rank"] == 1
    (event,) = decision.report.notices
    assert (
        event.reason == "StragglerReplaced"
        and "node-1" in event.message
        and "no restart spent" in event.message
    )


def test_report_and_a_short_sighting_replace_nothing_and_wake_when_due() -> None:
    pods = observe(pod(0), pod(1), pod(2))
    status = {**RUNNING_STATUS, "replicas": 3}
    reported = decide(job_spec(replicas=3), status, pods, at(600), observed=observed(sighting()))
    assert reported.delete.pods == () and reported.create.replacements == ()
    early = decide(replace_job(), status, pods, at(100), observed=observed(sighting()))
    assert early.delete.pods == () and early.create.replacements == ()
    assert early.requeue_after is not None and early.requeue_after <= 20.0, "looked at again when it is due"


def test_past_the_bound_the_straggler_is_reported_with_a_note_and_one_event() -> None:
    # Rank 1's second replacement, in the group since a round that formed with it, slow again.
    pods = observe(pod(0), pod(1, replacement=2), pod(2))
    status = {
        **RUNNING_STATUS,
        "replicas": 3,
        "stragglerReplacements": 2,
        "avoidedNodes": ["node-7", "node-8"],
    }
    held = decide(replace_job(), status, pods, at(600), observed=observed(sighting(group_since=10)))
    assert held.delete.pods == () and held.create.replacements == ()
    note = held.report.status["straggler"]["note"]
    assert "maxReplacements" in note
    assert [n.reason for n in held.report.notices] == ["Straggler", "StragglerNotReplaced"]
    again = decide(
        replace_job(), held.report.status, pods, at(615), observed=observed(sighting(group_since=10))
    )
    assert again.report.notices == (), "said once while it lasts"
    assert again.report.status["avoidedNodes"] == ["node-7", "node-8"], "kept"


def test_a_rank_the_health_check_found_slow_is_replaced_alone_spending_no_restart() -> None:
    pods = observe(pod(0), pod(1), pod(2))
    seen = tracker.ProgressObservation(attempt=0, step=3, step_changed_at=at(599), health=check(rank=2))
    decision = decide(replace_job(), {**RUNNING_STATUS, "replicas": 3}, pods, at(600), observed=seen)
    assert decision.delete.pods == ("mnist-2-0",) and decision.create.replacements == ((2, 1),)
    written = decision.report.status
    assert written["restarts"] == 0 and written["avoidedNodes"] == ["node-2"]
    (event,) = decision.report.notices
    assert event.reason == "StragglerReplaced" and "health check" in event.message, event.message
    # Read again once the replacement runs, before its own check: the old verdict is not about it.
    after = observe(pod(0), pod(1), pod(2, replacement=1, created=601))
    again = decide(replace_job(), written, after, at(620), observed=seen)
    assert again.delete.pods == () and again.create.replacements == ()


def test_a_replacement_is_not_shown_as_the_straggler_for_its_predecessors_windows() -> None:
    # Seen on kind: status.straggler named rank 1's new pod 9.4x slow, the old pod's sighting.
    status = {**RUNNING_STATUS, "replicas": 3, "stragglerReplacements": 1, "podReplacements": 1}
    pods = observe(pod(0), pod(1, replacement=1, created=500), pod(2))
    before = decide(replace_job(), status, pods, at(600), observed=observed(sighting()))
    assert "straggler" not in before.report.status and before.report.notices == ()
    # Once a round formed with it, a sighting of its rank is its own.
    joined = decide(replace_job(), status, pods, at(600), observed=observed(sighting(group_since=520)))
    assert joined.report.status["straggler"]["pod"] == "mnist-1-0r1"
    assert [n.reason for n in joined.report.notices] == ["Straggler"]


SHRINK = StragglerPolicy(action="Shrink")


# (can the group lose a pod and keep minReplicas?) -> (the pod's rank moved, or None; held?)
SHRINK_CASES = [
    pytest.param(True, (1, False), id="above-the-minimum-the-pod-goes"),
    pytest.param(False, (None, True), id="at-the-minimum-reported-only"),
]


@pytest.mark.parametrize(("shrinkable", "expected"), SHRINK_CASES)
def test_shrink_acts_only_while_the_group_keeps_its_minimum(
    shrinkable: bool, expected: tuple[int | None, bool]
) -> None:
    verdict = straggler.verdict(SHRINK, sighting(), running(1), at(600), 0, shrinkable=shrinkable)
    assert (verdict.replace.rank if verdict.replace else None, verdict.held is not None) == expected
    if verdict.held is not None:
        assert "minReplicas" in verdict.held
    else:
        assert "trains on without it" in verdict.text


def test_an_elastic_jobs_straggler_under_shrink_goes_and_its_replacement_may_not_use_that_node() -> None:
    job = elastic_shrink_job()
    pods = observe(pod(0), pod(1), pod(2))
    status = {**RUNNING_STATUS, "replicas": 3}
    seen = tracker.ProgressObservation(
        attempt=0,
        step=500,
        step_changed_at=at(599),
        straggler=sighting(),
        rank_pods={0: "mnist-0-0", 1: "mnist-1-0", 2: "mnist-2-0"},
    )
    decision = decide(job, status, pods, at(600), observed=seen)
    assert decision.delete.pods == ("mnist-1-0",) and decision.create.replacements == ((1, 1),)
    written = decision.report.status
    assert written["avoidedNodes"] == ["node-1"] and written.get("restarts", 0) == 0
    (event,) = decision.report.notices
    assert event.reason == "StragglerReplaced" and "trains on without it" in event.message
    built = builders.build_rank_pod(job, 1, 0, replacement=1, avoid_nodes=("node-1",))
    affinity = built["spec"]["affinity"]["nodeAffinity"]
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [AVOID_NODE_1]}]
    }
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in affinity
    # Two pods running of min 2: the group cannot lose one, so the straggler is reported only.
    short = observe(pod(0), pod(1))
    held = decide(job, {**status, "replicas": 2}, short, at(600), observed=seen)
    assert held.delete.pods == () and "minReplicas" in held.report.status["straggler"]["note"]


def test_rank_0_is_replaced_like_any_other_except_where_it_is_special() -> None:
    pods = observe(pod(0), pod(1), pod(2))
    seen = observed(sighting(rank=0))
    replaced = decide(replace_job(), {**RUNNING_STATUS, "replicas": 3}, pods, at(600), observed=seen)
    assert replaced.delete.pods == ("mnist-0-0",) and replaced.create.replacements == ((0, 1),)
    # Where rank 0 is special, it is reported only: without a rendezvous pod
    # (policies.recovery.rendezvous_apart), and under Shrink, whose new pod 0 may find no node.
    for policy, rank0 in ((REPLACE, False), (SHRINK, True)):
        held = straggler.verdict(policy, sighting(rank=0), pods[0], at(600), 0, rank0=rank0)
        assert held.replace is None and held.held is not None and "rank 0's" in held.held, policy


# ---- the pods built after it --------------------------------------------------------------------------

AVOID = {
    "weight": 100,
    "preference": {
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["a", "b"]}]
    },
}
AFFINITY_CASES = [
    pytest.param(None, [AVOID], id="no-affinity"),
    pytest.param(
        {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 5, "preference": {"matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["z1"]}]}}],
         "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}},
        [{"weight": 5, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}},
         AVOID],
        id="beside-the-templates-own",
    ),
]  # fmt: skip


AVOID_NODE_1 = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-1"]}
POOL = {"key": "pool", "operator": "In", "values": ["gpu"]}
ZONE = {"key": "zone", "operator": "In", "values": ["z1"]}
# Shrink: the template's required terms (ORed) -> each with the avoided nodes ANDed in.
REQUIRED_CASES = [
    pytest.param(None, [{"matchExpressions": [AVOID_NODE_1]}], id="no-affinity-one-term"),
    pytest.param(
        [{"matchExpressions": [POOL]}, {"matchExpressions": [ZONE]}],
        [{"matchExpressions": [POOL, AVOID_NODE_1]}, {"matchExpressions": [ZONE, AVOID_NODE_1]}],
        id="joined-to-every-term",
    ),
    pytest.param(
        [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}]}],
        [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}],
          "matchExpressions": [AVOID_NODE_1]}],
        id="a-fields-only-term",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("terms", "expected"), REQUIRED_CASES)
def test_under_shrink_a_pod_built_after_a_replacement_requires_other_nodes(
    terms: list[dict[str, Any]] | None, expected: list[dict[str, Any]]
) -> None:
    template: dict[str, Any] = {"spec": {"containers": [{"name": "trainer", "image": "ddp-trainer:1"}]}}
    if terms is not None:
        template["spec"]["affinity"] = {
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
        }
    job = elastic_shrink_job(template=template)
    built = builders.build_rank_pod(job, 1, 0, replacement=1, avoid_nodes=("node-1",))
    required = built["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required["nodeSelectorTerms"] == expected
    assert job.template["spec"].get("affinity") == template["spec"].get("affinity"), (
        "the job's template untouched"
    )


@pytest.mark.parametrize(("node_affinity", "expected"), AFFINITY_CASES)
def test_a_pod_built_after_a_replacement_prefers_other_nodes(
    node_affinity: dict[str, Any] | None, expected: list[dict[str, Any]]
) -> None:
    template: dict[str, Any] = {"spec": {"containers": [{"name": "trainer", "image": "ddp-trainer:1"}]}}
    if node_affinity is not None:
        template["spec"]["affinity"] = {"nodeAffinity": node_affinity}
    built = builders.build_rank_pod(job_spec(template=template), 1, 0, replacement=1, avoid_nodes=("b", "a"))
    affinity = built["spec"]["affinity"]["nodeAffinity"]
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"] == expected
    if node_affinity is not None:
        required = node_affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        assert affinity["requiredDuringSchedulingIgnoredDuringExecution"] == required, (
            "the template's own kept"
        )
    assert "affinity" not in builders.build_rank_pod(job_spec(), 1, 0)["spec"], "no node to avoid: untouched"
