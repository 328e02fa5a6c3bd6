"""The pod's supervisor (DDP_RESTART_MODE=InPlace): our own, on torch's public API.

Every pod runs one supervisor. It starts the pod's workers (forked from a forkserver that imported
torch once), meets the other pods' supervisors in rounds of the launchers' rendezvous
(``ddp_trainer.supervisor.rendezvous``) whose keys live in a TCP store: the job's rendezvous pod at
DDP_RENDEZVOUS_ENDPOINT, or, without it, one that the supervisor of NODE_RANK 0 hosts at
MASTER_ADDR:MASTER_PORT (``ddpjob run``, a single pod). It reads its workers' exit codes from its own
process handles. Nothing of ``torch.distributed.elastic``'s agent is used, so the trainer runs on the
user's torch (docs/trainer.md, "The pod's supervisor").

**Survivors keep their processes.** When a worker or a pod is lost, every surviving worker leaves the
broken collective (gloo: the error the dead peer's socket raises; the watchdog bounds the rest), keeps
its model and optimizer where they are, tells its supervisor the step it holds, and waits
(``ddp_trainer.supervisor.membership``). Each supervisor whose workers left, or whose worker died, joins the next
round; once every pod is in, the surviving workers form the new group in their own processes and only
the lost workers start anew, receiving the state from a survivor over the new group
(``ddp_trainer.training.trainer``). A pod that waits to join a healthy group (an elastic job's grow, a standby)
makes every supervisor ask its workers to leave at the next stop check, all at the same step.

What it adds on top:

- **Ranks**: group rank k is pod k (``ddp_trainer.supervisor.restarts.node_addr``), or in an elastic job's
  smaller round the k-th pod present, or, where the ranks follow the topology, the pod whose order key
  sorts k-th; pod 0 is rank 0 always; checked after every round.
- **One gang-wide budget**: the gang's restart count is the round number, which rank 0's supervisor
  takes from a counter in the rendezvous store (a replaced rank 0 pod continues it) and publishes in
  each round's store. A failed worker is replaced only while the count is below DDP_RESTART_BUDGET,
  and never for a permanent exit code (docs/restarts.md); then the pod exits with the worker's code
  and closes the rendezvous, so the other pods stop waiting for it.
- **Measuring**: each supervisor appends its failures and its "workers stopped" time and step to the
  rendezvous store under the restart count of the round it leaves; rank 0's supervisor, once the next
  round is complete, turns them into the record of the last restart (``RestartRecord``).
- **Elastic jobs** (docs/elastic.md): a round may have DDP_MIN_MEMBERS to NNODES members; a round
  without pod 0 waits for it (only pod 0 mounts the checkpoint volume).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Final, TypeVar

from torch.distributed import DistError, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # public, re-exported implicitly
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousConnectionError

from ddp_trainer.config import DistEnv, TrainConfig
from ddp_trainer.control import read_exit_records
from ddp_trainer.exitcodes import EXIT_OK, EXIT_PEER_LOST, EXIT_STOPPED, first_failure
from ddp_trainer.progress import launcher_status_line
from ddp_trainer.supervisor import worker_forkserver
from ddp_trainer.supervisor.addresses import AGENT_SERVES_STORE_ENV, loopback_listener
from ddp_trainer.supervisor.gang_store import LOOK_TIMEOUT, Connect, WaitingWatch, reconnect, set_if_absent
from ddp_trainer.supervisor.membership import Round
from ddp_trainer.supervisor.rank_order import RankOrderMissingError, wait_for_key
from ddp_trainer.supervisor.rendezvous import RoundsRendezvous
from ddp_trainer.supervisor.restarts import (
    Failure,
    RestartLedger,
    RestartRecord,
    build_record,
    decide,
    healthy_restart,
    node_addr,
    rank_mismatch,
    restarts_spent,
)
from ddp_trainer.supervisor.resume import read_step_marker, step_marker_path, write_restarts
from ddp_trainer.supervisor.stores import tcp_store
from ddp_trainer.training.worker import supervised_worker
from ddp_trainer.training.workloads import LAZY_IMPORTS

# Keys in each round's store (a PrefixStore of the round, so a key is per round).
RESTARTS_KEY = "ddp/group_restarts"
GROWS_KEY = "ddp/group_grows"
RESIZES_KEY = "ddp/group_resizes"
# Where the store is apart: the address of the pod whose first worker is global rank 0 and whose
# supervisor serves the workers' store, and (elastic rounds) which pod is the round's rank 0.
WORKERS_HOST_KEY = "ddp/workers_host"
FIRST_POD_KEY = "ddp/first_pod"
# The port of the workers' store that the round's rank 0 supervisor serves.
WORKERS_PORT_KEY = "ddp/workers_port"
# Keys in the rendezvous store itself, the same for every round of the attempt: the gang's counters
# (``add`` returns the new total) and, per restart count, what the round that count left held.
ROUNDS_TOTAL_KEY = "ddp/gang/rounds"
GROWS_TOTAL_KEY = "ddp/gang/grows"
RESIZES_TOTAL_KEY = "ddp/gang/resizes"
MEMBERS_KEY = "members"
FAILURES_KEY = "ddp/failures"
STOPPED_KEY = "ddp/stopped"

# The exit code that a worker which left its group for this reason stands for in the restart's record
# (docs/metrics.md, ddp_last_restart_info): a lost peer, or a peer's agreed stop; a leave its own
# supervisor asked for (a pod joins) is no failure.
LEFT_CODES: Final = {"peer-lost": EXIT_PEER_LOST, "stopped": EXIT_STOPPED}

# How often the supervisor looks at its workers and the rendezvous: a healthy pod notices a waiting
# pod within this (one store request per look).
MONITOR_INTERVAL = 0.1
# The grace between SIGTERM and SIGKILL when the pod itself is stopped: the agreed stop and rank 0's
# checkpoint happen in it (the pod's terminationGracePeriodSeconds bounds it from outside).
SHUTDOWN_TIMEOUT = 60
# A worker asked to leave has until its watchdog would end it, and this much more, to say it left;
# then it is ended and starts anew (its state comes from a survivor).
LEAVE_GRACE = 10.0
# A worker asked to leave that completes no step for this long is blocked (in a collective with a peer
# that hangs with its sockets open, say): it is ended at once, not after its watchdog's timeout. A
# healthy worker leaves at its next stop check, steps still moving until then.
LEAVE_STALL_SECONDS = 15.0

T = TypeVar("T")


class PodRankMismatchError(RuntimeError):
    """The rendezvous ranked this pod elsewhere than its NODE_RANK (two pods claim one rank)."""


class PodZeroMissingError(RuntimeError):
    """An elastic round formed without pod 0, and no pod came to join it within the init timeout."""


class ShortRoundError(RuntimeError):
    """A complete round has fewer members than the job trains on."""


class RestartBudgetSpentError(RuntimeError):
    """A pod joined, but the gang may not restart again: the operator decides."""


class StoppedError(Exception):
    """The pod was told to stop (SIGTERM, SIGINT) while its supervisor waited in the rendezvous."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def log(message: str) -> None:
    print(f"ddp_trainer: {message}", file=sys.stderr, flush=True)


def _status(event: str, **fields: object) -> None:
    print(launcher_status_line(event, fields), flush=True)


@dataclass
class _Worker:
    """One worker process of this pod and its pipe (ddp_trainer.supervisor.membership)."""

    local_rank: int
    rank: int
    process: BaseProcess
    connection: Connection
    # (step, time, why) once it said it left its group, until it is given the next round.
    left: tuple[int, float, str] | None = None
    asked_to_leave: bool = False
    # Since when its step (ddp_trainer.supervisor.resume's marker) has been the one seen last, once asked to leave.
    seen_step: int | None = None
    seen_at: float = 0.0

    @property
    def code(self) -> int | None:
        return self.process.exitcode

    def send(self, message: tuple[object, ...]) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.connection.send(message)

    def read(self) -> None:
        """Take what the worker said (its "left" note) without waiting."""
        with contextlib.suppress(EOFError, OSError, ValueError):
            while self.connection.poll():
                message = self.connection.recv()
                if message[0] == "left":
                    self.left = (int(message[1]), float(message[2]), str(message[3]))


@dataclass
class _Outcome:
    """How a round ended for this pod: ``code`` set ends the pod; else the gang re-forms."""

    code: int | None = None


class Supervisor:
    """One pod's supervisor: the rounds, its workers, and the gang's books (see the module)."""

    def __init__(
        self,
        env: DistEnv,
        config: TrainConfig,
        argv: list[str],
        *,
        handler: RendezvousHandler,
        gang_store: Store,
        exit_dir: Path,
        progress_dir: Path,
        ledger: RestartLedger,
        connect: Connect | None = None,
    ) -> None:
        self._env = env
        self._config = config
        self._argv = argv
        self._handler = handler
        self._gang_store = gang_store
        self._exit_dir = exit_dir
        self._progress_dir = progress_dir
        self._ledger = ledger
        self._pod_rank = env.pod_rank
        self._nproc = env.nproc_per_node
        self._budget = env.restart_budget
        self._elastic = env.elastic
        self._ordered = env.rank_order_file is not None
        self._pods = env.pods
        self._fewest = env.min_members if env.min_members is not None else env.pods
        # Where rank 0's pod may be replaced (the store apart), its IP: its name may still resolve to
        # its predecessor for a few seconds after a replacement.
        self._pod_ip = env.pod_ip if env.rendezvous_endpoint is not None else None
        self._init_timeout = timedelta(seconds=config.init_timeout)
        self._leave_timeout = config.watchdog_timeout + LEAVE_GRACE
        self._context = multiprocessing.get_context("forkserver")
        self._workers: dict[int, _Worker] = {}
        self._workers_store: TCPStore | None = None
        self._round_store: Store | None = None
        self._restarts = 0
        self._grows = 0
        self._resizes = 0
        self._members = 0
        self._signal: int | None = None
        # Where the store is the rendezvous pod's: how to reach the one that replaces it, the look at
        # the pods waiting that never blocks the watch, and a reconnect under way (gang_store).
        self._connect = connect
        self._watcher = (
            WaitingWatch(connect, handler.waiting_key, MONITOR_INTERVAL)
            if connect is not None and isinstance(handler, RoundsRendezvous)
            else None
        )
        self._relinking: _Relinking | None = None
        # Lines for the gang's books written while no store answered: added to the new store before
        # this pod joins a round there, so the restart's record still has them.
        self._unwritten: list[tuple[int, str, str]] = []

    @property
    def stopped(self) -> bool:
        """Whether the pod itself was told to stop (SIGTERM, SIGINT)."""
        return self._signal is not None

    @property
    def joined(self) -> bool:
        """Whether this pod was ever part of a complete round of this attempt."""
        return self._members > 0

    # --- the life of the pod ---------------------------------------------------------------------
    def run(self) -> int:
        """Rounds until the workers finish (0), a failure ends the pod (its code), or the pod is
        stopped (its workers' code, else 128 + the signal). Rendezvous errors propagate."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        try:
            while True:
                self._form_round()
                outcome = self._watch()
                if outcome.code is not None:
                    return outcome.code
                ended = self._await_left()
                if ended is not None:
                    return ended
        except StoppedError as stopped:
            return self._stop_pod(stopped.signum)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signal = signum

    def _check_signal(self) -> None:
        if self._signal is not None:
            raise StoppedError(self._signal)

    def _interruptible(self, call: Callable[[], T]) -> T:
        """``call()`` (a wait in the rendezvous store) in a thread of its own, so that a stop signal
        ends this pod's wait at once instead of after the store's timeout."""
        result: list[T] = []
        error: list[BaseException] = []

        def target() -> None:
            try:
                result.append(call())
            except BaseException as raised:
                error.append(raised)

        thread = threading.Thread(target=target, name="ddp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(MONITOR_INTERVAL)
            self._check_signal()
        if error:
            raise error[0]
        return result[0]

    # --- a round ---------------------------------------------------------------------------------
    def _form_round(self) -> None:
        self._start_round(*self.join_round())

    def join_round(self) -> tuple[int, int, str, int]:
        """Join the next complete round this pod can train in; returns this pod's rank in it, its
        members, and where its workers' store is (address, port)."""
        while True:
            try:
                if self._watcher is not None and self._watcher.lost:
                    raise RendezvousConnectionError("the rendezvous store did not answer a look")
                info = self._interruptible(self._handler.next_rendezvous)
            except RendezvousConnectionError as lost:
                if not self._relink(lost):
                    raise
                continue
            reformed = time.time()
            store, group_rank, members = info.store, info.rank, info.world_size
            problem = rank_mismatch(self._pod_rank, group_rank, self._elastic, self._ordered)
            if problem is not None:
                raise PodRankMismatchError(problem)
            if members < self._fewest:
                raise ShortRoundError(
                    f"the round has {members} member(s), fewer than the {self._fewest} this job trains on: "
                    "the rendezvous dropped a pod whose heartbeats came late"
                )
            if self._has_pod_zero(store, group_rank):
                break
            self._await_pod_zero(members)
        record = self._publish(store, members, reformed) if group_rank == 0 else None
        master_addr = self._env.master_addr
        if self._pod_ip is not None:
            # Every pod's workers meet at this round's rank 0 pod, which says where it is.
            if group_rank == 0:
                store.set(WORKERS_HOST_KEY, self._pod_ip)
            master_addr = store.get(WORKERS_HOST_KEY).decode()
        # The round's rank 0 supervisor serves its workers' store on a port it holds from the start.
        self._workers_store = None  # the previous round's: its groups are gone
        if group_rank == 0:
            self._workers_store = serve_workers_store(master_addr, self._init_timeout)
            store.set(WORKERS_PORT_KEY, str(self._workers_store.port))
        master_port = int(store.get(WORKERS_PORT_KEY))
        # Rank 0 sets the grows and resizes before the restarts, and a get waits for its key: all are there.
        self._restarts = int(store.get(RESTARTS_KEY))
        self._grows = int(store.get(GROWS_KEY))
        resizes = self._resizes = int(store.get(RESIZES_KEY))
        self._members = members
        self._round_store = store
        write_restarts(self._progress_dir, self._restarts)
        self._ledger.round_formed(self._restarts, self._grows, members, record, resizes=resizes)
        if self._restarts > 0:
            _status(
                "reformed",
                pod=self._pod_rank,
                restarts=self._restarts,
                grows=self._grows,
                resizes=resizes,
                members=members,
                time=f"{reformed:.6f}",
            )
        return group_rank, members, master_addr, master_port

    def _start_round(self, group_rank: int, members: int, master_addr: str, master_port: int) -> None:
        """Give every surviving worker the round; start a worker for every local rank that has none."""
        fresh = [local for local in range(self._nproc) if not self._survives(local)]
        if fresh:
            # Exit records of an earlier round must not decide this one's code.
            for record in self._exit_dir.glob("rank-*.json"):
                record.unlink(missing_ok=True)
        for local in range(self._nproc):
            round_ = Round(
                restarts=self._restarts,
                members=members,
                group_rank=group_rank,
                rank=group_rank * self._nproc + local,
                local_rank=local,
                world_size=members * self._nproc,
                master_addr=master_addr,
                master_port=master_port,
            )
            worker = self._workers.get(local)
            if worker is not None and local not in fresh:
                worker.rank, worker.left, worker.asked_to_leave = round_.rank, None, False
                worker.seen_step = None
                worker.send(("round", round_))
            else:
                self._workers[local] = self._start_worker(round_)
        _status(
            "started",
            pod=self._pod_rank,
            restarts=self._restarts,
            members=members,
            workers=",".join(f"{w.rank}:{w.process.pid}" for _, w in sorted(self._workers.items())),
            kept=",".join(
                str(self._workers[local].rank) for local in range(self._nproc) if local not in fresh
            )
            or "-",
            store=f"{master_addr}:{master_port}",
        )

    def _survives(self, local: int) -> bool:
        worker = self._workers.get(local)
        return worker is not None and worker.code is None and worker.left is not None

    def _start_worker(self, round_: Round) -> _Worker:
        parent, child = self._context.Pipe()
        environ = {
            **round_.environ(self._nproc),
            "NODE_RANK": str(self._pod_rank),
            "NNODES": str(self._pods),
        }
        process = self._context.Process(
            target=supervised_worker,
            args=(self._argv, environ, child),
            name=f"ddp-worker-{round_.local_rank}",
            daemon=False,
        )
        process.start()
        child.close()
        return _Worker(round_.local_rank, round_.rank, process, parent)

    def _has_pod_zero(self, store: Store, group_rank: int) -> bool:
        """Whether pod 0 is in the round, which only an elastic round with its store apart can lack."""
        if not (self._elastic and self._pod_ip is not None):
            return True
        if group_rank == 0:
            store.set(FIRST_POD_KEY, str(self._pod_rank))
        return store.get(FIRST_POD_KEY).decode() == "0"

    def _await_pod_zero(self, members: int) -> None:
        """A round without pod 0 trains nothing (its first worker would be global rank 0 without the
        checkpoint volume, which only pod 0 mounts): every member waits until a pod waits to join (pod
        0's replacement) and then joins the next round with it; the round is never published."""
        _status("awaiting", pod=self._pod_rank, members=members, missing=0, time=f"{time.time():.6f}")
        deadline = time.monotonic() + self._init_timeout.total_seconds()
        while self._handler.num_nodes_waiting() == 0:
            self._check_signal()
            if self._handler.is_closed():
                raise RendezvousClosedError()
            if time.monotonic() > deadline:
                raise PodZeroMissingError(
                    f"a round of {members} pod(s) formed without pod 0, and no pod came to join it in "
                    f"{self._init_timeout.total_seconds():.0f} s (the init timeout)"
                )
            time.sleep(MONITOR_INTERVAL)

    def _publish(self, store: Store, members: int, reformed: float) -> RestartRecord | None:
        """Rank 0's supervisor, once a round is complete: the gang's counts for it, in its store;
        returns the record of the restart that led to it (None for the first round). Every count comes
        from the rendezvous store, so a rank 0 pod that replaced a lost one continues them."""
        gang = self._gang_store
        restarts = gang.add(ROUNDS_TOTAL_KEY, 1) - 1
        record: RestartRecord | None = None
        grew = resized = 0
        if restarts > 0:
            left = _books(gang, restarts - 1)
            failures = [Failure.decode(line) for line in _read_all(left, FAILURES_KEY)]
            stops = [line.split() for line in _read_all(left, STOPPED_KEY)]
            stopped = [float(fields[1]) for fields in stops]
            # The newest step a survivor held (a step only a lost worker completed is no step redone:
            # the group never had it); where nothing survived, the newest any pod completed.
            known = [fields for fields in stops if len(fields) > 2 and fields[2] != "-"]
            survived = [int(fields[2]) for fields in known if fields[3:] == ["1"]]
            steps = survived or [int(fields[2]) for fields in known]
            members_before = int(left.get(MEMBERS_KEY)) if left.check([MEMBERS_KEY]) else None
            record = build_record(
                restarts, failures, stopped, reformed, max(steps, default=None), members_before, members
            )
            grew, resized = int(record.grow), int(members_before is not None and members_before != members)
        _books(gang, restarts).set(MEMBERS_KEY, str(members))
        store.set(GROWS_KEY, str(gang.add(GROWS_TOTAL_KEY, grew)))
        store.set(RESIZES_KEY, str(gang.add(RESIZES_TOTAL_KEY, resized)))
        store.set(RESTARTS_KEY, str(restarts))
        return record

    # --- watching a round ------------------------------------------------------------------------
    def _watch(self) -> _Outcome:
        """Until the round ends for this pod: its workers all finished (code 0), one failed (the gang
        re-forms, or the failure ends the pod), one left its broken group, or a pod waits to join."""
        while True:
            self._check_signal()
            for worker in self._workers.values():
                worker.read()
            failed = {w.rank: int(w.code) for w in self._workers.values() if w.code not in (None, 0)}
            if failed:
                return self._failed(failed)
            if all(w.code == 0 for w in self._workers.values()):
                if any(w.asked_to_leave for w in self._workers.values()):
                    log(f"training was over when a pod joined the round of {self._members}; exiting 0")
                return _Outcome(code=EXIT_OK)
            left = [(w.rank, w.left) for w in self._workers.values() if w.left is not None]
            if left:
                for rank, (step, at, why) in left:
                    _status("left", pod=self._pod_rank, rank=rank, step=step, why=why, time=f"{at:.6f}")
                    code = LEFT_CODES.get(why)
                    if code is not None and self._round_store is not None:
                        # What the worker would have exited with, had it not kept its process: the
                        # restart's cause (PeerLost) in the gang's books.
                        failure = Failure(pod_rank=self._pod_rank, global_rank=rank, exit_code=code, time=at)
                        self._write_books(FAILURES_KEY, failure.encode())
                return _Outcome()
            self._end_blocked()
            if self._pod_waiting() and not any(w.asked_to_leave for w in self._workers.values()):
                self._pod_waits()
            time.sleep(MONITOR_INTERVAL)

    def _pod_waiting(self) -> bool:
        """Whether a pod waits to join the next round. A store that cannot be reached says no: where it
        is the rendezvous pod's, the supervisor reconnects to its replacement meanwhile (and then looks
        there); where it was hosted by rank 0's pod, it is gone with that pod (at the job's end), and
        this pod's workers then finish or lose their peers, which decides instead."""
        if self._watcher is not None:
            self._follow_store()
            return self._watcher.waiting > 0
        try:
            return self._handler.num_nodes_waiting() > 0
        except RendezvousConnectionError:
            return False

    # --- the rendezvous store lost and started anew (gang_store) ---------------------------------
    def _follow_store(self) -> None:
        """While the group trains: once a look found the store lost, reconnect in the background; once
        a new store answers, go on with it (in this thread, which alone uses the handler)."""
        assert self._watcher is not None and self._connect is not None
        if self._relinking is None:
            if self._watcher.lost and self._members > 0:
                self._begin_relink(None)
            return
        if self._relinking.done:
            store, self._relinking = self._relinking.store, None
            if store is not None:
                self._adopt(store)

    def _relink(self, lost: Exception) -> bool:
        """The store failed a request (``lost``): wait for its replacement, up to the init timeout, and
        go on with it; False where the store has no replacement (this job hosts none) or none came."""
        if self._connect is None:
            return False
        relinking = self._relinking if self._relinking is not None else self._begin_relink(lost)
        self._interruptible(relinking.wait)
        self._relinking = None
        if relinking.store is None:
            return False
        self._adopt(relinking.store)
        return True

    def _adopt(self, store: Store) -> None:
        """Go on with a store that answers again: seed what it lacks of what this pod holds (a new
        store knows no round; every survivor holds the same counts, the first write wins)."""
        if self._members > 0:
            set_if_absent(store, ROUNDS_TOTAL_KEY, str(self._restarts + 1))
            set_if_absent(store, GROWS_TOTAL_KEY, str(self._grows))
            set_if_absent(store, RESIZES_TOTAL_KEY, str(self._resizes))
            set_if_absent(_books(store, self._restarts), MEMBERS_KEY, str(self._members))
        for restarts, key, value in self._unwritten:
            _push(_books(store, restarts), key, value)
        self._unwritten.clear()
        assert isinstance(self._handler, RoundsRendezvous)
        self._handler.adopt(store)
        self._gang_store = store
        if self._watcher is not None:
            self._watcher.relinked()
        _status("store-relinked", pod=self._pod_rank, restarts=self._restarts, time=f"{time.time():.6f}")

    def _write_books(self, key: str, value: str) -> None:
        """Add to the gang's books of the current round. Where the store does not answer, the line waits
        for its replacement (``_adopt`` writes it there before this pod joins a round) and the
        supervisor goes on with its workers meanwhile; a store this job cannot replace loses the line,
        which only makes a poorer record."""
        if self._relinking is None and not (self._watcher is not None and self._watcher.lost):
            try:
                _push(_books(self._gang_store, self._restarts), key, value)
                return
            except DistError as lost:
                if self._connect is None:
                    log(f"the restart's books lost a line ({key}): the rendezvous store is gone")
                    return
                self._begin_relink(lost)
        self._unwritten.append((self._restarts, key, value))

    def _begin_relink(self, lost: Exception | None) -> _Relinking:
        """Start reconnecting to the rendezvous store in the background (``lost``: the failed request,
        None when a look found it gone)."""
        assert self._connect is not None
        _status("store-lost", pod=self._pod_rank, time=f"{time.time():.6f}")
        if lost is not None:
            log(f"the rendezvous store failed ({lost}); waiting for its replacement")
        self._relinking = _Relinking(self._connect, self._init_timeout, lambda: self.stopped)
        return self._relinking

    def _failed(self, failed: dict[int, int]) -> _Outcome:
        seen = time.time()
        found = first_failure(failed, read_exit_records(self._exit_dir))
        rank, code = found if found is not None else (-1, EXIT_PEER_LOST)
        decision = decide(code, restarts_spent(self._restarts, self._grows), self._budget)
        _status(
            "failed",
            pod=self._pod_rank,
            rank=rank,
            code=code,
            decision=decision,
            restarts=self._restarts,
            grows=self._grows,
            budget=self._budget,
            time=f"{seen:.6f}",
        )
        if decision != "restart":
            self.kill_workers()
            if decision == "budget-spent":
                log(f"the gang spent its restart budget ({self._budget}); exiting {code}")
            return _Outcome(code=code)
        if self._round_store is not None:
            failure = Failure(pod_rank=self._pod_rank, global_rank=rank, exit_code=code, time=seen)
            self._write_books(FAILURES_KEY, failure.encode())
        return _Outcome()

    def _pod_waits(self) -> None:
        """A pod waits to join this healthy round: an elastic job's grow, or a pod that replaces a lost
        one the group has not noticed. Every worker leaves at its next stop check, with the others."""
        spent = restarts_spent(self._restarts, self._grows)
        action = healthy_restart(self._elastic, self._members, self._pods, spent, self._budget)
        if action == "budget-spent":
            self.kill_workers()
            raise RestartBudgetSpentError(
                f"a pod waits to join, but the gang has spent its restart budget ({self._budget})"
            )
        if action == "grow":
            _status("grow", pod=self._pod_rank, members=self._members, time=f"{time.time():.6f}")
        self._ask_to_leave()

    def _ask_to_leave(self) -> None:
        for worker in self._workers.values():
            if worker.code is None and worker.left is None and not worker.asked_to_leave:
                worker.asked_to_leave = True
                worker.seen_step, worker.seen_at = self._step(worker), time.monotonic()
                worker.send(("leave",))

    def _step(self, worker: _Worker) -> int:
        found = read_step_marker(step_marker_path(self._progress_dir, worker.rank))
        return -1 if found is None else found

    def _end_blocked(self) -> None:
        """End every worker asked to leave that has made no step for LEAVE_STALL_SECONDS: it is blocked
        and would never reach the stop check (its exit is then a failure of the round, replaced)."""
        now = time.monotonic()
        for worker in self._workers.values():
            if not worker.asked_to_leave or worker.left is not None or worker.code is not None:
                continue
            step = self._step(worker)
            if step != worker.seen_step:
                worker.seen_step, worker.seen_at = step, now
            elif now - worker.seen_at > LEAVE_STALL_SECONDS:
                log(
                    f"the worker of rank {worker.rank} made no step for {LEAVE_STALL_SECONDS:g} s after it was "
                    "asked to leave its group: it is blocked, ending it"
                )
                _kill(worker.process)
                worker.process.join(5)

    def _await_left(self) -> int | None:
        """Until every live worker of this pod has left its group (holding its state) or ended; one that
        does neither in time is ended (it starts anew, its state from a survivor). Then this pod's
        workers are stopped: said in the log and in the gang's books. Returns 0 when the workers
        finished instead (the group was done), else None."""
        self._ask_to_leave()
        deadline = time.monotonic() + self._leave_timeout
        while True:
            self._check_signal()
            pending = []
            for worker in self._workers.values():
                worker.read()
                if worker.code is None and worker.left is None:
                    pending.append(worker)
            if not pending:
                break
            self._end_blocked()
            if time.monotonic() > deadline:
                for worker in pending:
                    log(
                        f"worker of rank {worker.rank} did not leave its group in {self._leave_timeout:g} s: ending it"
                    )
                    _kill(worker.process)
                break
            time.sleep(MONITOR_INTERVAL)
        if all(w.code == 0 for w in self._workers.values()):
            return EXIT_OK
        stopped = time.time()
        # The step this pod's surviving workers hold; a pod none of whose workers survived says the
        # last step its first worker completed, which counts only when no pod kept any (_publish).
        kept = [w.left[0] for w in self._workers.values() if w.left is not None and w.left[0] >= 0]
        ranks = [w.rank for w in self._workers.values()]
        steps = max(kept) if kept else None
        if steps is None and ranks:
            steps = read_step_marker(step_marker_path(self._progress_dir, min(ranks)))
        _status("stopped", pod=self._pod_rank, time=f"{stopped:.6f}")
        if self._round_store is not None:
            line = f"{self._pod_rank} {stopped:.6f} {'-' if steps is None else steps} {int(bool(kept))}"
            self._write_books(STOPPED_KEY, line)
        return None

    # --- ending ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the threads that talk to the rendezvous store, before the interpreter exits."""
        if self._watcher is not None:
            self._watcher.stop()
        if self._relinking is not None:
            self._relinking.wait(LOOK_TIMEOUT.total_seconds() + 1)

    def kill_workers(self) -> None:
        for worker in self._workers.values():
            _kill(worker.process)
        for worker in self._workers.values():
            worker.process.join(5)

    def _stop_pod(self, signum: int) -> int:
        """The pod is stopped (deleted, or the job ends): the workers get the signal for the agreed stop
        and rank 0's checkpoint, up to SHUTDOWN_TIMEOUT; the pod exits with their code."""
        live = [w for w in self._workers.values() if w.code is None]
        for worker in live:
            if worker.process.pid is not None:  # never -1: that would signal every process we may
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT
        for worker in live:
            worker.process.join(max(deadline - time.monotonic(), 0.0))
        self.kill_workers()
        failed = {w.rank: int(w.code) for w in self._workers.values() if w.code not in (None, 0)}
        found = first_failure(failed, read_exit_records(self._exit_dir))
        return found[1] if found is not None else 128 + signum


class _Relinking:
    """A reconnect to the rendezvous store in a thread of its own (gang_store.reconnect)."""

    def __init__(self, connect: Connect, timeout: timedelta, stopped: Callable[[], bool]) -> None:
        self.store: Store | None = None
        deadline = time.monotonic() + timeout.total_seconds()

        def target() -> None:
            self.store = reconnect(connect, timeout, deadline, stopped)

        self._thread = threading.Thread(target=target, name="ddp-store-reconnect", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def _kill(process: BaseProcess) -> None:
    if process.exitcode is None and process.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)


def _books(gang: Store, restarts: int) -> Store:
    """What the round with this restart count left (its members, its failures and stops), in the
    rendezvous store: kept after the round's own store is replaced, and where any pod finds it."""
    return PrefixStore(f"ddp/gang/restart/{restarts}", gang)


def _push(store: Store, key: str, value: str) -> None:
    """Add ``value`` to the list ``key`` of a round's store (any pod may add, concurrently)."""
    index = store.add(f"{key}/count", 1)
    store.set(f"{key}/{index}", value)


def _read_all(store: Store, key: str) -> list[str]:
    """The values added to ``key`` so far (each one, once its writer has set it)."""
    count = store.add(f"{key}/count", 0)
    keys = [f"{key}/{index}" for index in range(1, count + 1)]
    return [store.get(name).decode() for name in keys if store.check([name])]


# What the forkserver imports once, for every worker: torch and the trainer, and torch._dynamo, which
# torch imports lazily in the first optimizer's constructor (seconds; docs/benchmarks.md).
FORKSERVER_PRELOAD: Final = ("ddp_trainer.training.worker", "ddp_trainer.training.trainer", "torch._dynamo")


def start_forkserver(workload: str, *, fork: bool = True) -> None:
    """Start the process the workers are forked from, importing the trainer and the workload's lazy
    imports now: a fork of this supervisor, which has imported torch already (``fork``; see
    ddp_trainer.supervisor.worker_forkserver), else a new interpreter that imports torch too. A new worker then
    costs a fork, not an interpreter start and the imports (docs/benchmarks.md)."""
    worker_forkserver.start([*FORKSERVER_PRELOAD, *LAZY_IMPORTS.get(workload, ())], log, fork=fork)


def prepare_workers(env: DistEnv, config: TrainConfig) -> None:
    """What the workers inherit, settled before the supervisor starts any thread of its own (its
    /metrics server): their environment, and the forkserver they are forked from."""
    os.environ[AGENT_SERVES_STORE_ENV] = "1"
    start_forkserver(config.workload, fork=env.worker_forkserver == "fork")


def serve_workers_store(host: str, timeout: timedelta) -> TCPStore:
    """The workers' store of a round, served by its rank 0 supervisor at ``host`` on a port the kernel
    picks as it binds: no other process can take it between the pick and the bind. On loopback only
    when ``host`` is a loopback address (docs/trainer.md, "Where rank 0 listens")."""
    return tcp_store(host, 0, is_master=True, timeout=timeout, listen_fd=loopback_listener(host, 0))


def rendezvous_handler(env: DistEnv, config: TrainConfig) -> tuple[RendezvousHandler, Store, Connect | None]:
    """The launchers' rendezvous (ddp_trainer.supervisor.rendezvous) and its store: the job's rendezvous pod at
    DDP_RENDEZVOUS_ENDPOINT (every supervisor a client, waiting up to the init timeout for it to
    listen), or, without one, the store NODE_RANK 0's supervisor hosts at MASTER_ADDR:MASTER_PORT."""
    started = time.monotonic()
    timeout = timedelta(seconds=config.init_timeout)
    host, port = env.rendezvous_store
    is_host = env.rendezvous_endpoint is None and env.pod_rank == 0
    store = tcp_store(
        host,
        port,
        is_master=is_host,
        timeout=timeout,
        # A job on one machine stays on loopback (docs/trainer.md, "Where rank 0 listens").
        listen_fd=loopback_listener(host, port) if is_host else None,
    )
    handler = RoundsRendezvous(
        store,
        env.run_id,
        pod_rank=env.pod_rank,
        sort_key=node_addr(env.pod_rank, _order_key(env, config.init_timeout - (time.monotonic() - started))),
        fewest=env.min_members if env.min_members is not None else env.pods,
        most=env.pods,
        # A replacement pod may take a while to be scheduled and started: the survivors wait for it
        # as long as a first start may take (an elastic job's below DDP_MIN_MEMBERS too).
        join_timeout=config.init_timeout,
        last_call=float(env.replacement_wait) if env.elastic else 0.0,
        store_info=(host, port),
    )
    # The rendezvous pod's store may be replaced (gang_store); a store this pod hosts goes with it.
    connect: Connect | None = None
    if not is_host:

        def connect(timeout: timedelta) -> Store:
            return tcp_store(host, port, is_master=False, timeout=timeout)

    return handler, store, connect


def _order_key(env: DistEnv, timeout: float) -> str | None:
    """This pod's rendezvous order key (a job whose ranks follow the topology), waited for; None for a
    job whose ranks follow NODE_RANK."""
    if env.rank_order_file is None:
        return None
    key = wait_for_key(
        Path(env.rank_order_file),
        max(timeout, 0.0),
        on_wait=lambda: _status("waiting", pod=env.pod_rank, on="rank-order"),
    )
    _status("ordered", pod=env.pod_rank, key=key)
    return key


# What a pod that comes to join a group that has ended meets: a closed rendezvous, or no host at all.
_GROUP_GONE: Final = (RendezvousClosedError, RendezvousConnectionError)


def run_in_place(
    env: DistEnv,
    config: TrainConfig,
    argv: list[str],
    exit_dir: Path,
    progress_dir: Path,
    ledger: RestartLedger,
) -> int:
    """Run this pod's supervisor until the job ends; returns the pod's exit code."""
    try:
        handler, gang_store, connect = rendezvous_handler(env, config)
    except RankOrderMissingError as missing:
        log(f"{missing}; exiting {EXIT_PEER_LOST}")
        return EXIT_PEER_LOST
    supervisor = Supervisor(
        env,
        config,
        argv,
        handler=handler,
        gang_store=gang_store,
        exit_dir=exit_dir,
        progress_dir=progress_dir,
        ledger=ledger,
        connect=connect if env.rendezvous_endpoint is not None else None,
    )
    close_rendezvous, finished = True, False
    try:
        code = supervisor.run()
        finished = code == EXIT_OK
        if supervisor.stopped and code != EXIT_OK:
            # This pod was stopped (deleted): the others go on without it, so the rendezvous stays open.
            close_rendezvous = False
    except Exception as error:
        supervisor.kill_workers()
        if not supervisor.joined and isinstance(error, RendezvousClosedError) and _finished(handler):
            # This rank's pod was lost after the last step, and this pod (its replacement, or the standby
            # that took the rank) came after the group had finished: nothing is left to train.
            close_rendezvous = False
            log("the group had trained to its last step when this pod came to join it; exiting 0")
            return EXIT_OK
        if env.elastic and not supervisor.joined and isinstance(error, _GROUP_GONE):
            # An elastic group may finish without a pod that came late: it took no part (docs/elastic.md).
            log(
                f"the elastic group had ended when this pod came to join it ({type(error).__name__}); exiting 0"
            )
            return EXIT_OK
        # The rendezvous failed: its store is gone, it timed out waiting for a pod, or it was closed by
        # a pod that ended the job. The operator restarts the gang: retried.
        log(
            f"pod {env.pod_rank} left {_where(env)} ({type(error).__name__}: {error}); exiting {EXIT_PEER_LOST}"
        )
        code = EXIT_PEER_LOST
    finally:
        if close_rendezvous:
            _close(handler, finished)
        supervisor.close()
    return code


def _finished(handler: RendezvousHandler) -> bool:
    """Whether the group finished training (its rendezvous closed as finished); False where that cannot
    be read (the store gone: the operator then restarts the gang, which resumes at the end)."""
    try:
        return isinstance(handler, RoundsRendezvous) and handler.finished()
    except (RendezvousConnectionError, DistError, OSError):
        return False


def _where(env: DistEnv) -> str:
    """The rendezvous this pod meets at, for its log."""
    host, port = env.rendezvous_store
    if env.rendezvous_endpoint is not None:
        return f"the rendezvous pod's store at DDP_RENDEZVOUS_ENDPOINT = {host}:{port}"
    return f"the rendezvous at MASTER_ADDR:MASTER_PORT = {host}:{port}"


def _close(handler: RendezvousHandler, finished: bool) -> None:
    """Close the rendezvous so the other pods stop waiting for this one, as finished where this pod's
    workers trained to the end (best effort: its host may be gone already)."""
    try:
        if finished and isinstance(handler, RoundsRendezvous):
            handler.finish()
        else:
            handler.shutdown()
    except Exception as error:
        log(f"could not close the rendezvous ({type(error).__name__}: {error})")
