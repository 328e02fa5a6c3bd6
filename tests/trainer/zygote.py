"""Trainer processes forked from a Python that has already imported torch (a "zygote").

Every rank and launcher of the trainer tier is a ``python -m ddp_trainer`` (or a script) of its own.
Started fresh, each spends 2.5-4 CPU-seconds importing torch, torch._dynamo and the rendezvous handler
before its first line of our code: on 2 cores that was most of the tier's CPU and the larger part of a
CI run's. A zygote imports those once; each process is then a fork of it that sets its own session,
environment, argv, working directory and standard streams and runs the program's ``__main__`` as
``python -m`` or ``python SCRIPT`` would, to a normal interpreter exit (atexit, thread joins, the exit
code, or death by a signal, reported as ``subprocess.Popen`` reports it).

What a fork shares with its zygote, and what keeps that from making the world gentler than a pod's:
- the modules named in ``PRELOAD`` (never ours: ``ddp_trainer`` is imported by each process itself,
  after its environment is set, so a module that reads a variable at import reads the process's own);
- the variables those libraries read at import (OpenMP's thread count, ``TORCH*``, ``PYTHON*``,
  ``LD_*``...): a process whose environment differs from its zygote's in any of them is not forked
  but started fresh (``fresh_reason``), so such a variable always takes effect;
- the string hash seed, fixed at interpreter start: the pool holds several zygotes, each with its own
  random seed, and hands them out in turn, so the processes of one gang (started one after another)
  iterate their sets and dicts of strings in different orders, as separate pods do.

A pod's own processes (the in-place launcher's forkserver and its workers) are started by the product
itself, exactly as in a container: only the first interpreter of each "pod" comes from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

# What every trainer process imports before its own code runs, and what it costs most to import.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "torch.distributed.elastic.rendezvous",
    "sklearn.datasets",
)
# Variables a preloaded library may read while it is imported: a process that needs another value
# than its zygote's is started fresh.
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "PYTHON", "TORCH", "CUDA", "NVIDIA", "MALLOC")
START_TIMEOUT = 180.0


def fresh_reason(zygote_env: Mapping[str, str], env: Mapping[str, str], argv: Sequence[str]) -> str | None:
    """Why a process must start as a fresh interpreter instead of a fork, or None when a fork is the
    same process."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return f"not this Python: {argv[:1]}"
    if argv[1].startswith("-") and argv[1] != "-m":
        return f"interpreter option {argv[1]}"
    if argv[1] == "-m" and len(argv) < 3:
        return "-m without a module"
    for key in sorted(set(zygote_env) | set(env)):
        if key.startswith(IMPORT_TIME_PREFIXES) and zygote_env.get(key) != env.get(key):
            return f"{key} differs from the zygote's"
    return None


class ForkedProcess:
    """The part of ``subprocess.Popen``'s interface the trainer tier uses, for a zygote's child: its
    exit status comes over the zygote's connection, since the test process is not its parent."""

    def __init__(self, args: Sequence[str], pid: int, connection: socket.socket) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._connection = connection
        self._pending = b""

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        readable, _, _ = select.select([self._connection], [], [], timeout)
        if not readable:
            return
        chunk = self._connection.recv(64)
        self._pending += chunk
        if not chunk or b"\n" in self._pending:
            line = self._pending.split(b"\n", 1)[0]
            if not line:
                raise RuntimeError(f"the zygote of pid {self.pid} went away before it exited")
            self.returncode = int(line)
            self._connection.close()

    def poll(self) -> int | None:
        self._read(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(left)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        # As Popen: nothing once it has exited (its pid may belong to another process by now).
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygotes:
    """A few zygotes, each with its own hash seed, handed out in turn."""

    def __init__(self, workdir: Path, env: Mapping[str, str], count: int = 3) -> None:
        self.env = dict(env)
        self.sockets = [workdir / f"zygote{index}.sock" for index in range(count)]
        self.processes: list[subprocess.Popen[bytes]] = []
        self._next = 0
        # How many processes were forked, and why the others started fresh (the tier's summary).
        self.forked = 0
        self.fresh: Counter[str] = Counter()
        for index, path in enumerate(self.sockets):
            with open(workdir / f"zygote{index}.log", "wb") as log:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, __file__, str(path)],
                        env=self.env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path
    ) -> ForkedProcess | None:
        """``argv`` forked from the next zygote with exactly ``env``, its streams appended to the files;
        None when it must start fresh (``fresh_reason``)."""
        reason = fresh_reason(self.env, env, argv)
        if reason is not None:
            self.fresh[reason] += 1
            return None
        self.forked += 1
        index = self._next
        self._next = (index + 1) % len(self.sockets)
        connection = self._connect(index)
        request = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": os.getcwd(),
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        connection.sendall(json.dumps(request).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = connection.recv(64)
            if not chunk:
                raise RuntimeError(f"zygote {index} closed the connection without a pid (see its log)")
            reply += chunk
        return ForkedProcess(argv, int(reply), connection)

    def _connect(self, index: int) -> socket.socket:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            process = self.processes[index]
            if process.poll() is not None:
                raise RuntimeError(f"zygote {index} exited {process.returncode} (see its log)")
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(str(self.sockets[index]))
                return connection
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"zygote {index} did not listen within {START_TIMEOUT:.0f} s"
                    ) from None
                time.sleep(0.05)

    def summary(self) -> str:
        fresh = ", ".join(f"{reason} ({count})" for reason, count in self.fresh.most_common())
        return f"{self.forked} processes forked from a zygote; started fresh: {fresh or 'none'}"

    def close(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait(timeout=30)


# The zygote's side. It runs as a script: ``python zygote.py SOCKET``.


def _serve(path: str) -> dict[str, object]:
    """Accept requests until this returns, in a forked child, with that child's request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # connectable only once it listens
    parent = os.getppid()
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            connection, _ = listener.accept()
            with connection.makefile("rb") as reader:
                request = json.loads(reader.readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                for other in children.values():
                    other.close()
                return dict(request)
            connection.sendall(f"{pid}\n".encode())
            children[pid] = connection
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = children.pop(pid)
            with contextlib.suppress(OSError):
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            connection.close()
        if os.getppid() != parent:  # the test session is gone
            os._exit(0)


def _become(request: Mapping[str, object]) -> list[str]:
    """Turn this fork into the requested process, up to running its program; its argv."""
    os.setsid()
    stdin = os.open(os.devnull, os.O_RDONLY)
    stdout = os.open(str(request["stdout"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    stderr = os.open(str(request["stderr"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for source, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, target)
    os.closerange(3, 65536)
    os.chdir(str(request["cwd"]))
    env = request["env"]
    assert isinstance(env, dict)
    os.environ.clear()
    os.environ.update({str(key): str(value) for key, value in env.items()})
    argv = request["argv"]
    assert isinstance(argv, list)
    return [str(arg) for arg in argv]


if __name__ == "__main__":
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    # The zygote's own handlers are a fresh interpreter's, so the children's are too.
    argv = _become(_serve(sys.argv[1]))
    import runpy

    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        sys.path[0] = str(Path(argv[1]).resolve().parent)
        runpy.run_path(argv[1], run_name="__main__")
