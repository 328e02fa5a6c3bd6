"""The gang health check (DDP_HEALTH_CHECK=on) in real gloo groups on loopback.

A group measures its all-reduce bus bandwidth and every rank's link to the next before its first
step; a rank made late in every send (``--inject-fault RANK:health:slow=MS``, the only way to slow one
rank's links from outside its code here) is named by every rank. The check leaves training bit for
bit as it is without it, across a resume. Under the in-place launcher a round re-formed of the same
pods does not check again; a round with a replacement pod does.

What is asserted is the result's structure and sense (positive bandwidths, one verdict on every rank,
the order of events), never how long anything took: benchmarks/bench_health_check.py measures that.
"""

from __future__ import annotations

import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
from trainer_gang import Gangs, TrainerProcess, describe, events, finish, samples, wait_all

pytestmark = pytest.mark.trainer

# A small buffer: on loopback a round trip of 64 KiB takes about a millisecond, far from the slow
# rank's delay, so the verdict does not depend on how loaded the machine is.
HEALTH = {"DDP_HEALTH_CHECK": "on", "DDP_HEALTH_CHECK_BYTES": str(64 * 1024)}
SLOW_RANK = 2
SLOW_MS = 200
SHORT = ["--max-steps", "5", "--progress-every", "5", "--metrics-linger", "120"]
# 15 steps an epoch (digits on 3 ranks, batch 32); 40 steps end mid-epoch 2, 20 mid-epoch 1.
DIGITS = ["--max-steps", "40", "--seed", "11", "--progress-every", "40"]
IN_PLACE = {"DDP_RESTART_MODE": "InPlace", "DDP_RESTART_BUDGET": "3"}
# Bounds how long a broken test waits; nothing here asserts on elapsed time.
WAIT = 180.0


def health_lines(process: TrainerProcess) -> list[dict[str, str]]:
    return process.status_lines("health")


def line_index(process: TrainerProcess, pattern: str, nth: int = 0) -> int:
    """Where the ``nth`` line matching ``pattern`` is in the process's stdout (order of events)."""
    found = [i for i, line in enumerate(process.stdout.splitlines()) if re.search(pattern, line)]
    assert len(found) > nth, describe([process])
    return found[nth]


def links(text: str) -> set[tuple[str, str]]:
    """The (rank, peer) of every positive ``ddp_health_link_bandwidth_bytes_per_second`` sample."""
    found = set()
    for labels, value in re.findall(
        r"^ddp_health_link_bandwidth_bytes_per_second\{([^}]*)\} (\S+)$", text, re.M
    ):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if float(value) > 0:
            found.add((pairs["rank"], pairs["peer"]))
    return found


def wait_for_count(process: TrainerProcess, pattern: str, count: int) -> None:
    deadline = time.monotonic() + WAIT
    regex = re.compile(pattern, re.MULTILINE)
    while len(regex.findall(process.stdout)) < count:
        assert time.monotonic() < deadline, f"fewer than {count} of {pattern!r}\n{describe([process])}"
        assert process.process.poll() is None, describe([process])
        time.sleep(0.1)


def test_every_rank_names_the_rank_late_in_its_sends(gangs: Gangs) -> None:
    args = [*SHORT, "--inject-fault", f"{SLOW_RANK}:health:slow={SLOW_MS}"]
    gang = gangs.ranks(4, args, metrics_ranks=range(4), env=HEALTH)
    scrapes = finish(gang)
    verdicts = {}
    for rank, text in enumerate(scrapes):
        mine = str(rank)
        verdicts[rank] = samples(text, "ddp_health_slow_rank")[mine]
        busbw = samples(text, "ddp_health_busbw_bytes_per_second")[mine]
        assert busbw > 0 and math.isfinite(busbw)
        assert samples(text, "ddp_health_allreduce_seconds")[mine] > 0
        assert samples(text, "ddp_health_check_seconds")[mine] > 0
        assert samples(text, "ddp_health_check_timestamp_seconds")[mine] > 0
        assert links(text) == {(mine, str((rank + 1) % 4))}, text
    assert verdicts == {rank: SLOW_RANK for rank in range(4)}, describe(gang)
    [line] = health_lines(gang[0])
    assert (line["world_size"], line["bytes"], line["slow_rank"], line["slow_link"]) == (
        "4",
        str(64 * 1024),
        str(SLOW_RANK),
        "na",
    )
    assert float(line["busbw_bytes_per_s"]) > 0
    assert float(line["link_min_bytes_per_s"]) <= float(line["link_median_bytes_per_s"])
    # The check came before the first step, and training went on as usual.
    assert line_index(gang[0], r"^health ") < line_index(gang[0], r"^progress ")
    assert len({d for rank in gang for d in rank.digests().values()}) == 1


def run_digest(gangs: Gangs, args: list[str], tag: str, env: dict[str, str] | None = None) -> str:
    gang = gangs.ranks(3, args, tag=tag, env=env)
    assert wait_all(gang) == [0, 0, 0], describe(gang)
    digests = {d for rank in gang for d in rank.digests().values()}
    assert len(digests) == 1, describe(gang)
    assert len(health_lines(gang[0])) == (1 if env else 0), describe(gang)
    return digests.pop()


def test_the_check_leaves_training_bit_for_bit_as_without_it_across_a_resume(
    gangs: Gangs, tmp_path: Path
) -> None:
    reference = run_digest(gangs, DIGITS, "reference")
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    halfway = [*DIGITS[:1], "20", *DIGITS[2:], *checkpoints]
    run_digest(gangs, halfway, "first-half", HEALTH)
    resumed = run_digest(gangs, [*DIGITS, *checkpoints], "second-half", HEALTH)
    assert resumed == reference


def test_a_round_checks_again_only_with_a_new_pod(gangs: Gangs, tmp_path: Path) -> None:
    args = ["--max-steps", "200", "--progress-every", "5", "--stop-check-every", "5", "--seed", "7"]
    args += ["--throttle-ms", "40", "--init-timeout", "120", "--metrics-linger", "120"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10"]
    pods = gangs.pods(3, 1, args, env={**IN_PLACE, **HEALTH})
    pods[0].wait_for_stdout(r"^progress step=20 ")
    # A worker restarted where it was: the same pods re-form round 1 and measure nothing new.
    os.kill(pods[1].worker_pids()[1], signal.SIGKILL)
    pods[0].wait_for_stdout(r"^resumed step=")
    wait_for_count(pods[0], r"^progress step=", len(pods[0].progress()) + 2)
    # A pod replaced: round 2 has a member new to the gang and checks its links again.
    pods[2].end()
    for survivor in pods[:2]:
        wait_for_count(survivor, r"^launcher event=stopped ", 2)
    replacement = gangs.again(pods[2], "pod2-again")
    scrapes = finish([pods[0], pods[1], replacement])

    assert [e["restarts"] for e in events(pods[0], "reformed")] == ["1", "2"], describe(pods)
    checks = health_lines(pods[0])
    assert len(checks) == 2, describe(pods)
    assert all(line["world_size"] == "3" and line["slow_rank"] in {"-1", "0", "1", "2"} for line in checks)
    # The first before round 1, the second after round 2 re-formed.
    assert line_index(pods[0], r"^health ", 0) < line_index(pods[0], r"^launcher event=reformed ", 0)
    assert line_index(pods[0], r"^health ", 1) > line_index(pods[0], r"^launcher event=reformed ", 1)
    # Every member exports round 2's verdict, the replacement included.
    verdicts = [samples(text, "ddp_health_slow_rank")[str(rank)] for rank, text in enumerate(scrapes)]
    assert len(set(verdicts)) == 1 and verdicts[0] == int(checks[1]["slow_rank"]), scrapes
    digests = [pods[0].digests(), pods[1].digests(), replacement.digests()]
    assert len({d for found in digests for d in found.values()}) == 1, describe(pods)
