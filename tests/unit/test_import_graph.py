"""No import circle in our packages, late (function-level) imports included: a circle dodged by
importing late is still a circle. The product and the harness are checked alike."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"ddp_operator": "operator", "ddp_trainer": "trainer_image", "ddp_harness": "harness"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, base in PACKAGES.items():
        for path in (ROOT / base / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT / base).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports anywhere in its body (`from pkg import sub` is an edge
    to pkg.sub, not to pkg)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                targets |= submodules
                if len(submodules) < len(node.names):
                    targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = (targets & modules.keys()) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> None:
        visiting.append(module)
        for target in sorted(graph[module]):
            if target in visiting:
                found.append([*visiting[visiting.index(target) :], target])
            elif target not in done:
                visit(target)
        visiting.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b", "a"]]


def test_no_import_circle_in_our_packages() -> None:
    graph = _import_graph()
    assert "ddp_harness.real_node" in graph and "ddp_operator.cli" in graph
    assert _cycles(graph) == []


# Packages that must not depend on another of ours, anywhere in their bodies. The operator runs without
# the trainer's dependencies (torch, numpy), so a value both need (a histogram's buckets, an exit
# marker) is written out on the operator's side and tied to the trainer's by a unit test instead.
@pytest.mark.parametrize(
    ("importer", "imported"),
    [pytest.param("ddp_operator", "ddp_trainer", id="the-operator-never-imports-the-trainer")],
)
def test_a_package_never_imports_another(importer: str, imported: str) -> None:
    graph = _import_graph()
    offending = {
        module: sorted(t for t in targets if t.split(".")[0] == imported)
        for module, targets in graph.items()
        if module.split(".")[0] == importer
    }
    assert {m: t for m, t in offending.items() if t} == {}


# What a policy may import: the standard library and our pure modules. Never the API client, the
# controller or kopf: one place talks to the API (docs/architecture.md, "Where new code goes").
_IMPURE = {"ddp_operator.kube_api", "ddp_operator.controller", "ddp_operator.handlers", "ddp_operator.leader"}
_IMPURE_THIRD_PARTY = {"kopf", "aiohttp", "kubernetes", "kubernetes_asyncio", "requests", "urllib3"}


def _third_party_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
    return names


def test_no_policy_talks_to_the_api() -> None:
    graph, modules = _import_graph(), _modules()
    policies = sorted(name for name in modules if name.startswith("ddp_operator.policies."))
    assert policies, "no module found under ddp_operator/policies"
    for name in policies:
        assert not graph[name] & _IMPURE, f"{name} imports {sorted(graph[name] & _IMPURE)}"
        third = _third_party_imports(modules[name]) & _IMPURE_THIRD_PARTY
        assert not third, f"{name} imports {sorted(third)}"


# The phase machine (reconcile.py) and the executor (controller.py) are each read whole by whoever
# changes them: what decides a job and in what order, and how a Decision is carried out. A reader holds
# such a module by its parts: every function fits on a screen (test_function_length.py: 80 lines), and
# the module has no more parts than one reading keeps apart by name. Fifty is that many here: the size
# of a module whose every definition a newcomer can name after one read. A count of lines instead only
# moved code around to stay under it; what a rule asks belongs in policies/ (its own module, registered:
# policies/registry.py), the status it writes in status.py, the Decision types in decision.py.
WHOLE_READ_MODULES = ("reconcile.py", "controller.py")
MAX_DEFINITIONS = 50


def _definitions(path: Path) -> int:
    """Functions (nested ones and methods included) and classes of a module."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return sum(isinstance(node, kinds) for node in ast.walk(ast.parse(path.read_text())))


@pytest.mark.parametrize("module", [pytest.param(m, id=m) for m in WHOLE_READ_MODULES])
def test_reconcile_does_not_grow(module: str) -> None:
    count = _definitions(ROOT / "operator" / "ddp_operator" / module)
    assert count <= MAX_DEFINITIONS, (
        f"{module} has {count} definitions (at most {MAX_DEFINITIONS}): a new rule is a module of "
        "policies/ (pure, table-tested, registered by its RULES), never a function here"
    )
