"""Gang scheduling in the pure builders: Kueue's plain-pod group labels on the rank pods, and the
in-tree Workload/PodGroup adapter (gang.py), for every mode and served API version."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from tests.unit.kube_factories import JOB_UID, job_object

from ddp_operator import builders, gang, names
from ddp_operator.spec import JobSpec, SpecError, parse_job

pytestmark = pytest.mark.unit

QUEUE = names.KUEUE_QUEUE_LABEL
PRIORITY = names.KUEUE_PRIORITY_CLASS_LABEL
GROUP = names.KUEUE_POD_GROUP_LABEL
TOTAL = names.KUEUE_POD_GROUP_TOTAL_COUNT_ANNOTATION
V1ALPHA2 = "scheduling.k8s.io/v1alpha2"


def job_with(
    job_labels: dict[str, Any] | None = None,
    template_labels: dict[str, Any] | None = None,
    name: str = "mnist",
    uid: str = JOB_UID,
    **spec: Any,
) -> JobSpec:
    obj = job_object(name, **spec)
    obj["metadata"]["uid"] = uid
    if job_labels is not None:
        obj["metadata"]["labels"] = job_labels
    if template_labels is not None:
        obj["spec"]["template"]["metadata"] = {"labels": template_labels}
    return parse_job(obj)


# ---- Kueue: parsing the labels ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("job_labels", "template_labels", "queue", "priority"),
    [
        pytest.param(None, None, None, None, id="no-queue"),
        pytest.param({"team": "a"}, None, None, None, id="unrelated-labels"),
        pytest.param({QUEUE: "gpu"}, None, "gpu", None, id="job-label"),
        pytest.param({QUEUE: "gpu", PRIORITY: "high"}, None, "gpu", "high", id="job-label-with-priority"),
        pytest.param(None, {QUEUE: "tmpl"}, "tmpl", None, id="template-label-only"),
        pytest.param({QUEUE: "job"}, {QUEUE: "tmpl"}, "job", None, id="job-label-wins"),
        pytest.param({QUEUE: "gpu"}, {PRIORITY: "low"}, "gpu", "low", id="priority-from-template"),
        pytest.param({PRIORITY: "high"}, None, None, None, id="priority-alone-asks-for-nothing"),
    ],
)
def test_kueue_labels_are_parsed(
    job_labels: dict[str, Any] | None,
    template_labels: dict[str, Any] | None,
    queue: str | None,
    priority: str | None,
) -> None:
    job = job_with(job_labels, template_labels)
    if queue is None:
        assert job.kueue is None
    else:
        assert job.kueue is not None
        assert (job.kueue.queue_name, job.kueue.priority_class) == (queue, priority)


@pytest.mark.parametrize(
    ("job_labels", "template_labels", "field"),
    [
        pytest.param({QUEUE: ""}, None, f"metadata.labels['{QUEUE}']", id="empty-job-queue"),
        pytest.param(None, {QUEUE: 3}, f"spec.template.metadata.labels['{QUEUE}']", id="non-string"),
    ],
)
def test_invalid_kueue_labels_name_the_field(
    job_labels: dict[str, Any] | None, template_labels: dict[str, Any] | None, field: str
) -> None:
    with pytest.raises(SpecError) as caught:
        job_with(job_labels, template_labels)
    assert caught.value.field == field


# ---- Kueue: the rank pods -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "attempt"),
    [
        pytest.param(0, 0, id="rank0-attempt0"),
        pytest.param(3, 0, id="rank3-attempt0"),
        pytest.param(0, 5, id="rank0-attempt5"),
        pytest.param(3, 7, id="rank3-attempt7"),
    ],
)
def test_every_rank_pod_of_every_attempt_joins_the_same_kueue_group(rank: int, attempt: int) -> None:
    job = job_with({QUEUE: "gpu-queue"}, replicas=4)
    pod = builders.build_rank_pod(job, rank, attempt)
    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels[QUEUE] == "gpu-queue"
    assert labels[GROUP] == "mnist-uid1234", "one group per job, the same for every rank and attempt"
    assert annotations[TOTAL] == "4"
    assert PRIORITY not in labels
    # Kueue's own additions are its webhook's, never ours.
    assert "schedulingGates" not in pod["spec"] and "nodeName" not in pod["spec"]
    assert "finalizers" not in pod["metadata"]
    assert names.KUEUE_MANAGED_LABEL not in labels
    # Our own labels still hold.
    assert (labels[names.LABEL_RANK], labels[names.LABEL_ATTEMPT]) == (str(rank), str(attempt))


def test_kueue_priority_class_is_copied_and_template_annotations_kept() -> None:
    obj = job_object(replicas=2)
    obj["metadata"]["labels"] = {QUEUE: "q", PRIORITY: "high"}
    obj["spec"]["template"]["metadata"] = {"annotations": {"team": "vision"}}
    pod = builders.build_rank_pod(parse_job(obj), 1, 0)
    assert pod["metadata"]["labels"][PRIORITY] == "high"
    assert pod["metadata"]["annotations"] == {"team": "vision", TOTAL: "2"}


def test_a_template_group_label_cannot_split_the_gang() -> None:
    job = job_with({QUEUE: "q"}, {GROUP: "users-own", "app": "x"})
    pod = builders.build_rank_pod(job, 0, 0)
    assert pod["metadata"]["labels"][GROUP] == names.kueue_pod_group_name("mnist", JOB_UID)
    assert pod["metadata"]["labels"]["app"] == "x"


def test_without_a_queue_pods_carry_no_kueue_metadata() -> None:
    pod = builders.build_rank_pod(job_with(), 0, 0)
    assert not [key for key in pod["metadata"]["labels"] if key.startswith("kueue.x-k8s.io/")]
    assert "annotations" not in pod["metadata"]


@pytest.mark.parametrize(
    ("job", "uid", "expected"),
    [
        pytest.param("mnist", "0b6d3f5e-1111-2222-3333-444455556666", "mnist-0b6d3f5e", id="short-name"),
        pytest.param("mnist", "", "mnist", id="no-uid-local-run"),
        pytest.param("a" * 54, "0b6d3f5e-1111", "a" * 54 + "-0b6d3f5e", id="exactly-63"),
        pytest.param("a" * 58, "0b6d3f5e-1111", "a" * 58 + "-0b6d", id="longest-job-keeps-4"),
    ],
)
def test_kueue_group_names_are_label_values(job: str, uid: str, expected: str) -> None:
    name = names.kueue_pod_group_name(job, uid)
    assert name == expected
    assert len(name) <= names.DNS_LABEL_MAX


def test_a_recreated_job_of_the_same_name_gets_another_group() -> None:
    first = job_with({QUEUE: "q"}, uid="11111111-aaaa")
    second = job_with({QUEUE: "q"}, uid="22222222-bbbb")
    groups = {builders.build_rank_pod(job, 0, 0)["metadata"]["labels"][GROUP] for job in (first, second)}
    assert len(groups) == 2


def test_kueue_labels_change_the_spec_hash_only_when_set() -> None:
    plain, queued = job_with(), job_with({QUEUE: "q"})
    assert builders.spec_hash(plain) == builders.spec_hash(job_with({"team": "a"}))
    assert builders.spec_hash(plain) != builders.spec_hash(queued)


# ---- the in-tree gang API -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group_versions", "expected"),
    [
        pytest.param([], None, id="nothing"),
        pytest.param(["scheduling.k8s.io/v1", "batch/v1"], None, id="only-priorityclasses"),
        pytest.param(["scheduling.k8s.io/v1alpha1"], None, id="1.35-v1alpha1-not-supported"),
        pytest.param(["scheduling.k8s.io/v1", V1ALPHA2], "v1alpha2", id="1.36-v1alpha2"),
        pytest.param(["scheduling.k8s.io/v1beta1"], None, id="1.37-v1beta1-not-yet"),
    ],
)
def test_served_version_from_discovery(group_versions: list[str], expected: str | None) -> None:
    assert gang.served_version(group_versions) == expected


@pytest.mark.parametrize(
    ("mode", "version", "has_gang", "problem"),
    [
        pytest.param("Auto", "v1alpha2", True, False, id="auto-served"),
        pytest.param("Auto", None, False, False, id="auto-not-served"),
        pytest.param("Workload", "v1alpha2", True, False, id="workload-served"),
        pytest.param("Workload", None, False, True, id="workload-not-served"),
        pytest.param("None", "v1alpha2", False, False, id="none-served"),
        pytest.param("None", None, False, False, id="none-not-served"),
    ],
)
def test_gang_modes(mode: str, version: str | None, has_gang: bool, problem: bool) -> None:
    job = job_with(scheduling={"gang": mode})
    assert (gang.gang_objects(job, 0, version) is not None) is has_gang
    assert gang.wants_gang(job, version) is has_gang
    reason = gang.unavailable_reason(job, version)
    assert (reason is not None) is problem
    if reason:
        assert "GenericWorkload" in reason and "scheduling.k8s.io/v1alpha2" in reason


@pytest.mark.parametrize(("replicas", "attempt"), [(1, 0), (3, 0), (3, 2), (4096, 11)])
def test_v1alpha2_workload_and_pod_group(replicas: int, attempt: int) -> None:
    job = job_with(replicas=replicas)
    objects = gang.gang_objects(job, attempt, "v1alpha2")
    assert objects is not None
    name = f"mnist-{attempt}"
    owner = [builders.owner_reference(job)]
    labels = {**names.job_selector("mnist"), names.LABEL_ATTEMPT: str(attempt)}
    policy = {"gang": {"minCount": replicas}}
    assert objects.api_version == V1ALPHA2
    assert objects.workload == {
        "apiVersion": V1ALPHA2,
        "kind": "Workload",
        "metadata": {"name": name, "namespace": "team-a", "labels": labels, "ownerReferences": owner},
        "spec": {
            "controllerRef": {"apiGroup": "ddp.dev", "kind": "DDPJob", "name": "mnist"},
            "podGroupTemplates": [{"name": "ranks", "schedulingPolicy": policy}],
        },
    }
    assert objects.pod_group == {
        "apiVersion": V1ALPHA2,
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": "team-a", "labels": labels, "ownerReferences": owner},
        "spec": {
            "podGroupTemplateRef": {"workload": {"workloadName": name, "podGroupTemplateName": "ranks"}},
            "schedulingPolicy": policy,
        },
    }
    assert objects.pod_spec_patch == {"schedulingGroup": {"podGroupName": name}}


def test_each_attempt_has_its_own_pod_group() -> None:
    job = job_with(replicas=2)
    first, second = (gang.gang_objects(job, attempt, "v1alpha2") for attempt in (0, 1))
    assert first is not None and second is not None
    assert first.pod_spec_patch != second.pod_spec_patch
    assert first.pod_group["metadata"]["name"] != second.pod_group["metadata"]["name"]


def test_the_pod_spec_patch_joins_the_rank_pods_to_the_group() -> None:
    job = job_with({QUEUE: "q"}, replicas=2)
    objects = gang.gang_objects(job, 1, "v1alpha2")
    assert objects is not None
    pod = builders.build_rank_pod(job, 1, 1, pod_spec_patch=objects.pod_spec_patch)
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "mnist-1"}
    # Kueue and the in-tree gang together: Kueue admits the group, the scheduler places it whole.
    assert pod["metadata"]["labels"][GROUP] == names.kueue_pod_group_name("mnist", JOB_UID)
    patched = copy.deepcopy(objects.pod_spec_patch)
    pod["spec"]["schedulingGroup"]["podGroupName"] = "changed"
    assert objects.pod_spec_patch == patched, "the patch is copied into the pod, not shared"
    assert "schedulingGroup" not in builders.build_rank_pod(job, 1, 1)["spec"]


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        pytest.param({}, (None, ""), id="no-status"),
        pytest.param({"conditions": [{"type": "Other", "status": "True"}]}, (None, ""), id="other"),
        pytest.param(
            {"conditions": [{"type": "PodGroupScheduled", "status": "True", "reason": "Scheduled"}]},
            (True, ""),
            id="scheduled",
        ),
        pytest.param(
            {
                "conditions": [
                    {
                        "type": "PodGroupScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/4 nodes",
                    }
                ]
            },
            (False, "Unschedulable: 0/4 nodes"),
            id="unschedulable",
        ),
    ],
)
def test_pod_group_scheduled(status: dict[str, Any], expected: tuple[bool | None, str]) -> None:
    assert gang.pod_group_scheduled({"status": status}) == expected
