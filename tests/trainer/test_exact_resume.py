"""A resumed run is the uninterrupted run, bit for bit (docs/restarts.md: what recovery keeps).

Real 3-rank gloo groups on loopback. A run stopped after step N and resumed from the newest
checkpoint must end with the digest of one run that never stopped, wherever N falls: mid-epoch, at an
epoch boundary, right after a periodic checkpoint (a step done but never saved), and with dropout
drawing random numbers (the gcn workload). The in-memory copies that survivors carry (ddp_trainer.snapshot) give back exactly
what was saved, and a slot that is incomplete or holds anything but plain values is never read.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_gang import Gangs, RunsCodeWhenUnpickled, describe, wait_all

from ddp_trainer.snapshot import CopyPacer, StateSnapshots, copy_interval, load_slot, newest_slot, slot_path

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


def trained(optimizer_kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    optimizer: torch.optim.Optimizer
    if optimizer_kind == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).sum().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("optimizer_kind", ["sgd-momentum", "adam"])
def test_a_snapshot_gives_back_the_model_optimizer_and_fields_exactly(
    tmp_path: Path, optimizer_kind: str
) -> None:
    model, optimizer = trained(optimizer_kind)
    snapshots = StateSnapshots(tmp_path, rank=2)
    snapshots.save(3, {"step": 3, "epoch": 0, "kept_step_seconds": 1.5}, model, optimizer)
    found = newest_slot(tmp_path)
    assert found is not None and found[0] == 3
    state = load_slot(found[1])
    assert state is not None
    assert (state["step"], state["epoch"], state["kept_step_seconds"]) == (3, 0, 1.5)
    expected_model, expected_optimizer = model.state_dict(), optimizer.state_dict()
    assert list(state["model"]) == list(expected_model)
    assert all(torch.equal(state["model"][k], v) for k, v in expected_model.items())
    assert state["optimizer"]["param_groups"] == expected_optimizer["param_groups"]
    for index, values in expected_optimizer["state"].items():
        assert set(state["optimizer"]["state"][index]) == set(values)
        assert all(torch.equal(state["optimizer"]["state"][index][k], v) for k, v in values.items())


def test_the_newest_complete_slot_wins_and_an_incomplete_one_is_never_read(tmp_path: Path) -> None:
    model, optimizer = trained("sgd-momentum")
    older, newer = StateSnapshots(tmp_path, rank=0), StateSnapshots(tmp_path, rank=1)
    older.save(7, {"step": 7}, model, optimizer)
    newer.save(8, {"step": 8}, model, optimizer)
    newer.save(9, {"step": 9}, model, optimizer)
    found = newest_slot(tmp_path)
    assert found is not None and found[0] == 9 and found[1].name.startswith("state-1.")
    # A worker killed while it copies step 9 leaves that slot without its sequence number.
    with open(found[1], "r+b") as slot:
        slot.seek(16)
        slot.write(struct.pack("<q", 0))
    assert newest_slot(tmp_path) == (8, slot_path(tmp_path, 1, 1 - int(found[1].suffix[1:])))
    assert load_slot(found[1]) is None


def test_a_slot_that_holds_anything_but_plain_values_is_refused(tmp_path: Path) -> None:
    model, optimizer = trained("sgd-momentum")
    StateSnapshots(tmp_path, rank=0).save(1, {"step": 1}, model, optimizer)
    found = newest_slot(tmp_path)
    assert found is not None
    path = found[1]
    raw = path.read_bytes()
    evil = pickle.dumps(({"x": RunsCodeWhenUnpickled(tmp_path / "ran")}, {}))
    header = struct.Struct("<8sqqqqq")
    magic, version, sequence, step, _, data = header.unpack_from(raw)
    # The same tensor bytes, and a skeleton that would run code if it were unpickled as it is.
    path.write_bytes(
        header.pack(magic, version, sequence, step, len(evil), data) + raw[header.size : 64 + data] + evil
    )
    assert load_slot(path) is None
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    ("copy_seconds", "step_seconds", "every"),
    [
        # Why a CPU state is not paced: its 14 us copy is 2.3% of the 1-rank digits step, so it would
        # lose zero redo for a cost that a multi-rank step's allreduce dwarfs.
        pytest.param(0.000014, 0.0006, 2, id="the-cpu-digits-copy-paced-would-be-every-second-step"),
        pytest.param(0.001, 0.060, 1, id="within-the-budget-every-step"),
        pytest.param(0.0013, 0.060, 2, id="just-over-the-budget-every-second-step"),
        pytest.param(0.324, 0.060, 512, id="a-3.5-GiB-state-on-an-h200-every-512th"),
        pytest.param(9.0, 1.0, 512, id="a-7b-adam-state-every-512th"),
        pytest.param(0.5, 0.0, 1, id="no-step-time-yet-every-step"),
    ],
)
def test_a_gpu_state_is_copied_as_often_as_two_percent_of_the_training_time_allows(
    copy_seconds: float, step_seconds: float, every: int
) -> None:
    assert copy_interval(copy_seconds, step_seconds) == every


def test_the_pacer_measures_each_copy_against_the_steps_before_it_and_a_cpu_state_is_copied_every_step() -> (
    None
):
    gpu, cpu = CopyPacer(paced=True), CopyPacer(paced=False)
    # Steps of 60 ms; a copy of 0.3 s (the 3.5 GiB state of docs/benchmarks.md) after steps 1 and 2.
    for pacer in (gpu, cpu):
        assert pacer.due(1) and pacer.copied(1, started=0.06, ended=0.36) is None  # nothing to compare yet
        assert pacer.due(2)
    assert gpu.copied(2, started=0.42, ended=0.72) == 256
    assert cpu.copied(2, started=0.42, ended=0.72) is None
    assert [step for step in range(3, 600) if gpu.due(step)] == [256, 512]
    assert all(cpu.due(step) for step in range(3, 600))
    # The copies got cheap (the state shrank, or the link is faster): every step again.
    assert gpu.copied(256, started=0.72 + 254 * 0.06, ended=0.72 + 254 * 0.06 + 0.001) == 1
    assert gpu.due(257)
