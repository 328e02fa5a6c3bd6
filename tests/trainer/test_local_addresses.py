"""A job on one machine stays on loopback: rank 0's store listens on MASTER_ADDR when that is local."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from trainer_gang import LINGERING, Gangs, describe, free_port, wait_all

from ddp_trainer.training.trainer import loopback_listener

pytestmark = pytest.mark.trainer


@pytest.mark.parametrize(
    ("master_addr", "bound_to"),
    [
        pytest.param("127.0.0.1", "127.0.0.1", id="loopback-literal"),
        pytest.param("localhost", "127.0.0.1", id="localhost"),
        pytest.param("127.0.0.2", "127.0.0.2", id="other-loopback-address"),
        pytest.param("10.1.2.3", None, id="pod-ip-listens-everywhere"),
        pytest.param("digits-0.digits.team-a.svc", None, id="dns-name-listens-everywhere"),
    ],
)
def test_rank0_store_binds_only_loopback_addresses(master_addr: str, bound_to: str | None) -> None:
    port = free_port()
    fd = loopback_listener(master_addr, port)
    if bound_to is None:
        assert fd is None
        return
    assert fd is not None
    with socket.socket(fileno=fd) as listener:
        assert listener.getsockname() == (bound_to, port)
        with socket.create_connection((bound_to, port), timeout=5):
            pass  # it accepts connections: the store can take it over as its server socket


def listening_addresses(port: int) -> set[str]:
    """Local addresses in LISTEN state on ``port``, from /proc/net/tcp and tcp6 (hex, as the kernel writes)."""
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":
                found.add(address)
    return found


def test_a_local_gang_listens_on_loopback_only(gangs: Gangs) -> None:
    port = free_port()
    gang = gangs.ranks(
        2,
        ["--max-steps", "10", "--metrics-linger", "120"],
        metrics_ranks=(0,),
        env={"MASTER_PORT": str(port)},
    )
    gang[0].wait_for_stdout(LINGERING)
    listening = listening_addresses(port)
    for process in gang:
        process.signal(15)
    assert wait_all(gang) == [0, 0], describe(gang)
    # 0100007F is 127.0.0.1 in the kernel's byte order; a wildcard server would show 00000000 or ::.
    assert listening == {"0100007F"}, f"rank 0's store listens on {listening}"
