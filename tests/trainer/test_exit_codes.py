"""Exit codes mean what the ExitCode restart policy reads (docs/trainer.md, "Exit codes").

Real gloo process groups: one rank is made to fail (--inject-fault) at each point where the gang
meets, and the survivors must exit 170 (a lost peer, retried); a rank whose own code fails exits a
permanent code (1) while its peers exit 170; a pod of several workers reports the failing worker's
own code, even when that worker could not write its exit record.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from trainer_gang import Gangs, describe, wait_all

from ddp_trainer.exitcodes import EXIT_OWN_ERROR, EXIT_PEER_LOST

pytestmark = pytest.mark.trainer


def trainer_args(max_steps: int = 8) -> list[str]:
    """Short runs; generous timeouts, so that only the broken connection ends the survivors."""
    return [
        *("--max-steps", str(max_steps), "--progress-every", "4"),
        *("--watchdog-timeout", "120", "--init-timeout", "120"),
    ]


KILLED = -signal.SIGKILL


@dataclass(frozen=True)
class Fault:
    fault: str  # --inject-fault RANK:POINT:ACTION
    victim: int
    victim_code: int
    victim_says: str = ""  # on the victim's stderr
    resumes: bool = False  # a checkpoint to resume from must exist first


def run_with_fault(gangs: Gangs, tmp_path: Path, case: Fault) -> list[int]:
    args = trainer_args()
    if case.resumes:
        checkpoints = tmp_path / "checkpoints"
        first = gangs.ranks(2, [*trainer_args(4), "--checkpoint-dir", str(checkpoints)], tag="first")
        assert wait_all(first) == [0, 0], describe(first)
        args += ["--checkpoint-dir", str(checkpoints)]
    gang = gangs.ranks(2, [*args, "--inject-fault", case.fault])
    codes = wait_all(gang)
    victim = gang[case.victim]
    assert codes[case.victim] == case.victim_code, describe(gang)
    assert case.victim_says in victim.stderr, describe(gang)
    survivors = [code for rank, code in enumerate(codes) if rank != case.victim]
    assert survivors == [EXIT_PEER_LOST], describe(gang)
    return codes


PEER_LOST = [
    pytest.param(Fault("1:rendezvous:kill", 1, KILLED), id="during-the-rendezvous"),
    pytest.param(
        Fault("0:resume:kill", 0, KILLED, victim_says="rank 0 resumes from", resumes=True),
        id="during-the-checkpoint-broadcast-on-resume",
    ),
    pytest.param(Fault("1:ddp:kill", 1, KILLED), id="during-ddp-construction"),
    pytest.param(Fault("1:step=3:kill", 1, KILLED), id="in-the-training-loop"),
    pytest.param(Fault("1:final-barrier:kill", 1, KILLED), id="at-the-final-barrier"),
]


@pytest.mark.parametrize("case", PEER_LOST)
def test_a_peer_lost_makes_the_survivors_exit_peer_lost(gangs: Gangs, tmp_path: Path, case: Fault) -> None:
    run_with_fault(gangs, tmp_path, case)


OWN_ERRORS = [
    pytest.param(
        Fault(
            "1:step=3:bad-shape", 1, EXIT_OWN_ERROR, victim_says="mat1 and mat2 shapes cannot be multiplied"
        ),
        id="shape-error-in-the-loop",
    ),
    pytest.param(
        Fault("1:ddp:value-error", 1, EXIT_OWN_ERROR, victim_says="ValueError: injected fault"),
        id="value-error-before-ddp-construction",
    ),
    pytest.param(
        Fault("0:resume:value-error", 0, EXIT_OWN_ERROR, victim_says="ValueError: injected fault"),
        id="value-error-before-the-checkpoint-broadcast",
    ),
]


@pytest.mark.parametrize("case", OWN_ERRORS)
def test_an_own_error_is_permanent_and_its_peers_exit_peer_lost(
    gangs: Gangs, tmp_path: Path, case: Fault
) -> None:
    run_with_fault(gangs, tmp_path, case)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        pytest.param("1:step=3:kill", 128 + signal.SIGKILL, id="worker-killed-without-record"),
        pytest.param("1:step=3:crash=3", 3, id="worker-exits-3-without-record"),
        pytest.param("1:step=3:bad-shape", EXIT_OWN_ERROR, id="worker-own-error"),
    ],
)
def test_a_pod_reports_its_failing_workers_own_code_over_its_peers_170(
    gangs: Gangs, fault: str, expected: int
) -> None:
    pods = gangs.pods(1, 2, [*trainer_args(), "--inject-fault", fault], with_metrics=False)
    assert pods[0].wait() == expected, describe(pods)
    # The other worker did see a lost peer: its 170 was there to be preferred, and was not.
    assert "a peer is gone" in pods[0].stderr, describe(pods)
