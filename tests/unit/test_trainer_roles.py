"""The trainer's package by reader (docs/architecture.md, "Module map"): a user's script imports the
library (``ddp_trainer.instrument`` and what it needs) and must not load the pod's supervisor or the
built-in trainer, whose imports (the forkserver, the workloads' scikit-learn) it never asked for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

_LOADED = "import sys, json; {imports}; print(json.dumps(sorted(m for m in sys.modules if m.startswith('ddp_trainer'))))"


def _loaded_after(imports: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _LOADED.format(imports=imports)], capture_output=True, text=True, check=True
    ).stdout
    loaded: list[str] = json.loads(out)
    return loaded


@pytest.mark.parametrize(
    "imports",
    [
        pytest.param("import ddp_trainer; ddp_trainer.instrument", id="the-public-instrument"),
        pytest.param("import ddp_trainer; ddp_trainer.process_group_session", id="the-public-session"),
        pytest.param("import ddp_trainer.library.sync", id="the-recorders"),
    ],
)
def test_the_library_loads_neither_the_supervisor_nor_the_trainer(imports: str) -> None:
    loaded = _loaded_after(imports)
    assert any(m.startswith("ddp_trainer.library.") for m in loaded), loaded
    assert [m for m in loaded if m.split(".")[1:2] in (["supervisor"], ["training"])] == []


def test_the_check_sees_a_supervisor_module_when_one_is_loaded() -> None:
    # The positive control: the same reading finds the supervisor where it is imported.
    assert "ddp_trainer.supervisor.restarts" in _loaded_after("import ddp_trainer.supervisor.restarts")
