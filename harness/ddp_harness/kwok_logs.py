"""Container logs of the pods on kwok's fake nodes, served through the real apiserver: pure builders.

`GET /api/v1/namespaces/<ns>/pods/<pod>/log` (`kubectl logs`, with or without `follow=true`) works for
a kwok pod as for a kubelet's: the apiserver reads the pod's node, dials
``status.addresses[InternalIP]:status.daemonEndpoints.kubeletEndpoint.Port`` over HTTPS (always HTTPS:
k8s.io/kubernetes pkg/kubelet/client/kubelet_client.go), verifies the serving certificate against
``--kubelet-certificate-authority``, and relays ``/containerLogs/<ns>/<pod>/<container>``. A log
request is long-running for the apiserver: no request timeout cuts a follow stream.

The pieces, and why each lives where it does:

- kwok's server (``--server-address``, the same port as ``--node-port``, which the node-initialize
  stage writes into the node's daemonEndpoints) serves TLS and plain HTTP on one port once given
  ``--tls-cert-file``/``--tls-private-key-file`` (sigs.k8s.io/kwok v0.8.0 pkg/kwok/server/server.go,
  ``Run``); pki.py signs that certificate for the node IP (manifests.kwok_command passes it).
- kwok answers ``/containerLogs`` from files (pkg/kwok/server/debugging_logs.go): a ``Logs`` object
  named after the pod (namespace and name must match) or a ``ClusterLogs`` whose selector matches it
  names a ``logsFile`` (no templating: one path per object), read with the kubelet's own reader
  (k8s.io/cri-client pkg/logs ``ReadLogs``), so the file is in the CRI log format (``cri_records``).
- kwok watches ``Logs`` objects when started with ``--enable-crds=Logs`` (pkg/kwok/cmd/root.go), and a
  file config cannot know the pods in advance, so the harness installs the ``Logs`` CRD (``logs_crd``)
  before kwok starts, and ``LocalCluster.write_pod_log`` creates one ``Logs`` object per pod
  (``pod_logs``), owned by the pod so the garbage collector removes it with the pod. The file is per
  pod UID (``pod_log_file``): a later pod of the same name gets a log of its own at its first write
  (until then, and until the garbage collector removes the earlier pod's object, it reads the earlier
  pod's log).
- A pod nobody wrote a log for has no ``Logs`` object: kwok answers 400 ("no logs found for
  container"), which the apiserver relays, as a kubelet does for a container that has not started.

Follow streams never end on their own: kwok's stand-in for the container runtime answers every status
query with "Unavailable", which the reader takes as "still running", so a follow stream of a kwok pod
stays open after the pod is deleted (a kubelet's ends once the container stops). A client that follows
logs across pod replacements closes it when it sees the pod go, as it must anyway for a node that
went silent.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ddp_harness.kwok_stages import KWOK_API_VERSION

KWOK_GROUP = "kwok.x-k8s.io"
LOGS_CRD_NAME = f"logs.{KWOK_GROUP}"
LOGS_KIND = "Logs"  # kwok's --enable-crds value
LOGS_PLURAL = "logs"
# CRI log records: "<RFC 3339 nanoseconds> <stdout|stderr> <F(ull)|P(artial)> <content>\n".
_CRI_STREAM = "stdout"
_CRI_FULL_LINE = "F"


def logs_crd() -> dict[str, Any]:
    """The CustomResourceDefinition of kwok's namespaced ``Logs`` (kwok.x-k8s.io/v1alpha1), with the
    fields kwok v0.8.0 reads (pkg/apis/v1alpha1/logs_types.go)."""
    log_entry = {
        "type": "object",
        "properties": {
            "containers": {"type": "array", "items": {"type": "string"}},
            "logsFile": {"type": "string"},
            "previousLogsFile": {"type": "string"},
            "follow": {"type": "boolean"},
        },
    }
    schema = {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {
                "type": "object",
                "required": ["logs"],
                "properties": {"logs": {"type": "array", "items": log_entry}},
            },
            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": LOGS_CRD_NAME},
        "spec": {
            "group": KWOK_GROUP,
            "names": {"kind": LOGS_KIND, "listKind": "LogsList", "plural": LOGS_PLURAL, "singular": "logs"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": KWOK_API_VERSION.split("/", 1)[1],
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {"status": {}},
                }
            ],
        },
    }


def logs_path(namespace: str, name: str = "") -> str:
    """The API path of the Logs objects of a namespace, or of one of them."""
    base = f"/apis/{KWOK_API_VERSION}/namespaces/{namespace}/{LOGS_PLURAL}"
    return f"{base}/{name}" if name else base


def pod_log_file(pod_logs_dir: Path, namespace: str, pod: str, uid: str) -> Path:
    """Where one pod's log lives: a directory per pod, like the kubelet's /var/log/pods/<ns>_<pod>_<uid>,
    so a follow stream (which watches the file's directory) wakes only for its own pod."""
    return pod_logs_dir / f"{namespace}_{pod}_{uid}" / "containers.log"


def pod_logs(namespace: str, pod: str, uid: str, log_file: Path) -> dict[str, Any]:
    """The Logs object that points every container of the pod at ``log_file``; the pod owns it."""
    return {
        "apiVersion": KWOK_API_VERSION,
        "kind": LOGS_KIND,
        "metadata": {
            "name": pod,
            "namespace": namespace,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}],
        },
        # No `containers`: the entry is the default for every container of the pod.
        "spec": {"logs": [{"logsFile": str(log_file)}]},
    }


def logs_target(obj: dict[str, Any]) -> tuple[str | None, str | None]:
    """(owner pod UID, logsFile) of a Logs object made by ``pod_logs``."""
    owners = obj.get("metadata", {}).get("ownerReferences") or [{}]
    entries = obj.get("spec", {}).get("logs") or [{}]
    return owners[0].get("uid"), entries[0].get("logsFile")


def cri_records(text: str, now: datetime | None = None) -> str:
    """``text`` as CRI log records on stdout, one per line, stamped ``now`` (default: the current time).
    A missing final newline is implied; "" is no record at all."""
    if not text:
        return ""
    stamp = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lines = text.removesuffix("\n").split("\n")
    return "".join(f"{stamp} {_CRI_STREAM} {_CRI_FULL_LINE} {line}\n" for line in lines)


def log_text(records: str) -> str:
    """What a log read returns for a file of ``cri_records``: every record's content, one line each."""
    lines = records.removesuffix("\n").split("\n") if records else []
    return "".join(record.split(" ", 3)[3] + "\n" for record in lines)
