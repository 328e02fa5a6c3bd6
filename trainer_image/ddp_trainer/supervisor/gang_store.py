"""The rendezvous store as a pod's supervisor reaches it: one more pod that may be lost and replaced.

The job's rendezvous pod (docs/restarts.md, "No rank is special") holds the launchers' rounds and the
gang's books. Losing it must cost no more than losing any other pod: the operator starts a new one
behind the same DNS name, and every supervisor, once it finds its connection broken, connects to the new
store and writes back what that store lacks and it holds (``seed``): the next round's number, the
gang's counters and the books of its current round. Every surviving supervisor holds the same values,
so whichever writes first wins and the others' writes change nothing (each is set only where absent).

While the group trains no supervisor needs the store, so training goes on through the loss; what
needs it (a pod waiting to join, the next restart) waits for the new store for up to the init timeout.
A store whose pod was deleted closes its sockets and the next request fails at once; one on a lost node
answers nothing, so the look at it that runs while the group trains (``WaitingWatch``) has a connection
of its own with a short timeout: a look that times out counts as a lost store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Final

from torch.distributed import DistError, Store  # type: ignore[attr-defined]  # public, re-exported implicitly

# Connects a client to the rendezvous store; its argument bounds the connect and every later request.
Connect = Callable[[timedelta], Store]

# How long one look at the store may take before the store counts as lost (its pod's node gone).
LOOK_TIMEOUT: Final = timedelta(seconds=5)
# Between two connects to a store that is not back yet.
RECONNECT_INTERVAL: Final = 0.5


def set_if_absent(store: Store, key: str, value: str) -> None:
    """``key`` = ``value`` unless it is set already (the first writer of equal values wins)."""
    store.compare_set(key, "", value)


def reconnect(
    connect: Connect, timeout: timedelta, deadline: float, stopped: Callable[[], bool]
) -> Store | None:
    """A client of the store once it answers again, before ``deadline`` (monotonic); None when it did not
    or ``stopped()`` says the pod is stopping. Its requests are bounded by ``timeout``."""
    while not stopped():
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            store = connect(timedelta(seconds=min(left, LOOK_TIMEOUT.total_seconds())))
            store.check(["ddp/probe"])  # a request: the connection reaches a live server
        except DistError:
            time.sleep(min(RECONNECT_INTERVAL, max(deadline - time.monotonic(), 0.0)))
            continue
        store.set_timeout(timeout)
        return store
    return None


class WaitingWatch:
    """How many pods wait to join the next round, read in a thread of its own every ``interval``, so
    that the supervisor's watch of its workers never blocks on a store that answers nothing. ``lost``
    turns true when a look fails or times out, and back once ``relinked`` is called."""

    def __init__(self, connect: Connect, key: Callable[[], str | None], interval: float) -> None:
        self._connect = connect
        self._key = key
        self._interval = interval
        self._store: Store | None = None
        # The last look: the counter it read and its value (a look at an earlier round's counter says
        # nothing of the current one's: the pods that joined it are this round's members).
        self._seen: tuple[str, int] | None = None
        self._lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddp-waiting-watch", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        seen = self._seen
        if self._lost or seen is None or seen[0] != self._key():
            return 0
        return seen[1]

    @property
    def lost(self) -> bool:
        return self._lost

    def relinked(self) -> None:
        """The supervisor reached a live store again: look at it anew."""
        self._store, self._lost = None, False

    def stop(self) -> None:
        """End the looks and wait for the one under way (bounded by LOOK_TIMEOUT): a thread left in a
        store request while the interpreter exits would abort the process."""
        self._stop.set()
        self._thread.join(LOOK_TIMEOUT.total_seconds() + 1)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            key = self._key()
            if key is None or self._lost:
                continue
            try:
                if self._store is None:
                    self._store = self._connect(LOOK_TIMEOUT)
                self._seen = (key, int(self._store.add(key, 0)))
            except DistError:
                self._store, self._seen, self._lost = None, None, True
