"""Progress signals and stall dumps from real gloo gangs (issue 12, the trainer's side).

The built-in trainer must export its total steps and every rank's step parts, and when one rank is
SIGSTOPped the others must write every thread's stack to their logs before the operator's timeout.
Naming a slow rank: test_straggler.py.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
from trainer_gang import LINGERING, Gangs, describe, samples, wait_all

from ddp_trainer.exitcodes import EXIT_STOPPED

pytestmark = pytest.mark.trainer

DUMP_HEADER = "the Python stack of every thread follows"
# The stall watch's line while a stall it dumped lasts: at the timeout, then at each doubling.
STILL_STALLED = "still no training step completed"
# Bounds how long a broken test waits; nothing here asserts on elapsed time.
WAIT = 180.0


def labelled(text: str, name: str) -> dict[str, float]:
    """``name``'s samples keyed by their ``peer`` label."""
    found = {}
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        found[labels.get("peer", "")] = float(match.group(2))
    return found


def phases(text: str) -> dict[str, float]:
    """``ddp_step_phase_seconds`` by its ``phase`` label."""
    return {
        match.group(1): float(match.group(2))
        for match in re.finditer(
            r'^ddp_step_phase_seconds\{[^}]*phase="(\w+)"[^}]*\} (\S+)$', text, re.MULTILINE
        )
    }


@pytest.mark.parametrize("mode", ["detailed", "light"])
def test_the_built_in_trainer_exports_its_total_and_every_ranks_compute_time(gangs: Gangs, mode: str) -> None:
    # Light mode has no hook: its compute time is the DDP logger's, sampled every 10 steps.
    args = [
        "--max-steps",
        "30",
        "--stop-check-every",
        "5",
        "--progress-every",
        "10",
        "--metrics-linger",
        "120",
    ]
    gang = gangs.ranks(2, [*args, "--sync-metrics", mode], metrics_ranks=[0, 1])
    texts = []
    for process in gang:
        process.wait_for_stdout(LINGERING)
        texts.append(process.scrape())
        process.signal(signal.SIGTERM)
    assert wait_all(gang) == [0, 0], describe(gang)
    rank0, rank1 = texts
    assert samples(rank0, "ddp_target_steps")["0"] == 30
    assert samples(rank0, "ddp_sync_steps_total")["0"] == 30
    # The exchange rides in the stop-flag allreduce: both ranks measured, rank 0 shows both.
    assert set(labelled(rank0, "ddp_rank_compute_seconds")) == {"0", "1"}
    assert all(v > 0 for v in labelled(rank0, "ddp_rank_compute_seconds").values())
    assert set(labelled(rank0, "ddp_rank_wait_seconds")) == {"0", "1"}
    assert samples(rank0, "ddp_straggler_rank")["0"] in (0, 1)
    assert samples(rank1, "ddp_compute_seconds")["1"] > 0
    # Each rank's step in its parts; the wait is measured in both modes (light: DDP's logger).
    parts = phases(rank1)
    assert set(parts) == {"data", "compute", "communication", "wait"}
    assert parts["compute"] > 0 and parts["wait"] > 0 and parts["data"] > 0
    # The per-rank picture is rank 0's alone.
    assert "ddp_straggler_rank" not in rank1 and "ddp_rank_compute_seconds" not in rank1


def test_a_sigstopped_rank_makes_the_others_dump_their_stacks_once(gangs: Gangs) -> None:
    gang = gangs.ranks(
        3,
        ["--max-steps", "100000", "--throttle-ms", "20", "--progress-every", "5", "--stop-check-every", "5"],
        env={"DDP_STALL_TIMEOUT_SECONDS": "2"},  # dump after 1.5 s without a step
    )
    gang[0].wait_for_stdout(r"^progress step=10 ")
    for process in gang:
        assert DUMP_HEADER not in process.stderr  # steps complete: no stall, no dump
    gang[2].signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + WAIT
        # The dump, then the watch's notes of the same stall at 2 s and 4 s without a step: it
        # checked over a dozen times more (every 0.15 s) after dumping.
        while not all(p.stderr.count(STILL_STALLED) >= 2 for p in gang[:2]):
            assert time.monotonic() < deadline, describe(gang)
            time.sleep(0.2)
        stalled = [p.stderr for p in gang[:2]]
    finally:
        gang[2].signal(signal.SIGCONT)
    for rank, log in enumerate(stalled):
        assert log.count(DUMP_HEADER) == 1, log[-4000:]  # once per stall
        assert log.index(DUMP_HEADER) < log.index(STILL_STALLED), log[-4000:]
        assert 'Thread "MainThread"' in log and 'Thread "ddp-stall-watch"' in log
        # Where the rank waits: inside its training step (the gradient allreduce of backward or the
        # stop-flag allreduce), in the trainer's loop.
        dump = log[log.index(DUMP_HEADER) :]
        assert re.search(r"trainer\.py\", line \d+, in (train|_agree_to_stop)", dump), dump[-4000:]
        assert f"rank {rank}: end of the stack dump" in log
    # Training resumes after SIGCONT; a stop is then agreed as usual.
    steps_before = len(gang[0].progress())
    gang[0].wait_for_stdout(rf"^progress step={(steps_before + 2) * 5} ")
    for process in gang:
        process.signal(signal.SIGTERM)
    assert wait_all(gang) == [EXIT_STOPPED] * 3, describe(gang)
