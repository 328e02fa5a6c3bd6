"""Compressed payload bytes follow the gradients' real dtype; checkpoints load only tensors and plain
values (torch.load(weights_only=True))."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from trainer_gang import RunsCodeWhenUnpickled, run_torchrun

from ddp_trainer.training.checkpoint import checkpoint_path, load_newest_checkpoint, save_checkpoint

pytestmark = pytest.mark.trainer

PROBE = Path(__file__).with_name("payload_probe.py")
CASE = re.compile(
    r"^case mode=(\w+) hook=(\w+) rank=(\d) elements=(\d+) "
    r"sync_steps=(\d+) gradient_bytes=(\d+) allreduce_bytes=(\d+)$",
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def fp64_cases() -> dict[tuple[str, str, str], tuple[int, int, int, int]]:
    """(mode, hook, rank) -> (elements, sync steps, gradient bytes, payload bytes), one torchrun run."""
    result = run_torchrun(PROBE)
    assert result.returncode == 0, result.stdout + result.stderr
    found = {}
    for match in CASE.finditer(result.stdout):
        elements, steps, gradient, payload = (int(match.group(i)) for i in range(4, 8))
        found[(match.group(1), match.group(2), match.group(3))] = (elements, steps, gradient, payload)
    assert len(found) == 8, result.stdout + result.stderr
    return found


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("hook", ["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["detailed", "light"])
def test_compressing_fp64_gradients_sends_two_bytes_per_element(
    fp64_cases: dict[tuple[str, str, str], tuple[int, int, int, int]], mode: str, hook: str, rank: str
) -> None:
    elements, steps, gradient, payload = fp64_cases[(mode, hook, rank)]
    assert steps == 4
    assert gradient == elements * 8 * steps
    # A quarter of the fp64 gradient bytes, not the half that "compression halves" would claim.
    assert payload == elements * 2 * steps


def test_a_checkpoint_that_needs_more_than_tensors_is_refused_unexecuted(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # momentum buffers: the optimizer state holds tensors too
    state = {"step": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "workload": "t"}
    save_checkpoint(directory, 1, state, keep=5)
    marker = tmp_path / "code-ran"
    torch.save(
        {"format_version": 1, "step": 2, "payload": RunsCodeWhenUnpickled(marker)},
        checkpoint_path(directory, 2),
    )

    found = load_newest_checkpoint(directory)

    assert not marker.exists(), "loading a checkpoint ran code from it"
    assert found is not None and found[1] == checkpoint_path(directory, 1)
    loaded = found[0]
    assert loaded["step"] == 1
    assert torch.equal(loaded["model"]["weight"], model.state_dict()["weight"])
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).load_state_dict(loaded["optimizer"])
