"""Parse a DDPJob object into a typed, defaulted, validated ``JobSpec``.

The CRD already refuses most invalid manifests on a cluster; this parser repeats those checks so that
`ddpjob run` (no apiserver) refuses the same manifests with the same field paths, and so that the
operator never acts on an object that slipped past an older CRD.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

from ddp_operator import names

Backend = Literal["nccl", "gloo"]
RestartPolicy = Literal["Never", "OnFailure", "ExitCode"]
CleanPodPolicy = Literal["Running", "All", "None"]
# How a retried failure is recovered (docs/restarts.md): the pods stay and their launchers restart the
# workers (only a lost pod is replaced), or every pod of the gang is recreated.
RestartMode = Literal["InPlace", "Recreate"]
GangMode = Literal["Auto", "Workload", "None"]

BACKENDS: Final = ("auto", "nccl", "gloo")
RESTART_POLICIES: Final = ("Never", "OnFailure", "ExitCode")
CLEAN_POD_POLICIES: Final = ("Running", "All", "None")
RESTART_MODES: Final = ("InPlace", "Recreate")
RESTART_MODE_IN_PLACE: Final = "InPlace"
RESTART_MODE_RECREATE: Final = "Recreate"
GANG_MODES: Final = ("Auto", "Workload", "None")
DEFAULT_GANG_MODE: Final[GangMode] = "Auto"

DEFAULT_REPLICAS: Final = 1
DEFAULT_NPROC_PER_NODE: Final = 1
MAX_NPROC_PER_NODE: Final = 256
DEFAULT_RESTART_POLICY: Final[RestartPolicy] = "ExitCode"
DEFAULT_BACKOFF_LIMIT: Final = 3
MAX_BACKOFF_LIMIT: Final = 1000
# runPolicy.standbyPods: a few spares are what a failure every few minutes needs; each one holds a
# rank pod's resources (GPUs included) while it waits.
MAX_STANDBY_PODS: Final = 8
DEFAULT_CLEAN_POD_POLICY: Final[CleanPodPolicy] = "Running"
DEFAULT_RESTART_MODE: Final[RestartMode] = "InPlace"
DEFAULT_CHECKPOINT_MOUNT_PATH: Final = "/var/run/ddp/checkpoints"
DEFAULT_RENDEZVOUS_PORT: Final = 29500
DEFAULT_METRICS_PORT: Final = 9400
# An elastic job's survivors wait this long for a lost pod's replacement before they train without it.
# Survivors re-join a round within a second or two of each other; a lost pod's replacement cannot join
# before its pod starts (15 s and more). So a longer wait after a loss is idle time (docs/elastic.md,
# "Survivors never idle"), and the cost of forming without a slow starter is one grow later.
DEFAULT_REPLACEMENT_WAIT_SECONDS: Final = 5
MAX_REPLACEMENT_WAIT_SECONDS: Final = 3600
MAX_CONTAINERS: Final = 16


class SpecError(ValueError):
    """A manifest the operator cannot run; str() names the field path and the fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# The fields the CRD's schema declares, where it is closed (the template's pod spec is the apiserver's
# to check). tests/unit/test_spec.py keeps this in step with crds/ddp.dev_ddpjobs.yaml.
DECLARED_FIELDS: Final[Mapping[str, frozenset[str]]] = {
    "": frozenset({"apiVersion", "kind", "metadata", "spec", "status"}),
    "spec": frozenset(
        {
            "replicas",
            "nprocPerNode",
            "backend",
            "restartPolicy",
            "runPolicy",
            "template",
            "checkpoint",
            "rendezvousPort",
            "metrics",
            "networkPolicy",
            "scheduling",
            "elastic",
        }
    ),
    "spec.runPolicy": frozenset(
        {
            "backoffLimit",
            "activeDeadlineSeconds",
            "startupDeadlineSeconds",
            "stallTimeoutSeconds",
            "ttlSecondsAfterFinished",
            "cleanPodPolicy",
            "suspend",
            "restartMode",
            "stragglerPolicy",
            "standbyPods",
        }
    ),
    "spec.runPolicy.stragglerPolicy": frozenset(
        {"action", "slowdownPercent", "sustainedSeconds", "maxReplacements"}
    ),
    "spec.template": frozenset({"metadata", "spec"}),
    "spec.checkpoint": frozenset({"volumeClaimTemplate", "mountPath"}),
    "spec.metrics": frozenset({"enabled", "port"}),
    "spec.networkPolicy": frozenset({"enabled"}),
    "spec.scheduling": frozenset({"gang", "topology"}),
    "spec.scheduling.topology": frozenset({"required", "preferred"}),
    "spec.elastic": frozenset({"minReplicas", "maxReplicas", "replacementWaitSeconds"}),
}


def unknown_fields(manifest: Mapping[str, Any]) -> list[SpecError]:
    """Fields the schema does not declare, as kubectl's default ``--validate=strict`` refuses them.

    The apiserver would silently prune them otherwise: a typo such as ``spec.replica`` must not run a
    job of the default size. Each error suggests the closest declared name.
    """
    errors = []
    for path, declared in DECLARED_FIELDS.items():
        node: Any = manifest
        for key in path.split(".") if path else ():
            node = node.get(key) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            continue
        for key in node:
            if key in declared:
                continue
            close = difflib.get_close_matches(str(key), sorted(declared), n=1)
            hint = f"did you mean {'.'.join(filter(None, (path, close[0])))}?" if close else "remove it"
            field = ".".join(filter(None, (path, str(key))))
            errors.append(SpecError(field, f"unknown field (kubectl apply refuses it); {hint}"))
    return errors


# A stall is judged from scrapes; shorter than a few scrape intervals would read a slow step as a hang.
MIN_STALL_TIMEOUT_SECONDS: Final = 10


StragglerAction = Literal["Report", "Replace", "Shrink"]
STRAGGLER_ACTIONS: Final = ("Report", "Replace", "Shrink")
STRAGGLER_REPLACE: Final = "Replace"
# An elastic job's: the slow pod goes and its replacement may not land on that node, so the group trains
# on without it until another node is free, then grows back (docs/restarts.md, "Stragglers").
STRAGGLER_SHRINK: Final = "Shrink"
# The actions that move the slow rank's pod (Report only names it).
STRAGGLER_MOVES: Final = (STRAGGLER_REPLACE, STRAGGLER_SHRINK)
# Defaults of runPolicy.stragglerPolicy (docs/restarts.md, "Stragglers"): a rank that makes every step
# at least twice as long as it would be without it, for two minutes (eight reads at the operator's 15 s
# interval; a checkpoint or a neighbour's burst lasts seconds), is worth a pod's start; at most two such
# replacements a job, so a cluster-wide slowdown (every node slow) cannot churn pods.
DEFAULT_STRAGGLER_SLOWDOWN_PERCENT: Final = 200
DEFAULT_STRAGGLER_SUSTAINED_SECONDS: Final = 120
DEFAULT_STRAGGLER_MAX_REPLACEMENTS: Final = 2
# Below 1.5x the straggler is not even named (progress.tracker.STRAGGLER_THRESHOLD); shorter than a
# minute is a few reads, within the noise of a loaded node.
MIN_STRAGGLER_SLOWDOWN_PERCENT: Final = 150
MIN_STRAGGLER_SUSTAINED_SECONDS: Final = 60


@dataclass(frozen=True)
class StragglerPolicy:
    """What the operator does about a rank the others wait for (docs/restarts.md, "Stragglers")."""

    action: StragglerAction = "Report"
    slowdown_percent: int = DEFAULT_STRAGGLER_SLOWDOWN_PERCENT
    sustained_seconds: int = DEFAULT_STRAGGLER_SUSTAINED_SECONDS
    max_replacements: int = DEFAULT_STRAGGLER_MAX_REPLACEMENTS

    @property
    def slowdown(self) -> float:
        return self.slowdown_percent / 100.0


@dataclass(frozen=True)
class RunPolicy:
    backoff_limit: int = DEFAULT_BACKOFF_LIMIT
    active_deadline_seconds: int | None = None
    startup_deadline_seconds: int | None = None
    # No synchronized step for this long, once training started: Stalled (retried like a lost peer).
    stall_timeout_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    clean_pod_policy: CleanPodPolicy = DEFAULT_CLEAN_POD_POLICY
    suspend: bool = False
    restart_mode: RestartMode = DEFAULT_RESTART_MODE
    straggler: StragglerPolicy = field(default_factory=StragglerPolicy)
    # Pods kept started and ready beside the ranks, each taking a lost pod's rank when one is lost
    # (docs/restarts.md, "Standby pods").
    standby_pods: int = 0


# A PVC's access modes (docs/restarts.md, "Standby pods": which of them let a standby take rank 0).
ACCESS_MODE_RWO: Final = "ReadWriteOnce"
ACCESS_MODE_ROX: Final = "ReadOnlyMany"
ACCESS_MODE_RWX: Final = "ReadWriteMany"
ACCESS_MODE_RWOP: Final = "ReadWriteOncePod"


@dataclass(frozen=True)
class CheckpointSpec:
    volume_claim_template: Mapping[str, Any]
    mount_path: str = DEFAULT_CHECKPOINT_MOUNT_PATH

    @property
    def access_modes(self) -> tuple[str, ...]:
        """The claim's access modes as the operator creates it (ReadWriteOnce when none are given)."""
        modes = self.volume_claim_template.get("accessModes") or [ACCESS_MODE_RWO]
        return tuple(str(mode) for mode in modes)


@dataclass(frozen=True)
class MetricsSpec:
    enabled: bool = True
    port: int = DEFAULT_METRICS_PORT


@dataclass(frozen=True)
class NetworkPolicySpec:
    """Whether the operator creates the job's NetworkPolicy (builders.build_network_policy)."""

    enabled: bool = True


@dataclass(frozen=True)
class TopologySpec:
    """Where the gang must (``required``) or should land: in one domain of the node label ``key``
    (docs/scheduling.md, "Topology"; policies/topology.py translates it)."""

    key: str
    required: bool


@dataclass(frozen=True)
class SchedulingSpec:
    """How the gang is scheduled (docs/scheduling.md). ``gang``: ``Workload`` asks the scheduler for
    the whole gang through the in-tree Workload/PodGroup API, ``Auto`` does so when the cluster serves
    that API, ``None`` never does. ``topology``: spec.scheduling.topology, None when not set."""

    gang: GangMode = DEFAULT_GANG_MODE
    topology: TopologySpec | None = None


@dataclass(frozen=True)
class KueueSpec:
    """Kueue admission, asked for with the DDPJob label ``kueue.x-k8s.io/queue-name`` (or, failing
    that, the same label on the pod template); ``priority_class`` is Kueue's WorkloadPriorityClass
    label, copied to the pods when set."""

    queue_name: str
    priority_class: str | None = None


@dataclass(frozen=True)
class ElasticSpec:
    """An elastic job (docs/elastic.md): it trains on any number of pods from ``min_replicas`` to
    ``max_replicas``. It starts ``max_replicas`` pods; a lost pod whose replacement cannot start within
    ``replacement_wait_seconds`` leaves the others training without it, and it joins them again (the
    group grows back) once it runs."""

    min_replicas: int
    max_replicas: int
    replacement_wait_seconds: int = DEFAULT_REPLACEMENT_WAIT_SECONDS


@dataclass(frozen=True)
class JobSpec:
    name: str
    namespace: str
    uid: str
    generation: int
    replicas: int
    nproc_per_node: int
    world_size: int
    backend: Backend
    template: Mapping[str, Any]
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY
    run_policy: RunPolicy = field(default_factory=RunPolicy)
    checkpoint: CheckpointSpec | None = None
    rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT
    metrics: MetricsSpec = field(default_factory=MetricsSpec)
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec)
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)
    kueue: KueueSpec | None = None
    # Elastic jobs only; ``replicas`` is then ``elastic.max_replicas``, the pods the job asks for.
    elastic: ElasticSpec | None = None

    @property
    def min_replicas(self) -> int:
        """The fewest pods the job trains on: ``replicas`` unless it is elastic."""
        return self.elastic.min_replicas if self.elastic is not None else self.replicas


def _mapping(value: Any, path: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None:
        if required:
            raise SpecError(path, "is required")
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(path, f"must be an object, got {type(value).__name__}")
    return value


def _int(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    default: int | None,
    *,
    minimum: int,
    maximum: int | None = None,
) -> int | None:
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}.{key}", f"must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise SpecError(f"{path}.{key}", f"must be {bounds}, got {value}")
    return value


def _required_int(obj: Mapping[str, Any], key: str, path: str, default: int, **bounds: int) -> int:
    value = _int(obj, key, path, default, **bounds)
    assert value is not None
    return value


def _enum(obj: Mapping[str, Any], key: str, path: str, allowed: tuple[str, ...], default: str) -> str:
    value = obj.get(key, default)
    if value not in allowed:
        raise SpecError(f"{path}.{key}", f"must be one of {', '.join(allowed)}, got {value!r}")
    return cast(str, value)


def _bool(obj: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key}", f"must be true or false, got {value!r}")
    return value


def trainer_container(template: Mapping[str, Any]) -> Mapping[str, Any]:
    """The container named `trainer` of a (validated) pod template."""
    for container in template.get("spec", {}).get("containers", []):
        if container.get("name") == names.TRAINER_CONTAINER:
            return cast(Mapping[str, Any], container)
    raise SpecError("spec.template.spec.containers", f"needs a container named '{names.TRAINER_CONTAINER}'")


def _quantity_is_positive(value: Any) -> bool:
    text = str(value).strip()
    try:
        return float(text) > 0
    except ValueError:
        return text not in ("", "0")


def requests_gpu(container: Mapping[str, Any]) -> bool:
    """Whether the container's limits or requests name a positive count of nvidia.com/gpu."""
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        amounts = resources.get(section) or {}
        if names.GPU_RESOURCE in amounts and _quantity_is_positive(amounts[names.GPU_RESOURCE]):
            return True
    return False


def resolve_backend(requested: str, template: Mapping[str, Any]) -> Backend:
    if requested == "nccl" or (requested == "auto" and requests_gpu(trainer_container(template))):
        return "nccl"
    return "gloo"


def _validate_template(template: Mapping[str, Any]) -> None:
    pod_spec = _mapping(template.get("spec"), "spec.template.spec", required=True)
    containers = pod_spec.get("containers")
    if not isinstance(containers, list) or not containers:
        raise SpecError("spec.template.spec.containers", "must list at least one container")
    if len(containers) > MAX_CONTAINERS:
        raise SpecError("spec.template.spec.containers", f"may list at most {MAX_CONTAINERS} containers")
    seen: set[str] = set()
    for index, container in enumerate(containers):
        path = f"spec.template.spec.containers[{index}]"
        container = _mapping(container, path, required=True)
        name = container.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError(f"{path}.name", "is required")
        if name in seen:
            raise SpecError(f"{path}.name", f"duplicates the container name {name!r}")
        seen.add(name)
        image = container.get("image")
        if not isinstance(image, str) or not image.strip():
            raise SpecError(f"{path}.image", f"container {name!r} needs an image")
    if names.TRAINER_CONTAINER not in seen:
        raise SpecError(
            "spec.template.spec.containers",
            f"needs a container named '{names.TRAINER_CONTAINER}' (the DDP process); rename your training container",
        )


def _parse_run_policy(raw: Mapping[str, Any]) -> RunPolicy:
    path = "spec.runPolicy"
    return RunPolicy(
        backoff_limit=_required_int(
            raw, "backoffLimit", path, DEFAULT_BACKOFF_LIMIT, minimum=0, maximum=MAX_BACKOFF_LIMIT
        ),
        active_deadline_seconds=_int(raw, "activeDeadlineSeconds", path, None, minimum=1),
        startup_deadline_seconds=_int(raw, "startupDeadlineSeconds", path, None, minimum=1),
        stall_timeout_seconds=_int(raw, "stallTimeoutSeconds", path, None, minimum=MIN_STALL_TIMEOUT_SECONDS),
        ttl_seconds_after_finished=_int(raw, "ttlSecondsAfterFinished", path, None, minimum=0),
        clean_pod_policy=cast(
            CleanPodPolicy, _enum(raw, "cleanPodPolicy", path, CLEAN_POD_POLICIES, DEFAULT_CLEAN_POD_POLICY)
        ),
        suspend=_bool(raw, "suspend", path, False),
        restart_mode=cast(RestartMode, _enum(raw, "restartMode", path, RESTART_MODES, DEFAULT_RESTART_MODE)),
        straggler=_parse_straggler_policy(_mapping(raw.get("stragglerPolicy"), f"{path}.stragglerPolicy")),
        standby_pods=_required_int(raw, "standbyPods", path, 0, minimum=0, maximum=MAX_STANDBY_PODS),
    )


def _parse_straggler_policy(raw: Mapping[str, Any]) -> StragglerPolicy:
    path = "spec.runPolicy.stragglerPolicy"
    return StragglerPolicy(
        action=cast(StragglerAction, _enum(raw, "action", path, STRAGGLER_ACTIONS, "Report")),
        slowdown_percent=_required_int(
            raw, "slowdownPercent", path, DEFAULT_STRAGGLER_SLOWDOWN_PERCENT,
            minimum=MIN_STRAGGLER_SLOWDOWN_PERCENT, maximum=10000,
        ),
        sustained_seconds=_required_int(
            raw, "sustainedSeconds", path, DEFAULT_STRAGGLER_SUSTAINED_SECONDS,
            minimum=MIN_STRAGGLER_SUSTAINED_SECONDS, maximum=86400,
        ),
        max_replacements=_required_int(
            raw, "maxReplacements", path, DEFAULT_STRAGGLER_MAX_REPLACEMENTS, minimum=1, maximum=100
        ),
    )  # fmt: skip


def _parse_checkpoint(raw: Any) -> CheckpointSpec | None:
    if raw is None:
        return None
    checkpoint = _mapping(raw, "spec.checkpoint")
    claim = _mapping(
        checkpoint.get("volumeClaimTemplate"), "spec.checkpoint.volumeClaimTemplate", required=True
    )
    storage = ((claim.get("resources") or {}).get("requests") or {}).get("storage")
    if storage is None:
        raise SpecError(
            "spec.checkpoint.volumeClaimTemplate.resources.requests.storage", "is required (e.g. 10Gi)"
        )
    mount_path = checkpoint.get("mountPath", DEFAULT_CHECKPOINT_MOUNT_PATH)
    if not isinstance(mount_path, str) or not mount_path.startswith("/"):
        raise SpecError("spec.checkpoint.mountPath", f"must be an absolute path, got {mount_path!r}")
    return CheckpointSpec(volume_claim_template=copy.deepcopy(dict(claim)), mount_path=mount_path)


# A node label key: an optional DNS-subdomain prefix and "/", then a name of at most 63 characters.
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)


def _parse_topology(raw: Any) -> TopologySpec | None:
    if raw is None:
        return None
    topology = _mapping(raw, "spec.scheduling.topology")
    given = [
        (field_name, topology[field_name])
        for field_name in ("required", "preferred")
        if field_name in topology
    ]
    if len(given) != 1:
        raise SpecError(
            "spec.scheduling.topology",
            "needs exactly one of required or preferred (a node label key such as topology.kubernetes.io/rack)",
        )
    field_name, key = given[0]
    path = f"spec.scheduling.topology.{field_name}"
    if not isinstance(key, str) or len(key) > 317 or not _LABEL_KEY.match(key):
        raise SpecError(path, f"must be a node label key such as topology.kubernetes.io/rack, got {key!r}")
    return TopologySpec(key=key, required=field_name == "required")


def _parse_scheduling(raw: Any) -> SchedulingSpec:
    scheduling = _mapping(raw, "spec.scheduling")
    return SchedulingSpec(
        gang=cast(GangMode, _enum(scheduling, "gang", "spec.scheduling", GANG_MODES, DEFAULT_GANG_MODE)),
        topology=_parse_topology(scheduling.get("topology")),
    )


def _label(labels: Mapping[str, Any], key: str, path: str) -> str | None:
    value = labels.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise SpecError(f"{path}['{key}']", f"must be a non-empty string, got {value!r}")
    return value


def _parse_kueue(metadata: Mapping[str, Any], template: Mapping[str, Any]) -> KueueSpec | None:
    """The job's labels win over the template's; a queue named only on the template still makes the
    whole gang one Kueue group (a lone pod label would make every rank a workload of its own)."""
    job_labels = _mapping(metadata.get("labels"), "metadata.labels")
    template_meta = _mapping(template.get("metadata"), "spec.template.metadata")
    template_labels = _mapping(template_meta.get("labels"), "spec.template.metadata.labels")

    def pick(key: str) -> str | None:
        return _label(job_labels, key, "metadata.labels") or _label(
            template_labels, key, "spec.template.metadata.labels"
        )

    queue = pick(names.KUEUE_QUEUE_LABEL)
    if queue is None:
        return None
    return KueueSpec(queue_name=queue, priority_class=pick(names.KUEUE_PRIORITY_CLASS_LABEL))


def _parse_elastic(spec: Mapping[str, Any], run_policy: RunPolicy) -> ElasticSpec | None:
    """spec.elastic, checked against the fields it excludes or needs (the CRD's CEL says the same)."""
    if spec.get("elastic") is None:
        return None
    path = "spec.elastic"
    raw = _mapping(spec.get("elastic"), path)
    if spec.get("replicas") is not None:
        raise SpecError(
            "spec.replicas",
            "an elastic job's size is spec.elastic.minReplicas..maxReplicas; remove spec.replicas",
        )
    bounds = {"minimum": 1, "maximum": names.MAX_REPLICAS}
    for key in ("minReplicas", "maxReplicas"):
        if raw.get(key) is None:
            raise SpecError(f"{path}.{key}", "is required")
    minimum = _required_int(raw, "minReplicas", path, 1, **bounds)
    maximum = _required_int(raw, "maxReplicas", path, 1, **bounds)
    if minimum > maximum:
        raise SpecError(
            f"{path}.minReplicas", f"must be at most spec.elastic.maxReplicas ({maximum}), got {minimum}"
        )
    if run_policy.restart_mode != RESTART_MODE_IN_PLACE:
        raise SpecError(
            "spec.runPolicy.restartMode",
            "an elastic job resizes its group in place: set it to InPlace (its default) or remove spec.elastic",
        )
    wait = _required_int(
        raw,
        "replacementWaitSeconds",
        path,
        DEFAULT_REPLACEMENT_WAIT_SECONDS,
        minimum=1,
        maximum=MAX_REPLACEMENT_WAIT_SECONDS,
    )
    return ElasticSpec(min_replicas=minimum, max_replicas=maximum, replacement_wait_seconds=wait)


def _check_standby_pods(
    run_policy: RunPolicy,
    replicas: int,
    queued: bool,
    elastic: bool,
    scheduling: SchedulingSpec,
    checkpoint: CheckpointSpec | None,
) -> None:
    """A standby takes a lost pod's rank in the survivors' rendezvous: it needs pods that restart in
    place at a rendezvous pod (InPlace, more than one pod), and ranks that are pod numbers (no elastic
    renumbering, no topology order); it may take rank 0, so it mounts the checkpoint claim, which a
    ReadWriteOncePod claim allows one pod only. The CRD refuses all of these but the Kueue one: a
    standby outside the job's Kueue pod group would run outside the queue's quota."""
    if run_policy.standby_pods == 0:
        return
    field = "spec.runPolicy.standbyPods"
    problems = [
        (run_policy.restart_mode != RESTART_MODE_IN_PLACE, "needs spec.runPolicy.restartMode InPlace (its default)"),
        (replicas < 2, "needs a job of at least 2 pods (a single pod has no survivor to join)"),
        (elastic, "is for fixed-size jobs: an elastic job trains on without a lost pod (spec.elastic)"),
        (scheduling.topology is not None, "needs ranks that follow the pod numbers: not with spec.scheduling.topology"),
        (queued, "is not available to a job queued by Kueue (a standby would run outside the queue's quota): drop "
         "the kueue.x-k8s.io/queue-name label, or set it to 0"),
        (checkpoint is not None and ACCESS_MODE_RWOP in checkpoint.access_modes,
         "needs a checkpoint claim that a standby can mount too (it may take rank 0): "
         "spec.checkpoint.volumeClaimTemplate.accessModes ReadWriteOncePod allows one pod only; use "
         "ReadWriteMany (or ReadWriteOnce: standbys then run on rank 0's node), or set standbyPods to 0"),
    ]  # fmt: skip
    for present, why in problems:
        if present:
            raise SpecError(field, why)


def _check_straggler_policy(run_policy: RunPolicy, queued: bool, elastic: bool) -> None:
    """Replace and Shrink move one rank's pod alone: a Recreate job never does, and a Kueue group would
    count the moved pod until its deletion is confirmed (the CRD refuses the first, this the second).
    Shrink trains on without the pod, which only an elastic job can (the CRD refuses it too)."""
    action = run_policy.straggler.action
    if action not in STRAGGLER_MOVES:
        return
    field = "spec.runPolicy.stragglerPolicy.action"
    if action == STRAGGLER_SHRINK and not elastic:
        raise SpecError(
            field,
            "Shrink trains on without the slow rank's pod, which needs spec.elastic (minReplicas below "
            "maxReplicas); use Replace, or make the job elastic",
        )
    if run_policy.restart_mode != RESTART_MODE_IN_PLACE:
        raise SpecError(
            field,
            f"{action} moves the slow rank's pod alone, which needs spec.runPolicy.restartMode InPlace "
            "(its default); use Report, or InPlace",
        )
    if queued:
        raise SpecError(
            field,
            f"{action} is not available to a job queued by Kueue (its pod group would count the moved pod "
            "until its deletion is confirmed); use Report, or drop the kueue.x-k8s.io/queue-name label",
        )


def parse_job(obj: Mapping[str, Any]) -> JobSpec:
    """A defaulted JobSpec from a DDPJob object (as the apiserver returns it, or as a user wrote it)."""
    metadata = _mapping(obj.get("metadata"), "metadata", required=True)
    name = metadata.get("name")
    if not isinstance(name, str):
        raise SpecError("metadata.name", "is required")
    problem = names.job_name_problem(name)
    if problem:
        raise SpecError("metadata.name", problem)
    spec = _mapping(obj.get("spec"), "spec", required=True)

    replicas = _required_int(
        spec, "replicas", "spec", DEFAULT_REPLICAS, minimum=1, maximum=names.MAX_REPLICAS
    )
    nproc = _required_int(
        spec, "nprocPerNode", "spec", DEFAULT_NPROC_PER_NODE, minimum=1, maximum=MAX_NPROC_PER_NODE
    )
    requested_backend = _enum(spec, "backend", "spec", BACKENDS, "auto")
    restart_policy = cast(
        RestartPolicy, _enum(spec, "restartPolicy", "spec", RESTART_POLICIES, DEFAULT_RESTART_POLICY)
    )
    template = _mapping(spec.get("template"), "spec.template", required=True)
    _validate_template(template)
    run_policy = _parse_run_policy(_mapping(spec.get("runPolicy"), "spec.runPolicy"))
    elastic = _parse_elastic(spec, run_policy)
    if elastic is not None:
        replicas = elastic.max_replicas
    checkpoint = _parse_checkpoint(spec.get("checkpoint"))
    rendezvous_port = _required_int(
        spec, "rendezvousPort", "spec", DEFAULT_RENDEZVOUS_PORT, minimum=1, maximum=65535
    )
    raw_metrics = _mapping(spec.get("metrics"), "spec.metrics")
    metrics = MetricsSpec(
        enabled=_bool(raw_metrics, "enabled", "spec.metrics", True),
        port=_required_int(
            raw_metrics, "port", "spec.metrics", DEFAULT_METRICS_PORT, minimum=1, maximum=65535
        ),
    )
    if metrics.enabled and metrics.port == rendezvous_port:
        raise SpecError("spec.metrics.port", f"must differ from spec.rendezvousPort ({rendezvous_port})")
    if not metrics.enabled and run_policy.restart_mode == RESTART_MODE_IN_PLACE:
        # The launchers' restarts in place reach status.restarts only through rank 0's endpoint.
        raise SpecError(
            "spec.metrics.enabled",
            "the operator counts in-place restarts against backoffLimit from the ranks' metrics: keep it "
            "true, or set spec.runPolicy.restartMode to Recreate (the operator then recovers every failure)",
        )

    raw_network_policy = _mapping(spec.get("networkPolicy"), "spec.networkPolicy")
    network_policy = NetworkPolicySpec(
        enabled=_bool(raw_network_policy, "enabled", "spec.networkPolicy", True)
    )
    scheduling = _parse_scheduling(spec.get("scheduling"))
    kueue = _parse_kueue(metadata, template)
    _check_straggler_policy(run_policy, kueue is not None, elastic is not None)
    _check_standby_pods(run_policy, replicas, kueue is not None, elastic is not None, scheduling, checkpoint)

    generation = metadata.get("generation", 1)
    return JobSpec(
        name=name,
        namespace=str(metadata.get("namespace") or "default"),
        uid=str(metadata.get("uid") or ""),
        generation=generation if isinstance(generation, int) else 1,
        replicas=replicas,
        nproc_per_node=nproc,
        world_size=replicas * nproc,
        backend=resolve_backend(requested_backend, template),
        template=copy.deepcopy(dict(template)),
        restart_policy=restart_policy,
        run_policy=run_policy,
        checkpoint=checkpoint,
        rendezvous_port=rendezvous_port,
        metrics=metrics,
        network_policy=network_policy,
        scheduling=scheduling,
        kueue=kueue,
        elastic=elastic,
    )


# NetworkPolicyPeer fields (networking.k8s.io/v1), for the operator's --metrics-allow-from.
_PEER_FIELDS: Final = frozenset({"podSelector", "namespaceSelector", "ipBlock"})
_SELECTOR_OPERATORS: Final = ("In", "NotIn", "Exists", "DoesNotExist")


def _parse_label_selector(raw: Any, path: str) -> dict[str, Any]:
    selector = _mapping(raw, path, required=True)
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise SpecError(
            f"{path}.{sorted(unknown)[0]}", "unknown field; a selector has matchLabels and matchExpressions"
        )
    labels = _mapping(selector.get("matchLabels"), f"{path}.matchLabels")
    for key, value in labels.items():
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise SpecError(f"{path}.matchLabels", f"must map label names to strings, got {key!r}: {value!r}")
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise SpecError(f"{path}.matchExpressions", "must be a list")
    for index, expression in enumerate(expressions):
        where = f"{path}.matchExpressions[{index}]"
        expression = _mapping(expression, where, required=True)
        if not isinstance(expression.get("key"), str) or not expression["key"]:
            raise SpecError(f"{where}.key", "is required")
        operator = expression.get("operator")
        if operator not in _SELECTOR_OPERATORS:
            raise SpecError(
                f"{where}.operator", f"must be one of {', '.join(_SELECTOR_OPERATORS)}, got {operator!r}"
            )
        values = expression.get("values") or []
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise SpecError(f"{where}.values", "must be a list of strings")
        if (operator in ("In", "NotIn")) != bool(values):
            raise SpecError(
                f"{where}.values",
                f"must be {'non-empty' if operator in ('In', 'NotIn') else 'empty'} for {operator}",
            )
    return copy.deepcopy(dict(selector))


def _parse_ip_block(raw: Any, path: str) -> dict[str, Any]:
    import ipaddress

    block = _mapping(raw, path, required=True)
    unknown = set(block) - {"cidr", "except"}
    if unknown:
        raise SpecError(f"{path}.{sorted(unknown)[0]}", "unknown field; an ipBlock has cidr and except")
    cidrs = [("cidr", block.get("cidr"))] + [
        (f"except[{i}]", value) for i, value in enumerate(block.get("except") or [])
    ]
    for key, value in cidrs:
        try:
            ipaddress.ip_network(str(value), strict=False)
        except ValueError:
            raise SpecError(f"{path}.{key}", f"must be a CIDR such as 10.0.0.0/8, got {value!r}") from None
    return copy.deepcopy(dict(block))


def parse_network_peers(raw: Any, path: str) -> tuple[dict[str, Any], ...]:
    """A list of NetworkPolicyPeer objects, checked as the apiserver would check them.

    The operator reads where Prometheus runs from its --metrics-allow-from flag (a JSON list of peers):
    a mistake there must stop the operator at start, not fail every job's NetworkPolicy create.
    """
    if not isinstance(raw, list):
        raise SpecError(path, f"must be a list of NetworkPolicyPeer objects, got {type(raw).__name__}")
    peers = []
    for index, peer in enumerate(raw):
        where = f"{path}[{index}]"
        peer = _mapping(peer, where, required=True)
        unknown = set(peer) - _PEER_FIELDS
        if unknown:
            raise SpecError(
                f"{where}.{sorted(unknown)[0]}",
                "unknown field; a peer has podSelector, namespaceSelector or ipBlock",
            )
        if not peer:
            raise SpecError(where, "needs podSelector, namespaceSelector or ipBlock")
        if "ipBlock" in peer and len(peer) > 1:
            raise SpecError(f"{where}.ipBlock", "cannot be combined with a selector in one peer")
        parsed: dict[str, Any] = {}
        for key in ("namespaceSelector", "podSelector"):
            if key in peer:
                parsed[key] = _parse_label_selector(peer[key], f"{where}.{key}")
        if "ipBlock" in peer:
            parsed["ipBlock"] = _parse_ip_block(peer["ipBlock"], f"{where}.ipBlock")
        peers.append(parsed)
    return tuple(peers)
