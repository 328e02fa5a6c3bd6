"""A real node an interrupted run left behind (docs/real-node.md): the next start takes it down only
when none of its components runs; a running one is another run's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddp_harness import real_node
from ddp_harness.processes import ComponentState

pytestmark = pytest.mark.unit


def _state_with(component_pid: int) -> real_node.NodeState:
    stat = Path(f"/proc/{component_pid}/stat").read_text().rsplit(")", 1)[1].split()
    kubelet = ComponentState("kubelet", component_pid, int(stat[19]), {}, "", ["kubelet"])
    return real_node.NodeState("n", "/bin", "/img", "/run/x", "ddpbr9", "10.0.0.0/24", components=[kubelet])


@pytest.mark.parametrize(
    ("recorded", "kept"),
    [
        pytest.param(None, False, id="pointer-to-no-record-is-dropped"),
        pytest.param("alive", True, id="a-running-node-is-another-runs-and-left-alone"),
    ],
)
def test_the_next_start_takes_down_only_a_node_nobody_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorded: str | None, kept: bool
) -> None:
    pointer = tmp_path / "pointer"
    monkeypatch.setattr(real_node, "RUNNING_NODE_POINTER", pointer)
    state_dir = tmp_path / "cluster"
    (state_dir / "node").mkdir(parents=True)
    if recorded == "alive":
        _state_with(os.getpid()).save(state_dir / "node" / "node.json")
    pointer.write_text(str(state_dir))
    real_node._stop_abandoned(lambda _: None)
    assert pointer.exists() is kept
    assert (state_dir / "node" / "node.json").exists() is (recorded is not None)
