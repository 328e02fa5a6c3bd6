"""The job commands' flags (`ddpjob get|describe|logs|top|wait`): parsed as docs/cli.md says."""

from __future__ import annotations

import argparse

import pytest

from ddp_operator import cli
from ddp_operator.commands import wait

DURATION_CASES = [
    pytest.param("90", 90.0, id="plain-seconds"),
    pytest.param("2.5", 2.5, id="fractional-seconds"),
    pytest.param("30s", 30.0, id="seconds"),
    pytest.param("10m", 600.0, id="minutes"),
    pytest.param("1h30m", 5400.0, id="hours-and-minutes"),
    pytest.param("1h0m5s", 3605.0, id="all-three"),
]


@pytest.mark.parametrize(("text", "seconds"), DURATION_CASES)
def test_wait_durations(text: str, seconds: float) -> None:
    assert wait.duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten", "5d", "m5"])
def test_a_bad_duration_names_the_format(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="like 30s"):
        wait.duration(text)


PARSE_CASES = [
    pytest.param(["wait", "j"], {"phase": "Succeeded", "timeout": None}, id="wait-defaults"),
    pytest.param(
        ["wait", "j", "--for=failed", "--timeout=5m"],
        {"phase": "Failed", "timeout": 300.0},
        id="wait-any-case",
    ),
    pytest.param(["wait", "j", "--for=phase=Running"], {"phase": "Running"}, id="wait-kubectl-style"),
    pytest.param(
        ["logs", "j"],
        {"rank": None, "all_ranks": False, "follow": False, "timestamps": False},
        id="logs-defaults",
    ),
    pytest.param(
        ["logs", "j", "-f", "--timestamps"], {"follow": True, "timestamps": True}, id="logs-timestamps"
    ),
    pytest.param(
        ["logs", "j", "--rank", "1", "--rank", "3", "-f"], {"rank": [1, 3], "follow": True}, id="logs-ranks"
    ),
    pytest.param(["get", "-A"], {"job": None, "all_namespaces": True}, id="get-all-namespaces"),
    pytest.param(
        ["top", "j", "--once", "-n", "team-a"], {"once": True, "namespace": "team-a"}, id="top-once"
    ),
    pytest.param(
        ["describe", "j", "--context", "kind-x"], {"job": "j", "context": "kind-x"}, id="describe-context"
    ),
]


@pytest.mark.parametrize(("argv", "expected"), PARSE_CASES)
def test_flags(argv: list[str], expected: dict[str, object]) -> None:
    args = cli.build_parser().parse_args(argv)
    assert {key: getattr(args, key) for key in expected} == expected


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["wait", "j", "--for=Done"], id="wait-unknown-phase"),
        pytest.param(["logs", "j", "--rank", "0", "--all-ranks"], id="logs-rank-and-all"),
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        cli.build_parser().parse_args(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err
