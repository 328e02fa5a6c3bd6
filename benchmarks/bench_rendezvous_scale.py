"""How the launchers' rendezvous scales: forming a round and re-forming it at 64, 256 and 1,024 members.

Every pod's launcher is one member of the rendezvous in one TCP store, configured as
``ddp_trainer.elastic.rendezvous_handler`` configures it: ``ddp_trainer.supervisor.rendezvous.RoundsRendezvous``
(``--handler ddp``, the launcher's), or torch's c10d rendezvous (``DynamicRendezvousHandler`` on a
``C10dRendezvousBackend``, keep-alive every 2 s: ``--handler torch``, what the launcher used before, for
the comparison). An agent between rounds asks the store every ``MONITOR_INTERVAL`` (100 ms) whether a
member waits (``num_nodes_waiting``). Here the members are threads, many to a process (a launcher's
rendezvous is a few store round trips, not a training run), each with its own store connection, as a
pod has:

  form      every member calls ``next_rendezvous`` at once: until the last one has its rank.
  re-form   one member joins the next round (a restarted worker's agent); the others see it waiting at
            their next poll and join too: from that call until the last member has its new rank.
  polling   the members idle between rounds (polling, and torch's keep-alives) for a few seconds: the
            store requests per second, which is what the store serves while a job trains.

Each figure is the median of --runs runs; "x" columns are the ratio to the smallest size measured in the
same run (the same machine load). Store requests are counted at each member's store client (torch's:
its backend's state reads and writes, each one or two requests).

    python benchmarks/bench_rendezvous_scale.py [--members 64 256 1024 --runs 3 --processes 8 --handler ddp]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddp_operator.local.ports import free_ports

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer_image"))

POLL = 0.1  # ddp_trainer.elastic.MONITOR_INTERVAL, checked below
# torch's keep-alive as the launcher configured it with torch's rendezvous.
TORCH_KEEP_ALIVE_INTERVAL = 2
TORCH_KEEP_ALIVE_MAX_ATTEMPT = 5
# As the launcher runs it (ddp_trainer.elastic.run_in_place): rank 0's agent publishes the workers' store
# in each round instead of torch hosting one at the rank 0 member's address.
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


def free_port() -> int:
    return free_ports(1)[0]


@dataclass(frozen=True)
class Result:
    form: float
    reform: float
    polls_per_second: float
    round_trips_per_reform: float


class _Counted:
    """Counts the backend's state reads and writes (each one or two store requests)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls = 0

    def add(self) -> None:
        with self.lock:
            self.calls += 1


def _handler(port: int, members: int, rank: int, run_id: str, counter: _Counted, kind: str) -> Any:
    from torch._C._distributed_c10d import TCPStore

    from ddp_trainer.supervisor.restarts import node_addr

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    if kind == "ddp":
        from ddp_trainer.supervisor.rendezvous import RoundsRendezvous

        return RoundsRendezvous(
            _counting_store(store, counter),
            run_id,
            pod_rank=rank,
            sort_key=node_addr(rank),
            fewest=members,
            most=members,
            join_timeout=600,
            store_info=("127.0.0.1", port),
        )
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class CountingBackend(C10dRendezvousBackend):
        def get_state(self) -> Any:
            counter.add()
            return super().get_state()

        def set_state(self, state: bytes, token: Any = None) -> Any:
            counter.add()
            return super().set_state(state, token)

    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{port}",
        run_id=run_id,
        min_nodes=members,
        max_nodes=members,
        local_addr=node_addr(rank),
        join_timeout=600,
        keep_alive_interval=TORCH_KEEP_ALIVE_INTERVAL,
        keep_alive_max_attempt=TORCH_KEEP_ALIVE_MAX_ATTEMPT,
    )
    return create_handler(store, CountingBackend(store, run_id), params)


def _counting_store(inner: Any, counter: _Counted) -> Any:
    """The member's store client, counting its requests (a Python Store: PrefixStore takes it)."""
    import torch.distributed as dist

    class Counting(dist.Store):
        def __init__(self) -> None:
            super().__init__()

        def set(self, key: str, value: Any) -> None:
            counter.add()
            inner.set(key, value)

        def get(self, key: str) -> Any:
            counter.add()
            return inner.get(key)

        def add(self, key: str, value: int) -> int:
            counter.add()
            return int(inner.add(key, value))

        def check(self, keys: list[str]) -> bool:
            counter.add()
            return bool(inner.check(keys))

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            counter.add()
            inner.wait(keys, timeout) if timeout is not None else inner.wait(keys)

        def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
            counter.add()
            return inner.compare_set(key, expected, desired)

        def multi_get(self, keys: list[str]) -> Any:
            counter.add()
            return inner.multi_get(keys)

    return Counting()


def _member_process(
    port: int, members: int, ranks: list[int], run_id: str, barrier: Any, results: Any, idle: float, kind: str
) -> None:
    """One process's share of the members: build them, then form, idle and re-form in step with the
    other processes (``barrier``); each phase's end times go to ``results``."""
    from ddp_trainer import elastic

    assert elastic.MONITOR_INTERVAL == POLL, "the poll interval here is the launcher's"
    counter = _Counted()
    handlers = {rank: _handler(port, members, rank, run_id, counter, kind) for rank in ranks}
    ends: dict[str, list[float]] = {"form": [], "reform": []}
    lock = threading.Lock()

    def form(rank: int) -> None:
        handlers[rank].next_rendezvous()
        with lock:
            ends["form"].append(time.time())

    def reform(rank: int, starter: bool, stop_idle: threading.Event) -> None:
        handler = handlers[rank]
        if not starter:
            # An agent between rounds: poll whether a member waits, as torch's agent does.
            while handler.num_nodes_waiting() == 0:
                time.sleep(POLL)
        else:
            stop_idle.wait()
        handler.next_rendezvous()
        with lock:
            ends["reform"].append(time.time())

    barrier.wait()
    threads = [threading.Thread(target=form, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    barrier.wait()
    # Idle between rounds: every member polls; the keep-alives run in the handlers' own timers.
    before = counter.calls
    stop_idle = threading.Event()
    threads = [threading.Thread(target=reform, args=(rank, rank == members - 1, stop_idle)) for rank in ranks]
    idle_started = time.time()
    for thread in threads:
        thread.start()
    time.sleep(idle)
    polled = counter.calls - before
    idle_seconds = time.time() - idle_started
    barrier.wait()
    triggered = time.time()
    stop_idle.set()
    reform_before = counter.calls
    for thread in threads:
        thread.join()
    results.put(
        (
            max(ends["form"]),
            triggered if members - 1 in ranks else None,
            max(ends["reform"]),
            polled / idle_seconds,
            counter.calls - reform_before,
        )
    )
    barrier.wait()  # no member leaves (closing its connection) before all have their rank
    for handler in handlers.values():
        handler.shutdown()


def measure(members: int, processes: int, idle: float, kind: str) -> Result:
    from torch._C._distributed_c10d import TCPStore

    port = free_port()
    host = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    count = min(processes, members)
    shares = [list(range(members))[i::count] for i in range(count)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(count + 1)
    results = context.Queue()
    run_id = f"bench-{members}-{time.time_ns()}"
    children = [
        context.Process(
            target=_member_process, args=(port, members, share, run_id, barrier, results, idle, kind)
        )
        for share in shares
    ]
    for child in children:
        child.start()
    barrier.wait(timeout=600)  # every member built and connected
    started = time.time()
    barrier.wait(timeout=600)  # formed
    barrier.wait(timeout=600)  # idle measured, re-form triggered
    got = [results.get(timeout=600) for _ in children]
    barrier.wait(timeout=600)
    for child in children:
        child.join(timeout=120)
    del host
    triggered = next(t for _, t, _, _, _ in got if t is not None)
    return Result(
        form=max(f for f, _, _, _, _ in got) - started,
        reform=max(r for _, _, r, _, _ in got) - triggered,
        polls_per_second=sum(p for _, _, _, p, _ in got),
        round_trips_per_reform=float(sum(c for *_, c in got)),
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--members", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--processes", type=int, default=8, help="processes the members are spread over")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds of polling measured between rounds")
    parser.add_argument("--handler", choices=["ddp", "torch"], default="ddp", help="whose rendezvous (above)")
    args = parser.parse_args()
    rows: list[tuple[int, Result]] = []
    for members in args.members:
        runs = [measure(members, args.processes, args.idle, args.handler) for _ in range(args.runs)]
        median = Result(
            form=statistics.median(r.form for r in runs),
            reform=statistics.median(r.reform for r in runs),
            polls_per_second=statistics.median(r.polls_per_second for r in runs),
            round_trips_per_reform=statistics.median(r.round_trips_per_reform for r in runs),
        )
        rows.append((members, median))
        print(
            f"members={members} form={[round(r.form, 2) for r in runs]} reform={[round(r.reform, 2) for r in runs]} "
            f"idle_requests_per_s={[round(r.polls_per_second) for r in runs]} "
            f"round_trips_per_reform={[round(r.round_trips_per_reform) for r in runs]}",
            flush=True,
        )
    base = rows[0][1]
    print()
    print(
        "| members | form (s) | x | re-form (s) | x | store requests/s while idle | per member | requests per re-form |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for members, r in rows:
        print(
            f"| {members} | {r.form:.2f} | {r.form / base.form:.1f} | {r.reform:.2f} | {r.reform / base.reform:.1f} "
            f"| {r.polls_per_second:.0f} | {r.polls_per_second / members:.1f} | {r.round_trips_per_reform:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
