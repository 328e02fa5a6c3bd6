"""A rank the kubelet will never start: its image runs as root, and rank pods run with
``securityContext.runAsNonRoot`` (the operator's default). Failed at once, naming the fix, rather than
left to the startup deadline."""

from __future__ import annotations

from typing import Final

from ddp_operator import names
from ddp_operator.decision import REASON_INVALID_SPEC
from ddp_operator.observe import PodObservation
from ddp_operator.policies.rule import Attempt, Finish, Outcome, Rule, never


def refused(live: Attempt) -> PodObservation | None:
    """The lowest rank's pod whose trainer the kubelet refuses to run as root."""
    return next((p for p in sorted(live.current, key=lambda p: p.rank or 0) if p.refuses_root_image), None)


def _fail(live: Attempt, pod: PodObservation | None) -> Outcome | None:
    if pod is None:
        return None
    message = (
        f"rank {pod.rank}'s trainer cannot start: {pod.waiting_message}; rank pods run with "
        "securityContext.runAsNonRoot (the operator's default): use an image whose USER is a numeric "
        "non-root id, or set spec.template.spec.securityContext.runAsUser"
    )
    return Finish(names.PHASE_FAILED, REASON_INVALID_SPEC, message)


RULES: Final = (Rule("root_image_refused", 60, refused, _fail, never),)
