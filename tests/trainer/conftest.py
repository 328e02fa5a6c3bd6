from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from trainer_gang import Gangs


@pytest.fixture
def gangs(tmp_path: Path) -> Iterator[Gangs]:
    started = Gangs(tmp_path)
    try:
        yield started
    finally:
        started.end_all()
