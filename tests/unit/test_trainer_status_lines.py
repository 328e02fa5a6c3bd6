"""The trainer's status lines, IDX files and the launcher's choice of exit code (pure)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from ddp_trainer.progress import (
    FinalResult,
    Progress,
    launcher_status_line,
    parse_final,
    parse_progress,
    parse_status_line,
)
from ddp_trainer.training.idx import IdxFormatError, encode_idx, parse_idx, read_idx, write_idx

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "progress",
    [
        pytest.param(Progress(120, 3, 0.25, 5321.5, 0.241, 0.37), id="detailed"),
        pytest.param(Progress(5, 0, 2.5, 10.0, None, None), id="light-without-p50"),
    ],
)
def test_progress_line_round_trips(progress: Progress) -> None:
    line = progress.line()
    assert line.startswith(f"progress step={progress.step} ")
    assert parse_progress(line) == progress


def test_final_line_starts_with_the_accuracy() -> None:
    line = FinalResult(accuracy=0.96104, loss=0.12, steps=230).line()
    assert line.startswith("final accuracy=0.9610 ")
    assert parse_final(line) == FinalResult(accuracy=0.961, loss=0.12, steps=230)


@pytest.mark.parametrize(
    "line",
    [
        pytest.param("W1130 04:32:05 torch warning", id="log"),
        pytest.param("progress step", id="no-equals"),
        pytest.param("", id="empty"),
    ],
)
def test_other_lines_are_not_status_lines(line: str) -> None:
    assert parse_status_line(line) is None
    assert parse_progress(line) is None


def test_a_launcher_line_writes_each_deprecated_field_with_the_same_value() -> None:
    line = launcher_status_line("started", {"pod": 2, "restarts": 1, "members": 3, "workers": "4:99"})
    assert line == "launcher event=started pod=2 restarts=1 members=3 workers=4:99 node=2 nodes=3"
    assert parse_status_line(line) == (
        "launcher",
        {
            "event": "started",
            "pod": "2",
            "restarts": "1",
            "members": "3",
            "workers": "4:99",
            "node": "2",
            "nodes": "3",
        },
    )
    assert (
        launcher_status_line("stopped", {"pod": 0, "time": "5.5"})
        == "launcher event=stopped pod=0 time=5.5 node=0"
    )


@pytest.mark.parametrize(
    "array",
    [
        pytest.param(np.arange(24, dtype=np.uint8).reshape(2, 3, 4), id="images-u8"),
        pytest.param(np.array([7, 1, 0], dtype=np.uint8), id="labels"),
        pytest.param(np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3), id="float32"),
        pytest.param(np.array([-5, 300], dtype=np.int32), id="int32"),
    ],
)
def test_idx_round_trip(array: np.ndarray, tmp_path: Path) -> None:  # type: ignore[type-arg]
    decoded = parse_idx(encode_idx(array))
    assert decoded.shape == array.shape and (decoded == array).all()
    path = tmp_path / "data-idx.gz"
    write_idx(path, array)
    assert gzip.decompress(path.read_bytes()) == encode_idx(array)
    assert (read_idx(path) == array).all()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x01\x00\x08\x01", id="bad-magic"),
        pytest.param(b"\x00\x00\x07\x01\x00\x00\x00\x01\x00", id="bad-type"),
        pytest.param(b"\x00\x00\x08\x01\x00\x00\x00\x03\x00", id="short-payload"),
    ],
)
def test_idx_rejects_malformed_files(data: bytes) -> None:
    with pytest.raises(IdxFormatError):
        parse_idx(data)
