"""The in-place launcher's forkserver, forked from the launcher instead of started as a new interpreter.

Every worker of an in-place pod, the first ones and each restart's, is forked by multiprocessing's
forkserver (``ddp_trainer.elastic.start_forkserver``). multiprocessing starts that server as a new
interpreter, which imports torch a second time in every pod: 2.5 CPU-seconds, and seconds of a pod's
start on a loaded node (a replacement's included). The launcher has imported torch already and, at
the point it starts the server, runs no thread and no signal handler of its own, so a fork of it is
the same server without that import: the fork imports what only the workers need (the trainer,
torch._dynamo, the workload's lazy imports) while the launcher joins the rendezvous, then runs
multiprocessing's own server loop (``multiprocessing.forkserver.main``).

This is the one module that touches multiprocessing's private surface: the forkserver singleton's
``_lock``, ``_forkserver_address``, ``_forkserver_alive_fd`` and ``_forkserver_pid`` as CPython 3.10 to
3.12 define them (3.13 added an authentication key to the handshake). On another Python, or when the
launcher already runs a thread or a handler, the server starts the documented way and the launcher
says why in its log: slower, never different.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing import connection, forkserver, resource_tracker
from typing import Any, Final, NoReturn

FORKED_ON: Final = ((3, 10), (3, 11), (3, 12))
# Imported again in the fork (see _serve): the packages whose import reads the workers' environment.
REIMPORTED: Final = frozenset({"ddp_trainer", "prometheus_client"})
PRIVATE_ATTRIBUTES: Final = ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
# The handlers a new interpreter starts with; a fork must not carry the launcher's into the workers.
FRESH_HANDLERS: Final[dict[int, object]] = {
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGINT: signal.default_int_handler,
    signal.SIGHUP: signal.SIG_DFL,
    signal.SIGUSR1: signal.SIG_DFL,
    signal.SIGUSR2: signal.SIG_DFL,
    signal.SIGCHLD: signal.SIG_DFL,
}


def why_not_forked() -> str | None:
    """Why the forkserver cannot be a fork of this process, or None when it can."""
    if sys.version_info[:2] not in FORKED_ON:
        version = ".".join(map(str, sys.version_info[:2]))
        return f"Python {version}'s forkserver is not one this launcher forks (3.10 to 3.12)"
    server = getattr(forkserver, "_forkserver", None)
    missing = [name for name in PRIVATE_ATTRIBUTES if not hasattr(server, name)]
    if missing:
        return f"multiprocessing's forkserver lacks {', '.join(missing)}"
    if getattr(server, "_forkserver_pid", None) is not None:
        return "a forkserver already runs"
    if threading.active_count() != 1:
        return f"the launcher already runs {threading.active_count() - 1} thread(s) of its own"
    # A handler marked fork_safe (the entry point's start-up SIGTERM handler) does nothing in a fork
    # but end it, and the fork resets it before it serves.
    changed = [
        signal.Signals(signum).name
        for signum, fresh in FRESH_HANDLERS.items()
        if signal.getsignal(signum) not in (fresh, signal.SIG_IGN)
        and not getattr(signal.getsignal(signum), "fork_safe", False)
    ]
    if changed:
        return f"the launcher already handles {', '.join(changed)}"
    return None


def start(preload: Sequence[str], log: Callable[[str], None], *, fork: bool = True) -> bool:
    """Start the workers' forkserver, importing ``preload``; True when it is a fork of this process.
    ``fork`` False (DDP_WORKER_FORKSERVER=interpreter): multiprocessing starts it, as documented."""
    multiprocessing.set_forkserver_preload(list(preload))
    reason = why_not_forked() if fork else None
    if not fork or reason is not None:
        if reason is not None:
            log(f"the workers' forkserver starts as a new interpreter (it imports torch again): {reason}")
        forkserver.ensure_running()
        return False
    server: Any = getattr(forkserver, "_forkserver")  # noqa: B009 (private: this module's to touch)
    with server._lock:
        resource_tracker.ensure_running()
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w, preload)
        os.close(alive_r)
        listener.close()
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int, alive_w: int, preload: Sequence[str]) -> NoReturn:
    """The fork: hold what a new interpreter's server would hold, then run multiprocessing's loop."""
    code = 1
    try:
        # Nothing the launcher made is collected here (a finalizer could close an fd number this
        # process has reused); the server and its workers allocate their own.
        gc.freeze()
        os.close(alive_w)  # the server ends when every client's end is closed
        for signum, fresh in FRESH_HANDLERS.items():
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, fresh)  # type: ignore[arg-type]
        # Only the descriptors a new interpreter's server is passed: the standard streams, the listener
        # and the read end of the pipe that says when the last client is gone.
        keep = sorted({0, 1, 2, listener_fd, alive_r})
        previous = -1
        for fd in [*keep, os.sysconf("SC_OPEN_MAX")]:
            # Never an empty range: CPython 3.11 turns closerange(n, n) into close_range(n, ~0),
            # which closes every descriptor, the standard streams included.
            if fd > previous + 1:
                os.closerange(previous + 1, fd)
            previous = fd
        # Our own modules, and the one library that reads the workers' environment when it is
        # imported (prometheus-client picks its multiprocess value class then), are imported again
        # here, under the environment the launcher has set since it imported them: as a new
        # interpreter's server would import them. torch and the rest stay shared.
        for name in [name for name in sys.modules if name.split(".")[0] in REIMPORTED]:
            del sys.modules[name]
        forkserver.main(listener_fd, alive_r, list(preload))
        code = 0
    except SystemExit as stop:  # the server's own way out once the last client is gone
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)
