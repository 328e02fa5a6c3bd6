from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from trainer_gang import Gangs, base_env
from zygote import Zygotes

SUMMARY: list[str] = []


@pytest.fixture(scope="session")
def zygotes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygotes]:
    """Pythons that imported torch once, for the whole tier to fork its trainer processes from."""
    started = Zygotes(tmp_path_factory.mktemp("zygotes"), base_env())
    try:
        yield started
    finally:
        started.close()
        SUMMARY.append(started.summary())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many processes the zygotes started: a tier that silently started them all fresh again
    would only be slower, so it is said."""
    for line in SUMMARY:
        terminalreporter.write_line(f"trainer tier: {line}")


@pytest.fixture
def gangs(tmp_path: Path, zygotes: Zygotes) -> Iterator[Gangs]:
    started = Gangs(tmp_path, zygotes)
    try:
        yield started
    finally:
        started.end_all()
