"""The in-tree gang scheduling API behind one small adapter, picked by API discovery.

Kubernetes 1.36 serves (alpha, behind feature gates and a runtime-config) ``scheduling.k8s.io/v1alpha2``:
a ``Workload`` holds pod group templates, a ``PodGroup`` is the runtime instance the scheduler places
all-or-nothing (policy ``gang`` with ``minCount``), and a pod joins one with the immutable
``spec.schedulingGroup.podGroupName``. The shape changed in every release from 1.35 (v1alpha1,
``spec.workloadRef``) to 1.37 (v1beta1), so everything version-specific lives here and the caller
only passes the group versions the apiserver serves.

One Workload and one PodGroup per attempt, both ``<job>-<attempt>`` and owned by the DDPJob: the
template is immutable (a spec edit may change the gang size between attempts) and so is a pod's
group, so a new attempt never joins an older attempt's group. Pure functions, no client calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ddp_operator import names
from ddp_operator.builders import owner_reference
from ddp_operator.policies import topology
from ddp_operator.spec import JobSpec

GROUP: Final = "scheduling.k8s.io"
# Versions this adapter can write, most preferred first.
SUPPORTED_VERSIONS: Final = ("v1alpha2",)
WORKLOAD_KIND: Final = "Workload"
POD_GROUP_KIND: Final = "PodGroup"
WORKLOAD_PLURAL: Final = "workloads"
POD_GROUP_PLURAL: Final = "podgroups"
# The PodGroup condition the scheduler sets (True once the whole gang is placed; False with reason
# Unschedulable while it cannot be).
POD_GROUP_SCHEDULED_CONDITION: Final = "PodGroupScheduled"


@dataclass(frozen=True)
class GangObjects:
    """What one attempt needs: create ``workload`` then ``pod_group`` before the attempt's pods, and
    merge ``pod_spec_patch`` into every rank pod's spec (builders.build_rank_pod does)."""

    api_version: str
    workload: dict[str, Any]
    pod_group: dict[str, Any]
    pod_spec_patch: dict[str, Any]


def served_version(group_versions: Iterable[str]) -> str | None:
    """The ``scheduling.k8s.io`` version to use, from discovery's group versions (for instance the
    ``groupVersion`` strings of ``/apis``), or None when none this adapter knows is served."""
    served = set(group_versions)
    for version in SUPPORTED_VERSIONS:
        if f"{GROUP}/{version}" in served:
            return version
    return None


def wants_gang(job: JobSpec, version: str | None) -> bool:
    """Whether this job's attempts get a Workload and a PodGroup on a cluster serving ``version``."""
    return job.scheduling.gang != "None" and version in SUPPORTED_VERSIONS


def unavailable_reason(job: JobSpec, version: str | None) -> str | None:
    """Why a job that insists on the gang API (``gang: Workload``) cannot have it here; None when it
    can, or does not insist (``Auto`` quietly schedules pod by pod without the API)."""
    if job.scheduling.gang != "Workload" or version in SUPPORTED_VERSIONS:
        return None
    return (
        f"spec.scheduling.gang is Workload but the cluster serves none of "
        f"{', '.join(f'{GROUP}/{v}' for v in SUPPORTED_VERSIONS)}: enable the GenericWorkload feature "
        f"gate (kube-apiserver, kube-scheduler and kube-controller-manager), GangScheduling "
        f"(kube-scheduler) and "
        f"--runtime-config={GROUP}/{SUPPORTED_VERSIONS[0]}=true, or set spec.scheduling.gang to Auto"
    )


def _metadata(job: JobSpec, name: str, attempt: int) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": {**names.job_selector(job.name), names.LABEL_ATTEMPT: str(attempt)},
        "ownerReferences": [owner_reference(job)],
    }


def _v1alpha2(job: JobSpec, attempt: int, *, topology_served: bool) -> GangObjects:
    api_version = f"{GROUP}/v1alpha2"
    workload_name = names.gang_workload_name(job.name, attempt)
    pod_group_name = names.gang_pod_group_name(job.name, attempt)
    # A fixed-size DDP group cannot start without every rank: the gang's minimum is the whole job. An
    # elastic one trains on minReplicas pods, so the scheduler may bind those first (docs/elastic.md).
    policy: dict[str, Any] = {"gang": {"minCount": job.min_replicas}}
    workload = {
        "apiVersion": api_version,
        "kind": WORKLOAD_KIND,
        "metadata": _metadata(job, workload_name, attempt),
        "spec": {
            "controllerRef": {"apiGroup": names.API_GROUP, "kind": names.KIND, "name": job.name},
            "podGroupTemplates": [{"name": names.GANG_POD_GROUP_TEMPLATE, "schedulingPolicy": policy}],
        },
    }
    pod_group: dict[str, Any] = {
        "apiVersion": api_version,
        "kind": POD_GROUP_KIND,
        "metadata": _metadata(job, pod_group_name, attempt),
        "spec": {
            "podGroupTemplateRef": {
                "workload": {
                    "workloadName": workload_name,
                    "podGroupTemplateName": names.GANG_POD_GROUP_TEMPLATE,
                }
            },
            "schedulingPolicy": policy,
        },
    }
    constraints = topology.pod_group_constraints(job) if topology_served else None
    if constraints is not None:
        pod_group["spec"]["schedulingConstraints"] = constraints
    patch = {"schedulingGroup": {"podGroupName": pod_group_name}}
    return GangObjects(api_version, workload, pod_group, patch)


def gang_objects(
    job: JobSpec, attempt: int, version: str | None, *, topology_served: bool = False
) -> GangObjects | None:
    """The Workload, PodGroup and pod spec patch of one attempt, or None when the job does not use the
    in-tree gang here (``gang: None``, or no supported version served). ``version`` is
    served_version()'s answer for this cluster, ``topology_served`` topology_kept()'s."""
    if not wants_gang(job, version):
        return None
    return _v1alpha2(job, attempt, topology_served=topology_served)


# The node label the probe asks for: any valid key does, the probe object is never stored.
_PROBE_KEY: Final = "topology.kubernetes.io/zone"


def topology_probe(version: str, namespace: str) -> dict[str, Any]:
    """A PodGroup to create with ``dryRun=All``: the apiserver drops ``schedulingConstraints`` when its
    TopologyAwareWorkloadScheduling gate is off, so what comes back says whether the in-tree
    topology constraint is served (discovery cannot see feature gates)."""
    return {
        "apiVersion": f"{GROUP}/{version}",
        "kind": POD_GROUP_KIND,
        "metadata": {"name": "ddp-operator-topology-probe", "namespace": namespace},
        # No podGroupTemplateRef: the apiserver's PodGroup admission then needs no Workload.
        "spec": {
            "schedulingPolicy": {"gang": {"minCount": 1}},
            "schedulingConstraints": {"topology": [{"key": _PROBE_KEY}]},
        },
    }


def topology_kept(created: Mapping[str, Any]) -> bool:
    """Whether the apiserver kept the probe's topology constraint (topology_probe)."""
    constraints = (created.get("spec") or {}).get("schedulingConstraints") or {}
    return any(term.get("key") == _PROBE_KEY for term in constraints.get("topology") or ())


def pod_group_scheduled(pod_group: Mapping[str, Any]) -> tuple[bool | None, str]:
    """The scheduler's verdict on a PodGroup: (True, "") once placed, (False, message) while it
    cannot be placed, (None, "") before the scheduler has said anything."""
    for condition in (pod_group.get("status") or {}).get("conditions") or ():
        if condition.get("type") == POD_GROUP_SCHEDULED_CONDITION:
            placed = condition.get("status") == "True"
            message = "" if placed else f"{condition.get('reason', '')}: {condition.get('message', '')}"
            return placed, message.strip(": ")
    return None, ""
