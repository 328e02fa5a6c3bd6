"""Start, watch and stop one gang of local rank processes.

Every rank runs in its own session (so its process group is its own and a terminal's Ctrl-C reaches
only `ddpjob run`, which forwards SIGTERM on purpose); stopping a rank signals its whole group, and
once a rank's main process has exited whatever it left in its session is killed, the way a container
ends when its PID 1 does. An exit by signal N is reported as 128+N, as a kubelet reports it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ddp_operator.local.plan import ProcessSpec
from ddp_operator.policies.failure import exit_code_from_returncode


@dataclass(frozen=True)
class Exit:
    rank: int
    exit_code: int
    finished_at: float  # time.time(), like a container's finishedAt


def _session_processes(session_id: int, proc_root: Path) -> list[tuple[int, int, str]]:
    """(pid, process group, state) of every process whose session or process group is ``session_id``."""
    members: list[tuple[int, int, str]] = []
    try:
        entries = list(proc_root.iterdir())
    except OSError:
        return members
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command name (which may hold spaces and parentheses): state ppid pgrp session.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 4 and session_id in (int(fields[2]), int(fields[3])):
            members.append((int(entry.name), int(fields[2]), fields[0]))
    return members


def session_members(session_id: int, proc_root: Path = Path("/proc")) -> list[int]:
    """PIDs whose session or process group is ``session_id`` (Linux /proc; empty elsewhere)."""
    return [pid for pid, _, _ in _session_processes(session_id, proc_root)]


def members_outside_group(session_id: int, proc_root: Path = Path("/proc")) -> list[int]:
    """Session members that moved to a process group of their own, which ``killpg`` does not reach."""
    return [pid for pid, group, _ in _session_processes(session_id, proc_root) if group != session_id]


# /proc states of a process that takes no signal but SIGKILL until it is continued: stopped, traced.
_STOPPED_STATES = frozenset({"T", "t"})


def stopped_members(session_id: int, proc_root: Path = Path("/proc")) -> list[int]:
    """Session members that are stopped (SIGSTOP, a debugger): a SIGTERM waits with them forever."""
    return [pid for pid, _, state in _session_processes(session_id, proc_root) if state in _STOPPED_STATES]


def _signal_session(session_id: int, signum: int) -> None:
    # Each process gets the signal once: a second SIGTERM can land after a handler has been swapped
    # back (torch's elastic agent turns it into an exception and exit 1 after a successful run).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(session_id, signum)
    for pid in members_outside_group(session_id):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


class RankProcess:
    def __init__(self, spec: ProcessSpec, popen: subprocess.Popen[bytes]) -> None:
        self.spec = spec
        self.popen = popen
        self.session_id = popen.pid
        self.exit: Exit | None = None
        self.done = threading.Event()
        self.threads: list[threading.Thread] = []

    @property
    def running(self) -> bool:
        return not self.done.is_set()


class Gang:
    """The processes of one attempt."""

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        *,
        cwd: str | None,
        on_line: Callable[[int, str], None],
    ) -> None:
        self.exits: queue.Queue[Exit] = queue.Queue()
        self.processes: list[RankProcess] = []
        self._on_line = on_line
        try:
            for spec in specs:
                self._start(spec, cwd)
        except BaseException:
            self.stop(grace_seconds=0)
            raise

    def _start(self, spec: ProcessSpec, cwd: str | None) -> None:
        popen = subprocess.Popen(
            list(spec.argv),
            env=dict(spec.env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        process = RankProcess(spec, popen)
        self.processes.append(process)
        reader = threading.Thread(
            target=self._read, args=(process,), name=f"rank-{spec.rank}-output", daemon=True
        )
        waiter = threading.Thread(
            target=self._wait, args=(process,), name=f"rank-{spec.rank}-wait", daemon=True
        )
        process.threads = [reader, waiter]
        reader.start()
        waiter.start()

    def _read(self, process: RankProcess) -> None:
        assert process.popen.stdout is not None
        for raw in iter(process.popen.stdout.readline, b""):
            self._on_line(process.spec.rank, raw.decode("utf-8", errors="replace").rstrip("\r\n"))
        process.popen.stdout.close()

    def _wait(self, process: RankProcess) -> None:
        returncode = process.popen.wait()
        finished = Exit(process.spec.rank, exit_code_from_returncode(returncode), time.time())
        # The main process is gone: nothing else in its session may outlive it (a container's PID 1).
        _signal_session(process.session_id, signal.SIGKILL)
        process.exit = finished
        process.done.set()
        self.exits.put(finished)

    def next_exit(self, timeout: float) -> Exit | None:
        try:
            return self.exits.get(timeout=timeout)
        except queue.Empty:
            return None

    @property
    def running(self) -> list[RankProcess]:
        return [p for p in self.processes if p.running]

    def signal_all(self, signum: int) -> None:
        for process in self.running:
            _signal_session(process.session_id, signum)

    def signal_rank(self, rank: int, signum: int) -> None:
        for process in self.running:
            if process.spec.rank == rank:
                _signal_session(process.session_id, signum)

    def stop(self, grace_seconds: float, *, should_hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM every live rank, wait up to the grace period, then SIGKILL what is left; reap all.

        A rank with a stopped process (a frozen pod) cannot take the SIGTERM: it is killed at once, so
        the others' stop does not wait out the grace period for it.
        """
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while self.running and time.monotonic() < deadline and not should_hurry():
            for process in self.running:
                if stopped_members(process.session_id):
                    _signal_session(process.session_id, signal.SIGKILL)
            time.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        self.signal_all(signal.SIGKILL)
        for process in self.processes:
            process.done.wait(timeout=10)
            for thread in process.threads:
                thread.join(timeout=5)

    def wait_all(self) -> None:
        for process in self.processes:
            process.done.wait()
            for thread in process.threads:
                thread.join(timeout=5)
