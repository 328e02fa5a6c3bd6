"""The worker's control thread on a real gloo group of two processes (ddp_trainer.supervisor.membership,
ddp_trainer.supervisor.group_abort): asked to leave and blocked in a collective, the worker's group is
aborted through torch's ProcessGroup.abort(); asked to leave and reaching its stop check, never. On gloo
the abort does nothing: the collective still completes, and the process forms its next group itself.
What an abort does to an NCCL collective needs a GPU: benchmarks/gpu_check.py checks it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_gang import base_env

from ddp_operator.local.ports import free_ports

pytestmark = pytest.mark.trainer

PROBE = Path(__file__).with_name("abort_probe.py")
LINE = re.compile(r"aborts=(\d+) sum=\[([^\]]*)\] pid=(\d+) regrouped=([\d.]+)")


def run_pair(case: str) -> tuple[int, list[float], str]:
    env = {**base_env(), "CASE": case}
    ports = [str(port) for port in free_ports(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, str(PROBE), str(rank), *ports],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(outputs)
    found = LINE.search(outputs[0])
    assert found is not None, outputs[0]
    total = [float(value) for value in found.group(2).split(",")]
    assert float(found.group(4)) == 2.0, outputs[0]  # the next group, formed in the same process
    return int(found.group(1)), total, outputs[0]


def test_a_blocked_worker_asked_to_leave_has_its_group_aborted_and_gloo_goes_on() -> None:
    aborts, total, output = run_pair("blocked")
    assert aborts == 1, output
    assert "aborted the process group (a no-op on gloo)" in output, output
    assert total == [3.0] * 4, output  # gloo's allreduce was not broken by the abort


def test_a_worker_whose_stop_check_agreed_is_never_aborted() -> None:
    aborts, total, output = run_pair("stop-check")
    assert aborts == 0, output
    assert "aborted the process group" not in output, output
    assert total == [3.0] * 4, output
