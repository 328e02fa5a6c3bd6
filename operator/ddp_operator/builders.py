"""Manifests of a DDPJob's children: the headless Service, the NetworkPolicy, the rank pods and the PVC.

Pure functions of a JobSpec. The pod template is the user's; this module adds the env contract and
the pod defaults (docs/api.md, "The template") wherever the template does not already say otherwise. A few fields are
the operator's and always win: the pod name, hostname, subdomain and `restartPolicy: Never` (the
operator owns restarts), the labels and ownerReference, and the env variables of the contract.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final

from ddp_operator import names
from ddp_operator.observe import format_time
from ddp_operator.policies import accounting, recovery, standby, straggler, topology
from ddp_operator.policies.budget import launcher_budget
from ddp_operator.spec import RESTART_MODE_IN_PLACE, STRAGGLER_SHRINK, JobSpec, trainer_container

# Long enough for rank 0 to finish a step and write a checkpoint after SIGTERM.
DEFAULT_TERMINATION_GRACE_SECONDS: Final = 120
# The rendezvous pod writes nothing on its way out.
RENDEZVOUS_GRACE_SECONDS: Final = 5
# A lost node is noticed in seconds instead of the apiserver's default 300.
NODE_LOSS_TOLERATION_SECONDS: Final = 30
NODE_LOSS_TAINTS: Final = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")

# Where Prometheus runs unless the operator is told otherwise (--metrics-allow-from; the chart's
# rankMetrics.allowFrom has the same default): pods of the namespace `monitoring`. A namespace's
# kubernetes.io/metadata.name label is set by the apiserver, so only that namespace matches; a pod label
# alone would match any pod anyone labels so.
DEFAULT_METRICS_ALLOW_FROM: Final = (
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
)

# Variables the trainer needs to join its group: the operator's values replace any the template sets.
CONTRACT_ENV: Final = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NNODES",
    "NODE_RANK",
    "NPROC_PER_NODE",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_NPROC_PER_NODE",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "DDPJOB_NAME",
    "DDPJOB_NAMESPACE",
    "DDPJOB_ATTEMPT",
    "DDP_BACKEND",
    "DDP_METRICS_PORT",
    "DDP_CHECKPOINT_DIR",
    "DDP_STALL_TIMEOUT_SECONDS",
    "DDP_RESTART_MODE",
    "DDP_RESTART_BUDGET",
    "DDP_RUN_ID",
    "PET_RDZV_BACKEND",
    "PET_RDZV_ENDPOINT",
    "PET_RDZV_ID",
    "PET_MAX_RESTARTS",
    "PET_RDZV_CONF",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "DDP_RANK_ORDER_FILE",
    "DDP_RENDEZVOUS_ENDPOINT",
    "DDP_STANDBY_FILE",  # a standby pod's, in place of NODE_RANK, RANK and LOCAL_RANK
    "POD_IP",
)
# Defaults the template may override.
DEFAULT_ENV: Final = {"PYTHONUNBUFFERED": "1"}


def owner_reference(job: JobSpec) -> dict[str, Any]:
    return {
        "apiVersion": names.API_GROUP_VERSION,
        "kind": names.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: JobSpec, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(job)],
    }


def build_service(job: JobSpec, attempt: int) -> dict[str, Any]:
    """Headless, and publishing not-ready addresses: ranks resolve rank 0 before anyone is Ready.

    It selects the pods of one attempt of this job object only, and follows the job from attempt to
    attempt (the executor patches its selector before it creates the next attempt's pods).
    """
    ports = [
        {"name": names.RENDEZVOUS_PORT_NAME, "port": job.rendezvous_port, "targetPort": job.rendezvous_port}
    ]
    if job.metrics.enabled:
        ports.append(
            {"name": names.METRICS_PORT_NAME, "port": job.metrics.port, "targetPort": job.metrics.port}
        )
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, names.service_name(job.name), names.job_selector(job.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.service_selector(job.name, job.uid, attempt),
            "ports": ports,
        },
    }


def build_network_policy(
    job: JobSpec, metrics_allow_from: Sequence[Mapping[str, Any]]
) -> dict[str, Any] | None:
    """The job's NetworkPolicy: its rank pods admit their own job's pods, Prometheus on /metrics, no one else.

    Rank ports are unauthenticated (rank 0's TCPStore takes any writer; gloo, NCCL and the elastic
    agent's store listen on ports of their choosing), so every port is open to the job's own pods of
    any attempt and to nobody else. ``metrics_allow_from`` (NetworkPolicyPeers, the operator's
    --metrics-allow-from) may reach the metrics port; an empty list keeps it closed too. Only Ingress
    is listed: egress (data, checkpoints, DNS, the image registry) stays as the namespace has it.
    None when the job turned the policy off.
    """
    if not job.network_policy.enabled:
        return None
    own_pods = names.job_object_selector(job.name, job.uid)
    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": {"matchLabels": dict(own_pods)}}]}]
    if job.metrics.enabled and metrics_allow_from:
        ingress.append(
            {
                "from": [copy.deepcopy(dict(peer)) for peer in metrics_allow_from],
                "ports": [{"protocol": "TCP", "port": job.metrics.port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, names.network_policy_name(job.name), names.job_selector(job.name)),
        "spec": {
            "podSelector": {"matchLabels": dict(own_pods)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def build_checkpoint_pvc(job: JobSpec) -> dict[str, Any] | None:
    """Created once per job (not per attempt) and kept until the job is deleted."""
    if job.checkpoint is None:
        return None
    spec = copy.deepcopy(dict(job.checkpoint.volume_claim_template))
    spec.setdefault("accessModes", ["ReadWriteOnce"])
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(job, names.pvc_name(job.name), names.job_selector(job.name)),
        "spec": spec,
    }


# The rendezvous pod's program: torch's own TCPStore server, and nothing of ours, so it runs in any image
# the trainer container runs (a stock torchrun image as well as ours). It serves until SIGTERM.
RENDEZVOUS_STORE_PROGRAM: Final = """\
import signal, sys
from datetime import timedelta
from torch.distributed import TCPStore
port = int(sys.argv[1])
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
print(f"rendezvous store serving on port {port}", flush=True)
signal.sigwait({signal.SIGTERM, signal.SIGINT})
print("rendezvous store stopped", flush=True)
"""
# What the store needs: a Python interpreter with torch imported, and a few connections per pod.
RENDEZVOUS_RESOURCES: Final = {"requests": {"cpu": "50m", "memory": "256Mi"}}
# Template pod fields the rendezvous pod keeps: where the trainer's image may run and be pulled from.
RENDEZVOUS_KEPT_FIELDS: Final = (
    "imagePullSecrets",
    "nodeSelector",
    "tolerations",
    "priorityClassName",
    "securityContext",
    "runtimeClassName",
)


def build_rendezvous_pod(job: JobSpec, attempt: int, name: str | None = None) -> dict[str, Any] | None:
    """The attempt's rendezvous pod (docs/restarts.md, "No rank is special"): the c10d store every
    rank's launcher meets at, in a pod that is no rank's, so the store outlives any rank's pod. It runs
    the trainer container's image, under the template's pod security context and placement fields, and
    is reached at ``names.rendezvous_addr`` (the headless Service publishes it with the attempt's pods;
    the NetworkPolicy admits the job's own pods to it). None for a job without one
    (policies.recovery.rendezvous_apart). ``name``: a replacement's (policies.rendezvous), else the
    attempt's first."""
    if not recovery.rendezvous_apart(job):
        return None
    template_spec: Mapping[str, Any] = job.template.get("spec") or {}
    trainer = trainer_container(job.template)
    container: dict[str, Any] = {
        "name": names.RENDEZVOUS_CONTAINER,
        "image": trainer["image"],
        "command": ["python3", "-c", RENDEZVOUS_STORE_PROGRAM, str(job.rendezvous_port)],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [
            {"name": names.RENDEZVOUS_PORT_NAME, "containerPort": job.rendezvous_port, "protocol": "TCP"}
        ],
        "resources": copy.deepcopy(RENDEZVOUS_RESOURCES),
        "securityContext": copy.deepcopy(trainer.get("securityContext") or {}),
    }
    if trainer.get("imagePullPolicy"):
        container["imagePullPolicy"] = trainer["imagePullPolicy"]
    _restrict_container(container)
    pod_spec: dict[str, Any] = {
        key: copy.deepcopy(template_spec[key]) for key in RENDEZVOUS_KEPT_FIELDS if key in template_spec
    }
    pod_spec.update(
        restartPolicy="Never",
        hostname=names.rendezvous_hostname(job.name),
        subdomain=names.service_name(job.name),
        enableServiceLinks=False,
        automountServiceAccountToken=False,
        terminationGracePeriodSeconds=RENDEZVOUS_GRACE_SECONDS,
        containers=[container],
    )
    context: dict[str, Any] = pod_spec.setdefault("securityContext", {})
    context.setdefault("runAsNonRoot", True)
    context.setdefault("seccompProfile", {"type": "RuntimeDefault"})
    _add_tolerations(pod_spec)
    labels = names.rendezvous_labels(job.name, job.uid, attempt)
    metadata = _metadata(job, name or names.rendezvous_pod_name(job.name, attempt), labels)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def run_id(job: JobSpec, attempt: int) -> str:
    """The rendezvous run id of one attempt: unique per job object and attempt, so no agent of an older
    attempt or of an older job of the same name can join the group (docs/restarts.md)."""
    return f"{job.uid or job.name}-{attempt}"


def restart_env(job: JobSpec, rank: int, attempt: int, restart_budget: int) -> list[tuple[str, str]]:
    """How the pod's launcher recovers a failure (docs/trainer.md): in place on a rendezvous whose
    store is the attempt's rendezvous pod (rank 0's launcher where the job has a single pod), at most
    ``restart_budget`` more gang restarts; or not at all (Recreate)."""
    values: list[tuple[str, str]] = [("DDP_RESTART_MODE", job.run_policy.restart_mode)]
    if job.run_policy.restart_mode != RESTART_MODE_IN_PLACE:
        return values
    budget = str(max(0, restart_budget))
    apart = recovery.rendezvous_apart(job)
    host = names.rendezvous_addr if apart else names.master_addr
    endpoint = f"{host(job.name, job.namespace)}:{job.rendezvous_port}"
    # No launcher hosts the store when the rendezvous pod does.
    rdzv_conf = f"is_host={1 if rank == 0 and not apart else 0}"
    if apart:
        values.append(("DDP_RENDEZVOUS_ENDPOINT", endpoint))
    if job.elastic is not None:
        # An elastic job trains on DDP_MIN_MEMBERS..NNODES pods; a round waits this long for missing ones.
        # Its deprecated name, the same value, is what an older trainer image reads (docs/api.md,
        # "Deprecated names").
        wait = str(job.elastic.replacement_wait_seconds)
        least = str(job.elastic.min_replicas)
        values += [
            ("DDP_MIN_MEMBERS", least),
            ("DDP_MIN_NODES", least),
            ("DDP_REPLACEMENT_WAIT_SECONDS", wait),
        ]
        rdzv_conf += f",last_call_timeout={wait}"
    if topology.orders_ranks(job):
        # The launcher waits for the operator's order key of this pod and brings it to every round.
        values.append(("DDP_RANK_ORDER_FILE", f"{names.PLACEMENT_PATH}/{names.RANK_ORDER_FILE}"))
    return [
        *values,
        ("DDP_RESTART_BUDGET", budget),
        ("DDP_RUN_ID", run_id(job, attempt)),
        # The same for a stock torchrun image: an elastic c10d rendezvous whose agents restart in place.
        ("PET_RDZV_BACKEND", "c10d"),
        ("PET_RDZV_ENDPOINT", endpoint),
        ("PET_RDZV_ID", run_id(job, attempt)),
        ("PET_MAX_RESTARTS", budget),
        # torchrun would guess the store's host by matching addresses, before rank 0's DNS is published.
        ("PET_RDZV_CONF", rdzv_conf),
        # Rank 0 publishes a store for the workers each round, so a replacement pod can join a later one.
        ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),
    ]


def _torchrun_nnodes(job: JobSpec) -> str:
    """torchrun's --nnodes: the pods, or ``min:max`` for an elastic job."""
    if job.elastic is None:
        return str(job.replicas)
    return f"{job.elastic.min_replicas}:{job.elastic.max_replicas}"


def contract_env(job: JobSpec, rank: int, attempt: int, restart_budget: int = 0) -> list[dict[str, Any]]:
    """The env contract (docs/api.md, "The env contract") for one rank, in a stable order."""
    master = names.master_addr(job.name, job.namespace)
    values: list[tuple[str, str]] = [
        ("MASTER_ADDR", master),
        ("MASTER_PORT", str(job.rendezvous_port)),
        ("NNODES", str(job.replicas)),
        ("NODE_RANK", str(rank)),
        ("NPROC_PER_NODE", str(job.nproc_per_node)),
        ("WORLD_SIZE", str(job.world_size)),
    ]
    if job.nproc_per_node == 1:
        # With several processes per pod the launcher assigns these per worker.
        values += [("RANK", str(rank)), ("LOCAL_RANK", "0")]
    values += [
        ("PET_NNODES", _torchrun_nnodes(job)),
        ("PET_NODE_RANK", str(rank)),
        ("PET_NPROC_PER_NODE", str(job.nproc_per_node)),
        ("PET_MASTER_ADDR", master),
        ("PET_MASTER_PORT", str(job.rendezvous_port)),
        ("DDPJOB_NAME", job.name),
        ("DDPJOB_NAMESPACE", job.namespace),
        ("DDPJOB_ATTEMPT", str(attempt)),
        ("DDP_BACKEND", job.backend),
        # 0 tells the trainer to serve no endpoint: with metrics disabled the port may even be the
        # rendezvous port (the CRD only checks it while metrics are enabled).
        ("DDP_METRICS_PORT", str(job.metrics.port) if job.metrics.enabled else "0"),
    ]
    if job.checkpoint is not None:
        values.append(("DDP_CHECKPOINT_DIR", job.checkpoint.mount_path))
    if job.run_policy.stall_timeout_seconds is not None:
        # The ranks dump their stacks before the operator restarts a stalled gang.
        values.append(("DDP_STALL_TIMEOUT_SECONDS", str(job.run_policy.stall_timeout_seconds)))
    values += restart_env(job, rank, attempt, restart_budget)
    env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in values]
    env.append({"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    return env


def _merge_env(user_env: list[dict[str, Any]], contract: list[dict[str, Any]]) -> list[dict[str, Any]]:
    user_names = {entry.get("name") for entry in user_env}
    defaults = [{"name": key, "value": value} for key, value in DEFAULT_ENV.items() if key not in user_names]
    kept = [entry for entry in user_env if entry.get("name") not in CONTRACT_ENV]
    # Contract first, so a user variable can refer to it with $(MASTER_ADDR).
    return contract + defaults + kept


def _add_port(container: dict[str, Any], name: str, port: int) -> None:
    ports: list[dict[str, Any]] = container.setdefault("ports", [])
    if any(p.get("name") == name or p.get("containerPort") == port for p in ports):
        return
    ports.append({"name": name, "containerPort": port, "protocol": "TCP"})


def _restrict_container(container: dict[str, Any]) -> None:
    """Pod Security "restricted" for one container, keeping whatever the template set."""
    context: dict[str, Any] = container.setdefault("securityContext", {})
    added = ((context.get("capabilities") or {}).get("add")) or ()
    # The apiserver rejects allowPrivilegeEscalation false beside privileged or CAP_SYS_ADMIN: a template
    # that asks for those keeps them (and Pod Security "restricted", if enforced, refuses the pod).
    if context.get("privileged") is not True and not {"SYS_ADMIN", "CAP_SYS_ADMIN"} & set(added):
        context.setdefault("allowPrivilegeEscalation", False)
    context.setdefault("capabilities", {"drop": ["ALL"]})


def _add_tolerations(pod_spec: dict[str, Any]) -> None:
    tolerations: list[dict[str, Any]] = pod_spec.setdefault("tolerations", [])
    present = {t.get("key") for t in tolerations}
    for key in NODE_LOSS_TAINTS:
        if key not in present:
            tolerations.append(
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": NODE_LOSS_TOLERATION_SECONDS,
                }
            )


def _mounts_path(container: dict[str, Any], path: str) -> bool:
    return any(m.get("mountPath") == path for m in container.get("volumeMounts", []))


def spec_hash(job: JobSpec) -> str:
    """A short digest of every spec field that shapes a rank pod (not the policies, which may change).

    Pods of one attempt built from different versions of the spec would disagree on the world size or
    the template; the label lets the operator find and replace them before the attempt starts.
    """
    shaping: dict[str, Any] = {
        "replicas": job.replicas,
        "nprocPerNode": job.nproc_per_node,
        "backend": job.backend,
        "template": job.template,
        "rendezvousPort": job.rendezvous_port,
        "metrics": [job.metrics.enabled, job.metrics.port],
        "stallTimeoutSeconds": job.run_policy.stall_timeout_seconds,
        "checkpoint": None
        if job.checkpoint is None
        else [job.checkpoint.volume_claim_template, job.checkpoint.mount_path],
    }
    # Only when set, so the digest of a job that uses neither stays what it was before these existed.
    if job.scheduling.gang != "Auto":
        shaping["gang"] = job.scheduling.gang
    if job.kueue is not None:
        shaping["kueue"] = [job.kueue.queue_name, job.kueue.priority_class]
    encoded = json.dumps(shaping, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def kueue_pod_metadata(job: JobSpec) -> tuple[dict[str, str], dict[str, str]]:
    """Labels and annotations that make the rank pods one Kueue plain-pod group (empty without a
    queue): every pod of every attempt carries the same queue, group name and total count, so the pods
    of a new attempt replace the old ones in the group that holds the quota (docs/scheduling.md)."""
    if job.kueue is None:
        return {}, {}
    labels = {
        names.KUEUE_QUEUE_LABEL: job.kueue.queue_name,
        names.KUEUE_POD_GROUP_LABEL: names.kueue_pod_group_name(job.name, job.uid),
    }
    if job.kueue.priority_class is not None:
        labels[names.KUEUE_PRIORITY_CLASS_LABEL] = job.kueue.priority_class
    annotations = {
        names.KUEUE_POD_GROUP_TOTAL_COUNT_ANNOTATION: str(job.replicas),
        **topology.kueue_annotations(job),
    }
    return labels, annotations


def build_rank_pod(
    job: JobSpec,
    rank: int,
    attempt: int,
    *,
    pod_spec_patch: Mapping[str, Any] | None = None,
    replacement: int = 0,
    restart_budget: int | None = None,
    avoid_nodes: Sequence[str] = (),
) -> dict[str, Any]:
    """One rank pod of one attempt. ``pod_spec_patch`` (gang.py's, when the gang is scheduled through
    the in-tree Workload API) is merged into the pod spec last: its fields are the operator's.
    ``avoid_nodes``: nodes the job moved away from (status.avoidedNodes, policies.straggler)."""
    budget = launcher_budget(job, 0) if restart_budget is None else restart_budget
    template = copy.deepcopy(dict(job.template))
    template_meta: dict[str, Any] = template.get("metadata") or {}
    pod_spec: dict[str, Any] = template.get("spec") or {}

    kueue_labels, kueue_annotations = kueue_pod_metadata(job)
    labels = {
        **(template_meta.get("labels") or {}),
        **kueue_labels,
        **names.rank_labels(job.name, rank, attempt, job.uid),
        names.LABEL_SPEC_HASH: spec_hash(job),
    }
    if replacement:
        labels[names.LABEL_REPLACEMENT] = str(replacement)
    metadata = _metadata(job, names.pod_name(job.name, rank, attempt, replacement), labels)
    annotations = {**(template_meta.get("annotations") or {}), **kueue_annotations}
    if annotations:
        metadata["annotations"] = annotations

    # The operator's own fields.
    pod_spec["restartPolicy"] = "Never"
    pod_spec["hostname"] = names.pod_hostname(job.name, rank)
    pod_spec["subdomain"] = names.service_name(job.name)

    # Defaults: the template wins wherever it says something.
    pod_spec.setdefault("enableServiceLinks", False)
    pod_spec.setdefault("automountServiceAccountToken", False)
    pod_spec.setdefault("terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE_SECONDS)
    pod_context: dict[str, Any] = pod_spec.setdefault("securityContext", {})
    pod_context.setdefault("runAsNonRoot", True)
    pod_context.setdefault("seccompProfile", {"type": "RuntimeDefault"})
    _add_tolerations(pod_spec)
    for container in pod_spec.get("initContainers", []) + pod_spec.get("containers", []):
        _restrict_container(container)

    volumes: list[dict[str, Any]] = pod_spec.setdefault("volumes", [])
    trainer = next(c for c in pod_spec["containers"] if c.get("name") == names.TRAINER_CONTAINER)
    volume_names = {v.get("name") for v in volumes}
    if names.SHM_VOLUME not in volume_names and not _mounts_path(trainer, names.SHM_PATH):
        volumes.append({"name": names.SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
        trainer.setdefault("volumeMounts", []).append({"name": names.SHM_VOLUME, "mountPath": names.SHM_PATH})
    if job.checkpoint is not None and rank == 0:
        # Only rank 0 writes checkpoints and broadcasts them on start, so of the ranks only it mounts the
        # volume (and the standbys, which may become rank 0: build_standby_pod).
        _mount_checkpoint(job, attempt, metadata, pod_spec, trainer)

    if topology.orders_ranks(job) and names.PLACEMENT_VOLUME not in volume_names:
        # The order key is written once the pod is bound, after the container may have started.
        _show_annotation(volumes, trainer, names.RANK_ORDER_FILE, names.ANNOTATION_RANK_ORDER)

    trainer["env"] = _merge_env(list(trainer.get("env") or []), contract_env(job, rank, attempt, budget))
    _add_port(trainer, names.RENDEZVOUS_PORT_NAME, job.rendezvous_port)
    if job.metrics.enabled:
        _add_port(trainer, names.METRICS_PORT_NAME, job.metrics.port)
    _avoid_nodes(pod_spec, avoid_nodes, required=job.run_policy.straggler.action == STRAGGLER_SHRINK)
    _near_other_ranks(pod_spec, topology.affinity_term(job))
    for key, value in (pod_spec_patch or {}).items():
        pod_spec[key] = copy.deepcopy(value)

    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _mount_checkpoint(
    job: JobSpec,
    attempt: int,
    metadata: dict[str, Any],
    pod_spec: dict[str, Any],
    trainer: dict[str, Any],
) -> None:
    """The checkpoint claim on the trainer at its mount path, and the label that says so. Where the
    claim is one node's (ReadWriteOnce) and standbys share it, a required pod affinity keeps the pod
    on the node of the attempt's other pods that mount it (the first one goes anywhere: a pod that
    matches its own term is placed like one without it)."""
    assert job.checkpoint is not None
    pod_spec.setdefault("volumes", []).append(
        {"name": names.CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": names.pvc_name(job.name)}}
    )
    trainer.setdefault("volumeMounts", []).append(
        {"name": names.CHECKPOINT_VOLUME, "mountPath": job.checkpoint.mount_path}
    )
    metadata["labels"][names.LABEL_CHECKPOINT_MOUNT] = names.CHECKPOINT_MOUNT_VALUE
    if not standby.pins_to_checkpoint_node(job):
        return
    selector = {
        **names.attempt_selector(job.name, job.uid, attempt),
        names.LABEL_CHECKPOINT_MOUNT: names.CHECKPOINT_MOUNT_VALUE,
    }
    term = {"labelSelector": {"matchLabels": selector}, "topologyKey": names.HOSTNAME_TOPOLOGY_KEY}
    affinity = pod_spec.setdefault("affinity", {}).setdefault("podAffinity", {})
    affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)


# A standby's env has no rank of its own: these come from its assignment (ddp_trainer.supervisor.standby).
STANDBY_FILE_ENV: Final = "DDP_STANDBY_FILE"
_RANK_ENV: Final = frozenset({"NODE_RANK", "PET_NODE_RANK", "RANK", "LOCAL_RANK"})
# A rank but 0 builds a standby's spec (rank 0's own fields, its checkpoint mount, are added only
# where the standby may take rank 0: policies.standby.checkpoint_mount).
_STANDBY_TEMPLATE_RANK: Final = 1
# Fields the apiserver's Priority admission derives from priorityClassName: set beside another class
# they would be refused as a mismatch.
_PRIORITY_FIELDS: Final = ("priority", "preemptionPolicy")


def build_standby_pod(
    job: JobSpec,
    attempt: int,
    number: int,
    *,
    avoid_nodes: Sequence[str] = (),
    priority_class: str | None = names.DEFAULT_STANDBY_PRIORITY_CLASS,
    waiting_cpu: str | None = None,
) -> dict[str, Any]:
    """The attempt's ``number``-th standby pod (runPolicy.standbyPods): a rank pod of no rank. Its own
    name and labels (names.ROLE_STANDBY), no hostname (a rank's DNS name stays its rank's), no rank in
    its env, and its assignment file; not in the in-tree gang (it must not hold the gang's minimum).
    It runs at ``priority_class`` (the operator's standby class, below the ranks: the scheduler
    preempts a standby for a rank pod; None or empty: the template's), and mounts the checkpoint claim
    where the access mode allows it (policies.standby.checkpoint_mount), so it may take rank 0. Its
    trainer requests ``waiting_cpu`` where policies.standby.waiting_cpu allows, and the rank's request
    is kept in names.ANNOTATION_RANK_CPU for the resize that gives it back."""
    pod = build_rank_pod(job, _STANDBY_TEMPLATE_RANK, attempt, avoid_nodes=avoid_nodes)
    metadata, pod_spec = pod["metadata"], pod["spec"]
    metadata["name"] = names.standby_pod_name(job.name, attempt, number)
    labels = metadata["labels"]
    del labels[names.LABEL_RANK]
    labels[names.LABEL_ROLE] = names.ROLE_STANDBY
    labels[names.LABEL_STANDBY] = str(number)
    del pod_spec["hostname"], pod_spec["subdomain"]
    if priority_class:
        pod_spec["priorityClassName"] = priority_class
        for key in _PRIORITY_FIELDS:
            pod_spec.pop(key, None)
    trainer = next(c for c in pod_spec["containers"] if c.get("name") == names.TRAINER_CONTAINER)
    lower = standby.waiting_cpu(pod_spec, waiting_cpu)
    if lower is not None:
        requests = trainer["resources"]["requests"]
        metadata.setdefault("annotations", {})[names.ANNOTATION_RANK_CPU] = str(requests["cpu"])
        requests["cpu"] = lower
    if standby.checkpoint_mount(job) in (standby.MOUNT_ANYWHERE, standby.MOUNT_ON_NODE):
        _mount_checkpoint(job, attempt, metadata, pod_spec, trainer)
    env = [entry for entry in trainer["env"] if entry.get("name") not in _RANK_ENV]
    env.append({"name": STANDBY_FILE_ENV, "value": f"{names.PLACEMENT_PATH}/{names.ASSIGNMENT_FILE}"})
    trainer["env"] = env
    _show_annotation(pod_spec["volumes"], trainer, names.ASSIGNMENT_FILE, names.ANNOTATION_ASSIGNMENT)
    return pod


def standby_promotion(rank: int, replacement: int, budget: int, at: datetime) -> dict[str, Any]:
    """The merge patch that gives a standby pod rank ``rank``'s place at ``at``: the rank's labels (its
    ``replacement`` number makes it the rank's newest pod), no standby role, its assignment and when."""
    return {
        "metadata": {
            "labels": {
                names.LABEL_RANK: str(rank),
                names.LABEL_REPLACEMENT: str(replacement),
                names.LABEL_ROLE: None,
            },
            "annotations": {
                names.ANNOTATION_ASSIGNMENT: names.assignment(rank, budget),
                names.ANNOTATION_ASSIGNED_AT: accounting.format_micro_time(at),
            },
        }
    }


def _show_annotation(
    volumes: list[dict[str, Any]], trainer: dict[str, Any], path: str, annotation: str
) -> None:
    """An annotation the operator writes after the container may have started, as a file: a downward
    API volume follows the annotation as it changes (an env var keeps its value at start)."""
    volumes.append(
        {
            "name": names.PLACEMENT_VOLUME,
            "downwardAPI": {
                "items": [{"path": path, "fieldRef": {"fieldPath": f"metadata.annotations['{annotation}']"}}]
            },
        }
    )
    trainer.setdefault("volumeMounts", []).append(
        {"name": names.PLACEMENT_VOLUME, "mountPath": names.PLACEMENT_PATH, "readOnly": True}
    )


def _avoid_nodes(pod_spec: dict[str, Any], avoided: Sequence[str], *, required: bool) -> None:
    """Steer the pod off ``avoided``: under Replace, a preferred node affinity term beside the template's
    own, so a job whose only fitting node is the slow one is slowed, never stranded (the straggler
    bound, policies.straggler, ends the loop that would follow); under Shrink (an elastic job, which
    trains on without the pod meanwhile), a required one."""
    if not avoided:
        return
    affinity = pod_spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    if required:
        straggler.require_off(affinity, avoided)
        return
    term = straggler.avoid_term(avoided)
    if term is not None:
        affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(term)


def _near_other_ranks(pod_spec: dict[str, Any], term: Mapping[str, Any] | None) -> None:
    """The affinity path of spec.scheduling.topology (policies.topology): a preferred pod affinity
    term beside the template's own."""
    if term is None:
        return
    affinity = pod_spec.setdefault("affinity", {}).setdefault("podAffinity", {})
    affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(dict(term))


def build_event(
    job: Mapping[str, Any], event_type: str, reason: str, message: str, now: datetime, instance: str
) -> dict[str, Any]:
    """A core/v1 Event on the DDPJob ``job`` (as stored), what `kubectl describe ddpjob` shows.

    ``instance`` names the operator process that reports it (its host name).
    """
    meta: Mapping[str, Any] = job.get("metadata") or {}
    timestamp = format_time(now)
    namespace = str(meta.get("namespace", "default"))
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name', names.SINGULAR)}.", "namespace": namespace},
        "involvedObject": {
            "apiVersion": names.API_GROUP_VERSION,
            "kind": names.KIND,
            "name": meta.get("name"),
            "namespace": namespace,
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": event_type,
        "reason": reason,
        # The apiserver refuses longer messages.
        "message": message[:1024],
        "firstTimestamp": timestamp,
        "lastTimestamp": timestamp,
        "count": 1,
        "source": {"component": names.MANAGED_BY_VALUE},
        "reportingComponent": f"{names.API_GROUP}/{names.MANAGED_BY_VALUE}",
        "reportingInstance": instance[:128],
    }
