"""The harness's ground floor: the processes it starts, the ports they listen on, and the JSON records
of what was started, so that `status` and `down` work from another process.

The control plane (control_plane.py) and the real node (real_node.py) are built on this module; it
imports neither of them, nor anything else of the harness."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

LOCALHOST = "127.0.0.1"
POLL_S = 0.1
STOP_GRACE_S = 10.0

Progress = Callable[[str], None]


class ClusterError(RuntimeError):
    """Something of the local cluster (control plane or node) did not start, stop or answer."""


# ---- where things live -------------------------------------------------------------------------------


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$DDP_CACHE, else ~/.cache/ddp-operator: built binaries, images and default state live here."""
    return Path(environ.get("DDP_CACHE") or Path.home() / ".cache" / "ddp-operator")


def default_state_dir() -> Path:
    env = os.environ.get("DDP_CLUSTER_STATE_DIR")
    return Path(env) if env else cache_dir() / "cluster"


class StateLayout:
    """The files every part of the cluster has: a JSON record, logs, and certificates with their keys.
    Subclasses say where the record, the logs and the certificates live."""

    @property
    def state_file(self) -> Path:
        raise NotImplementedError

    @property
    def pki_dir(self) -> Path:
        raise NotImplementedError

    @property
    def log_dir(self) -> Path:
        raise NotImplementedError

    def log_file(self, component: str) -> Path:
        return self.log_dir / f"{component}.log"

    def cert(self, name: str) -> Path:
        return self.pki_dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.pki_dir / f"{name}.key"


# ---- the records -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComponentState:
    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat starttime: tells our process from a later one reusing the pid
    ports: dict[str, int]
    log: str
    command: list[str]


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int
    running: bool
    rss_bytes: int
    ports: dict[str, int]
    log: str


class ComponentsRecord:
    """A dataclass kept as a JSON file, whose `components` field lists what it started."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    components: list[ComponentState]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Self:
        raw = json.loads(text)
        raw["components"] = [ComponentState(**c) for c in raw["components"]]
        return cls(**raw)

    def save(self, path: Path) -> None:
        """Replace the file atomically: a reader never sees half a record."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Self | None:
        return cls.from_json(path.read_text()) if path.is_file() else None


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# ---- processes ---------------------------------------------------------------------------------------

# Components this process started: polled through Popen, so they are reaped without a ResourceWarning.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _proc_stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces; everything after its closing paren splits cleanly.
    return text[text.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int:
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else -1


def spawn(
    name: str, command: list[str], log: Path, ports: dict[str, int], cwd: Path | None = None
) -> ComponentState:
    """Start a component in its own process group (stopping it signals the group, so whatever it
    spawned goes too), its output appended to log."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
    _CHILDREN[proc.pid] = proc
    return ComponentState(
        name=name, pid=proc.pid, start_ticks=start_ticks(proc.pid), ports=ports, log=str(log), command=command
    )


def is_running(component: ComponentState) -> bool:
    child = _CHILDREN.get(component.pid)
    if child is not None:
        if child.poll() is None:
            return True
        del _CHILDREN[component.pid]
        return False
    stat = _proc_stat(component.pid)
    if stat is None or int(stat[19]) != component.start_ticks:
        return False
    if stat[0] == "Z":  # exited, waiting for its parent (us, when we started it) to reap it
        with contextlib.suppress(ChildProcessError):
            os.waitpid(component.pid, os.WNOHANG)
        return False
    return True


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def component_statuses(components: Iterable[ComponentState]) -> list[ComponentStatus]:
    """What `ddp-harness cluster status` lists for each recorded component."""
    rows = []
    for c in components:
        running = is_running(c)
        rows.append(
            ComponentStatus(c.name, c.pid, running, rss_bytes(c.pid) if running else 0, c.ports, c.log)
        )
    return rows


def log_tail(path: Path | str, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def wait_for(
    what: str,
    check: Callable[[], bool],
    deadline: float,
    watch: Iterable[ComponentState],
    error: type[ClusterError] = ClusterError,
    poll_s: float = POLL_S,
) -> None:
    """Poll ``check`` until it holds; fail early, with the log's tail, when a watched component exits."""
    watched = list(watch)
    while not check():
        for c in watched:
            if not is_running(c):
                raise error(f"{c.name} exited while waiting for {what}; log {c.log}:\n{log_tail(c.log)}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {c.name} ({c.log}):\n{log_tail(c.log, 10)}" for c in watched)
            raise error(f"timed out waiting for {what}\n{logs}")
        time.sleep(poll_s)


def _signal_and_wait(components: Sequence[ComponentState], sig: signal.Signals, wait_s: float) -> None:
    for c in components:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(c.pid, sig)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(is_running(c) for c in components):
        time.sleep(POLL_S)


def kill(component: ComponentState, wait_s: float = STOP_GRACE_S) -> None:
    """SIGKILL a component's process group, as a crash would end it, and wait until it is gone."""
    _signal_and_wait([component], signal.SIGKILL, wait_s)


def stop_components(
    components: Sequence[ComponentState],
    waves: Sequence[Sequence[str]] = (),
    grace_s: float = STOP_GRACE_S,
) -> list[str]:
    """SIGTERM each running component's process group, wave by wave (components named in no wave come
    last, together), and SIGKILL what is still running after grace_s; returns the names of the
    components that had to be killed."""
    killed = []
    known = {name for wave in waves for name in wave}
    for wave in [*waves, tuple(c.name for c in components if c.name not in known)]:
        running = [c for c in components if c.name in wave and is_running(c)]
        if not running:
            continue
        _signal_and_wait(running, signal.SIGTERM, grace_s)
        stubborn = [c for c in running if is_running(c)]
        killed += [c.name for c in stubborn]
        _signal_and_wait(stubborn, signal.SIGKILL, grace_s)
    return killed


# ---- ports and endpoints -----------------------------------------------------------------------------


def http_status(url: str, ctx: ssl.SSLContext | None = None) -> int:
    """The HTTP status of a GET, or 0 when nothing answered (not listening yet, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def tcp_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def unix_socket_alive(path: Path) -> bool:
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        s.connect(str(path))
        return True
    return False


def node_ready(node: dict[str, Any] | None) -> bool:
    """Whether a Node object reports the Ready condition True."""
    conditions = (node or {}).get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
