"""What the product ships: the wheel gets every package pyproject declares and nothing of the test
harness; both images are built from that same distribution and copy no harness code; `ddpjob` from the
wheel alone answers `run` and `operator`.

The wheel is built once per session from a copy of this checkout (the harness included, so a pyproject
that pulled it in would show here), offline, with the setuptools of this environment."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from ddp_operator import cli

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = {"ddp_operator", "ddp_trainer"}
HARNESS_PACKAGE = "ddp_harness"
DOCKERFILES = ("operator/Dockerfile", "trainer_image/Dockerfile")
# What a build needs is the tracked source; caches and build outputs of this checkout are not.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".ddpjob",
)


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


def test_the_harness_is_declared_apart_from_the_product() -> None:
    product = tomllib.loads((ROOT / "pyproject.toml").read_text())
    harness = tomllib.loads((ROOT / "harness" / "pyproject.toml").read_text())
    assert not any(p.split(".")[0] == HARNESS_PACKAGE for p in product["tool"]["setuptools"]["packages"])
    assert harness["tool"]["setuptools"]["packages"] == [HARNESS_PACKAGE]
    assert "ddp-harness" in harness["project"]["scripts"]
    assert "ddp-harness" not in product["project"]["scripts"]


def test_no_product_module_imports_the_harness() -> None:
    importing = [
        str(path.relative_to(ROOT))
        for top in ("operator/ddp_operator", "trainer_image/ddp_trainer")
        for path in (ROOT / top).rglob("*.py")
        if re.search(rf"^\s*(from|import)\s+{HARNESS_PACKAGE}\b", path.read_text(), re.MULTILINE)
    ]
    assert importing == []


@pytest.fixture(scope="session")
def product_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The product's wheel, and what its build printed on stderr."""
    source = tmp_path_factory.mktemp("checkout") / "src"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])",
            out,
        ],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = out.glob("ddp_operator-*.whl")
    return wheel, build.stderr


def test_the_wheel_holds_the_product_and_nothing_of_the_harness(product_wheel: tuple[Path, str]) -> None:
    wheel, _ = product_wheel
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == PRODUCT_PACKAGES
    harness_files = [n for n in names if HARNESS_PACKAGE in n or n.startswith("ddp_operator/cluster/")]
    assert harness_files == []
    # Every declared package made it in (a package missing from pyproject would be missing here).
    for package in _packages_on_disk():
        assert f"{package.replace('.', '/')}/__init__.py" in names


def test_the_license_is_an_spdx_expression_and_the_build_warns_of_nothing(
    product_wheel: tuple[Path, str],
) -> None:
    wheel, stderr = product_wheel
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        assert "License-Expression: Apache-2.0" in archive.read(metadata).decode()
    assert "deprecat" not in stderr.lower(), stderr


def test_ddpjob_from_the_wheel_alone_runs_run_and_operator(
    product_wheel: tuple[Path, str], tmp_path: Path
) -> None:
    """In a fresh venv with no other package (the subcommands import their dependencies only when they
    run), away from the checkout."""
    wheel, _ = product_wheel
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        # Away from the checkout, and with none of this process's pip or Python variables: a pip that
        # sees a ddp-operator elsewhere (the checkout's egg-info, the test venv's editable install)
        # takes the wheel for installed and installs nothing.
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "_PIP_", "PYTHON"))},
        timeout=300,
        check=False,
    )
    assert install.returncode == 0, install.stderr
    ddpjob = str(env_dir / "bin" / "ddpjob")
    # One CI run found pip's exit 0 and an empty venv: what pip said is kept for such a case.
    installed = sorted(p.name for p in (env_dir / "lib").glob("python*/site-packages/*"))
    assert Path(ddpjob).is_file(), (install.stdout, install.stderr, installed)
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, capture_output=True, text=True, env=environ, cwd=tmp_path, timeout=60, check=False
        )

    for command, expected in (("run", "DDPJob manifest"), ("operator", "--kubeconfig")):
        result = run(ddpjob, command, "--help")
        assert result.returncode == 0, result.stderr
        assert expected in result.stdout
    top = run(ddpjob, "--help")
    assert top.returncode == 0, top.stderr
    # The product's commands, and no other: the harness's `cluster` is not one.
    assert re.findall(r"^ {4}(\w+) +\w", top.stdout, re.MULTILINE) == list(cli.SUBCOMMANDS), top.stdout
    for command in cli.SUBCOMMANDS:
        assert run(ddpjob, command, "--help").returncode == 0, (
            f"`ddpjob {command} --help` from the wheel alone"
        )
    where = run(str(python), "-c", "import ddp_operator; print(ddp_operator.__file__)")
    assert where.stdout.startswith(str(env_dir)), where.stdout + where.stderr
    harness = run(str(python), "-c", f"import {HARNESS_PACKAGE}")
    assert harness.returncode != 0


def _copy_sources(dockerfile: str) -> list[str]:
    """The sources of every COPY/ADD in a Dockerfile (the last word is the destination)."""
    sources = []
    for line in (ROOT / dockerfile).read_text().splitlines():
        words = line.split()
        if words and words[0].upper() in ("COPY", "ADD"):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_images_copy_only_the_product(dockerfile: str) -> None:
    """An image installs /src with pip: the product's pyproject (checked above to leave the harness out)
    and the product's packages, nothing of the harness."""
    sources = _copy_sources(dockerfile)
    assert sources, f"{dockerfile} copies nothing?"
    assert set(sources) <= {
        "pyproject.toml",
        "README.md",
        "operator/ddp_operator",
        "trainer_image/ddp_trainer",
    }


def test_the_image_build_context_holds_no_harness() -> None:
    """hack/build-images.sh stages the build context: it copies the product's packages only."""
    script = (ROOT / "hack" / "build-images.sh").read_text()
    staged = re.findall(r"^\s*cp (?:-r )?(.+)$", script, re.MULTILINE)
    assert staged, "hack/build-images.sh stages no context?"
    assert not any("harness" in line for line in staged), staged
