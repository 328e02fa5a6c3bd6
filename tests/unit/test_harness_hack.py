"""How the test harness finds the repository's hack/ scripts without assuming where it is installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_harness.hack import HACK_DIR_ENV, HackDirError, hack_dir, hack_file

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _fake_hack(base: Path) -> Path:
    hack = base / "hack"
    hack.mkdir(parents=True)
    (hack / "k8s-versions.env").write_text("KUBERNETES_VERSION=v0\n")
    return hack


def test_the_environment_variable_wins(tmp_path: Path) -> None:
    hack = _fake_hack(tmp_path / "elsewhere")
    assert hack_dir({HACK_DIR_ENV: str(hack)}) == hack
    assert hack_file("build-k8s.sh", {HACK_DIR_ENV: str(hack)}) == hack / "build-k8s.sh"


def test_an_environment_variable_pointing_elsewhere_is_refused(tmp_path: Path) -> None:
    with pytest.raises(HackDirError, match=HACK_DIR_ENV):
        hack_dir({HACK_DIR_ENV: str(tmp_path)})


def test_without_it_the_checkout_around_the_package_is_found() -> None:
    assert hack_dir({}) == ROOT / "hack"


def test_the_current_directory_is_searched_upwards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hack = _fake_hack(tmp_path / "checkout")
    deep = tmp_path / "checkout" / "some" / "where"
    deep.mkdir(parents=True)
    # As for an installed (not editable) harness: nothing above the package's files has a hack/.
    monkeypatch.setattr(
        "ddp_harness.hack.__file__", str(tmp_path / "site-packages" / "ddp_harness" / "hack.py")
    )
    assert hack_dir({}, cwd=deep) == hack
    with pytest.raises(HackDirError, match=HACK_DIR_ENV):
        hack_dir({}, cwd=tmp_path)
