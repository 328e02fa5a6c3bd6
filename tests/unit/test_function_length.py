"""No function of the product (and the harness) is longer than MAX_LINES, except declarative tables.

A long function that does things mixes steps a reader has to hold at once; a table (an argument
parser, a set of manifests, a list of metric declarations) reads line by line, so it may be long.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"ddp_operator": "operator", "ddp_trainer": "trainer_image", "ddp_harness": "harness"}
MAX_LINES = 80

# Declarative tables, each "module.function": one declaration per line, nothing done between them.
DECLARATIVE_TABLES = {
    # Argument parsers: one add_argument per option.
    "ddp_operator.commands.operator.configure_parser",
    "ddp_trainer.config.build_parser",
    # The rank's Prometheus series: one declaration (name, help, buckets) per series.
    "ddp_trainer.metrics.create_rank_metrics",
    # kwok's Stage objects (a CRD's instances): node and pod lifecycles, one Stage per entry.
    "ddp_harness.kwok_stages.kwok_stages",
    # The API objects a real node needs (Service, endpoints, RBAC, StorageClass): manifests.
    "ddp_harness.node_manifests.api_objects",
}


def _functions() -> dict[str, int]:
    """ "module.function" (methods and nested functions by their dotted path) -> lines."""
    found: dict[str, int] = {}
    for package, base in PACKAGES.items():
        for path in sorted((ROOT / base / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT / base).with_suffix("").parts).removesuffix(".__init__")

            def visit(node: ast.AST, prefix: str) -> None:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        name = f"{prefix}.{child.name}"
                        if not isinstance(child, ast.ClassDef):
                            assert child.end_lineno is not None
                            found[name] = child.end_lineno - child.lineno + 1
                        visit(child, name)

            visit(ast.parse(path.read_text()), module)
    return found


def test_no_function_is_longer_than_the_limit_but_declarative_tables() -> None:
    lengths = _functions()
    long = {name: lines for name, lines in lengths.items() if lines > MAX_LINES}
    assert set(long) - DECLARATIVE_TABLES == set(), f"split these (or, if a table, allow-list them): {long}"


def test_every_allow_listed_table_exists_and_is_long() -> None:
    lengths = _functions()
    stale = {name for name in DECLARATIVE_TABLES if lengths.get(name, 0) <= MAX_LINES}
    assert stale == set(), f"no longer long (or gone): take them off DECLARATIVE_TABLES: {stale}"


def test_the_walk_sees_methods_and_nested_functions() -> None:
    lengths = _functions()
    assert "ddp_operator.controller.Controller.reconcile" in lengths
    assert "ddp_trainer.metrics.create_rank_metrics.counter" in lengths
