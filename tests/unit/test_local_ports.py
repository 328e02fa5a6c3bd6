"""ddp_operator.local.ports: ports picked now and bound later by another process come from below the
kernel's ephemeral range, are distinct, and are free when picked."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from ddp_operator.local import ports


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        pytest.param("32768\t60999\n", 32768, id="linux-default"),
        pytest.param("1024 65000", 1024, id="widened-range"),
        pytest.param("", ports.EPHEMERAL_START, id="empty-file"),
        pytest.param("not-a-port 60999", ports.EPHEMERAL_START, id="unreadable"),
        pytest.param(None, ports.EPHEMERAL_START, id="no-file"),
    ],
)
def test_the_ephemeral_range_starts_where_the_kernel_says(
    tmp_path: Path, content: str | None, expected: int
) -> None:
    path = tmp_path / "ip_local_port_range"
    if content is not None:
        path.write_text(content)
    assert ports.ephemeral_start(path) == expected


def test_picked_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    picked = ports.free_ports(16)
    assert len(set(picked)) == 16, picked
    start = ports.ephemeral_start()
    if start - 1 - ports.LOWEST >= 100 * 16:
        assert all(ports.LOWEST <= port < min(ports.HIGHEST + 1, start) for port in picked), picked
    for port in picked:
        with socket.socket() as server:
            server.bind((ports.LOCALHOST, port))


def test_a_port_in_use_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        # Every pick tries the held port first: it must be skipped for the next one.
        monkeypatch.setattr(ports, "LOWEST", taken)
        monkeypatch.setattr(ports, "HIGHEST", taken + 500)
        monkeypatch.setattr(ports, "ephemeral_start", lambda: 65536)

        class HeldFirst(random.Random):
            def sample(self, population, k, *, counts=None):  # type: ignore[no-untyped-def,override]
                rest = [p for p in population if p != taken]
                return [taken, *rest][:k]

        picked = ports.free_ports(3, chooser=HeldFirst())
    assert taken not in picked and len(set(picked)) == 3, (taken, picked)


def test_a_narrow_range_falls_back_to_the_kernels_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST + 50)
    picked = ports.free_ports(4)
    assert len(set(picked)) == 4, picked
    assert all(port > 0 for port in picked)


def test_a_port_handed_out_is_never_handed_out_again_by_the_process() -> None:
    # Nothing binds them here: each stays free, as a picked port does until its process binds it.
    picked = [port for _ in range(200) for port in ports.free_ports(2)]
    assert len(set(picked)) == len(picked), sorted(picked)
