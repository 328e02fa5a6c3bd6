"""docs/architecture.md's module map names every module of the operator and the trainer, and nothing
else: a new module without its line, or a line left behind by a moved or removed one, fails here.

The map is the code block under "## Module map": a name in the first NAME_COLUMN characters of a line,
indented two spaces per level (a name ending in "/" opens a package), its description after it; a line
with nothing in that column continues the description above.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
CHECKED = ("operator/ddp_operator/", "trainer_image/ddp_trainer/")
NAME_COLUMN = 30
INDENT = 2


def mapped(text: str) -> set[str]:
    """The paths the module map names, each relative to the repository (packages end in "/")."""
    block = re.search(r"^## Module map\n.*?^```\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert block, 'no code block under "## Module map"'
    names: set[str] = set()
    parents: list[str] = []
    for line in block.group(1).splitlines():
        name = line[:NAME_COLUMN].strip()
        if not name:
            continue
        depth = (len(line) - len(line.lstrip(" "))) // INDENT
        del parents[depth:]
        path = "".join(parents) + name
        names.add(path)
        if name.endswith("/"):
            parents.append(name)
    return names


def holds_more_than_a_docstring(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return any(
        not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
        and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
        for node in body
    )


def on_disk() -> tuple[set[str], set[str]]:
    """(what the map must name, what it may name): every module and subpackage of the checked
    packages; a package's __init__.py must be named only where it holds more than its docstring."""
    required: set[str] = set()
    existing: set[str] = set(CHECKED)
    for top in CHECKED:
        for path in (ROOT / top).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            existing.add(relative)
            package = path.parent.relative_to(ROOT).as_posix() + "/"
            existing.add(package)
            if package not in CHECKED:
                required.add(package)
            if path.name != "__init__.py" or holds_more_than_a_docstring(path):
                required.add(relative)
    return required, existing


def row(depth: int, name: str, text: str) -> str:
    """One line of a map: the name indented to its depth and padded to the name column."""
    return f"{' ' * INDENT * depth}{name}".ljust(NAME_COLUMN) + text + "\n"


@pytest.mark.parametrize(
    ("block", "names"),
    [
        pytest.param(
            row(0, "pkg/", "a package") + row(1, "a.py", "a module"),
            {"pkg/", "pkg/a.py"},
            id="module-of-a-package",
        ),
        pytest.param(
            row(0, "pkg/", "a package")
            + row(1, "sub/", "its subpackage")
            + row(2, "b.py", "deeper")
            + row(1, "c.py", "back up one level"),
            {"pkg/", "pkg/sub/", "pkg/sub/b.py", "pkg/c.py"},
            id="nested-then-back-up",
        ),
        pytest.param(
            row(0, "pkg/", "a package")
            + row(1, "a.py", "a description that")
            + row(0, "", "goes on: b.py is text"),
            {"pkg/", "pkg/a.py"},
            id="continuation-line-names-nothing",
        ),
    ],
)
def test_the_map_is_read_by_its_name_column(block: str, names: set[str]) -> None:
    assert mapped(f"## Module map\n\n```\n{block}```\n") == names


def test_every_module_is_in_the_map() -> None:
    named = mapped(DOC.read_text())
    required, _ = on_disk()
    missing = sorted(required - named)
    assert not missing, f"modules without a line in docs/architecture.md's module map: {missing}"


def test_every_module_the_map_names_exists() -> None:
    named = {n for n in mapped(DOC.read_text()) if n.startswith(CHECKED)}
    _, existing = on_disk()
    stale = sorted(named - existing)
    assert not stale, f"docs/architecture.md's module map names what does not exist: {stale}"
