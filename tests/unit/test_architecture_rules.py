"""docs/architecture.md lists the rules of an attempt in the order decide() walks them (the registry of
policies/registry.py), each with the module that is its home; and no policy imports the registry (it
imports them: a policy that did would import itself through it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ddp_operator.policies import registry

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
POLICIES = ROOT / "operator" / "ddp_operator" / "policies"


def test_the_documented_rules_are_the_live_rules_in_their_order() -> None:
    text = DOC.read_text()
    table = text[text.index("| rule | home | asked | decides |") :].split("\n\n", 1)[0]
    documented = re.findall(r"^\s*\| `(\w+)` \| `policies/(\w+)\.py` \|", table, re.MULTILINE)
    registered = [(r.name, r.decide.__module__.rsplit(".", 1)[-1]) for r in registry.every()]
    assert documented == registered


def test_every_registered_rule_lives_in_its_policy_module() -> None:
    for rule in registry.every():
        homes = {f.__module__ for f in (rule.facts, rule.decide)}
        assert homes <= {rule.decide.__module__, "ddp_operator.policies.rule"}, rule.name


def test_no_policy_imports_the_registry() -> None:
    for path in sorted(POLICIES.glob("*.py")):
        if path.stem == "registry":
            continue
        imported = {
            node.module
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
        } | {
            f"{node.module}.{alias.name}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }
        assert "ddp_operator.policies.registry" not in imported, path.name
