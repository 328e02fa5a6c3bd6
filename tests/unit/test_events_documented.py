"""docs/api.md lists every Event reason the operator posts, and no other (a list that mirrors code is
tested against it)."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import pytest

from ddp_operator import decision

pytestmark = pytest.mark.unit

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
PACKAGE = Path(decision.__file__).resolve().parent
# The Events posted without a phase change: the operator's reasons that no condition carries.
EVENT_ONLY = (
    "STRAGGLER",
    "STRAGGLER_REPLACED",
    "STRAGGLER_NOT_REPLACED",
    "RESTARTED_IN_PLACE",
    "RESIZED",
    "POD_REPLACED",
    "RECOVERED",
    "STANDBY_YIELDED",
    "STANDBY_NOT_CREATED",
    "STANDBY_NOT_RESIZED",
    "RENDEZVOUS_REPLACED",
)


def documented_events() -> set[str]:
    text = API_DOC.read_text()
    table = text[text.index("| Event | type | when |") :].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE))


def test_every_event_the_operator_posts_is_documented_and_nothing_else() -> None:
    posted = {getattr(decision, f"REASON_{name}") for name in EVENT_ONLY}
    assert documented_events() == posted
    # The same list found in the code: what the operator posts that no condition carries.
    scanned = set().union(*posted_reasons().values())
    assert documented_events() == scanned - documented_reasons()


def documented_reasons() -> set[str]:
    """Every reason of the "Reasons" table (a phase change's Event carries it)."""
    text = API_DOC.read_text()
    table = text[text.index("| reason | phase | meaning |") :].split("\n\n", 1)[0]
    cells = re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
    return {name for cell in cells for name in re.findall(r"`(\w+)`", cell)}


def _value(module: ModuleType, node: ast.expr) -> object:
    """What a constant expression names in ``module``: a literal, a name, a dotted name, or an item of
    a mapping (every value of it: any may be the one looked up). None for anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return getattr(module, node.id, None)
    if isinstance(node, ast.Attribute):
        return getattr(_value(module, node.value), node.attr, None)
    if isinstance(node, ast.Subscript):
        table = _value(module, node.value)
        return frozenset(table.values()) if isinstance(table, Mapping) else None
    return None


def _is_phase_event(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Name) and func.id == "PhaseEvent") or (
        isinstance(func, ast.Attribute) and func.attr == "PhaseEvent"
    )


def posted_reasons() -> dict[str, set[str]]:
    """Module -> the reasons of the PhaseEvents it builds, for every module of the operator that builds
    one; a reason held in a variable (a phase change's, from the conditions table) is not resolved."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and _is_phase_event(node)
        ]
        if not calls:
            continue
        name = ".".join((PACKAGE.name, *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        module = importlib.import_module(name)
        reasons: set[str] = set()
        for call in calls:
            for keyword in call.keywords:
                value = _value(module, keyword.value) if keyword.arg == "reason" else None
                values = value if isinstance(value, frozenset) else {value}
                reasons |= {v for v in values if isinstance(v, str)}
        found[name] = reasons
    return found


def test_every_event_reason_in_reconcile_is_in_one_of_the_two_tables() -> None:
    """Every module that builds a PhaseEvent is scanned, not reconcile.py alone."""
    found = posted_reasons()
    assert "ddp_operator.reconcile" in found, "no PhaseEvent found: the scan no longer matches the code"
    posted = set().union(*found.values())
    assert {getattr(decision, f"REASON_{name}") for name in EVENT_ONLY} <= posted
    assert posted <= documented_reasons() | documented_events()


def test_every_reason_decision_names_is_documented() -> None:
    named = {value for key, value in vars(decision).items() if key.startswith("REASON_")}
    assert named <= documented_reasons() | documented_events()
