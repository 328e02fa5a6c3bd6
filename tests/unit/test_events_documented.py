"""docs/api.md lists every Event reason the operator posts, and no other (a list that mirrors code is
tested against it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddp_operator import reconcile

pytestmark = pytest.mark.unit

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
# The Events posted without a phase change: reconcile.py's reasons that no condition carries.
EVENT_ONLY = ("STRAGGLER", "RESTARTED_IN_PLACE", "RESIZED", "POD_REPLACED", "RECOVERED")


def documented_events() -> set[str]:
    text = API_DOC.read_text()
    table = text[text.index("| Event | type | when |") :].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE))


def test_every_event_the_operator_posts_is_documented_and_nothing_else() -> None:
    posted = {getattr(reconcile, f"REASON_{name}") for name in EVENT_ONLY}
    assert documented_events() == posted


def documented_reasons() -> set[str]:
    """Every reason of the "Reasons" table (a phase change's Event carries it)."""
    text = API_DOC.read_text()
    table = text[text.index("| reason | phase | meaning |") :].split("\n\n", 1)[0]
    cells = re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
    return {name for cell in cells for name in re.findall(r"`(\w+)`", cell)}


def test_every_event_reason_in_reconcile_is_in_one_of_the_two_tables() -> None:
    source = Path(reconcile.__file__).read_text()
    posted = {
        getattr(reconcile, f"REASON_{name}")
        for name in re.findall(r"PhaseEvent\([^)]*reason=REASON_(\w+)", source, re.DOTALL)
    }
    assert posted, "no PhaseEvent found: the pattern no longer matches reconcile.py"
    assert posted <= documented_reasons() | documented_events()
