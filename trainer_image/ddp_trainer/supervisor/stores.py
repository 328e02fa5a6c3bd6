"""The one place that makes a TCP store: torch's public ``TCPStore``, on whichever torch is installed.

A store that serves on a listening socket we made (``ddp_trainer.supervisor.addresses.loopback_listener``) needs a
server that takes one: torch 2.15's default (libuv) server does, torch 2.6's refuses it and only its
legacy server (``use_libuv=False``, a public argument) takes one. :func:`tcp_store` tries the default first and falls back
once the installed torch says it cannot, so the newest torch keeps its default server.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, re-exported implicitly

# Whether the installed torch's default store server takes a listening socket (until it says not).
_default_takes_fd = True


def tcp_store(
    host: str,
    port: int,
    *,
    is_master: bool,
    timeout: timedelta,
    world_size: int | None = None,
    listen_fd: int | None = None,
) -> TCPStore:
    """A client of the store at ``host:port``, or with ``is_master`` its server (on ``listen_fd`` when
    given: it takes over the descriptor)."""
    if listen_fd is None:
        return TCPStore(host, port, world_size, is_master, timeout, wait_for_workers=False)
    global _default_takes_fd
    port = bound_port(listen_fd)  # the legacy server checks that the two agree
    if _default_takes_fd:
        try:
            return TCPStore(
                host, port, world_size, is_master, timeout, wait_for_workers=False, master_listen_fd=listen_fd
            )
        except NotImplementedError:
            # "The libuv TCPStore backend does not support initialization with an listen fd" (torch 2.6):
            # asked once per process, it says so once.
            _default_takes_fd = False
    return TCPStore(
        host,
        port,
        world_size,
        is_master,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listen_fd,
        use_libuv=False,
    )


def bound_port(fd: int) -> int:
    """The port the listening socket ``fd`` is bound to (the descriptor stays open)."""
    with socket.socket(fileno=os.dup(fd)) as listener:
        return int(listener.getsockname()[1])
