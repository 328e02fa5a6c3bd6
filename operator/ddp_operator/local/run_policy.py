"""Which ``spec.runPolicy`` fields `ddpjob run` honours, and the warning it prints for the others.

Honoured fields go through the operator's own policy code (``ddp_operator.policies``), so they act
the same here as on a cluster. The others have no local meaning; `ddpjob run` names each one set in
the manifest at start, so nobody takes its silence for the operator's behaviour (docs/local-run.md).
tests/unit/test_local_run_policy.py holds this table against every field of the CRD.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final


@dataclass(frozen=True)
class LocalSupport:
    honoured: bool
    # Honoured: what it does here; not honoured: why it cannot be.
    why: str


RUN_POLICY: Final[Mapping[str, LocalSupport]] = {
    "backoffLimit": LocalSupport(True, "retried attempts count against it (policies.failure)"),
    "activeDeadlineSeconds": LocalSupport(True, "stops every rank and fails the job, DeadlineExceeded"),
    "stallTimeoutSeconds": LocalSupport(
        True, "no new synchronized step for it restarts the gang, reason Stalled (policies.stall)"
    ),
    "suspend": LocalSupport(True, "true runs nothing and exits 0"),
    "restartMode": LocalSupport(
        True,
        "InPlace: each rank's launcher restarts its workers in place, counted against backoffLimit "
        "from rank 0's metrics and printed (policies.recovery); Recreate: every retry is a new attempt",
    ),
    "startupDeadlineSeconds": LocalSupport(
        False, "local processes start at once: nothing is scheduled, no image is pulled"
    ),
    "ttlSecondsAfterFinished": LocalSupport(False, "no DDPJob object exists here, so none is deleted"),
    "cleanPodPolicy": LocalSupport(False, "no pod is kept: every process of the job ends with each attempt"),
    "stragglerPolicy": LocalSupport(
        False,
        "the straggler is reported (its rank, slowdown and phase in the live line and the summary), "
        "never replaced: Replace and Shrink move a pod to another node, and every local rank shares this machine",
    ),
    "standbyPods": LocalSupport(
        False,
        "no standby process is started: a standby saves a replacement pod's start (scheduling, the "
        "sandbox, the torch import), and no local pod is replaced alone",
    ),
}


# Fields of spec.scheduling without a local meaning (the gang and Kueue fields are silently moot: every
# rank starts at once here, which is what they ask for).
SCHEDULING: Final[Mapping[str, LocalSupport]] = {
    "topology": LocalSupport(
        False, "every local rank runs on this machine: one host, no rack or block to place the ranks by"
    ),
}


def warnings(manifest: Mapping[str, Any]) -> list[str]:
    """One warning per runPolicy or scheduling field the manifest sets that `ddpjob run` does not honour."""
    spec = manifest.get("spec")
    if not isinstance(spec, Mapping):
        return []
    found: list[str] = []
    for section, table in (("runPolicy", RUN_POLICY), ("scheduling", SCHEDULING)):
        fields = spec.get(section)
        if not isinstance(fields, Mapping):
            continue
        found.extend(
            f"spec.{section}.{name} is not honoured by ddpjob run: {support.why}"
            for name, support in table.items()
            if name in fields and not support.honoured
        )
    return found
