"""In-place restarts (DDP_RESTART_MODE=InPlace): torch's elastic agent on the launchers' rendezvous.

Every pod runs one ``LocalElasticAgent`` (torch's), which starts the pod's workers once every pod has
joined a round of the launchers' rendezvous (``ddp_trainer.rendezvous``, torch's handler interface)
whose keys live in a TCP store: the job's rendezvous pod at DDP_RENDEZVOUS_ENDPOINT, which outlives any
rank's pod (so rank 0's pod is replaced alone like any other), or, without it, one that the agent of
NODE_RANK 0 hosts at MASTER_ADDR:MASTER_PORT (``ddpjob run``, a single pod). When a worker fails, its
agent stops the pod's workers and joins the next round; torch's other agents see a pod waiting
(``num_nodes_waiting() > 0``, polled every ``monitor_interval``), stop theirs and join too; once all
pods are in, each starts its workers again and the group resumes from the survivors' state.

What this module adds to torch's agent (:class:`InPlaceAgent`, a small subclass, not a second agent):

- **Ranks**: group rank k is pod k (``ddp_trainer.restarts.node_addr``), or in an elastic job's
  smaller round, the k-th pod present, or, where the ranks follow the topology, the pod whose order
  key (``ddp_trainer.rank_order``) sorts k-th; pod 0 is rank 0 always; checked after every round.
- **One gang-wide budget**: torch counts restarts per agent. The gang's count is the round number,
  which rank 0's agent takes from a counter in the rendezvous store (not from its own memory: a
  replaced rank 0 pod's agent continues it) and publishes in each round's store; a failed agent restarts only while the count
  is below DDP_RESTART_BUDGET, and not at all for a permanent exit code (docs/restarts.md). Then it
  returns the failure, the launcher exits with the worker's code and closes the rendezvous, so the
  other agents stop waiting for it.
- **Stopping at once**: a restart kills the workers (SIGKILL). The group is broken, so the agreed
  SIGTERM stop (docs/trainer.md) could never complete; a worker blocked in a collective is ended by
  the kernel, not after torch's 30 s shutdown grace. A pod's own SIGTERM (its deletion) still goes
  to the workers as SIGTERM, for the agreed stop and the checkpoint, and so does a grow's stop.
- **Measuring**: each agent appends its failures and its "workers stopped" time and step to the
  rendezvous store under the restart count of the round it leaves; rank 0's agent, once the next round
  is complete, turns them into the record of the last restart (``ddp_trainer.restarts.RestartRecord``),
  exported by the launcher's endpoint. A rank 0 pod that replaced a lost one finds them there too.
- **Elastic jobs** (DDP_MIN_MEMBERS, docs/trainer.md "Elastic jobs"): a round may have
  DDP_MIN_MEMBERS to NNODES members (``last_call_timeout``: DDP_REPLACEMENT_WAIT_SECONDS). A pod after a missing one
  ranks lower (pod 0 stays rank 0: ``ddp_trainer.restarts.rank_mismatch``). When a pod joins a smaller healthy round, torch's agents restart
  their workers for it: a grow, stopped with the agreed SIGTERM stop, not counted against the budget
  (rank 0 publishes the gang's grows beside its restarts).

torch facts this relies on (torch 2.15, ``torch/distributed/elastic``): ``_invoke_run`` restarts a
failed group while ``_remaining_restarts > 0`` and a healthy one when nodes (torch's word: pods)
wait; it takes each round's store, rank and size from the handler's ``RendezvousInfo``, and a handler
whose ``use_agent_store`` is False leaves the workers' store to the agent (rank 0's agent serves it
and publishes its address in every round's store: a replacement pod joining a later round reads it
there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, RunProcsResult
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
from torch.distributed.elastic.rendezvous import RendezvousHandler
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousConnectionError

from ddp_trainer import worker_forkserver
from ddp_trainer.addresses import AGENT_SERVES_STORE_ENV, loopback_listener
from ddp_trainer.config import DistEnv, TrainConfig
from ddp_trainer.control import read_exit_records
from ddp_trainer.exitcodes import (
    EXIT_BAD_CONFIG,
    EXIT_OK,
    EXIT_PEER_LOST,
    first_failure,
    first_failure_code,
    is_retryable,
)
from ddp_trainer.progress import launcher_status_line
from ddp_trainer.rank_order import RankOrderMissingError, wait_for_key
from ddp_trainer.rendezvous import RoundsRendezvous
from ddp_trainer.restarts import (
    Decision,
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
from ddp_trainer.resume import read_step_marker, step_marker_path, write_restarts
from ddp_trainer.worker import forked_worker
from ddp_trainer.workloads import LAZY_IMPORTS

# torch's private surface that InPlaceAgent overrides, calls or reads (LocalElasticAgent, tested with
# torch 2.15): each method and the parameters it must take, and the attributes its __init__ must set.
# check_torch_agent() compares them with the installed torch when the launcher starts, so a torch that
# changed them ends the pod at once with a clear message instead of a TypeError in a restart.
PRIVATE_METHODS: Final = {
    "_rendezvous": ("self", "worker_group"),
    "_start_workers": ("self", "worker_group"),
    "_monitor_workers": ("self", "worker_group"),
    "_restart_workers": ("self", "worker_group"),
    "_stop_workers": ("self", "worker_group"),
    "_initialize_workers": ("self", "worker_group"),
    "_shutdown": ("self", "death_sig", "timeout"),
    "_exit_barrier": ("self",),
}
PRIVATE_ATTRIBUTES: Final = ("_remaining_restarts", "_pcontext")
# The keyword parameters InPlaceAgent passes to LocalElasticAgent's constructor (torch 2.11's takes no
# shutdown_timeout: checked before the agent is built, so that torch is refused, not a TypeError).
INIT_KEYWORDS: Final = ("logs_specs", "start_method", "shutdown_timeout")
# And one more read: torch reports one failed worker per poll (the first sentinel it sees), so the
# launcher reads every worker's exit code itself, from the processes that MultiprocessContext keeps in
# `_pc`, a torch.multiprocessing ProcessContext (`processes`, in local-rank order).


class TorchAgentMismatchError(RuntimeError):
    """The installed torch's elastic agent is not what InPlaceAgent was written against."""


def check_torch_agent(
    agent_class: type = LocalElasticAgent,
    agent: object | None = None,
    context_class: type = MultiprocessContext,
) -> None:
    """Raise TorchAgentMismatchError naming what differs from PRIVATE_METHODS / PRIVATE_ATTRIBUTES, or
    from where worker_exit_codes() finds the workers' processes."""
    import inspect

    import torch
    from torch.multiprocessing.spawn import ProcessContext

    problems = []
    accepted = inspect.signature(agent_class).parameters
    problems += [f"its constructor takes no {name}" for name in INIT_KEYWORDS if name not in accepted]
    for name, parameters in PRIVATE_METHODS.items():
        method = getattr(agent_class, name, None)
        if not callable(method):
            problems.append(f"{name}() is gone")
            continue
        found = tuple(inspect.signature(method).parameters)
        if found != parameters:
            problems.append(f"{name}{found} takes other parameters than {name}{parameters}")
    if agent is not None:
        problems += [f"the agent has no {name}" for name in PRIVATE_ATTRIBUTES if not hasattr(agent, name)]
    start = getattr(context_class, "_start", None)
    if "_pc" not in getattr(getattr(start, "__code__", None), "co_names", ()):
        problems.append(f"{context_class.__name__}._start() no longer keeps its processes in _pc")
    if "processes" not in inspect.signature(ProcessContext.__init__).parameters:
        problems.append("torch.multiprocessing's ProcessContext no longer takes its processes")
    if problems:
        raise TorchAgentMismatchError(
            f"torch {torch.__version__}'s LocalElasticAgent is not the one in-place restarts were built on "
            f"(torch 2.15): {'; '.join(problems)}. Use a torch in pyproject.toml's range, or "
            "runPolicy.restartMode: Recreate (docs/trainer.md)"
        )


# Keys in each round's store (a PrefixStore of the round, so a key is per round).
RESTARTS_KEY = "ddp/group_restarts"
# Keys in the rendezvous store itself, the same for every round of the attempt: the gang's counters
# (``add`` returns the new total) and, per restart count, what the round that count left held.
ROUNDS_TOTAL_KEY = "ddp/gang/rounds"
GROWS_TOTAL_KEY = "ddp/gang/grows"
RESIZES_TOTAL_KEY = "ddp/gang/resizes"
MEMBERS_KEY = "members"
# In each round's store, where the store is apart: the address of the pod whose first worker is global
# rank 0 and serves the workers' store.
WORKERS_HOST_KEY = "ddp/workers_host"
# In each round's store: the port of the workers' store that the round's rank 0 agent serves.
WORKERS_PORT_KEY = "ddp/workers_port"
GROWS_KEY = "ddp/group_grows"
RESIZES_KEY = "ddp/group_resizes"
# In each elastic round's store, where the store is apart: the pod whose agent is the round's rank 0.
FIRST_POD_KEY = "ddp/first_pod"
# Set by an agent that stops its healthy workers for a grow, before it stops them (see _restart_workers).
GROWING_KEY = "ddp/growing"
FAILURES_KEY = "ddp/failures"
STOPPED_KEY = "ddp/stopped"

# How often the agent checks its workers and the rendezvous: a healthy agent notices a waiting pod
# within this (ddp_trainer.rendezvous: one store request per check).
MONITOR_INTERVAL = 0.1
# torch's grace between SIGTERM and SIGKILL when the pod itself is stopped: the agreed stop and rank
# 0's checkpoint happen in it (the pod's terminationGracePeriodSeconds bounds it from outside).
SHUTDOWN_TIMEOUT = 60


class PodRankMismatchError(RuntimeError):
    """The rendezvous ranked this pod elsewhere than its NODE_RANK (two pods claim one rank)."""


class PodZeroMissingError(RuntimeError):
    """An elastic round formed without pod 0, and no pod came to join it within the init timeout."""


class ShortRoundError(RuntimeError):
    """A complete round has fewer members than the job trains on: torch dropped a member whose
    heartbeats came late after the round completed."""


class RestartBudgetSpentError(RuntimeError):
    """A pod joined, but the gang may not restart again: the operator decides."""


class TrainingFinishedError(Exception):
    """A grow's stop found this pod's workers finished: training was over, nothing is left to grow."""


def log(message: str) -> None:
    print(f"ddp_trainer: {message}", file=sys.stderr, flush=True)


def _status(event: str, **fields: object) -> None:
    print(launcher_status_line(event, fields), flush=True)


class InPlaceAgent(LocalElasticAgent):
    """torch's local agent with the gang's restart budget, SIGKILL on restart and the bookkeeping."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        env: DistEnv,
        exit_dir: Path,
        progress_dir: Path,
        ledger: RestartLedger,
        gang_store: Store,
        init_timeout: float,
    ) -> None:
        super().__init__(
            spec, logs_specs=DefaultLogsSpecs(), start_method="forkserver", shutdown_timeout=SHUTDOWN_TIMEOUT
        )
        self._pod_rank = env.node_rank
        self._budget = env.restart_budget
        self._elastic = env.elastic
        self._ordered = env.rank_order_file is not None
        self._pods = env.nnodes  # the job's pods: the largest round
        # The fewest members a round may train on: every pod, or an elastic job's DDP_MIN_MEMBERS.
        self._fewest = env.min_members if env.min_members is not None else env.nnodes
        self._exit_dir = exit_dir
        self._progress_dir = progress_dir
        self._restarts = 0
        self._grows = 0  # of the gang's restarts, the grows (not budgeted)
        self._members = 0  # members of the current round
        self._ledger = ledger
        self._gang_store = gang_store
        # Where rank 0's pod may be replaced (the store apart), its IP: its name may still resolve to
        # its predecessor for a few seconds after a replacement.
        self._pod_ip = env.pod_ip if env.rendezvous_endpoint is not None else None
        self._round_store: Store | None = None
        self._init_timeout = timedelta(seconds=init_timeout)
        # The workers' store of the round this agent's workers rank 0 in (serve_workers_store).
        self._workers_store: TCPStore | None = None
        # Set when a failed group ends the pod: the code it exits with and why.
        self.exit_code: int | None = None
        self.ending: Decision | None = None

    @property
    def joined(self) -> bool:
        """Whether this pod's agent was ever part of a complete round of this attempt."""
        return self._members > 0

    # --- the round -------------------------------------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        while True:
            super()._rendezvous(worker_group)
            reformed = time.time()
            store, group_rank = worker_group.store, worker_group.group_rank
            members = worker_group.group_world_size
            assert (
                store is not None and group_rank is not None and members is not None
            )  # set by the rendezvous
            problem = rank_mismatch(self._pod_rank, group_rank, self._elastic, self._ordered)
            if problem is not None:
                raise PodRankMismatchError(problem)
            if members < self._fewest:
                # Workers started in it would refuse their world as a bad configuration, a permanent
                # failure of the job for what is a late heartbeat: this pod leaves instead (exit 170,
                # retried), and the others find the round gone.
                raise ShortRoundError(
                    f"the round has {members} member(s), fewer than the {self._fewest} this job trains on: "
                    "the rendezvous dropped a pod whose heartbeats came late"
                )
            if self._has_pod_zero(store, group_rank):
                break
            self._await_pod_zero(worker_group, members)
        record = self._publish(store, members, reformed) if group_rank == 0 else None
        if self._pod_ip is not None:
            # torch gives every agent's workers spec.master_addr (the same name on every pod); this
            # round's rank 0 says where it is instead, and every agent waits for it in the round's store.
            if group_rank == 0:
                store.set(WORKERS_HOST_KEY, self._pod_ip)
            worker_group.master_addr = store.get(WORKERS_HOST_KEY).decode()
        # The round's rank 0 agent serves its workers' store on a port it holds from the start (torch
        # would pick a free port and let the worker bind it later: taken meanwhile, a round failed).
        self._workers_store = None  # the previous round's, if this agent served it: its workers are gone
        if group_rank == 0:
            self._workers_store = serve_workers_store(worker_group.master_addr, self._init_timeout)
            store.set(WORKERS_PORT_KEY, str(self._workers_store.port))
        worker_group.master_port = int(store.get(WORKERS_PORT_KEY))
        # Rank 0 sets the grows and resizes before the restarts, and a get waits for its key: all are there.
        self._restarts = int(store.get(RESTARTS_KEY))
        self._grows = int(store.get(GROWS_KEY))
        resizes = int(store.get(RESIZES_KEY))
        self._members = members
        self._round_store = store
        # Rank 0's note of its resume says which restart it belongs to.
        write_restarts(self._progress_dir, self._restarts)
        self._ledger.round_formed(self._restarts, self._grows, members, record, resizes=resizes)
        if self._restarts == 0:
            return
        _status(
            "reformed",
            pod=self._pod_rank,
            restarts=self._restarts,
            grows=self._grows,
            resizes=resizes,
            members=members,
            time=f"{reformed:.6f}",
        )

    def _has_pod_zero(self, store: Store, group_rank: int) -> bool:
        """Whether pod 0 is in the round, which only an elastic round with its store apart can lack
        (pod 0's pod lost and not yet replaced, or not yet started): the round's rank 0 agent says which
        pod it is, in the round's store, before any other key."""
        if not (self._elastic and self._pod_ip is not None):
            return True
        if group_rank == 0:
            store.set(FIRST_POD_KEY, str(self._pod_rank))
        return store.get(FIRST_POD_KEY).decode() == "0"

    def _await_pod_zero(self, worker_group: WorkerGroup, members: int) -> None:
        """A round without pod 0 trains nothing: its first worker would be global rank 0 without the
        checkpoint volume, which only pod 0 mounts. Every member waits until a pod waits to join (pod
        0's replacement, which the operator creates at once) and then joins the next round with it;
        the round is never published, so the gang's counts and the restart's record skip it."""
        handler = worker_group.spec.rdzv_handler
        _status("awaiting", pod=self._pod_rank, members=members, missing=0, time=f"{time.time():.6f}")
        deadline = time.monotonic() + self._init_timeout.total_seconds()
        while handler.num_nodes_waiting() == 0:
            if handler.is_closed():
                # A pod ended the job (it gave up, or the operator stopped the gang): nothing will join.
                raise RendezvousClosedError()
            if time.monotonic() > deadline:
                raise PodZeroMissingError(
                    f"a round of {members} pod(s) formed without pod 0, and no pod came to join it in "
                    f"{self._init_timeout.total_seconds():.0f} s (the init timeout)"
                )
            time.sleep(MONITOR_INTERVAL)

    def _publish(self, store: Store, members: int, reformed: float) -> RestartRecord | None:
        """Rank 0's agent, once a round is complete: the gang's counts for it, in its store; returns
        the record of the restart that led to it (from what the agents left under the previous round's
        restart count), None for the first round. The caller puts it in the ledger with the counts, in
        one update. Every count comes from the rendezvous store, so a rank 0 pod that replaced a lost
        one continues them."""
        gang = self._gang_store
        restarts = gang.add(ROUNDS_TOTAL_KEY, 1) - 1
        record: RestartRecord | None = None
        grew = resized = 0
        if restarts > 0:
            left = _books(gang, restarts - 1)
            failures = [Failure.decode(line) for line in _read_all(left, FAILURES_KEY)]
            stops = [line.split() for line in _read_all(left, STOPPED_KEY)]
            stopped = [float(fields[1]) for fields in stops]
            steps = [int(fields[2]) for fields in stops if len(fields) > 2 and fields[2] != "-"]
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

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # Exit records of an earlier round must not decide this one's code.
        for record in self._exit_dir.glob("rank-*.json"):
            record.unlink(missing_ok=True)
        pids = dict(super()._start_workers(worker_group))
        ranks = {worker.local_rank: worker.global_rank for worker in worker_group.workers}
        _status(
            "started",
            pod=self._pod_rank,
            restarts=self._restarts,
            members=self._members,
            workers=",".join(f"{ranks[local]}:{pid}" for local, pid in sorted(pids.items())),
            store=f"{worker_group.master_addr}:{worker_group.master_port}",
        )
        return pids

    # --- a failure --------------------------------------------------------------------------------
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state not in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            return result
        seen = time.time()
        failures = {rank: failure.exitcode for rank, failure in result.failures.items()}
        failures.update(worker_exit_codes(self._pcontext, worker_group))
        found = first_failure(failures, read_exit_records(self._exit_dir))
        rank, code = found if found is not None else (-1, EXIT_PEER_LOST)
        # torch marks a group UNHEALTHY when a worker sits in uninterruptible sleep (a wedged device):
        # no restart can kill it, so this pod ends and the operator replaces it.
        stuck = result.state == WorkerState.UNHEALTHY
        if not stuck and is_retryable(code) and self._grow_under_way():
            # Another pod's agent stops the group for a grow, and this pod's workers ended with it (the
            # agreed stop's 143, or a lost peer's 170): no failure, the next round is the grow's.
            self._remaining_restarts = max(int(self._remaining_restarts), 1)
            _status("grow", pod=self._pod_rank, members=self._members, code=code, time=f"{seen:.6f}")
            return result
        spent = restarts_spent(self._restarts, self._grows)
        decision: Decision = "stuck" if stuck else decide(code, spent, self._budget)
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
        if decision == "restart":
            # The gang's budget is the limit; torch's own count per agent must not end it first.
            self._remaining_restarts = max(int(self._remaining_restarts), 1)
            if self._round_store is not None:
                record = Failure(pod_rank=self._pod_rank, global_rank=rank, exit_code=code, time=seen)
                _push(_books(self._gang_store, self._restarts), FAILURES_KEY, record.encode())
        else:
            self._remaining_restarts = 0
            self.exit_code = code
            self.ending = decision
        return result

    def _grow_under_way(self) -> bool:
        """An elastic job's agent stops this round's group for a grow (GROWING_KEY, set before its
        workers were told to stop, so a peer that ended because of it finds the key)."""
        return self._elastic and self._round_store is not None and self._round_store.check([GROWING_KEY])

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if worker_group.state == WorkerState.HEALTHY:
            # torch restarts a healthy group when a pod waits to join: an elastic job's grow, or a
            # replacement, a restart of the gang like any other (fixed-size jobs).
            members = worker_group.group_world_size or self._members
            spent = restarts_spent(self._restarts, self._grows)
            action = healthy_restart(self._elastic, members, self._pods, spent, self._budget)
            if action == "budget-spent":
                self._stop_workers(worker_group)
                raise RestartBudgetSpentError(
                    f"a pod waits to join, but the gang has spent its restart budget ({self._budget})"
                )
            if action == "grow" and self._round_store is not None:
                self._grow(worker_group, self._round_store, members)
                return
        super()._restart_workers(worker_group)

    def _grow(self, worker_group: WorkerGroup, store: Store, members: int) -> None:
        """torch's restart of the workers (stop, rendezvous, start), for a grow.

        A grow stops a healthy group, so it uses the agreed stop (docs/trainer.md), not SIGKILL: every
        rank stops at the same step boundary and rank 0 writes a checkpoint there, so the grown round
        redoes no step. The ranks combine their flags in one allreduce, so the workers of pods whose
        agents have not seen the waiting pod yet stop too; GROWING_KEY, set first, tells those agents
        that it was no failure (_monitor_workers).
        """
        store.set(GROWING_KEY, str(self._pod_rank))
        _status("grow", pod=self._pod_rank, members=members, time=f"{time.time():.6f}")
        ended = self._agreed_stop()
        self._stop_workers(worker_group)  # what is left (a worker stuck past the grace), and the books
        if ended is not None and not ended.is_failed():
            # The stop came after the last stop check: the workers finished training instead. A new
            # round would only resume at the end; this pod meets the others at torch's exit barrier,
            # as a finished group does, and exits 0.
            self._exit_barrier()  # type: ignore[no-untyped-call]
            raise TrainingFinishedError(f"training was over when a pod joined the round of {members}")
        worker_group.state = WorkerState.STOPPED
        self._initialize_workers(worker_group)

    def _agreed_stop(self) -> RunProcsResult | None:
        """SIGTERM this pod's workers and wait for their result, up to SHUTDOWN_TIMEOUT (None: some
        are still running). It polls as the monitor does, not torch's close: a worker that has
        returned waits until its agent has read its return value, which close never does."""
        if self._pcontext is None:
            return None
        for pid in self._pcontext.pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        result: RunProcsResult | None = self._pcontext.wait(SHUTDOWN_TIMEOUT, period=MONITOR_INTERVAL)
        return result

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown(death_sig=signal.SIGKILL)
        stopped = time.time()
        # The steps this pod's first worker completed: every rank completes the same steps, ± one in flight.
        ranks = [worker.global_rank for worker in worker_group.workers if worker.global_rank is not None]
        steps = read_step_marker(step_marker_path(self._progress_dir, min(ranks))) if ranks else None
        _status("stopped", pod=self._pod_rank, time=f"{stopped:.6f}")
        if self._round_store is not None and self.ending is None:
            line = f"{self._pod_rank} {stopped:.6f} {'-' if steps is None else steps}"
            _push(_books(self._gang_store, self._restarts), STOPPED_KEY, line)


def worker_exit_codes(pcontext: object, worker_group: WorkerGroup) -> dict[int, int]:
    """The exit code (-N for signal N, as torch reports it) of every worker of this pod that has ended,
    by global rank.

    torch's poll reports only the first failed worker whose end it sees, and then stops the others:
    when a killed worker and the peer that lost it end within one poll, the peer's collateral 170 may
    be the one reported, and the pod would exit with it instead of the kill's 137. The fence
    (check_torch_agent) makes sure `_pc` is still where torch keeps the processes.
    """
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None) if pcontext else None
    if processes is None:
        return {}
    codes: dict[int, int] = {}
    for worker in worker_group.workers:
        if worker.global_rank is None or not 0 <= worker.local_rank < len(processes):
            continue
        code = processes[worker.local_rank].exitcode
        if code is not None and code != 0:
            codes[worker.global_rank] = int(code)
    return codes


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
FORKSERVER_PRELOAD: Final = ("ddp_trainer.worker", "ddp_trainer.trainer", "torch._dynamo")


def start_forkserver(workload: str, *, fork: bool = True) -> None:
    """Start the process the workers are forked from, importing the trainer and the workload's lazy
    imports now: a fork of this launcher, which has imported torch already (``fork``; see
    ddp_trainer.worker_forkserver), else a new interpreter that imports torch too.

    Every worker, the first ones and each restart's, is a fork of it: a restart costs a fork, not an
    interpreter start and the imports (docs/benchmarks.md). It imports while this pod waits for the
    others in the rendezvous. It never initializes CUDA or a process group, so forking it is safe; it
    inherits this process's environment as it is now (the launcher's variables are all set).
    """
    worker_forkserver.start([*FORKSERVER_PRELOAD, *LAZY_IMPORTS.get(workload, ())], log, fork=fork)


class _NoTraceback(logging.Filter):
    """Drops the traceback from torch's log of a failed worker (the worker's own is on its stderr).

    torch's log formatter imports torch._dynamo for any record with a traceback: 1.5 s of this
    launcher's time, at the moment a worker has failed and the gang waits for it.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True


def prepare_workers(env: DistEnv, config: TrainConfig) -> None:
    """What the workers inherit, settled before the launcher starts any thread of its own (its
    /metrics server): their environment, and the forkserver they are forked from."""
    # Rank 0 publishes the workers' store address in every round (see the module's docstring).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[AGENT_SERVES_STORE_ENV] = "1"
    start_forkserver(config.workload, fork=env.worker_forkserver == "fork")
    quiet_worker_failures()


def quiet_worker_failures() -> None:
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoTraceback())


def serve_workers_store(host: str, timeout: timedelta) -> TCPStore:
    """The workers' store of a round, served by its rank 0 agent at ``host`` on a port the kernel picks
    as it binds: no other process can take it between the pick and the bind. On loopback only when
    ``host`` is a loopback address (docs/trainer.md, "Where rank 0 listens"), else on every interface,
    as rank 0's worker served it before."""
    return TCPStore(
        host,
        0,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=loopback_listener(host, 0),
    )


def rendezvous_handler(env: DistEnv, config: TrainConfig) -> tuple[RendezvousHandler, Store]:
    """The launchers' rendezvous (ddp_trainer.rendezvous) and its store: the job's rendezvous pod at DDP_RENDEZVOUS_ENDPOINT (every
    launcher a client, waiting up to the init timeout for it to listen), or, without one, the store
    NODE_RANK 0's launcher hosts at MASTER_ADDR:MASTER_PORT."""
    started = time.monotonic()
    timeout = timedelta(seconds=config.init_timeout)
    host, port = env.rendezvous_store
    is_host = env.rendezvous_endpoint is None and env.node_rank == 0
    store = TCPStore(
        host,
        port,
        is_master=is_host,
        timeout=timeout,
        wait_for_workers=False,
        # A job on one machine stays on loopback (docs/trainer.md, "Where rank 0 listens").
        master_listen_fd=loopback_listener(host, port) if is_host else None,
    )
    # An elastic job's round completes once DDP_MIN_MEMBERS pods have joined and then the replacement
    # wait has passed (or all NNODES are in): survivors go on without a pod that cannot be placed, and
    # a first start without all pods is bounded by it. A fixed-size job's round needs every pod.
    handler = RoundsRendezvous(
        store,
        env.run_id,
        pod_rank=env.node_rank,
        sort_key=node_addr(
            env.node_rank, _order_key(env, config.init_timeout - (time.monotonic() - started))
        ),
        fewest=env.min_members if env.min_members is not None else env.nnodes,
        most=env.nnodes,
        # A replacement pod may take a while to be scheduled and started: the survivors wait for it
        # as long as a first start may take (an elastic job's below DDP_MIN_MEMBERS too).
        join_timeout=config.init_timeout,
        last_call=float(env.replacement_wait) if env.elastic else 0.0,
        store_info=(host, port),
    )
    return handler, store


def _order_key(env: DistEnv, timeout: float) -> str | None:
    """This pod's rendezvous order key (a job whose ranks follow the topology), waited for; None for a
    job whose ranks follow NODE_RANK."""
    if env.rank_order_file is None:
        return None
    key = wait_for_key(
        Path(env.rank_order_file),
        max(timeout, 0.0),
        on_wait=lambda: _status("waiting", pod=env.node_rank, on="rank-order"),
    )
    _status("ordered", pod=env.node_rank, key=key)
    return key


def _joined_rendezvous(env: DistEnv, config: TrainConfig) -> tuple[RendezvousHandler, Store] | None:
    """The rendezvous handler and its store (the workers' forkserver was started by prepare_workers);
    None when this pod's order key never came (said in its log)."""
    try:
        return rendezvous_handler(env, config)
    except RankOrderMissingError as missing:
        log(f"{missing}; exiting {EXIT_PEER_LOST}")
        return None


def _worker_spec(env: DistEnv, handler: RendezvousHandler, argv: list[str]) -> WorkerSpec:
    return WorkerSpec(
        role="trainer",
        local_world_size=env.nproc_per_node,
        rdzv_handler=handler,
        entrypoint=forked_worker,
        args=(argv,),
        max_restarts=env.restart_budget,
        monitor_interval=MONITOR_INTERVAL,
        # The workers' store is at rank 0's pod's name (where rank 0's pod may be replaced, the round
        # says its IP), on the port its agent serves it at (InPlaceAgent._rendezvous); the node
        # descriptor's address is only a sort key.
        master_addr=env.master_addr,
    )


def run_in_place(
    env: DistEnv,
    config: TrainConfig,
    argv: list[str],
    exit_dir: Path,
    progress_dir: Path,
    ledger: RestartLedger,
) -> int:
    """Run this pod's agent until the job ends; returns the pod's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    joined = _joined_rendezvous(env, config)
    if joined is None:
        return EXIT_PEER_LOST
    handler, gang_store = joined
    try:
        check_torch_agent()  # before the agent is built: its constructor is part of the surface
    except TorchAgentMismatchError as mismatch:
        return _refuse(handler, str(mismatch))
    agent = InPlaceAgent(
        _worker_spec(env, handler, argv),
        env=env,
        exit_dir=exit_dir,
        progress_dir=progress_dir,
        ledger=ledger,
        gang_store=gang_store,
        init_timeout=config.init_timeout,
    )
    try:
        check_torch_agent(agent=agent)  # the attributes, before the first round: nothing has started yet
    except TorchAgentMismatchError as mismatch:
        return _refuse(handler, str(mismatch))
    close_rendezvous = True
    try:
        result = agent.run()
        if result is None:  # torch: the rendezvous was closed while this pod waited to join
            code = EXIT_PEER_LOST
        elif result.is_failed():
            failures = {rank: failure.exitcode for rank, failure in result.failures.items()}
            code = agent.exit_code or first_failure_code(failures, read_exit_records(exit_dir))
            if agent.ending == "budget-spent":
                log(f"the gang spent its restart budget ({env.restart_budget}); exiting {code}")
        else:
            code = 0
    except TrainingFinishedError as finished:
        log(f"{finished}; exiting 0")
        code = 0
    except SignalException as stopped:
        # This pod was stopped (deleted): the others restart without it, so the rendezvous stays open.
        close_rendezvous = False
        records = read_exit_records(exit_dir)
        code = first_failure_code({}, records) if records else 128 + int(stopped.sigval)
    except Exception as error:
        if env.elastic and not agent.joined and isinstance(error, _GROUP_GONE):
            # An elastic group may finish without a pod that came late (a replacement whose capacity
            # came back at the end): it took no part, and must not read as a failure (docs/elastic.md).
            # Had the group ended otherwise, its members' own codes, or rank 0's loss, decide.
            log(
                f"the elastic group had ended when this pod came to join it ({type(error).__name__}); exiting 0"
            )
            return EXIT_OK
        # The rendezvous failed: its store (the rendezvous pod, or rank 0's pod) is gone, it timed out
        # waiting for a pod, or it was closed by a pod that ended the job. The operator restarts the
        # gang: retried.
        log(
            f"pod {env.node_rank} left {_where(env)} ({type(error).__name__}: {error}); exiting {EXIT_PEER_LOST}"
        )
        code = EXIT_PEER_LOST
    finally:
        if close_rendezvous:
            _close(handler)
    return code


def _where(env: DistEnv) -> str:
    """The rendezvous this pod meets at, for its log."""
    host, port = env.rendezvous_store
    if env.rendezvous_endpoint is not None:
        return f"the rendezvous pod's store at DDP_RENDEZVOUS_ENDPOINT = {host}:{port}"
    return f"the rendezvous at MASTER_ADDR:MASTER_PORT = {host}:{port}"


# What a pod that comes to join a group that has ended meets: a closed rendezvous, or no host at all.
_GROUP_GONE: Final = (RendezvousClosedError, RendezvousConnectionError)


def _refuse(handler: RendezvousHandler, why: str) -> int:
    """End this pod before it joins: say why, let the other pods stop waiting, exit permanently."""
    log(why)
    _close(handler)
    return EXIT_BAD_CONFIG


def _close(handler: RendezvousHandler) -> None:
    """Close the rendezvous so the other pods stop waiting for this one (best effort: its host may be
    gone already)."""
    try:
        handler.shutdown()
    except Exception as error:
        log(f"could not close the rendezvous ({type(error).__name__}: {error})")
