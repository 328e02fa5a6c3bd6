"""Names, labels and DNS of a DDPJob and its children: the contract every other module builds on.

A job `<job>` owns a headless Service `<job>`, one pod per rank and attempt `<job>-<rank>-<attempt>`
whose hostname is `<job>-<rank>` under the subdomain `<job>`, a NetworkPolicy `<job>` (unless
`spec.networkPolicy.enabled` is false), optionally a PVC `<job>-checkpoint`, and for a job whose pods
restart in place, one rendezvous pod per attempt `<job>-rdzv-<attempt>` (hostname `<job>-rdzv`): the
c10d store that outlives any rank's pod (docs/restarts.md, "No rank is special").
The hostname must be a DNS label (63 characters), which is why a job name is limited to
``MAX_JOB_NAME_LENGTH``: `<job>-` plus a rank of up to four digits still fits. Pod names carry the
attempt and are DNS subdomains (253 characters), which they always are for any attempt number.
"""

from __future__ import annotations

import re
from typing import Final

API_GROUP: Final = "ddp.dev"
API_VERSION: Final = "v1alpha1"
API_GROUP_VERSION: Final = f"{API_GROUP}/{API_VERSION}"
KIND: Final = "DDPJob"
PLURAL: Final = "ddpjobs"
SINGULAR: Final = "ddpjob"
SHORT_NAME: Final = "ddpj"
CRD_NAME: Final = f"{PLURAL}.{API_GROUP}"

LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE: Final = "ddp-operator"
LABEL_JOB_NAME: Final = "ddp.dev/job-name"
LABEL_RANK: Final = "ddp.dev/rank"
LABEL_ATTEMPT: Final = "ddp.dev/attempt"
# On a pod that replaced a lost pod of its rank within the attempt (docs/restarts.md): the n-th such pod.
LABEL_REPLACEMENT: Final = "ddp.dev/replacement"
# Which version of the job's spec built a pod: all pods of one attempt must agree (reconcile.py).
LABEL_SPEC_HASH: Final = "ddp.dev/spec-hash"
# The UID of the DDPJob object: a job re-created under the same name has other pods.
LABEL_JOB_UID: Final = "ddp.dev/job-uid"
# On the pod of a job that is no rank's: the rendezvous pod (ROLE_RENDEZVOUS). Rank pods carry none.
LABEL_ROLE: Final = "ddp.dev/role"
# The rendezvous pod's job, in place of LABEL_JOB_NAME: the users' rules for rank pods (a required pod
# anti-affinity on ddp.dev/job-name, one rank per node) must never count it.
LABEL_RENDEZVOUS_OF: Final = "ddp.dev/rendezvous-of"
ROLE_RENDEZVOUS: Final = "rendezvous"
# A standby pod (runPolicy.standbyPods, docs/restarts.md "Standby pods") carries this role and its
# number in LABEL_STANDBY until it is given a rank; then it carries the rank's labels and keeps its number.
ROLE_STANDBY: Final = "standby"
LABEL_STANDBY: Final = "ddp.dev/standby"
# The rank and restart budget the operator gives a standby (``rank=<K> budget=<B>``), shown to its
# launcher by a downward API volume as the file DDP_STANDBY_FILE.
ANNOTATION_ASSIGNMENT: Final = "ddp.dev/assignment"
# When the operator gave it the rank (RFC 3339): the group changed then, as it does at a new pod's start,
# so a standby that took a hung pod's rank is not taken for hung by the same stall (policies.stall).
ANNOTATION_ASSIGNED_AT: Final = "ddp.dev/assigned-at"
ASSIGNMENT_FILE: Final = "assignment"
# The CPU request of the rank's trainer container on a standby that waits with less (its waiting CPU:
# --standby-waiting-cpu, policies.standby.waiting_cpu): what the operator resizes it to in place when it
# takes a rank. Absent on a standby that waits with its rank's request.
ANNOTATION_RANK_CPU: Final = "ddp.dev/rank-cpu"
# A waiting standby's CPU request unless the operator is told otherwise: low, so that the CPU shares
# it holds while it starts are a small fraction of its ranks' (docs/restarts.md, "Standby pods").
DEFAULT_STANDBY_WAITING_CPU: Final = "10m"
# The PriorityClass of standby pods unless the operator is told otherwise (--standby-priority-class; the
# chart installs it under this name for a release named ddp-operator, and passes its own name): below
# the ranks' priority, so the scheduler preempts a standby for any rank pod (docs/restarts.md).
DEFAULT_STANDBY_PRIORITY_CLASS: Final = "ddp-operator-standby"
# On every pod that mounts the job's checkpoint claim (rank 0's pods, and the standbys that may become
# rank 0): with a ReadWriteOnce claim the standbys are kept on the node of the pods labelled so.
LABEL_CHECKPOINT_MOUNT: Final = "ddp.dev/checkpoint-mount"
CHECKPOINT_MOUNT_VALUE: Final = "true"
HOSTNAME_TOPOLOGY_KEY: Final = "kubernetes.io/hostname"
RENDEZVOUS_CONTAINER: Final = "rendezvous"

TRAINER_CONTAINER: Final = "trainer"
SHM_VOLUME: Final = "dshm"
SHM_PATH: Final = "/dev/shm"
CHECKPOINT_VOLUME: Final = "checkpoint"
METRICS_PORT_NAME: Final = "metrics"
RENDEZVOUS_PORT_NAME: Final = "rendezvous"
GPU_RESOURCE: Final = "nvidia.com/gpu"
# The rank order by topology (docs/scheduling.md, "Rank order"): the operator writes a bound pod's
# rendezvous order key into this annotation, a downward API volume shows it to the launcher as a file.
ANNOTATION_RANK_ORDER: Final = "ddp.dev/rank-order"
PLACEMENT_VOLUME: Final = "ddp-placement"
PLACEMENT_PATH: Final = "/etc/ddp/placement"
RANK_ORDER_FILE: Final = "rank-order"

# Kueue's plain-pod groups (docs/scheduling.md). The DDPJob label names the LocalQueue; every rank pod
# carries it with one group name per job and the group's size. Kueue's webhook adds the admission
# scheduling gate, its finalizer and the managed label to such pods.
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_CLASS_LABEL: Final = "kueue.x-k8s.io/priority-class"
KUEUE_POD_GROUP_LABEL: Final = "kueue.x-k8s.io/pod-group-name"
KUEUE_POD_GROUP_TOTAL_COUNT_ANNOTATION: Final = "kueue.x-k8s.io/pod-group-total-count"
# Set to "false" on one pod of a group to tell Kueue the group has failed for good (it then finishes
# the group's Workload once no pod is active) instead of waiting for replacement pods.
KUEUE_RETRIABLE_IN_GROUP_ANNOTATION: Final = "kueue.x-k8s.io/retriable-in-group"
KUEUE_ADMISSION_GATE: Final = "kueue.x-k8s.io/admission"
KUEUE_MANAGED_LABEL: Final = "kueue.x-k8s.io/managed"  # also the name of Kueue's pod finalizer
KUEUE_POD_FINALIZER: Final = KUEUE_MANAGED_LABEL
# How many characters of the job's UID the Kueue group name keeps, at most (see kueue_pod_group_name).
KUEUE_GROUP_UID_CHARS: Final = 8

# The in-tree gang API (Kubernetes 1.36 scheduling.k8s.io/v1alpha2; gang.py): one Workload with one
# PodGroup template, and one PodGroup per attempt that the attempt's pods join.
GANG_POD_GROUP_TEMPLATE: Final = "ranks"

MAX_REPLICAS: Final = 4096
MAX_RANK_DIGITS: Final = len(str(MAX_REPLICAS - 1))
DNS_LABEL_MAX: Final = 63
# `<job>-<rank>` must stay a DNS label for every rank: 63 - len("-") - 4 digits.
MAX_JOB_NAME_LENGTH: Final = DNS_LABEL_MAX - 1 - MAX_RANK_DIGITS
# A DNS-1035 label: the Service is named after the job, and Service names must start with a letter.
JOB_NAME_PATTERN: Final = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
_JOB_NAME_RE: Final = re.compile(JOB_NAME_PATTERN)

# Phases of status.phase, in the order a healthy job passes through them.
PHASE_QUEUED: Final = "Queued"  # Kueue gates the rank pods: the gang waits for admission
PHASE_PENDING: Final = "Pending"
PHASE_STARTING: Final = "Starting"
PHASE_RUNNING: Final = "Running"
PHASE_RESTARTING: Final = "Restarting"
PHASE_SUCCEEDED: Final = "Succeeded"
PHASE_FAILED: Final = "Failed"
PHASE_SUSPENDED: Final = "Suspended"
PHASES: Final = (
    PHASE_QUEUED,
    PHASE_PENDING,
    PHASE_STARTING,
    PHASE_RUNNING,
    PHASE_RESTARTING,
    PHASE_SUCCEEDED,
    PHASE_FAILED,
    PHASE_SUSPENDED,
)
FINISHED_PHASES: Final = frozenset({PHASE_SUCCEEDED, PHASE_FAILED})
# The phases of a live attempt: its pods should exist.
LIVE_PHASES: Final = frozenset({PHASE_QUEUED, PHASE_PENDING, PHASE_STARTING, PHASE_RUNNING})

# Condition types: each one is True exactly while status.phase has the same name.
CONDITION_TYPES: Final = (
    PHASE_QUEUED,
    PHASE_RUNNING,
    PHASE_RESTARTING,
    PHASE_SUSPENDED,
    PHASE_SUCCEEDED,
    PHASE_FAILED,
)


def job_name_problem(name: str) -> str | None:
    """Why `name` cannot be a DDPJob name, or None when it can."""
    if not name:
        return "must not be empty"
    if len(name) > MAX_JOB_NAME_LENGTH:
        return (
            f"is {len(name)} characters; at most {MAX_JOB_NAME_LENGTH} keep the pod hostname "
            f"'<job>-<rank>' a {DNS_LABEL_MAX}-character DNS label"
        )
    if not _JOB_NAME_RE.match(name):
        return "must start with a lowercase letter and contain only lowercase letters, digits and '-', ending alphanumeric"
    return None


def pod_name(job: str, rank: int, attempt: int, replacement: int = 0) -> str:
    """``<job>-<rank>-<attempt>``; a pod that replaces a lost one of the same rank and attempt is
    ``<job>-<rank>-<attempt>r<n>``, ``n`` counting the job's replacements of every rank
    (``status.podReplacements``, policies.replacement.replace_pods): a name is never reused (Kueue's pod-group finalizers deadlock on
    reused names), and the letter keeps it apart from every name of another job (``a-1-2r1`` cannot be
    job ``a-1``'s)."""
    base = f"{job}-{rank}-{attempt}"
    return f"{base}r{replacement}" if replacement > 0 else base


def standby_pod_name(job: str, attempt: int, number: int) -> str:
    """The attempt's ``number``-th standby pod: ``<job>-standby<n>-<attempt>``. Its second part is not a
    number, so no rank pod of any job has this name, and not ``rdzv``, so no rendezvous pod either."""
    return f"{job}-standby{number}-{attempt}"


def assignment(rank: int, budget: int) -> str:
    """The value of ANNOTATION_ASSIGNMENT (the trainer's ddp_trainer.supervisor.standby parses it)."""
    return f"rank={rank} budget={budget}"


def pod_hostname(job: str, rank: int) -> str:
    """Stable across attempts, so rank 0's DNS name never changes."""
    return f"{job}-{rank}"


def rendezvous_pod_name(job: str, attempt: int, replacement: int = 0) -> str:
    """The rendezvous pod of one attempt: ``<job>-rdzv-<attempt>``, and ``<job>-rdzv-<attempt>r<n>`` for
    the n-th that replaced a lost one (policies.rendezvous). A rank pod's name ends in two numbers, so
    no rank pod of any job has this name."""
    base = f"{job}-rdzv-{attempt}"
    return f"{base}r{replacement}" if replacement > 0 else base


def rendezvous_hostname(job: str) -> str:
    """``<job>-rdzv``: as long as ``<job>-<rank>`` with a four-digit rank, so a DNS label too."""
    return f"{job}-rdzv"


def rendezvous_addr(job: str, namespace: str) -> str:
    """Where every rank's launcher meets the others: the rendezvous pod's DNS name."""
    return f"{rendezvous_hostname(job)}.{service_name(job)}.{namespace}.svc"


def service_name(job: str) -> str:
    return job


def network_policy_name(job: str) -> str:
    return job


def pvc_name(job: str) -> str:
    return f"{job}-checkpoint"


def kueue_pod_group_name(job: str, uid: str) -> str:
    """Kueue's group (and Kueue Workload) name: one per job, the same for every attempt, so the pods of
    a new attempt replace the old ones inside the group that already holds the quota. A short piece of
    the job's UID keeps a re-created job of the same name out of the old job's group, whose pods may
    still be finishing; it is cut to keep the name a 63-character label value (at least 4 characters
    remain, as MAX_JOB_NAME_LENGTH leaves 5)."""
    piece = uid.replace("-", "")[: min(KUEUE_GROUP_UID_CHARS, DNS_LABEL_MAX - len(job) - 1)]
    return f"{job}-{piece}" if piece else job


def gang_workload_name(job: str, attempt: int) -> str:
    """The in-tree scheduling.k8s.io Workload of one attempt (its pod group template is immutable)."""
    return f"{job}-{attempt}"


def gang_pod_group_name(job: str, attempt: int) -> str:
    """The in-tree PodGroup of one attempt: a new attempt's pods never join an older attempt's group
    (a pod's schedulingGroup is immutable)."""
    return f"{job}-{attempt}"


def master_addr(job: str, namespace: str) -> str:
    return f"{pod_hostname(job, 0)}.{service_name(job)}.{namespace}.svc"


def job_selector(job: str) -> dict[str, str]:
    """Labels that select every child of one job (all ranks, all attempts)."""
    return {LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_JOB_NAME: job}


def label_selector(job: str | None = None) -> str:
    """The selector string for a server-side LIST/WATCH: all our pods (the operator's watch: rank and
    rendezvous pods), or one job's rank pods."""
    if job is None:
        return f"{LABEL_MANAGED_BY}={MANAGED_BY_VALUE}"
    return ",".join([*(f"{key}={value}" for key, value in job_selector(job).items()), LABEL_RANK])


def job_object_selector(job: str, uid: str) -> dict[str, str]:
    """Labels that select every pod of one job object, whatever the attempt, its rendezvous pods too:
    its NetworkPolicy's. The UID says which job (a later job of the same name has another); only
    without one (a spec parsed without its object) does the name stand in.
    """
    if uid:
        return {LABEL_MANAGED_BY: MANAGED_BY_VALUE, LABEL_JOB_UID: uid}
    return job_selector(job)


def service_selector(job: str, uid: str, attempt: int) -> dict[str, str]:
    """Labels that select the pods of one attempt of one job object, its rendezvous pod too: what its
    headless Service publishes. Neither a Terminating pod of an earlier attempt nor one of an earlier
    job of the same name may be resolved or reached by a rank of this attempt."""
    return {**job_object_selector(job, uid), LABEL_ATTEMPT: str(attempt)}


def rendezvous_labels(job: str, uid: str, attempt: int) -> dict[str, str]:
    """The rendezvous pod's labels: its Service's and its policy's, and no ddp.dev/job-name."""
    return {
        **service_selector(job, uid, attempt),
        LABEL_RENDEZVOUS_OF: job,
        LABEL_ROLE: ROLE_RENDEZVOUS,
    }


def attempt_selector(job: str, uid: str, attempt: int) -> dict[str, str]:
    """Labels every rank pod of one attempt of one job object carries (``rank_labels``)."""
    selector = {**job_selector(job), LABEL_ATTEMPT: str(attempt)}
    if uid:
        selector[LABEL_JOB_UID] = uid
    return selector


def rank_labels(job: str, rank: int, attempt: int, uid: str = "") -> dict[str, str]:
    return {**attempt_selector(job, uid, attempt), LABEL_RANK: str(rank)}
