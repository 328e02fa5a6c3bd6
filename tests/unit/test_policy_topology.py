"""spec.scheduling.topology (policies/topology.py): the path per cluster, what each path writes on the
pods and the PodGroup, the refusal, and the placement read back (docs/scheduling.md#topology)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import JOB_UID, job_object, job_spec

from ddp_operator import builders, gang, names
from ddp_operator.policies import topology
from ddp_operator.spec import SpecError, parse_job

pytestmark = pytest.mark.unit

QUEUE_LABELS = {names.KUEUE_QUEUE_LABEL: "team-a-gpus"}


def topo_job(
    kind: str | None, key: str = "example.com/rack", *, queued: bool = False, gang_mode: str = "Auto"
) -> Any:
    scheduling: dict[str, Any] = {"gang": gang_mode}
    if kind is not None:
        scheduling["topology"] = {kind: key}
    body = job_object(scheduling=scheduling, replicas=4)
    if queued:
        body["metadata"]["labels"] = dict(QUEUE_LABELS)
    return parse_job(body)


@pytest.mark.parametrize(
    ("kind", "queued", "in_tree_gang", "in_tree_topology", "path", "refused"),
    [
        pytest.param(None, False, True, True, None, False, id="no-topology"),
        pytest.param("required", True, True, True, "Kueue", False, id="required-queued-kueue-wins"),
        pytest.param("preferred", True, False, False, "Kueue", False, id="preferred-queued"),
        pytest.param("required", False, True, True, "PodGroup", False, id="required-in-tree"),
        pytest.param("required", False, True, False, None, True, id="required-gate-off-refused"),
        pytest.param("required", False, False, False, None, True, id="required-no-gang-api-refused"),
        pytest.param("preferred", False, True, True, "Affinity", False, id="preferred-in-tree-is-affinity"),
        pytest.param("preferred", False, False, False, "Affinity", False, id="preferred-nothing-served"),
    ],
)
def test_the_path_follows_what_the_cluster_offers(
    kind: str | None,
    queued: bool,
    in_tree_gang: bool,
    in_tree_topology: bool,
    path: str | None,
    refused: bool,
) -> None:
    plan = topology.plan(
        topo_job(kind, queued=queued), in_tree_gang=in_tree_gang, in_tree_topology=in_tree_topology
    )
    assert (plan.path, plan.refusal is not None) == (path, refused)


@pytest.mark.parametrize(
    ("gang_mode", "in_tree_gang", "in_tree_topology", "why"),
    [
        pytest.param("None", False, False, "spec.scheduling.gang is None", id="gang-none"),
        pytest.param("Auto", False, False, "does not serve the in-tree gang API", id="api-not-served"),
        pytest.param(
            "Auto", True, False, "TopologyAwareWorkloadScheduling feature gate is off", id="gate-off"
        ),
    ],
)
def test_a_refusal_names_the_field_why_and_every_way_out(
    gang_mode: str, in_tree_gang: bool, in_tree_topology: bool, why: str
) -> None:
    plan = topology.plan(
        topo_job("required", gang_mode=gang_mode),
        in_tree_gang=in_tree_gang,
        in_tree_topology=in_tree_topology,
    )
    assert plan.refusal is not None
    for part in ("spec.scheduling.topology.required", why, names.KUEUE_QUEUE_LABEL, "preferred"):
        assert part in plan.refusal


@pytest.mark.parametrize(
    ("kind", "annotation"),
    [
        pytest.param("required", "kueue.x-k8s.io/podset-required-topology", id="required"),
        pytest.param("preferred", "kueue.x-k8s.io/podset-preferred-topology", id="preferred"),
    ],
)
def test_a_queued_job_asks_kueue_for_the_topology_with_ranks_in_order(kind: str, annotation: str) -> None:
    job = topo_job(kind, queued=True)
    pods = [builders.build_rank_pod(job, rank, 0) for rank in range(job.replicas)]
    for pod in pods:
        annotations = pod["metadata"]["annotations"]
        assert annotations[annotation] == "example.com/rack"
        # Kueue reads each pod's index from the label this names: our rank.
        label = annotations["kueue.x-k8s.io/pod-group-pod-index-label"]
        assert label == names.LABEL_RANK
        assert pod["metadata"]["labels"][label] == pod["metadata"]["labels"][names.LABEL_RANK]
        # Kueue places the pods; no affinity of ours competes with its node selectors.
        assert "podAffinity" not in (pod["spec"].get("affinity") or {})
    # Identical on every pod of the group, as Kueue requires.
    assert len({tuple(sorted(p["metadata"]["annotations"].items())) for p in pods}) == 1


def test_the_in_tree_path_constrains_the_pod_group_only_where_the_apiserver_keeps_it() -> None:
    job = topo_job("required")
    served = gang.gang_objects(job, 0, "v1alpha2", topology_served=True)
    dropped = gang.gang_objects(job, 0, "v1alpha2", topology_served=False)
    assert served is not None and dropped is not None
    assert served.pod_group["spec"]["schedulingConstraints"] == {"topology": [{"key": "example.com/rack"}]}
    assert "schedulingConstraints" not in dropped.pod_group["spec"]
    # The pods carry no topology of their own: the group's constraint places them (replacements too).
    pod = builders.build_rank_pod(job, 1, 0, pod_spec_patch=served.pod_spec_patch)
    assert "podAffinity" not in (pod["spec"].get("affinity") or {})
    assert not any(key.startswith("kueue.x-k8s.io/") for key in pod["metadata"].get("annotations") or {})


def test_a_queued_job_gets_no_pod_group_constraint_kueue_places_it() -> None:
    objects = gang.gang_objects(topo_job("required", queued=True), 0, "v1alpha2", topology_served=True)
    assert objects is not None
    assert "schedulingConstraints" not in objects.pod_group["spec"]


def test_the_affinity_path_keeps_the_templates_affinity_and_prefers_the_jobs_own_domain() -> None:
    own = {
        "weight": 5,
        "podAffinityTerm": {"labelSelector": {"matchLabels": {"x": "y"}}, "topologyKey": "zone"},
    }
    body = job_object(
        scheduling={"topology": {"preferred": "example.com/rack"}},
        template={
            "spec": {
                "containers": [{"name": "trainer", "image": "ddp-trainer:1"}],
                "affinity": {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [own]}},
            }
        },
    )
    pod = builders.build_rank_pod(parse_job(body), 1, 0)
    terms = pod["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == own
    assert terms[1] == {
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {
                "matchLabels": {names.LABEL_JOB_UID: JOB_UID},
                "matchExpressions": [{"key": names.LABEL_RANK, "operator": "Exists"}],
            },
            "topologyKey": "example.com/rack",
        },
    }


@pytest.mark.parametrize(
    ("topology_field", "error_path"),
    [
        pytest.param({}, "spec.scheduling.topology", id="neither"),
        pytest.param({"required": "rack", "preferred": "rack"}, "spec.scheduling.topology", id="both"),
        pytest.param({"required": "not a key"}, "spec.scheduling.topology.required", id="bad-key"),
        pytest.param({"preferred": 3}, "spec.scheduling.topology.preferred", id="not-a-string"),
    ],
)
def test_a_bad_topology_names_its_field(topology_field: dict[str, Any], error_path: str) -> None:
    with pytest.raises(SpecError) as raised:
        job_spec(scheduling={"topology": topology_field})
    assert raised.value.field == error_path


@pytest.mark.parametrize(
    ("domains", "shown", "crossings"),
    [
        pytest.param({0: "r1"}, [("r1", "0")], 0, id="one-rank"),
        pytest.param({0: "r1", 1: "r1", 2: "r1", 3: "r1"}, [("r1", "0-3")], 0, id="one-domain"),
        pytest.param({0: "r1", 1: "r1", 2: "r2", 3: "r2"}, [("r1", "0-1"), ("r2", "2-3")], 2, id="in-order"),
        pytest.param(
            {0: "r1", 1: "r2", 2: "r1", 3: "r2"}, [("r1", "0,2"), ("r2", "1,3")], 4, id="interleaved"
        ),
        pytest.param(
            {0: "r2", 1: "r2", 2: "", 3: "r2", 4: "r2"},
            [("r2", "0-1,3-4"), ("", "2")],
            2,
            id="unlabelled-node",
        ),
    ],
)
def test_the_placement_names_each_domain_and_counts_ring_links_between_domains(
    domains: dict[int, str], shown: list[tuple[str, str]], crossings: int
) -> None:
    status = topology.status_of("rack", "PodGroup", topology.placement(domains))
    assert [(d["name"], d["ranks"]) for d in status["domains"]] == shown
    assert status["ringCrossings"] == crossings
    assert (status["key"], status["path"]) == ("rack", "PodGroup")


def test_the_probe_reads_whether_the_apiserver_kept_the_constraint() -> None:
    probe = gang.topology_probe("v1alpha2", "team-a")
    assert gang.topology_kept(probe)
    dropped = {**probe, "spec": {k: v for k, v in probe["spec"].items() if k != "schedulingConstraints"}}
    assert not gang.topology_kept(dropped)
    # No template reference: the apiserver's PodGroup admission then looks up no Workload.
    assert "podGroupTemplateRef" not in probe["spec"]
