"""What a restart's Events and summaries say: one line per restart record, and per ``status.lostSeconds``.
Shared by the operator and `ddpjob run`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from ddp_operator.decision import REASON_RECOVERED, REASON_RESIZED, REASON_RESTARTED_IN_PLACE, PhaseEvent
from ddp_operator.policies.accounting import (
    CAUSE_MEMBER_JOINED,
    LOST_PHASES,
    MODE_IN_PLACE,
    MODE_POD_REPLACED,
    MODE_WHOLE_GANG,
    RestartAccounting,
    resize,
)


def describe_lost(lost: Mapping[str, Any]) -> str:
    """``status.lostSeconds`` in one line: the total over the restarts summed, then each phase that cost
    anything (`ddpjob describe`, `ddpjob run`'s closing line)."""
    phases = ", ".join(f"{key} {lost[key]}s" for key in LOST_PHASES if _positive(lost.get(key)))
    return f"{lost.get('total', '0')}s to {lost.get('restarts', 0)} restart(s)" + (
        f": {phases}" if phases else ""
    )


def _positive(value: object) -> bool:
    try:
        return float(str(value)) > 0
    except ValueError:
        return False


def describe(record: Mapping[str, Any], restarts: int, backoff_limit: int) -> str:
    """One line for the restart's Event: what failed, how it was recovered, and what it cost."""
    mode = {
        MODE_IN_PLACE: "restarted in place",
        MODE_POD_REPLACED: "replaced the lost pod alone; the others restarted in place",
        MODE_WHOLE_GANG: "recreated the whole gang",
    }.get(str(record.get("mode")), str(record.get("mode")))
    what = str(record.get("cause", "a failure"))
    if "rank" in record:
        what += f" of rank {record['rank']}"
    if "exitCode" in record:
        what += f" (exit code {record['exitCode']})"
    sizes = resize(record)
    if sizes is not None and sizes[1] > sizes[0] and record.get("cause") == CAUSE_MEMBER_JOINED:
        parts = [f"pods joined: the group grew from {sizes[0]} to {sizes[1]} pods in place (not a failure)"]
    else:
        parts = [f"{what}: {mode} (restart {restarts} of {backoff_limit})"]
        if sizes is not None:
            parts.append(
                f"the group {'grew' if sizes[1] > sizes[0] else 'shrank'} from {sizes[0]} to {sizes[1]} pods"
            )
    phases = [
        f"{label} {record[key]}s"
        for key, label in (
            ("stoppedSeconds", "survivors stopped after"),
            ("reformedSeconds", "group re-formed after"),
            ("resumedSeconds", "training again after"),
        )
        if key in record
    ]
    if phases:
        parts.append(", ".join(phases))
    if "stepsRedone" in record:
        parts.append(f"{record['stepsRedone']} step(s) redone")
    if record.get("note"):
        parts.append(str(record["note"]))
    return "; ".join(parts)


@dataclass(frozen=True)
class RestartNotice:
    """What a read's restart record tells: a resize, an in-place restart or a recovery, and its text."""

    kind: Literal["resized", "in-place", "recovered"]
    warning: bool
    text: str


def restart_notice(
    accounting: RestartAccounting, restarts: int, backoff_limit: int, *, resized: bool
) -> RestartNotice | None:
    """An elastic group's resize (``resized``: status counts it; a warning when the group shrank), else
    an in-place restart the launchers made (a warning), else a restart whose cost is now known."""
    record = accounting.record
    if record is None:
        return None
    text = describe(record, restarts, backoff_limit)
    sizes = resize(record)
    if resized and sizes is not None:
        return RestartNotice("resized", warning=sizes[1] <= sizes[0], text=text)
    if accounting.added:
        return RestartNotice("in-place", warning=True, text=text)
    if accounting.measured is not None:
        return RestartNotice("recovered", warning=False, text=text)
    return None


# The Event of each notice restart_notice gives.
_NOTICE_REASONS: Final = {
    "resized": REASON_RESIZED,
    "in-place": REASON_RESTARTED_IN_PLACE,
    "recovered": REASON_RECOVERED,
}


def notice_events(
    accounting: RestartAccounting, restarts: int, backoff_limit: int, *, resized: bool
) -> tuple[PhaseEvent, ...]:
    """The Event of what a read says of restarts (``restart_notice``), if any."""
    notice = restart_notice(accounting, restarts, backoff_limit, resized=resized)
    if notice is None:
        return ()
    kind: Literal["Normal", "Warning"] = "Warning" if notice.warning else "Normal"
    return (PhaseEvent(type=kind, reason=_NOTICE_REASONS[notice.kind], message=notice.text),)
