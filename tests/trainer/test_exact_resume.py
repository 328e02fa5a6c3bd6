"""A resumed run is the uninterrupted run, bit for bit (docs/restarts.md: what recovery keeps).

Real 3-rank gloo groups on loopback. A run stopped after step N and resumed from the newest
checkpoint must end with the digest of one run that never stopped, wherever N falls: mid-epoch, at an
epoch boundary, right after a periodic checkpoint (a step done but never saved), and with dropout
drawing random numbers (the gcn workload).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trainer_gang import Gangs, describe, wait_all

pytestmark = pytest.mark.trainer

# 15 steps an epoch (digits on 3 ranks, batch 32); 40 steps end mid-epoch 2.
DIGITS = ["--max-steps", "40", "--seed", "11", "--progress-every", "40"]
# Two ranks' share of a small generated graph; dropout on the hidden layer draws every step.
GCN = ["--workload", "gcn", "--graph-nodes", "2000", "--gcn-hidden", "16", "--batch-size", "200"]
GCN += ["--max-steps", "12", "--seed", "5", "--progress-every", "12"]


# Digests of uninterrupted runs, by their arguments: each reference runs once per module.
_REFERENCES: dict[tuple[str, ...], str] = {}


def uninterrupted(gangs: Gangs, args: list[str], world_size: int) -> str:
    key = (str(world_size), *args)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_to_end(gangs, args, world_size, "reference")
    return _REFERENCES[key]


def run_to_end(gangs: Gangs, args: list[str], world_size: int, tag: str) -> str:
    gang = gangs.ranks(world_size, args, tag=tag)
    assert wait_all(gang) == [0] * world_size, describe(gang)
    digests = {digest for rank in gang for digest in rank.digests().values()}
    assert len(digests) == 1, describe(gang)
    return digests.pop()


def with_max_steps(args: list[str], steps: int) -> list[str]:
    index = args.index("--max-steps")
    return [*args[: index + 1], str(steps), *args[index + 2 :]]


def resume(gangs: Gangs, args: list[str], world_size: int, directory: Path, stop_at: int) -> int:
    """Run from the newest checkpoint in ``directory`` to ``stop_at``; returns the step it resumed at."""
    run = gangs.ranks(world_size, [*with_max_steps(args, stop_at), "--checkpoint-dir", str(directory)])
    assert wait_all(run) == [0] * world_size, describe(run)
    match = run[0].wait_for_stdout(r"^resumed step=(\d+) epoch=\d+ from=disk")
    return int(match.group(1))


def test_a_run_resumed_mid_epoch_at_an_epoch_boundary_and_after_a_lost_step_is_the_uninterrupted_run(
    gangs: Gangs, tmp_path: Path
) -> None:
    """One chain of runs of 15-step epochs: stopped mid-epoch (22); resumed there and lost right after
    the periodic checkpoint of step 30, an epoch boundary, with step 31 done but never saved; resumed at
    30 to the end."""
    reference = uninterrupted(gangs, DIGITS, 3)
    directory = tmp_path / "ckpt"
    run_to_end(gangs, [*with_max_steps(DIGITS, 22), "--checkpoint-dir", str(directory)], 3, "first")
    periodic = [*DIGITS, "--checkpoint-every", "10"]
    assert resume(gangs, periodic, 3, directory, 31) == 22
    (directory / "ckpt-0000000031.pt").unlink()
    last = gangs.ranks(3, [*periodic, "--checkpoint-dir", str(directory)], tag="last")
    assert wait_all(last) == [0, 0, 0], describe(last)
    assert last[0].wait_for_stdout(r"^resumed step=30 epoch=\d+ from=disk")
    assert {digest for rank in last for digest in rank.digests().values()} == {reference}


def test_a_resumed_run_with_dropout_draws_what_the_uninterrupted_run_drew(
    gangs: Gangs, tmp_path: Path
) -> None:
    reference = uninterrupted(gangs, GCN, 2)
    directory = tmp_path / "ckpt"
    run_to_end(gangs, [*with_max_steps(GCN, 5), "--checkpoint-dir", str(directory)], 2, "first")
    resumed = gangs.ranks(2, [*GCN, "--checkpoint-dir", str(directory)], tag="resumed")
    assert wait_all(resumed) == [0, 0], describe(resumed)
    assert resumed[0].wait_for_stdout(r"^resumed step=5 epoch=\d+ from=disk")
    assert {digest for rank in resumed for digest in rank.digests().values()} == {reference}


def test_a_gang_restarted_after_the_last_step_trains_nothing_more(gangs: Gangs, tmp_path: Path) -> None:
    """A whole gang restarted once training is over (a pod lost after the last step: found on kind)
    resumes from the final checkpoint, whose place is past the last epoch, and ends there with the same
    model: not one epoch more."""
    epochs = ["--epochs", "2", "--seed", "11", "--progress-every", "15"]  # 2 epochs of 15 steps, no cap
    directory = tmp_path / "ckpt"
    done = run_to_end(gangs, [*epochs, "--checkpoint-dir", str(directory)], 3, "done")
    again = gangs.ranks(3, [*epochs, "--checkpoint-dir", str(directory)], tag="again")
    assert wait_all(again) == [0, 0, 0], describe(again)
    assert again[0].wait_for_stdout(r"^resumed step=30 epoch=2 from=disk")
    assert again[0].wait_for_stdout(r"^final accuracy=\S+ loss=\S+ steps=30$")
    assert {digest for rank in again for digest in rank.digests().values()} == {done}
