"""The launcher's last word (docs/restarts.md, "a pod killed with its launcher"): what the trainer writes
to its container's termination message, and what the operator reads of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.unit.kube_factories import observe, pod

from ddp_operator import observe as observing
from ddp_trainer import exitcodes

pytestmark = pytest.mark.unit


def test_the_trainer_and_the_operator_agree_on_the_marker() -> None:
    assert exitcodes.LAUNCHER_EXIT_MARKER == observing.LAUNCHER_EXIT_MARKER


def test_the_launcher_leaves_its_code_where_the_container_keeps_it(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet creates the file before the container starts
    assert exitcodes.write_launcher_exit(137, {exitcodes.TERMINATION_MESSAGE_ENV: str(log)})
    assert log.read_text() == f"{exitcodes.LAUNCHER_EXIT_MARKER} code=137\n"


def test_outside_a_container_nothing_is_written(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-file"
    assert not exitcodes.write_launcher_exit(0, {exitcodes.TERMINATION_MESSAGE_ENV: str(missing)})
    assert not missing.exists()


@pytest.mark.parametrize(
    ("code", "killed", "expected"),
    [
        pytest.param(137, True, True, id="sigkill-without-the-word"),
        pytest.param(137, False, False, id="the-launcher-passed-on-a-workers-137"),
        pytest.param(170, False, False, id="the-launcher-gave-up-peer-lost"),
        pytest.param(1, True, False, id="an-own-error-is-no-kill"),
        pytest.param(0, True, False, id="success"),
    ],
)
def test_a_pod_killed_with_its_launcher_is_told_from_a_launchers_decision(
    code: int, killed: bool, expected: bool
) -> None:
    (observed,) = observe(pod(1, exit_code=code, launcher_killed=killed))
    assert observed.launcher_killed is expected
