"""Where a job on one machine listens: loopback only (docs/trainer.md, "Where rank 0 listens")."""

from __future__ import annotations

import ipaddress
import socket
from typing import Final

# Set by the pod's supervisor for its workers (through its forkserver's environment): the round's
# rank 0 supervisor serves the workers' store at MASTER_ADDR:MASTER_PORT, and rank 0's worker joins it
# instead of serving one there itself (ddp_trainer.supervisor.inplace.serve_workers_store).
AGENT_SERVES_STORE_ENV: Final = "DDP_AGENT_SERVES_STORE"


def loopback_listener(master_addr: str, master_port: int) -> int | None:
    """A listening socket on MASTER_ADDR for rank 0's store when that is a loopback address, else None.

    TCPStore's own server listens on every interface. Where MASTER_ADDR is a pod's DNS name that is
    what peers need, but a job on one machine (``ddpjob run``, the tests) must stay on loopback. The
    store takes over the returned descriptor.
    """
    host = "127.0.0.1" if master_addr == "localhost" else master_addr
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not address.is_loopback:
        return None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, master_port))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener.detach()
