"""kwok's Stage objects for the local control plane: the whole set, since custom stages replace kwok's own.

Stages (each a rule "objects matching this selector get this status next"):
- node-initialize / node-heartbeat: fake nodes become Ready with the capacity they were created with,
  and keep reporting Ready.
- node-lost: a node annotated `kwok.ddp.dev/node-lost` reports Unknown, as a node whose kubelet went
  silent; removing the annotation makes it Ready again.
- pod-ready: a pod scheduled onto a fake node becomes Running and Ready.
- pod-complete-by-annotation: a test ends a pod by annotating it with `kwok.ddp.dev/exit-code` (and
  optionally `kwok.ddp.dev/reason`, and `kwok.ddp.dev/finished-at`: when the process ended, which a
  late report carries); every container is terminated with that code, the pod phase is Succeeded for
  0 and Failed otherwise.
- pod-stop-on-delete: a pod on a node marked for deletion that a finalizer keeps (Kueue's, for one)
  reports its containers ended by SIGTERM (exit 143) and the phase Failed, as a kubelet does before its
  final delete; the object then stays, terminal, until the finalizer goes. (Pods without a finalizer
  skip this report: they vanish at the final delete anyway, and 1024-rank tests save the writes.)
- pod-delete: a pod marked for deletion goes away at once (the kubelet's final delete).

The fault model of a real cluster (``ReportLatency``): each node's kubelet reports pod changes (start,
end) after a latency of its own plus jitter, so reports of one gang arrive late and out of order; and a
lost node's kubelet reports nothing at all: pods annotated `kwok.ddp.dev/node-lost` (the harness marks a
lost node's pods with the node) are never started, ended or finally deleted, so a deleted one stays
Terminating until the node comes back, as on a real cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

KWOK_API_VERSION = "kwok.x-k8s.io/v1alpha1"
# Nodes carrying this annotation are the ones kwok manages; a real kubelet node can join beside them.
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
FAKE_NODE_ANNOTATION_VALUE = "fake"
# A test simulates losing a node by annotating it; removing the annotation brings the node back.
NODE_LOST_ANNOTATION = "kwok.ddp.dev/node-lost"
EXIT_CODE_ANNOTATION = "kwok.ddp.dev/exit-code"
REASON_ANNOTATION = "kwok.ddp.dev/reason"
FINISHED_AT_ANNOTATION = "kwok.ddp.dev/finished-at"
# The container's termination message (what the trainer's launcher leaves when it decides to exit).
MESSAGE_ANNOTATION = "kwok.ddp.dev/message"

_NOT_DELETING = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
_EXIT_CODE_KEY = f'.metadata.annotations["{EXIT_CODE_ANNOTATION}"]'
_NODE_LOST_KEY = f'.metadata.annotations["{NODE_LOST_ANNOTATION}"]'

# What a node's conditions become when its kubelet stops reporting (as the node-lifecycle controller
# writes them); the controller then taints the node unreachable and evicts its pods.
_NODE_LOST = """\
{{ $now := Now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $now | Quote }}
  message: "Kubelet stopped posting node status."
  reason: NodeStatusUnknown
  status: Unknown
  type: {{ .type | Quote }}
{{ end }}
"""

_NODE_CONDITIONS = """\
{{ $now := Now }}
{{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
conditions:
{{ range NodeConditions }}
- lastHeartbeatTime: {{ $now | Quote }}
  lastTransitionTime: {{ $lastTransitionTime | Quote }}
  message: {{ .message | Quote }}
  reason: {{ .reason | Quote }}
  status: {{ .status | Quote }}
  type: {{ .type | Quote }}
{{ end }}
"""

# Capacity and allocatable are whatever the node was created with; the rest mimics a kubelet's report.
_NODE_INITIALIZE = (
    _NODE_CONDITIONS
    + """\
addresses:
{{ with NodeIP }}
- address: {{ . | Quote }}
  type: InternalIP
{{ end }}
- address: {{ .metadata.name | Quote }}
  type: Hostname
{{ with NodePort }}
daemonEndpoints:
  kubeletEndpoint:
    Port: {{ . }}
{{ end }}
allocatable:
{{ YAML .status.allocatable 1 }}
capacity:
{{ YAML .status.capacity 1 }}
{{ $kwokVersion := printf "kwok-%s" Version }}
nodeInfo:
  architecture: amd64
  bootID: ""
  containerRuntimeVersion: {{ $kwokVersion }}
  kernelVersion: {{ $kwokVersion }}
  kubeProxyVersion: {{ $kwokVersion }}
  kubeletVersion: {{ $kwokVersion }}
  machineID: ""
  operatingSystem: linux
  osImage: ""
  systemUUID: ""
phase: Running
"""
)

# A running container's resources, as a kubelet with in-place resize (Kubernetes >= 1.33) reports them:
# the apiserver allows a resize only of pods whose running containers report theirs.
_POD_READY = """\
{{ $now := Now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: PodReadyToStartContainers
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: ContainersReady
{{ range .spec.readinessGates }}
- lastTransitionTime: {{ $now | Quote }}
  status: "True"
  type: {{ .conditionType | Quote }}
{{ end }}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  started: true
  restartCount: 0
  resources: {{ toJson (or .resources dict) }}
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
initContainerStatuses:
{{ range .spec.initContainers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  state:
    terminated:
      exitCode: 0
      finishedAt: {{ $now | Quote }}
      reason: Completed
      startedAt: {{ $now | Quote }}
{{ end }}
{{ with NodeIPWith .spec.nodeName }}
hostIP: {{ . | Quote }}
hostIPs:
- ip: {{ . | Quote }}
{{ end }}
{{ with PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) }}
podIP: {{ . | Quote }}
podIPs:
- ip: {{ . | Quote }}
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""

# The exit code comes from the annotation verbatim, so a non-numeric value fails kwok's render loudly.
_POD_COMPLETE = (
    """\
{{ $now := Now }}
{{ $annotations := or .metadata.annotations dict }}
{{ $code := index $annotations "EXIT_CODE" }}
{{ $finishedAt := or (index $annotations "FINISHED_AT") $now }}
{{ $reason := "Error" }}
{{ if eq $code "0" }}{{ $reason = "Completed" }}{{ end }}
{{ with index $annotations "REASON" }}{{ $reason = . }}{{ end }}
{{ $message := index $annotations "MESSAGE" }}
{{ $startedAt := or .status.startTime $now }}
conditions:
- lastTransitionTime: {{ $now | Quote }}
  status: "False"
  type: PodReadyToStartContainers
- lastTransitionTime: {{ $startedAt | Quote }}
  status: "True"
  type: Initialized
- lastTransitionTime: {{ $now | Quote }}
  reason: PodCompleted
  status: "False"
  type: Ready
- lastTransitionTime: {{ $now | Quote }}
  reason: PodCompleted
  status: "False"
  type: ContainersReady
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: false
  started: false
  restartCount: 0
  state:
    terminated:
      exitCode: {{ $code }}
      reason: {{ $reason | Quote }}
      startedAt: {{ $startedAt | Quote }}
      finishedAt: {{ $finishedAt | Quote }}
{{ with $message }}
      message: {{ . | Quote }}
{{ end }}
{{ end }}
{{ if eq $code "0" }}
phase: Succeeded
{{ else }}
phase: Failed
{{ end }}
startTime: {{ $startedAt | Quote }}
""".replace("EXIT_CODE", EXIT_CODE_ANNOTATION)
    .replace("REASON", REASON_ANNOTATION)
    .replace("FINISHED_AT", FINISHED_AT_ANNOTATION)
    .replace("MESSAGE", MESSAGE_ANNOTATION)
)


# What a kubelet reports for a pod whose containers it stopped for a deletion: SIGTERM, 128 + 15.
_POD_STOPPED_ON_DELETE = (
    _POD_COMPLETE.replace(f'index $annotations "{EXIT_CODE_ANNOTATION}"', '"143"')
    .replace(f'or (index $annotations "{FINISHED_AT_ANNOTATION}") $now', "$now")
    .replace(f'with index $annotations "{REASON_ANNOTATION}"', "with false")
    .replace(f'index $annotations "{MESSAGE_ANNOTATION}"', '""')
)


@dataclass(frozen=True)
class ReportLatency:
    """How late each fake node's kubelet reports: node i after i x ``step_ms`` plus up to ``jitter_ms``."""

    step_ms: int = 300
    jitter_ms: int = 900

    def delay(self, node_index: int) -> dict[str, int]:
        base = node_index * self.step_ms
        # kwok picks the delay uniformly between durationMilliseconds and jitterDurationMilliseconds.
        return {"durationMilliseconds": base, "jitterDurationMilliseconds": base + self.jitter_ms}


def _stage(
    name: str, kind: str, selector: list[dict[str, Any]], next_: dict[str, Any], **extra: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "resourceRef": {"apiGroup": "v1", "kind": kind},
        "selector": {"matchExpressions": selector},
        "next": next_,
    }
    spec.update(extra)
    return {"apiVersion": KWOK_API_VERSION, "kind": "Stage", "metadata": {"name": name}, "spec": spec}


def _per_node(
    name: str,
    selector: list[dict[str, Any]],
    next_: dict[str, Any],
    nodes: Sequence[str],
    latency: ReportLatency | None,
) -> list[dict[str, Any]]:
    """One stage, or one per node with that node's report latency, and one for every node created
    later (a test's own pool of nodes), with a latency of its own."""
    if latency is None or not nodes:
        return [_stage(name, "Pod", selector, next_)]
    return [
        *(
            _stage(
                f"{name}-{node}",
                "Pod",
                [*selector, {"key": ".spec.nodeName", "operator": "In", "values": [node]}],
                next_,
                delay=latency.delay(index),
            )
            for index, node in enumerate(nodes)
        ),
        _stage(
            f"{name}-later-nodes",
            "Pod",
            [*selector, {"key": ".spec.nodeName", "operator": "NotIn", "values": list(nodes)}],
            next_,
            delay=latency.delay(len(nodes)),
        ),
    ]


def kwok_stages(
    heartbeat_interval_ms: int = 10_000, nodes: Sequence[str] = (), latency: ReportLatency | None = None
) -> list[dict[str, Any]]:
    """The full Stage set (node and pod lifecycles) that kwok runs with; with ``latency``, the pod
    stages of each node in ``nodes`` report after that node's latency."""
    ready_not_true = {
        "key": '.status.conditions.[] | select( .type == "Ready" ) | .status',
        "operator": "NotIn",
        "values": ["True"],
    }
    ready_true = {**ready_not_true, "operator": "In"}
    ready_not_unknown = {**ready_not_true, "values": ["Unknown"]}
    alive = {"key": _NODE_LOST_KEY, "operator": "DoesNotExist"}
    lost = {"key": _NODE_LOST_KEY, "operator": "Exists"}
    # A pod of a lost node (marked like its node): its kubelet reports nothing, deletions included.
    kubelet_alive = alive
    return [
        _stage("node-initialize", "Node", [alive, ready_not_true], {"statusTemplate": _NODE_INITIALIZE}),
        _stage("node-lost", "Node", [lost, ready_not_unknown], {"statusTemplate": _NODE_LOST}),
        _stage(
            "node-heartbeat",
            "Node",
            [alive, {"key": ".status.phase", "operator": "In", "values": ["Running"]}, ready_true],
            {"statusTemplate": _NODE_CONDITIONS},
            delay={
                "durationMilliseconds": heartbeat_interval_ms,
                "jitterDurationMilliseconds": heartbeat_interval_ms + heartbeat_interval_ms // 4,
            },
            immediateNextStage=True,
        ),
        *_per_node(
            "pod-ready",
            [
                _NOT_DELETING,
                kubelet_alive,
                {"key": _EXIT_CODE_KEY, "operator": "DoesNotExist"},
                {"key": ".status.phase", "operator": "In", "values": ["Pending"]},
                ready_not_true,
            ],
            {"statusTemplate": _POD_READY},
            nodes,
            latency,
        ),
        *_per_node(
            "pod-complete-by-annotation",
            [
                _NOT_DELETING,
                kubelet_alive,
                {"key": _EXIT_CODE_KEY, "operator": "Exists"},
                {"key": ".status.phase", "operator": "In", "values": ["Pending", "Running"]},
            ],
            {"statusTemplate": _POD_COMPLETE},
            nodes,
            latency,
        ),
        *_per_node(
            "pod-stop-on-delete",
            [
                {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
                {"key": ".metadata.finalizers", "operator": "Exists"},
                kubelet_alive,
                {"key": ".status.phase", "operator": "In", "values": ["Pending", "Running"]},
            ],
            {"statusTemplate": _POD_STOPPED_ON_DELETE},
            nodes,
            latency,
        ),
        # Two stages, as a selector cannot say "or": kwok would pick at random between overlapping ones.
        _stage(
            "pod-delete",
            "Pod",
            [
                {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
                {"key": ".metadata.finalizers", "operator": "DoesNotExist"},
                kubelet_alive,
            ],
            {"delete": True},
        ),
        _stage(
            "pod-delete-stopped",
            "Pod",
            [
                {"key": ".metadata.deletionTimestamp", "operator": "Exists"},
                {"key": ".metadata.finalizers", "operator": "Exists"},
                {"key": ".status.phase", "operator": "In", "values": ["Succeeded", "Failed"]},
                kubelet_alive,
            ],
            {"delete": True},
        ),
    ]
