"""The launchers' rendezvous: rounds in which each pod writes its own keys and one member assigns the ranks.

torch's c10d rendezvous (``DynamicRendezvousHandler``) keeps a round's whole state in one store key that
every member rewrites by compare-and-set: members join one successful write at a time, a member whose
write lost re-reads and tries again after a back-off of about a second, and a waiting member re-reads
the state once a second. A round of 8 pods re-formed in 3.2 s on a 2-core machine, 64 in 5.3 s, and 256
never formed (docs/benchmarks.md, "The rendezvous at scale"). This handler keeps torch's contract (the
supervisor calls ``next_rendezvous``, ``num_nodes_waiting``, ``is_closed``, ``shutdown``) with a store layout
whose cost per member does not grow with the members:

- **Joining round R** is one ``add`` on the round's join counter (the member's ticket) and one ``set``
  of its descriptor under its ticket: ``<pod rank> <sort key>``.
- **Completing it** is the business of the member whose ticket makes the round complete: in a
  fixed-size job, the one after which every pod rank has joined; in an elastic one, every pod rank, or
  at least the fewest after ``last_call`` seconds. It reads the descriptors in one ``multi_get``, keeps
  for each pod rank its newest ticket (a lost pod's older ticket is superseded by its replacement's:
  there is one pod per rank), sorts them by sort key (``ddp_trainer.supervisor.restarts.node_addr``: pod rank, or
  the topology's order) and writes the tickets in rank order to the round's one result key, by
  compare-and-set, so one completion wins.
- **Waiting** is the store's own ``wait``, on a ``done`` key set right after the result (torch's legacy
  store server wakes no waiter on a compare-and-set): no polling. Closing the rendezvous writes the
  result key too, so waiters wake at once.
- **Between rounds**, ``num_nodes_waiting`` is one ``add(…, 0)`` on the next round's join counter.

A member whose ticket is not in the result joined too late (the round completed first): it joins the
next round, where the others see it waiting. One whose pod rank is in the result under a newer ticket
was superseded by its replacement and leaves. In an elastic round the waiting members beat a counter
every second, and the completion after ``last_call`` drops those whose beat stopped (a pod lost while it
waited). A fixed-size round needs every pod rank, so a lost member is superseded instead.

Keys, under ``ddp/rendezvous/<run id>/``: ``closed`` (``finished`` or ``ended``); ``open`` (the newest round a new member tries
first); per round ``r<R>/joins``, ``r<R>/m<ticket>``, ``r<R>/beat<ticket>`` and ``r<R>/result``
(tickets in rank order, comma-separated, or ``closed``) and ``r<R>/done``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

from torch.distributed import DistError, DistStoreError, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # public, re-exported implicitly
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

BACKEND: Final = "ddp"
CLOSED: Final = "closed"
# What the ``closed`` key holds: the group trained to its end (its pods exited 0), or it ended otherwise
# (a permanent failure, a pod that gave up). The first close is kept. A pod that comes to join a group
# that finished has nothing left to train (its rank's pod was lost after the last step, and the
# operator replaced it before it saw the job finish).
FINISHED: Final = "finished"
ENDED: Final = "ended"
# How often a waiting member of an elastic round beats, and how many beats it may miss before the
# completion drops it.
BEAT_SECONDS: Final = 1.0
BEATS_MISSED: Final = 2
# How long the completing member waits for a descriptor whose ticket was taken and not yet written (a
# member between its two requests); one still missing then is a member lost in between.
DESCRIPTOR_WAIT_SECONDS: Final = 2.0
# How often a waiting member looks whether its round was left behind: a rendezvous store started anew
# (its pod lost) is seeded with the survivors' next round, and a member that joined the new store's
# round 0 before that moves on to it (ddp_trainer.supervisor.gang_store).
MOVED_CHECK_SECONDS: Final = 1.0


class SupersededError(RendezvousError):
    """A newer pod of this pod's rank is in the round: this pod was replaced and must not train."""


@dataclass(frozen=True)
class Member:
    """One ticket of a round: the pod rank it is for and the key the ranks are sorted by."""

    ticket: int
    pod_rank: int
    sort_key: str

    def encode(self) -> str:
        return f"{self.pod_rank} {self.sort_key}"

    @classmethod
    def decode(cls, ticket: int, text: str) -> Member:
        pod_rank, sort_key = text.split(" ", 1)
        return cls(ticket, int(pod_rank), sort_key)


def ranked(members: Iterable[Member]) -> list[Member]:
    """A round's members in rank order: each pod rank's newest ticket, sorted by sort key."""
    newest: dict[int, Member] = {}
    for member in members:
        kept = newest.get(member.pod_rank)
        if kept is None or member.ticket > kept.ticket:
            newest[member.pod_rank] = member
    return sorted(newest.values(), key=lambda m: (m.sort_key, m.pod_rank))


def encode_result(members: Sequence[Member]) -> str:
    return ",".join(str(m.ticket) for m in members)


def place(result: str, me: Member, members: Sequence[Member] | None = None) -> int | None:
    """This member's rank in a round's result; None when it is not in it (it came too late). Raises
    SupersededError when a newer ticket of its pod rank is (``members``: the round's descriptors,
    read only when needed)."""
    if result == CLOSED:
        raise RendezvousClosedError()
    tickets = [int(t) for t in result.split(",")]
    if me.ticket in tickets:
        return tickets.index(me.ticket)
    if members is not None and any(m.pod_rank == me.pod_rank and m.ticket > me.ticket for m in members):
        raise SupersededError(f"pod rank {me.pod_rank} joined the round again from a newer pod")
    return None


class RoundsRendezvous(RendezvousHandler):
    """torch's RendezvousHandler on the layout above, for one pod's supervisor."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        *,
        pod_rank: int,
        sort_key: str,
        fewest: int,
        most: int,
        join_timeout: float,
        last_call: float = 0.0,
        store_info: tuple[str, int] = ("", 0),
    ) -> None:
        if not 1 <= fewest <= most:
            raise ValueError(f"a round needs 1 <= fewest ({fewest}) <= most ({most}) members")
        self._store = store
        self._run_id = run_id
        self._prefix = f"ddp/rendezvous/{run_id}/"
        self._pod_rank = pod_rank
        self._sort_key = sort_key
        self._fewest = fewest
        self._most = most
        self._join_timeout = join_timeout
        self._last_call = last_call
        self._store_info = store_info
        self._elastic = fewest < most
        self._round: int | None = None  # the round this member is in

    # ---- torch's contract -------------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        # Each round's rank 0 supervisor serves its workers' store (ddp_trainer.supervisor.inplace.serve_workers_store).
        return False

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return bool(self._store.check([self._key("closed")]))

    def set_closed(self, why: str = ENDED) -> None:
        self._store.compare_set(self._key("closed"), "", why)
        # Wake the members waiting in the open round (and the next one of this member's).
        rounds = {self._open()} | ({self._round + 1} if self._round is not None else set())
        for number in rounds:
            self._store.compare_set(self._key(f"r{number}/result"), "", CLOSED)
            self._store.set(self._key(f"r{number}/done"), "1")

    def shutdown(self) -> bool:
        self.set_closed()
        return True

    def finish(self) -> None:
        """Close the rendezvous as finished: this pod's workers trained to the last step."""
        self.set_closed(FINISHED)

    def finished(self) -> bool:
        """Whether the rendezvous was closed by a group that trained to its end."""
        with _store_failures():
            return self.is_closed() and self._store.get(self._key("closed")).decode() == FINISHED

    def num_nodes_waiting(self) -> int:
        key = self.waiting_key()
        if key is None:
            return 0
        with _store_failures():
            return int(self._store.add(key, 0))

    def waiting_key(self) -> str | None:
        """The counter of the pods that joined the round after this member's (None before its first)."""
        return None if self._round is None else self._key(f"r{self._round + 1}/joins")

    # ---- a store started anew ---------------------------------------------------------------------

    def adopt(self, store: Store) -> None:
        """Go on with ``store``, which replaces a lost one: the next round is the one after this member's,
        set there unless a member set it first (every survivor was in the same round)."""
        self._store = store
        if self._round is not None:
            store.compare_set(self._key("open"), "", str(self._round + 1))

    def next_rendezvous(self) -> RendezvousInfo:
        with _store_failures():
            return self._next_round()

    def _next_round(self) -> RendezvousInfo:
        deadline = time.monotonic() + self._join_timeout
        if self.is_closed():
            raise RendezvousClosedError()
        number = max(self._open(), self._round + 1 if self._round is not None else 0)
        while True:
            ticket = int(self._store.add(self._key(f"r{number}/joins"), 1))
            me = Member(ticket, self._pod_rank, self._sort_key)
            # An elastic round's member beats from before its descriptor is there to be read.
            beats = _Beats(self._store, self._key(f"r{number}/beat{ticket}")) if self._elastic else None
            try:
                self._store.set(self._key(f"r{number}/m{ticket}"), me.encode())
                result = self._await(number, me, deadline)
            finally:
                if beats is not None:
                    beats.stop()
            if result is None:  # the round was left behind: the store was started anew
                number = max(number + 1, self._open())
                continue
            rank = place(result, me)
            if rank is None:  # is a newer pod of this rank in it?
                rank = place(result, me, self._descriptors(number, [int(t) for t in result.split(",")]))
            if rank is not None:
                break
            number += 1  # the round completed without this member: the next one has it waiting
        self._round = number
        world = len(result.split(","))
        info = RendezvousStoreInfo(*self._store_info)
        return RendezvousInfo(
            PrefixStore(f"ddp.rendezvous.{self._run_id}.{number}", self._store), rank, world, info
        )

    # ---- a round ----------------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _open(self) -> int:
        key = self._key("open")
        return int(self._store.get(key)) if self._store.check([key]) else 0

    def _await(self, number: int, me: Member, deadline: float) -> str | None:
        """The round's result, completing it when this member's ticket can; None when the newest round
        is past this one while it has no result (a store started anew, seeded by the survivors)."""
        result_key, done_key = self._key(f"r{number}/result"), self._key(f"r{number}/done")
        last_call: _LastCall | None = None
        if me.ticket >= self._fewest:
            members = ranked(self._descriptors(number, me.ticket))
            if len(members) >= self._most:
                self._complete(number, members)
            elif self._elastic and len(members) >= self._fewest:
                last_call = _LastCall(self, number, time.monotonic() + self._last_call)
        while not self._store.check([result_key]):
            if self.is_closed():
                raise RendezvousClosedError()
            now = time.monotonic()
            if now >= deadline:
                raise RendezvousTimeoutError(
                    f"round {number} did not complete in {self._join_timeout:.0f} s "
                    f"(fewest {self._fewest}, most {self._most} members)"
                )
            if last_call is not None and now >= last_call.at:
                members = last_call.members(me)
                if len(members) >= self._fewest:
                    self._complete(number, members[: self._most])
                    continue
                # Fewer than the fewest still beat: wait on, and the next member to join calls again.
                last_call = None
            until = min(deadline, last_call.at) if last_call is not None else deadline
            until = min(until, now + MOVED_CHECK_SECONDS)
            with contextlib.suppress(DistStoreError):  # the deadline or the last call came: above
                self._store.wait([done_key], timedelta(seconds=max(until - now, 0.001)))
            if not self._store.check([result_key]) and self._open() > number:
                return None
        return bytes(self._store.get(result_key)).decode()

    def _complete(self, number: int, members: Sequence[Member]) -> None:
        """Write the round's result (one completion wins) and point new members at the next round (a
        slow completer may set it one round back: a new member then finds that round complete and
        moves on)."""
        self._store.compare_set(self._key(f"r{number}/result"), "", encode_result(members))
        # Waiters wait for this key, not the result: torch's legacy store server (what ddp_trainer.supervisor.stores
        # falls back to where the default server takes no listening socket) wakes no waiter on a
        # compare-and-set, only on a set.
        self._store.set(self._key(f"r{number}/done"), "1")
        self._store.set(self._key("open"), str(number + 1))

    def _descriptors(self, number: int, tickets: int | Sequence[int]) -> list[Member]:
        """The descriptors of a round's ``tickets`` (a count: 1..count); a ticket whose member was lost
        before writing its descriptor is left out."""
        numbers = list(range(1, tickets + 1)) if isinstance(tickets, int) else list(tickets)
        keys = [self._key(f"r{number}/m{t}") for t in numbers]
        if keys and not self._store.check(keys):
            with contextlib.suppress(DistStoreError):
                self._store.wait(keys, timedelta(seconds=DESCRIPTOR_WAIT_SECONDS))
            present = [(t, k) for t, k in zip(numbers, keys, strict=True) if self._store.check([k])]
            numbers, keys = [t for t, _ in present], [k for _, k in present]
        values = self._store.multi_get(keys) if keys else []
        return [Member.decode(t, bytes(v).decode()) for t, v in zip(numbers, values, strict=True)]


class _LastCall:
    """An elastic round with its fewest members, waiting until ``at`` for more: the members then are
    those whose beats moved since the last call began (a member that joined since counts as alive)."""

    def __init__(self, handler: RoundsRendezvous, number: int, at: float) -> None:
        self._handler, self._number, self.at = handler, number, at
        self._started = time.monotonic()
        self._before = self._beats(self._members())

    def _members(self) -> list[Member]:
        handler = self._handler
        joined = int(handler._store.add(handler._key(f"r{self._number}/joins"), 0))
        return handler._descriptors(self._number, joined)

    def _beats(self, members: Sequence[Member]) -> dict[int, int]:
        """Each member's beat count, in one request: a member's beat key exists before its descriptor."""
        keys = [self._handler._key(f"r{self._number}/beat{m.ticket}") for m in members]
        values = self._handler._store.multi_get(keys) if keys else []
        return {m.ticket: int(bytes(v)) for m, v in zip(members, values, strict=True)}

    def members(self, me: Member) -> list[Member]:
        # A beat missed needs BEATS_MISSED beats' time to show: a short last call waits that long.
        missed_after = self._started + BEATS_MISSED * BEAT_SECONDS
        if time.monotonic() < missed_after:
            time.sleep(missed_after - time.monotonic())
        members = self._members()
        now = self._beats(members)
        alive = {t for t, beat in now.items() if t not in self._before or beat > self._before[t]}
        return ranked(m for m in members if m.ticket in alive or m.ticket == me.ticket)


class _Beats:
    """A waiting member's beat, on its own store connection (the member's is blocked in a wait)."""

    def __init__(self, store: Store, key: str) -> None:
        self._key = key
        self._stop = threading.Event()
        self._store = _own_connection(store)
        self._store.add(key, 1)
        self._thread = threading.Thread(target=self._run, name="rendezvous-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store is gone: the wait sees it too
                return

    def stop(self) -> None:
        self._stop.set()


def _own_connection(store: Store) -> Store:
    """Another client of the same store (a TCP store's host and port), or the store itself."""
    if isinstance(store, TCPStore):
        timeout: timedelta = getattr(store, "timeout")  # noqa: B009 (torch has it; its stubs do not)
        return TCPStore(store.host, store.port, is_master=False, timeout=timeout, wait_for_workers=False)
    return store


@contextlib.contextmanager
def _store_failures() -> Iterator[None]:
    """The store unreachable or failing: torch's RendezvousConnectionError, as its own handler says."""
    try:
        yield
    except DistError as error:
        raise RendezvousConnectionError(f"the rendezvous store failed: {error}") from error
