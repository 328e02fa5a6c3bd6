"""Whether an object found under a child's name is this job's, and how an existing child has drifted.

Pure functions of objects as the apiserver returns them. The executor passes ``is_ours`` to kube_api's
create as the rule for a 409 ("already exists" of our own object is success), and patches a Service
whose ports no longer match the job (a job resumed with other ports) and a NetworkPolicy that drifted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddp_operator import names


def is_ours(wanted: Mapping[str, Any], existing: Mapping[str, Any], owner_uid: str) -> bool:
    """Whether ``existing``, found under ``wanted``'s name, belongs to this job (and, for pods, this attempt)."""
    meta = existing.get("metadata") or {}
    owned = any(
        ref.get("uid") == owner_uid and ref.get("controller") for ref in meta.get("ownerReferences") or ()
    )
    if not owned:
        return False
    if wanted.get("kind") == "Pod":
        wanted_labels = (wanted.get("metadata") or {}).get("labels") or {}
        existing_labels = meta.get("labels") or {}
        if wanted_labels.get(names.LABEL_ATTEMPT) != existing_labels.get(names.LABEL_ATTEMPT):
            return False
        # A pod of this attempt built from another version of the spec is not the one wanted.
        existing_hash = existing_labels.get(names.LABEL_SPEC_HASH)
        return existing_hash is None or existing_hash == wanted_labels.get(names.LABEL_SPEC_HASH)
    return True


def _port_view(ports: Any) -> list[tuple[Any, ...]]:
    """A Service's ports as the builders set them, ignoring what the apiserver defaults."""
    return sorted(
        (
            port.get("name"),
            port.get("port"),
            port.get("targetPort", port.get("port")),
            port.get("protocol", "TCP"),
        )
        for port in ports or ()
    )


def service_patch(wanted: Mapping[str, Any], existing: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that brings our existing Service to the wanted one, or None when it matches."""
    wanted_spec: Mapping[str, Any] = wanted.get("spec") or {}
    existing_spec: Mapping[str, Any] = existing.get("spec") or {}
    patch: dict[str, Any] = {}
    if _port_view(wanted_spec.get("ports")) != _port_view(existing_spec.get("ports")):
        patch["ports"] = wanted_spec.get("ports")
    if wanted_spec.get("selector") != existing_spec.get("selector"):
        patch["selector"] = wanted_spec.get("selector")
    return {"spec": patch} if patch else None


def network_policy_patch(wanted: Mapping[str, Any], existing: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that brings our existing NetworkPolicy to the wanted one, or None when it matches.

    A job resumed with another metrics port, or an operator restarted with another --metrics-allow-from,
    changes the policy. Lists are replaced whole by a merge patch, which is what is wanted here.
    """
    wanted_spec: Mapping[str, Any] = wanted.get("spec") or {}
    existing_spec: Mapping[str, Any] = existing.get("spec") or {}
    patch = {key: value for key, value in wanted_spec.items() if existing_spec.get(key) != value}
    return {"spec": patch} if patch else None
