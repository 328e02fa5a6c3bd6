"""The distribution ships every package: a wheel or an image gets nothing that pyproject omits."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _packages_on_disk() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: set[str] = set()
    for top, directory in pyproject["tool"]["setuptools"]["package-dir"].items():
        base = ROOT / directory
        for init in base.rglob("__init__.py"):
            relative = init.parent.relative_to(base)
            found.add(".".join((top, *relative.parts)))
    return found


def test_every_package_directory_is_declared_in_pyproject() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = set(pyproject["tool"]["setuptools"]["packages"])
    on_disk = _packages_on_disk()
    assert on_disk - declared == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert declared - on_disk == set(), "these are declared in pyproject.toml but have no __init__.py"
