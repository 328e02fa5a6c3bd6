"""Ending the process group joins gloo's threads while the interpreter is alive (ddp_trainer.library.teardown).

A gloo thread that outlives the group can abort a finished rank at exit (SIGABRT, "terminate called
without an active exception"): rare, so counting crashes would make a flaky test. These tests check the
deterministic cause instead: whether the threads are gone before the script returns.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from trainer_gang import run_torchrun

pytestmark = pytest.mark.trainer

PROBE = Path(__file__).with_name("teardown_probe.py")
LINE = re.compile(r"rank (\d): before=(\d+) left=(True|False) after=(\d+)")


def run_probe(case: str) -> dict[int, tuple[int, bool, int]]:
    result = run_torchrun(PROBE, env={"CASE": case})
    assert result.returncode == 0, result.stdout + result.stderr
    found = {
        int(m.group(1)): (int(m.group(2)), m.group(3) == "True", int(m.group(4)))
        for m in LINE.finditer(result.stdout)
    }
    assert set(found) == {0, 1}, result.stdout + result.stderr
    return found


@pytest.mark.parametrize(
    "case",
    [
        "defaults-imported-early",  # what the trainer does: torch.distributed.nn imported before init
        "defaults-imported-by-ddp",  # a user script: DDP imports it after init; we release its defaults
        "instrumented-and-closed",  # instrument() then close(): the hook no longer pins the model
        "session",  # process_group_session(): closes the instrumentation and ends the group itself
    ],
)
def test_leaving_joins_the_gloo_threads(case: str) -> None:
    for rank, (before, left, after) in run_probe(case).items():
        assert before > 0, f"rank {rank}: no gloo threads to begin with: the probe measures nothing"
        assert left and after == 0, f"rank {rank}: {after} gloo thread(s) outlived the group"


@pytest.mark.parametrize(
    "case",
    [
        "model-still-held",  # the reducer of a live DDP model holds the group
        "instrumented-not-closed",  # the comm hook and the recorder pin the model through C++
    ],
)
def test_a_group_something_still_holds_is_reported(case: str) -> None:
    for rank, (before, left, after) in run_probe(case).items():
        assert before > 0 and not left and after == before, f"rank {rank}: {before=} {left=} {after=}"
