"""The launchers' rendezvous (ddp_trainer.supervisor.rendezvous) on a real TCP store, its members threads with their
own store connections as pods have: who gets which rank, a lost member superseded by its replacement, a
late one waiting for the next round, an elastic round's last call and a member lost while it waited,
closing and timing out. The launchers themselves use it on every in-place test of this tier."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
)

from ddp_trainer.supervisor import rendezvous
from ddp_trainer.supervisor.rendezvous import Member, RoundsRendezvous, SupersededError, place, ranked
from ddp_trainer.supervisor.restarts import node_addr

pytestmark = pytest.mark.trainer


@pytest.fixture
def host() -> Iterator[TCPStore]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def member(
    host: TCPStore,
    pod_rank: int,
    *,
    pods: int,
    fewest: int | None = None,
    last_call: float = 0.0,
    join_timeout: float = 30.0,
    sort_key: str | None = None,
) -> RoundsRendezvous:
    client = TCPStore("127.0.0.1", host.port, is_master=False, timeout=timedelta(seconds=30))
    return RoundsRendezvous(
        client,
        "job-0",
        pod_rank=pod_rank,
        sort_key=sort_key or node_addr(pod_rank),
        fewest=fewest or pods,
        most=pods,
        join_timeout=join_timeout,
        last_call=last_call,
    )


def join_all(handlers: dict[str, RoundsRendezvous], order: list[str] | None = None) -> dict[str, Any]:
    """Every handler's next_rendezvous at once (started in ``order``): (rank, world) or the error."""
    got: dict[str, Any] = {}

    def run(name: str) -> None:
        try:
            info = handlers[name].next_rendezvous()
            got[name] = (info.rank, info.world_size)
        except Exception as error:
            got[name] = error

    threads = [threading.Thread(target=run, args=(name,)) for name in order or list(handlers)]
    for thread in threads:
        thread.start()
        time.sleep(0.01)
    for thread in threads:
        thread.join(60)
    return got


@pytest.mark.parametrize(
    "order",
    [
        pytest.param(["0", "1", "2", "3"], id="in-rank-order"),
        pytest.param(["3", "1", "0", "2"], id="out-of-order"),
        pytest.param(["2", "3", "1", "0"], id="rank-0-last"),
    ],
)
def test_a_fixed_size_round_ranks_the_pods_by_pod_rank_whoever_joins_first(
    host: TCPStore, order: list[str]
) -> None:
    handlers = {str(r): member(host, r, pods=4) for r in range(4)}
    assert join_all(handlers, order) == {str(r): (r, 4) for r in range(4)}


def test_the_ranks_follow_the_sort_key_where_the_topology_orders_them(host: TCPStore) -> None:
    keys = {0: "a/000000", 1: "c/000001", 2: "b/000002"}
    handlers = {str(r): member(host, r, pods=3, sort_key=node_addr(r, keys[r])) for r in range(3)}
    assert join_all(handlers) == {"0": (0, 3), "2": (1, 3), "1": (2, 3)}


def test_a_survivor_sees_a_pod_waiting_and_the_next_round_forms_with_it(host: TCPStore) -> None:
    handlers = {str(r): member(host, r, pods=3) for r in range(3)}
    join_all(handlers)
    assert [h.num_nodes_waiting() for h in handlers.values()] == [0, 0, 0]
    # Pod 2's worker failed: its agent joins the next round; the others see it at their next check.
    started, _ = in_thread(handlers["2"].next_rendezvous)
    wait_until(lambda: handlers["0"].num_nodes_waiting() == 1)
    assert join_all({"0": handlers["0"], "1": handlers["1"]}) == {"0": (0, 3), "1": (1, 3)}
    started.join(30)


def test_a_lost_members_replacement_supersedes_it_and_the_lost_one_is_told(host: TCPStore) -> None:
    """Pod 1 joined the round and was lost before it completed (it never comes back to read it). Its
    replacement joins with the same pod rank: the round completes with the replacement, not with two
    pods of rank 1, and no one waits for the lost one's heartbeats to age out."""
    lost = member(host, 1, pods=2)
    first, told = in_thread(lost.next_rendezvous)
    wait_until(lambda: joined(host, 0) == 1)
    got = join_all({"new-1": member(host, 1, pods=2), "0": member(host, 0, pods=2)})
    assert got == {"new-1": (1, 2), "0": (0, 2)}
    first.join(30)
    assert isinstance(told.get("error"), SupersededError), told


def test_a_member_that_came_after_the_round_completed_waits_in_the_next_one(host: TCPStore) -> None:
    handlers = {str(r): member(host, r, pods=2) for r in range(2)}
    join_all(handlers)
    # A third member of this 2-pod round (a duplicate that raced the completion): it is not ranked
    # into the complete round, and shows as a waiting pod to its members.
    late = member(host, 1, pods=2)
    waiting, got = in_thread(late.next_rendezvous)
    wait_until(lambda: handlers["0"].num_nodes_waiting() == 1)
    assert join_all({"0": handlers["0"]}, ["0"]) == {"0": (0, 2)}
    waiting.join(30)
    assert (got["info"].rank, got["info"].world_size) == (1, 2)


def test_an_elastic_round_forms_on_the_fewest_after_its_last_call_and_at_once_with_every_pod(
    host: TCPStore,
) -> None:
    two = {str(r): member(host, r, pods=3, fewest=2, last_call=3.0) for r in (0, 2)}
    started = time.monotonic()
    assert join_all(two) == {"0": (0, 2), "2": (1, 2)}  # pod 2 ranks after pod 0: a smaller round
    assert time.monotonic() - started >= 3.0
    # The next round: pod 1 comes back during the last call; with every pod in, it forms at once.
    again = {"0": two["0"], "2": two["2"], "1": member(host, 1, pods=3, fewest=2, last_call=30.0)}
    started = time.monotonic()
    assert join_all(again) == {"0": (0, 3), "1": (1, 3), "2": (2, 3)}
    assert time.monotonic() - started < 30


def test_an_elastic_member_lost_while_it_waited_is_left_out_at_the_last_call(
    host: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pod 1 joins and stops beating (its launcher lost: no process left to beat); pods 0 and 2 join
    after it. The last call forms the round of the two that still beat, not a round with a dead pod
    whose workers would never connect."""
    lost = member(host, 1, pods=4, fewest=2, last_call=1.0)
    stopped = threading.Event()
    real_beats = rendezvous._Beats

    class Silent(real_beats):  # type: ignore[misc,valid-type]
        def _run(self) -> None:  # no beat after the first
            stopped.wait()

    monkeypatch.setattr(rendezvous, "_Beats", Silent)
    in_thread(lost.next_rendezvous)
    wait_until(lambda: joined(host, 0) == 1)
    monkeypatch.setattr(rendezvous, "_Beats", real_beats)
    got = join_all({str(r): member(host, r, pods=4, fewest=2, last_call=1.0) for r in (0, 2)})
    stopped.set()
    assert got == {"0": (0, 2), "2": (1, 2)}


def test_closing_wakes_every_waiting_member_at_once(host: TCPStore) -> None:
    waiting = {str(r): member(host, r, pods=3) for r in (1, 2)}
    got: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda n=n: got.update(join_all({n: waiting[n]}))) for n in waiting]
    for thread in threads:
        thread.start()
    wait_until(lambda: joined(host, 0) == 2)
    member(host, 0, pods=3).shutdown()  # pod 0 gave up (its budget spent) and closed the rendezvous
    for thread in threads:
        thread.join(10)
    assert {n: type(e) for n, e in got.items()} == {"1": RendezvousClosedError, "2": RendezvousClosedError}
    assert member(host, 0, pods=3).is_closed()


def test_a_round_that_does_not_complete_times_out_and_a_store_that_is_gone_is_a_connection_error() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    alone = member(store, 0, pods=2, join_timeout=1.0)
    with pytest.raises(RendezvousTimeoutError, match="did not complete in 1 s"):
        alone.next_rendezvous()
    del store  # the rendezvous pod is gone
    with pytest.raises(RendezvousConnectionError):
        alone.next_rendezvous()


@pytest.mark.parametrize(
    ("members", "expected"),
    [
        pytest.param([(1, 1), (2, 0)], [2, 1], id="sorted-by-pod-rank"),
        pytest.param([(1, 1), (2, 0), (3, 1)], [2, 3], id="a-pod-ranks-newest-ticket-kept"),
        pytest.param([(3, 1), (1, 1), (2, 0)], [2, 3], id="whatever-the-order-read"),
    ],
)
def test_the_ranking_keeps_each_pod_ranks_newest_ticket(
    members: list[tuple[int, int]], expected: list[int]
) -> None:
    assert [m.ticket for m in ranked(Member(t, r, node_addr(r)) for t, r in members)] == expected


@pytest.mark.parametrize(
    ("result", "me", "descriptors", "expected"),
    [
        pytest.param("2,1", Member(1, 1, "x"), None, 1, id="in-the-round"),
        pytest.param("2,1", Member(3, 0, "x"), None, None, id="came-too-late"),
        pytest.param("2,3", Member(1, 1, "x"), [Member(3, 1, "x")], SupersededError, id="superseded"),
        pytest.param(rendezvous.CLOSED, Member(1, 1, "x"), None, RendezvousClosedError, id="closed"),
    ],
)
def test_a_members_place_in_a_result(
    result: str, me: Member, descriptors: list[Member] | None, expected: int | type[Exception] | None
) -> None:
    if isinstance(expected, type):
        with pytest.raises(expected):
            place(result, me, descriptors)
    else:
        assert place(result, me, descriptors) == expected


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """``call`` in a daemon thread; what it returned (``info``) or raised (``error``) lands in the dict."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["info"] = call()
        except Exception as error:
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def joined(host: TCPStore, number: int) -> int:
    return int(host.add(f"ddp/rendezvous/job-0/r{number}/joins", 0))


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come"
        time.sleep(0.02)
