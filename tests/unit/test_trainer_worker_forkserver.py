"""ddp_trainer.supervisor.worker_forkserver.why_not_forked: when the launcher may fork the workers' forkserver,
and when it must start a new interpreter instead (and say why)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from types import SimpleNamespace

import pytest

from ddp_trainer.supervisor import worker_forkserver

pytestmark = pytest.mark.unit


class NotStarted:
    """multiprocessing's forkserver singleton as it is before anything started it."""

    _lock = threading.Lock()
    _forkserver_address = None
    _forkserver_alive_fd = None
    _forkserver_pid = None


def other_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_forkserver, "FORKED_ON", ())


def no_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver, "_forkserver", SimpleNamespace(_lock=threading.Lock()))


def already_running(monkeypatch: pytest.MonkeyPatch) -> None:
    server = NotStarted()
    server._forkserver_pid = 4242  # type: ignore[assignment]
    monkeypatch.setattr(forkserver, "_forkserver", server)


def handled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        signal, "getsignal", lambda signum: print if signum == signal.SIGTERM else signal.SIG_DFL
    )


@pytest.fixture
def a_thread() -> Iterator[None]:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    yield
    stop.set()
    thread.join()


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher that may fork: this Python, no server yet, its own handlers as a new one's."""
    monkeypatch.setattr(worker_forkserver, "FORKED_ON", (sys.version_info[:2],))
    monkeypatch.setattr(forkserver, "_forkserver", NotStarted())
    defaults = dict(worker_forkserver.FRESH_HANDLERS)
    monkeypatch.setattr(signal, "getsignal", lambda signum: defaults.get(signum, signal.SIG_DFL))


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        pytest.param(None, None, id="may-fork"),
        pytest.param(other_python, "forkserver is not one this launcher forks", id="other-python"),
        pytest.param(
            no_attributes, "lacks _forkserver_address, _forkserver_alive_fd", id="private-surface-gone"
        ),
        pytest.param(already_running, "a forkserver already runs", id="already-running"),
        pytest.param(handled, "the launcher already handles SIGTERM", id="own-handler"),
    ],
)
def test_why_the_forkserver_is_not_forked(
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[pytest.MonkeyPatch], None] | None,
    reason: str | None,
) -> None:
    if make is not None:
        make(monkeypatch)
    found = worker_forkserver.why_not_forked()
    if reason is None:
        assert found is None
    else:
        assert found is not None and reason in found, found


@pytest.mark.usefixtures("a_thread")
def test_a_running_thread_keeps_the_forkserver_a_new_interpreter() -> None:
    found = worker_forkserver.why_not_forked()
    assert found is not None and "1 thread(s)" in found, found
