"""Naming the rank everyone waits for, in real gloo gangs (issue 22).

examples/scripts/straggler_ddp.py makes one rank late on purpose: in its forward (compute), before it
(a slow data loader) or before each collective it starts (its comm path); or a CPU limit starves it,
as a pod's limit does. Rank 0's /metrics must name that rank, above the threshold the operator and
`ddpjob run` apply, with the phase it lost its time in, and keep naming it; a quiet gang of 3 or 4
ranks must name nobody. Every rank sleeps a little per step, as a data loader waits, so that 3 or 4
ranks leave each other some CPU on a 2-core machine that other work also loads; the slowdowns are
large (a rank late by several steps' worth).
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from trainer_gang import PYTHON, Gangs, TrainerProcess, cpu_limit, describe, samples, wait_all

from ddp_operator.progress.tracker import STRAGGLER_THRESHOLD

pytestmark = pytest.mark.trainer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = [PYTHON, str(REPO / "examples" / "scripts" / "straggler_ddp.py")]
# The operator's and `ddpjob run`'s shared default (docs/operator.md): a rank that makes the job's
# step at least this much longer is a straggler.
THRESHOLD = STRAGGLER_THRESHOLD
# How long the verdict must hold: shorter than the operator's and `ddpjob run`'s window, so stricter.
PERSIST = 5.0
STEP_MS = "10"
LATE_MS = "60"
# Bounds how long a broken test waits; nothing here asserts on elapsed time.
WAIT = 180.0


@dataclass(frozen=True)
class Verdict:
    """What rank 0's /metrics says of the straggler."""

    rank: int
    slowdown: float
    phase: str | None

    @property
    def named(self) -> bool:
        return self.rank >= 0 and self.slowdown >= THRESHOLD


def verdict(text: str) -> Verdict | None:
    """Rank 0's straggler, None before the first complete picture."""
    rank = samples(text, "ddp_straggler_rank").get("0", -1.0)
    slowdown = samples(text, "ddp_straggler_slowdown").get("0", float("nan"))
    if rank < 0 or slowdown != slowdown:
        return None
    phases = re.findall(r'^ddp_straggler_phase\{[^}]*phase="(\w+)"[^}]*\} 1\.0$', text, re.MULTILINE)
    return Verdict(int(rank), slowdown, phases[0] if len(phases) == 1 else None)


def verdicts(process: TrainerProcess, until: Callable[[list[Verdict]], bool]) -> list[Verdict]:
    """Scrape rank 0 every half second until ``until(the verdicts so far)``."""
    deadline = time.monotonic() + WAIT
    seen: list[Verdict] = []
    while not until(seen):
        assert time.monotonic() < deadline, f"verdicts so far: {seen[-20:]}\n{process.stderr[-3000:]}"
        assert process.process.poll() is None, f"{process.name} exited:\n{process.stderr[-3000:]}"
        try:
            found = verdict(process.scrape())
        except OSError:
            found = None
        if found is not None:
            seen.append(found)
        time.sleep(0.5)
    return seen


def lasting(scrapes: int) -> Callable[[list[Verdict]], bool]:
    """Until ``scrapes`` scrapes (PERSIST seconds) after the first that named a rank."""

    def enough(seen: list[Verdict]) -> bool:
        first = next((i for i, v in enumerate(seen) if v.named), None)
        return first is not None and len(seen) - first > scrapes

    return enough


def stop(gang: list[TrainerProcess]) -> None:
    for process in gang:
        process.signal(signal.SIGTERM)
    assert wait_all(gang) == [0] * len(gang), describe(gang)


def late_gang(gangs: Gangs, world: int, args: list[str]) -> list[TrainerProcess]:
    common = ["--steps", "0", "--step-ms", STEP_MS, "--exchange-every", "5"]
    return gangs.ranks(world, [*common, *args], metrics_ranks=[0], program=SCRIPT)


@pytest.mark.parametrize("phase", ["compute", "data", "communication"])
def test_a_late_rank_is_named_with_the_phase_it_lost_its_time_in(gangs: Gangs, phase: str) -> None:
    gang = late_gang(gangs, 3, ["--slow-rank", "1", "--slow-ms", LATE_MS, "--slow-in", phase])
    seen = verdicts(gang[0], lasting(int(PERSIST / 0.5)))
    stop(gang)
    first = next(i for i, v in enumerate(seen) if v.named)
    held = seen[first:]
    assert all(v.named and v.rank == 1 and v.phase == phase for v in held), held
    # Late by 60 ms on steps of ~10 ms: the job steps several times slower because of it. Each named
    # verdict is at least the naming threshold; on a loaded machine the others' steps stretch too, so
    # one read may dip under 2x (1.997 was seen at load 9 on 2 cores): the typical read is held to it.
    assert statistics.median(v.slowdown for v in held) > 2, held
    assert min(v.slowdown for v in held) >= STRAGGLER_THRESHOLD, held


def test_a_rank_starved_by_its_cpu_limit_is_named(gangs: Gangs) -> None:
    # 5% of a CPU, as `resources.limits.cpu: 50m`: the rank needs several times that, and its gloo
    # threads wait for a CPU inside the collectives, where its wait looks like everyone's.
    limit = cpu_limit(f"ddp-straggler-test-{os.getpid()}", 0.05)
    if limit is None:
        pytest.skip("cannot create a cgroup with a CPU limit here (needs root and the cpu controller)")
    try:
        gang = late_gang(gangs, 3, [])
        verdicts(gang[0], lambda seen: len(seen) >= 1)  # training: every rank measured its steps
        limit.add(gang[2].process.pid)
        seen = verdicts(gang[0], lasting(int(PERSIST / 0.5)))
        stop(gang)
    finally:
        limit.remove()
    first = next(i for i, v in enumerate(seen) if v.named)
    held = seen[first:]
    # Where a starved rank loses its time depends on where its CPU was wanted when the limit bit;
    # the rank is what must hold.
    assert all(v.named and v.rank == 2 for v in held), held


@pytest.mark.parametrize("world", [3, 4])
def test_a_quiet_gang_names_nobody(gangs: Gangs, world: int) -> None:
    gang = late_gang(gangs, world, [])
    # 40 scrapes (20 s) of complete pictures: the pool holds 2 s of steps, so ~10 independent ones.
    seen = verdicts(gang[0], lambda seen: len(seen) >= 40)
    stop(gang)
    scrapes = int(PERSIST / 0.5)
    lasting_runs = [
        seen[i : i + scrapes]
        for i in range(len(seen) - scrapes + 1)
        if all(v.named and v.rank == seen[i].rank for v in seen[i : i + scrapes])
    ]
    assert not lasting_runs, lasting_runs[0]
