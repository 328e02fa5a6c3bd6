"""Ports for processes on one machine (``ddpjob run``'s pods; the test harness's too).

A port is picked now and bound later by another process, seconds later when that process imports
torch first. A port the kernel hands out for ``bind(('', 0))`` lies in its ephemeral range, where any
connection on the machine may take it as its source port meanwhile: on a busy machine one did, and
the process that was given it failed with ``EADDRINUSE``. So the ports here come from below that
range, where only a bind that names a port takes one, picked at random and checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Final

LOCALHOST: Final = "127.0.0.1"
# Above the ports servers are commonly configured on (the kubelet's 10250, etcd's 2379, 8080, 9090)
# and below Kubernetes' NodePort range (30000-32767), which a kube-proxy may hold on the host.
LOWEST: Final = 20000
HIGHEST: Final = 29999
EPHEMERAL_RANGE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Where the ephemeral range starts when the kernel does not say (Linux's default).
EPHEMERAL_START: Final = 32768


def ephemeral_start(path: Path = EPHEMERAL_RANGE) -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_START


def _bindable(port: int, host: str) -> bool:
    """Whether nothing holds ``port`` on ``host`` or on every address (a server that listens on all
    interfaces conflicts with one on ``host``)."""
    for address in dict.fromkeys((host, "0.0.0.0")):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                return False
    return True


# Every port this process handed out: a port given for a later bind is free until that bind, so a
# second pick could return it again (a test's store port and its metrics port once matched).
_HANDED_OUT: set[int] = set()


def free_ports(count: int, host: str = LOCALHOST, *, chooser: random.Random | None = None) -> list[int]:
    """``count`` distinct ports that nothing holds now and that this process never handed out before,
    outside the kernel's ephemeral range where it leaves room (else, on a machine whose range starts
    lower, ports the kernel picks)."""
    highest = min(HIGHEST, ephemeral_start() - 1)
    if highest - LOWEST < 100 * count:
        return _kernel_ports(count, host)
    pick = chooser or random.SystemRandom()
    found: list[int] = []
    for port in pick.sample(range(LOWEST, highest + 1), highest + 1 - LOWEST):
        if port not in _HANDED_OUT and _bindable(port, host):
            found.append(port)
            if len(found) == count:
                _HANDED_OUT.update(found)
                return found
    raise OSError(f"no {count} free ports between {LOWEST} and {highest} on {host}")


def _kernel_ports(count: int, host: str) -> list[int]:
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()
