"""Turn the operator's own rank pod manifests into local process specs (pure).

`ddpjob run` builds each rank pod with the very builders the operator uses, then runs the pod's
`trainer` container here: its command and args as argv and its env as the process environment,
with the addresses rewritten for one machine. The image is not used.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddp_operator.builders import CONTRACT_ENV
from ddp_operator.names import TRAINER_CONTAINER
from ddp_operator.quantity import parse_quantity

LOCALHOST = "127.0.0.1"

# Variables of the env contract (and torchrun's own) that must come from the pod, never from the
# shell `ddpjob run` was started in: a stray RANK in the user's shell would break the group.
CONTRACT_PREFIXES = ("PET_", "TORCHELASTIC_", "DDP_", "DDPJOB_", "PROMETHEUS_MULTIPROC")
CONTRACT_NAMES = frozenset(CONTRACT_ENV) | {
    # What torchrun itself exports to its workers.
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
}

METRICS_LINGER_SECONDS = 15
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


class PlanError(ValueError):
    """A pod that cannot run locally; ``field`` is the path in the manifest to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class LocalAddresses:
    """What replaces the cluster's addresses for one pod of one attempt."""

    master_port: int
    metrics_port: int
    checkpoint_dir: str


@dataclass(frozen=True)
class Host:
    """Facts about this machine that the downward API would have reported from the node."""

    node_name: str
    cpus: int
    memory_bytes: int
    python: str
    loopback_interface: str | None = "lo"


@dataclass(frozen=True)
class ProcessSpec:
    pod_name: str
    rank: int
    argv: tuple[str, ...]
    env: Mapping[str, str]
    metrics_port: int
    notes: tuple[str, ...] = field(default=())


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: ``$$`` escapes, undefined references stay as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                close = text.find(")", i + 2)
                if close >= 0:
                    name = text[i + 2 : close]
                    out.append(variables.get(name, text[i : close + 1]))
                    i = close + 1
                    continue
        out.append(char)
        i += 1
    return "".join(out)


def _label_key(path: str, prefix: str) -> str | None:
    match = re.fullmatch(re.escape(prefix) + r"\['([^']*)'\]", path)
    return match.group(1) if match else None


def _field_ref(path: str, pod: Mapping[str, Any], where: str) -> str:
    metadata = pod.get("metadata", {})
    simple = {
        "metadata.name": metadata.get("name", ""),
        "metadata.namespace": metadata.get("namespace", "default"),
        "metadata.uid": metadata.get("uid", f"local-{metadata.get('name', '')}"),
        "spec.serviceAccountName": pod.get("spec", {}).get("serviceAccountName", "default"),
        "status.podIP": LOCALHOST,
        "status.podIPs": LOCALHOST,
        "status.hostIP": LOCALHOST,
        "status.hostIPs": LOCALHOST,
    }
    if path in simple:
        return str(simple[path])
    for prefix, source in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        key = _label_key(path, prefix)
        if key is not None:
            return str(metadata.get(source, {}).get(key, ""))
    raise PlanError(f"{where}.fieldRef.fieldPath", f"{path!r} is not a downward API field")


def _resource_ref(ref: Mapping[str, Any], container: Mapping[str, Any], host: Host, where: str) -> str:
    resource = str(ref.get("resource", ""))
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage"):
        raise PlanError(f"{where}.resourceFieldRef.resource", f"{resource!r} is not supported locally")
    resources = container.get("resources", {})
    declared = resources.get(kind, {}).get(name)
    if declared is None and kind == "requests":
        declared = resources.get("limits", {}).get(name)
    if declared is not None:
        amount = parse_quantity(declared)
    elif name == "cpu":
        amount = float(host.cpus) if kind == "limits" else 0.0
    elif name == "memory":
        amount = float(host.memory_bytes) if kind == "limits" else 0.0
    else:
        amount = 0.0
    divisor = parse_quantity(ref.get("divisor", "1"))
    # The kubelet rounds up, so a 500m limit with the default divisor reads as "1".
    return str(math.ceil(amount / divisor))


def _value_from(
    source: Mapping[str, Any],
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    host: Host,
    where: str,
) -> str | None:
    """Resolve one ``valueFrom``; None means "leave the variable unset" (an optional reference)."""
    if "fieldRef" in source:
        return _field_ref(str(source["fieldRef"].get("fieldPath", "")), pod, where)
    if "resourceFieldRef" in source:
        return _resource_ref(source["resourceFieldRef"], container, host, where)
    for kind in ("configMapKeyRef", "secretKeyRef"):
        if kind in source:
            if source[kind].get("optional"):
                return None
            raise PlanError(
                f"{where}.{kind}",
                f"{kind} {source[kind].get('name')!r}/{source[kind].get('key')!r} cannot be read without a "
                "cluster; fix: pass the value with --env NAME=VALUE or mark the reference optional",
            )
    raise PlanError(where, "valueFrom names no source this command knows")


def machine_defaults(host: Host, env: Mapping[str, str]) -> dict[str, str]:
    """Settings a pod gets from having a node to itself, which one shared machine must spell out.

    Every rank of the job shares this machine's cores: without a thread limit each would start one
    intra-op thread per core and they would fight over them. Gloo binds the interface its hostname
    resolves to unless told otherwise; loopback keeps everything on 127.0.0.1.
    """
    try:
        processes = max(1, int(env.get("WORLD_SIZE", "1")))
    except ValueError:
        processes = 1
    defaults = {
        "OMP_NUM_THREADS": str(max(1, host.cpus // processes)),
        # A trainer that reads it keeps /metrics up after training until `ddpjob run` has taken the
        # final numbers for its summary (and then sends SIGTERM, which ends the wait with exit 0).
        "DDP_METRICS_LINGER": str(METRICS_LINGER_SECONDS),
    }
    if host.loopback_interface:
        defaults["GLOO_SOCKET_IFNAME"] = host.loopback_interface
    return defaults


def local_argv(command: Sequence[str], host: Host) -> tuple[str, ...]:
    """Point the image's interpreter and torchrun at this environment's Python.

    The image's paths (``/usr/bin/python3``, ``/opt/conda/bin/torchrun``) mean nothing here; what the
    manifest means is "this program, with the packages that the image would have".
    """
    if not command:
        return ()
    head, rest = command[0], tuple(command[1:])
    base = head.rsplit("/", 1)[-1]
    if _PYTHON.fullmatch(base):
        return (host.python, *rest)
    if base == "torchrun":
        return (host.python, "-m", "torch.distributed.run", *rest)
    return (head, *rest)


def find_trainer(pod: Mapping[str, Any]) -> tuple[int, Mapping[str, Any]]:
    containers = pod.get("spec", {}).get("containers", [])
    for index, container in enumerate(containers):
        if container.get("name") == TRAINER_CONTAINER:
            return index, container
    raise PlanError("spec.template.spec.containers", f"no container is named {TRAINER_CONTAINER!r}")


def plan_process(
    pod: Mapping[str, Any],
    rank: int,
    addresses: LocalAddresses,
    host: Host,
    base_env: Mapping[str, str],
    *,
    overrides: Mapping[str, str] | None = None,
    template: Mapping[str, Any] | None = None,
) -> ProcessSpec:
    """The local process for one rank pod.

    ``base_env`` is the environment `ddpjob run` itself was started with (the container's would come
    from the image); ``overrides`` are the user's ``--env`` values, which win over the manifest.
    ``template`` is the job's pod template, so that errors point at the line the user wrote (the
    builders put the contract's variables in front of the user's).
    """
    index, container = find_trainer(pod)
    where = f"spec.template.spec.containers[{index}]"
    written_env = list(find_trainer(template)[1].get("env") or []) if template is not None else []

    def env_path(pod_index: int, name: str) -> str:
        for written_index, entry in enumerate(written_env):
            if entry.get("name") == name:
                return f"{where}.env[{written_index}]"
        return f"{where}.env[{pod_index}]"

    written = {
        str(e.get("name", "")): str(e.get("value", "")) for e in container.get("env", []) if "value" in e
    }
    local = _local_env(addresses, written)
    user = dict(overrides or {})
    env: dict[str, str] = {}
    for env_index, entry in enumerate(container.get("env", [])):
        name = str(entry.get("name", ""))
        if name in local:
            env[name] = local[name]
        elif name in user:
            env[name] = user[name]
        elif "valueFrom" in entry:
            value = _value_from(
                entry["valueFrom"], pod, container, host, f"{env_path(env_index, name)}.valueFrom"
            )
            if value is not None:
                env[name] = value
        else:
            env[name] = expand(str(entry.get("value", "")), env)
    env.update(local)
    env.update(user)
    for name, value in machine_defaults(host, env).items():
        if name not in env:
            # A value in the caller's shell wins over this machine's default (and is passed on
            # explicitly: the DDP_* variables of the shell are not inherited).
            env[name] = base_env.get(name, value)
    # An empty command is no command, as in Kubernetes: the image's entrypoint runs.
    if container.get("command"):
        command = [expand(str(part), env) for part in container["command"]]
    else:
        command = ["python", "-m", "ddp_trainer"]
    args = [expand(str(part), env) for part in container.get("args", [])]
    argv = local_argv([*command, *args], host)
    if not argv:
        raise PlanError(f"{where}.command", "is empty")

    return ProcessSpec(
        pod_name=str(pod.get("metadata", {}).get("name", f"rank-{rank}")),
        rank=rank,
        argv=argv,
        env={**_inherited(base_env, host), **env},
        metrics_port=addresses.metrics_port,
        notes=_skipped_env_from(container, where),
    )


def _local_env(addresses: LocalAddresses, contract: Mapping[str, str]) -> dict[str, str]:
    """The contract's variables that differ on this machine: they win over the manifest's."""
    local = {
        "MASTER_ADDR": LOCALHOST,
        "PET_MASTER_ADDR": LOCALHOST,
        "MASTER_PORT": str(addresses.master_port),
        "PET_MASTER_PORT": str(addresses.master_port),
        "DDP_METRICS_PORT": str(addresses.metrics_port),
        "DDP_CHECKPOINT_DIR": addresses.checkpoint_dir,
        "POD_IP": LOCALHOST,
        "PYTHONUNBUFFERED": "1",
        # The trainer's endpoint binds all addresses in a pod; on a workstation only loopback.
        "DDP_METRICS_HOST": LOCALHOST,
    }
    if "PET_RDZV_ENDPOINT" in contract:
        # In place (docs/restarts.md): the rendezvous rank 0's launcher hosts, on this machine. There is
        # no rendezvous pod here (a local pod lost restarts the whole gang: docs/cli.md), so an empty
        # DDP_RENDEZVOUS_ENDPOINT (unset, to the trainer) and rank 0 the store's host.
        local["PET_RDZV_ENDPOINT"] = f"{LOCALHOST}:{addresses.master_port}"
        rank0 = contract.get("NODE_RANK", contract.get("PET_NODE_RANK")) == "0"
        conf = contract.get("PET_RDZV_CONF", "is_host=0").split(",")
        local["PET_RDZV_CONF"] = ",".join([f"is_host={int(rank0)}", *conf[1:]])
        if "DDP_RENDEZVOUS_ENDPOINT" in contract:
            local["DDP_RENDEZVOUS_ENDPOINT"] = ""
    return local


def _skipped_env_from(container: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """A note for each required envFrom source, which cannot be read without a cluster."""
    notes: list[str] = []
    for from_index, source in enumerate(container.get("envFrom", [])):
        ref = source.get("configMapRef") or source.get("secretRef") or {}
        if not ref.get("optional"):
            notes.append(
                f"{where}.envFrom[{from_index}]: {ref.get('name')!r} cannot be read without a cluster; skipped"
            )
    return tuple(notes)


def _inherited(base_env: Mapping[str, str], host: Host) -> dict[str, str]:
    """What the process inherits from `ddpjob run`'s own environment: not the contract's variables,
    and a PATH that finds this Python first."""
    inherited = {
        key: value
        for key, value in base_env.items()
        if key not in CONTRACT_NAMES and not key.startswith(CONTRACT_PREFIXES)
    }
    python_dir = os.path.dirname(host.python)
    if python_dir:
        inherited["PATH"] = os.pathsep.join(p for p in (python_dir, inherited.get("PATH", "")) if p)
    return inherited
