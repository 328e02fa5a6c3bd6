"""One DDP rank: join the process group, train, checkpoint, stop together, report."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import signal
import sys
import time
import traceback
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from prometheus_client import Gauge
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from ddp_trainer.config import ConfigError, DistEnv, TrainConfig, metrics_port_error, resolve_backend
from ddp_trainer.control import StopFlag, Watchdog
from ddp_trainer.exitcodes import (
    EXIT_BAD_CONFIG,
    EXIT_OK,
    EXIT_PEER_LOST,
    EXIT_STOPPED,
    PeerLostError,
    exit_code_for,
)
from ddp_trainer.library.health import mark_joined, pod_is_new
from ddp_trainer.library.instrumentation import Instrumentation, instrument
from ddp_trainer.library.teardown import THREADS_OUTLIVED_GROUP, GroupSession, process_group_session
from ddp_trainer.metrics import (
    MetricsEndpoint,
    create_health_metrics,
    kept_step_seconds_gauge,
    open_endpoint,
    resumed_timestamp_gauge,
)
from ddp_trainer.progress import FinalResult, Progress, format_status_line
from ddp_trainer.supervisor.addresses import AGENT_SERVES_STORE_ENV, loopback_listener
from ddp_trainer.supervisor.group_abort import GroupAborter, default_nccl_error_handling
from ddp_trainer.supervisor.membership import LeftReason, Membership
from ddp_trainer.supervisor.membership import current as current_membership
from ddp_trainer.supervisor.resume import KEPT_SECONDS_FIELD as KEPT
from ddp_trainer.supervisor.resume import PROGRESS_DIR_ENV, StepBook
from ddp_trainer.supervisor.stores import tcp_store
from ddp_trainer.training import resize
from ddp_trainer.training.checkpoint import complete_checkpoints, load_newest_checkpoint, save_checkpoint
from ddp_trainer.training.determinism import seed_step, settle_buckets
from ddp_trainer.training.faults import InjectedExitError, inject, misshape, send_delay
from ddp_trainer.training.health_check import check_links
from ddp_trainer.training.workloads import Workload, build_workload


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device


def log(message: str) -> None:
    print(f"ddp_trainer: {message}", file=sys.stderr, flush=True)


def setup(env: DistEnv, config: TrainConfig) -> DistContext:
    """Join the process group from the env contract; raises PeerLostError after ``--init-timeout``."""
    backend = resolve_backend(env.backend, torch.cuda.is_available())
    device = _device(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        # Before the group is made, which reads it: NCCL's watchdog aborts a failed communicator and
        # leaves the process alone (ddp_trainer.supervisor.group_abort), unless the user said otherwise.
        default_nccl_error_handling()
    endpoint = f"{env.master_addr}:{env.master_port}"
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # Started by torch's static launcher (Recreate, nprocPerNode > 1): its agent hosts the store.
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=config.init_timeout),
            )
        else:
            # Under the pod's supervisor, the round's rank 0 supervisor serves the store already.
            serves = env.rank == 0 and os.environ.get(AGENT_SERVES_STORE_ENV) != "1"
            listen_fd = loopback_listener(env.master_addr, env.master_port) if serves else None
            store = tcp_store(
                env.master_addr,
                env.master_port,
                world_size=env.world_size,
                is_master=serves,
                timeout=timedelta(seconds=config.init_timeout),
                listen_fd=listen_fd,
            )
            dist.init_process_group(
                backend,
                store=store,
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=config.init_timeout),
            )
        inject(config.inject_fault, env.rank, "rendezvous")
        # Forming the group is what the init timeout bounds: every rank checks in here.
        dist.barrier()
    except Exception as error:
        raise PeerLostError(
            f"could not form the process group through MASTER_ADDR:MASTER_PORT = {endpoint} "
            f"within --init-timeout {config.init_timeout:g} s ({type(error).__name__}: {_first_line(error)})"
        ) from error
    _set_collective_timeout(config.watchdog_timeout)
    return DistContext(
        rank=env.rank, local_rank=env.local_rank, world_size=env.world_size, backend=backend, device=device
    )


def _set_collective_timeout(seconds: float) -> None:
    """After the group is formed, collectives get the watchdog's timeout instead of the init timeout."""
    from torch.distributed import distributed_c10d

    set_timeout = getattr(distributed_c10d, "set_timeout", None)
    if set_timeout is not None:
        set_timeout(timedelta(seconds=seconds))


def _peer_lost_message(rank: int, error: Exception) -> str:
    if isinstance(error, PeerLostError):
        return str(error)
    return f"rank {rank}: a collective failed, a peer is gone: {type(error).__name__}: {_first_line(error)}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def parameters_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class _Place:
    """Where training is: steps done, the epoch, and the next batch of that epoch."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    # The world size ``batch`` counts in: a checkpoint's, until :meth:`Trainer._plan` maps it to this
    # group's (None: this group's already).
    world_size: int | None = None


@dataclass
class _Run:
    """One run of the loop: what ``train`` built, where it is, and rank 0's progress window."""

    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    metrics: Instrumentation
    features: torch.Tensor
    labels: torch.Tensor
    sampler: DistributedSampler[Any]
    batches_per_epoch: int
    total_steps: int
    place: _Place
    loss_fn: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    loss_value: float = math.nan
    window_start: float = field(default_factory=time.perf_counter)
    window_steps: int = 0


# The stop flags the ranks combine (their maximum wins): a rank told to stop (SIGTERM), a rank whose
# supervisor asks it to leave the group with the others (a pod waits to join).
STOP_FLAG: Final = 2.0
LEAVE_FLAG: Final = 1.0


class LeaveGroupError(Exception):
    """The ranks agreed to stop at a step boundary and this rank was not told to stop itself: under the
    pod's supervisor it leaves the group with its state and waits for the next round."""

    def __init__(self, why: LeftReason, message: str) -> None:
        super().__init__(message)
        self.why: LeftReason = why


@dataclass
class Held:
    """What a worker keeps through the rounds of its gang (docs/restarts.md): the workload, the model and
    optimizer where they live (the device), and where training is (None before any state is held)."""

    workload: Workload
    model: nn.Module
    optimizer: torch.optim.Optimizer
    place: _Place | None = None
    kept_seconds: float = 0.0

    @property
    def step(self) -> int:
        """The step the held state is at; -1 when none is held."""
        return self.place.step if self.place is not None else -1


def hold(config: TrainConfig, device: torch.device) -> Held:
    """The workload, its model on ``device`` and the optimizer: built once per worker process."""
    workload: Workload = build_workload(config)
    model = workload.model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    return Held(workload, model, optimizer)


class Trainer:
    """Trains one workload on one rank of an initialized process group: one round of the gang."""

    def __init__(
        self,
        config: TrainConfig,
        env: DistEnv,
        context: DistContext,
        stop: StopFlag,
        endpoint: MetricsEndpoint,
        held: Held | None = None,
        membership: Membership | None = None,
        watchdog: Watchdog | None = None,
        aborter: GroupAborter | None = None,
    ) -> None:
        self.config = config
        self.env = env
        self.ctx = context
        self.stop = stop
        self.is_rank0 = context.rank == 0
        self.watchdog = watchdog or Watchdog(config.watchdog_timeout, context.rank)
        self.watchdog.rank = context.rank
        self.checkpoint_dir = Path(config.checkpoint_dir) if config.checkpoint_dir else None
        self.endpoint = endpoint
        self.book = StepBook(context.rank)
        self.held = held if held is not None else hold(config, context.device)
        # Under the pod's supervisor: the channel that asks this worker to leave at a stop check, and
        # what its control thread aborts the group with when the worker is blocked instead.
        self.membership = membership
        self.aborter = aborter
        # Why the ranks agreed to stop at the last stop check (see _agree_to_stop).
        self.agreed: LeftReason = "stopped"
        self.kept_gauge = kept_step_seconds_gauge(0, endpoint.registry) if self.is_rank0 else None
        # Set at the first step after a resume from a checkpoint (the restart's "training again").
        self.resumed_gauge: Gauge | None = None

    # --- building ------------------------------------------------------------------------------------
    def _collective(self, what: str) -> AbstractContextManager[None]:
        return self.watchdog.guard(what)

    def _instrument(self, ddp: DistributedDataParallel, total_steps: int) -> Instrumentation:
        """The library's metrics on our own model, exported on the endpoint opened before the rendezvous.

        The ranks' step parts are exchanged with the stop flag (:meth:`_agree_to_stop`), in its allreduce.
        """
        config = self.config
        return instrument(
            ddp,
            comm_hook=config.comm_hook,
            mode=config.sync_metrics,
            endpoint=self.endpoint,
            logger_sample_every=config.logger_sample_every,
            powersgd_rank=config.powersgd_rank,
            total_steps=total_steps,
            exchange_every=0,
            time_every=config.sync_time_every or config.stop_check_every,
            stall_timeout=self.env.stall_timeout or 0,
        )

    def _resume_state(self) -> tuple[dict[str, Any] | None, str, int] | None:
        """Agree on the newest state any member holds and give it to those that lack it (docs/restarts.md).

        Every rank offers the step its live state is at (a survivor of an earlier round holds its model
        and optimizer in this process) and, on rank 0, the newest complete checkpoint's. The group
        resumes at the newest step offered: a rank that holds it keeps its own state, untouched; the
        others receive it from the lowest rank that holds it live ("peer"), or from rank 0's disk when no
        member does ("disk"). Returns the state this rank received (None: it kept its own), where the
        group's newest state came from ("memory": every rank held it), and the step; None to start
        from scratch.
        """
        ctx, held = self.ctx, self.held
        disk_step = -1
        if self.is_rank0 and self.checkpoint_dir is not None:
            found = complete_checkpoints(self.checkpoint_dir)
            disk_step = found[-1][0] if found else -1
        offers: list[Any] = [None] * ctx.world_size
        with self._collective("the resume agreement"):
            dist.all_gather_object(offers, (held.step, disk_step))
        self._ensure_intact("the resume agreement")
        best = max(max(offer) for offer in offers)
        if best < 0:
            inject(self.config.inject_fault, ctx.rank, "resume")
            return None
        keepers = [rank for rank, offer in enumerate(offers) if offer[0] == best]
        if len(keepers) == ctx.world_size:
            inject(self.config.inject_fault, ctx.rank, "resume")
            return None, "memory", best
        source = min(keepers) if keepers else min(r for r, offer in enumerate(offers) if offer[1] == best)
        holder: list[Any] = [None, "peer"]
        if ctx.rank == source:
            if keepers:
                assert held.place is not None
                holder[0] = self._state(held.model, held.optimizer, held.place)
            elif self.checkpoint_dir is not None:
                loaded = load_newest_checkpoint(self.checkpoint_dir)
                if loaded is not None:
                    holder[0] = loaded[0]
                    log(f"rank {ctx.rank} resumes from {loaded[1]}")
                    holder[1] = "disk"
        inject(self.config.inject_fault, ctx.rank, "resume")
        with self._collective("the state broadcast"):
            dist.broadcast_object_list(
                holder, src=source, device=ctx.device if ctx.backend == "nccl" else None
            )
        state, origin = holder[0], str(holder[1])
        if ctx.rank in keepers:
            return None, origin, best
        return (state if isinstance(state, dict) else None), origin, best

    # --- the loop ------------------------------------------------------------------------------------
    def train(self) -> int:
        config, ctx = self.config, self.ctx
        workload, model, optimizer = self.held.workload, self.held.model, self.held.optimizer
        place = self._restore(model, optimizer)
        inject(config.inject_fault, ctx.rank, "ddp")
        # DDP's constructor checks the parameter shapes across ranks and broadcasts rank 0's parameters.
        with self._collective("DDP construction"):
            ddp = DistributedDataParallel(
                model,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                bucket_cap_mb=config.bucket_cap_mb,
            )
        self._issued_update()  # the constructor's broadcast of rank 0's parameters
        features, labels = workload.train.tensors
        loss_fn = nn.CrossEntropyLoss()
        with self._collective("settling DDP's gradient buckets"):
            head = slice(0, config.batch_size)
            settle_buckets(
                ddp, lambda: loss_fn(ddp(features[head].to(ctx.device)), labels[head].to(ctx.device))
            )
        self._check_health()
        sampler: DistributedSampler[Any] = DistributedSampler(
            workload.train, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=config.seed
        )
        batches_per_epoch = math.ceil(len(sampler) / config.batch_size)
        total_steps = self._plan(place, len(workload.train), batches_per_epoch)
        metrics = self._instrument(ddp, total_steps)
        run = _Run(
            ddp, optimizer, metrics, features, labels, sampler, batches_per_epoch, total_steps, place, loss_fn
        )
        self.book.loop_started()
        if self.membership is not None:
            self.membership.step_done()  # the stall clock of a leave request starts at the loop at most
        try:
            stop_requested = self._loop(run)
            run.metrics.flush()
            if stop_requested:
                path = self._checkpoint(ddp, optimizer, place)
                if self.is_rank0:
                    print(
                        format_status_line("stopped", {"step": place.step, "checkpoint": path or "none"}),
                        flush=True,
                    )
                if self.membership is not None and not self.stop.requested:
                    # Another rank's stop (its pod is going), or the supervisor's leave (a pod joins):
                    # this rank keeps its state for the next round.
                    raise LeaveGroupError(
                        self.agreed, f"the ranks agreed to leave the group at step {place.step}"
                    )
                return EXIT_STOPPED
            self._checkpoint(ddp, optimizer, place, final=True)
            self._report(ddp, workload, run.loss_value, place.step, run.metrics)
        # An error goes up to run_worker, which tells a lost peer from this rank's own error.
        finally:
            run.metrics.close()  # lets go of the model; the endpoint stays up for the linger
        self._linger()
        return EXIT_OK

    def _check_health(self) -> None:
        """The gang health check (DDP_HEALTH_CHECK, ddp_trainer.library.health), when a member is new to the group.

        Every run of a worker forms a group and passes here, before its first step: a job's start, a
        recreated gang, and every in-place round. A round re-formed of the same pods (a worker restarted
        where it was) measures the links it already measured, so it checks only when some pod is new: a
        replacement, or an elastic grow's. Here, after DDP's construction and its bucket re-layout and
        before the sampler and the loop, the check's buffers of zeros touch neither the training's
        random stream nor the buckets.
        """
        env, ctx = self.env, self.ctx
        if not env.health_check or ctx.world_size < 2:
            return
        directory = os.environ.get(PROGRESS_DIR_ENV)
        progress_dir = Path(directory) if directory else None
        with self._collective("the health check"):
            new = torch.tensor([1.0 if pod_is_new(progress_dir) else 0.0], device=ctx.device)
            dist.all_reduce(new, op=dist.ReduceOp.MAX)
            if new.item() == 0:
                return
            inject(self.config.inject_fault, ctx.rank, "health")
            delay = send_delay(self.config.inject_fault, ctx.rank)
            started = time.perf_counter()
            result = check_links(ctx.rank, ctx.world_size, ctx.device, env.health_check_bytes, delay)
            seconds = time.perf_counter() - started
        mark_joined(progress_dir)
        create_health_metrics(ctx.rank, self.endpoint.registry).show(result, seconds, time.time())
        if self.is_rank0:
            print(format_status_line("health", result.status_fields(seconds)), flush=True)

    def _restore(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> _Place:
        """Where this round starts: the held state, the newest state a peer or the disk gives this rank,
        or the start."""
        ctx, held = self.ctx, self.held
        resumed = self._resume_state()
        if resumed is None:
            held.place, held.kept_seconds = _Place(), 0.0
            self._book_resume(0, None)
            return held.place
        state, origin, _ = resumed
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step, epoch, position = int(state["step"]), int(state["epoch"]), int(state["batch_in_epoch"])
            held.place = _Place(step, epoch, position, int(state.get("world_size", ctx.world_size)))
            self._book_resume(step, state)
        else:
            assert held.place is not None
            self._book_resume(held.place.step, {KEPT: held.kept_seconds})
        place = held.place
        if self.is_rank0:
            fields = {"step": place.step, "epoch": place.epoch, "from": origin}
            print(format_status_line("resumed", fields), flush=True)
        return place

    def _plan(self, place: _Place, samples: int, batches_per_epoch: int) -> int:
        """Map a checkpoint's place in the epoch to this group's world size (an elastic job's resize,
        ddp_trainer.training.resize); returns the step the loop ends at.

        The learning rate stays as it is: with fewer ranks the effective batch size is smaller.
        """
        config, world_size = self.config, self.ctx.world_size
        saved = place.world_size if place.world_size is not None else world_size
        if saved != world_size:
            batch = resize.remap_batch(place.batch, saved, world_size, samples, config.batch_size)
            if self.is_rank0:
                fields = {
                    "from_world_size": saved,
                    "world_size": world_size,
                    "step": place.step,
                    "epoch": place.epoch,
                    "batch_from": place.batch,
                    "batch": batch,
                }
                print(format_status_line("resized", fields), flush=True)
            place.batch = batch
        place.world_size = world_size
        return resize.total_steps(
            place.step, place.epoch, place.batch, batches_per_epoch, config.epochs, config.max_steps
        )

    def _book_resume(self, step: int, state: dict[str, Any] | None) -> None:
        """The resume bookkeeping (ddp_trainer.supervisor.resume) starts at ``step``, from ``state`` if any."""
        self.book.resumed(step, state)
        if self.kept_gauge is not None:
            self.kept_gauge.set(self.book.kept_seconds)
        if state is not None and self.is_rank0:
            self.resumed_gauge = resumed_timestamp_gauge(0, self.endpoint.registry)

    def _book_step(self, step: int) -> None:
        self.book.step_done(step)
        if self.membership is not None:
            self.membership.step_done()
        self.held.kept_seconds = self.book.kept_seconds
        if self.kept_gauge is not None:
            self.kept_gauge.set(self.book.kept_seconds)
        if self.resumed_gauge is not None:
            self.resumed_gauge.set(time.time())
            self.resumed_gauge = None  # the first step after the resume only

    def _loop(self, run: _Run) -> bool:
        """Train up to the last step, epoch after epoch; True when the ranks agreed to stop early."""
        place = run.place
        while place.step < run.total_steps:
            run.sampler.set_epoch(place.epoch)
            order = list(iter(run.sampler))
            for batch_index in range(place.batch, run.batches_per_epoch):
                if place.step >= run.total_steps:
                    break
                if self._step(run, order, batch_index):
                    return True
            else:
                place.epoch, place.batch = place.epoch + 1, 0
        return False

    def _step(self, run: _Run, order: list[int], batch_index: int) -> bool:
        """One training step and what follows it; True when the ranks agreed to stop."""
        config, ctx, place = self.config, self.ctx, run.place
        inject(config.inject_fault, ctx.rank, "step", place.step)
        indices = torch.tensor(order[batch_index * config.batch_size : (batch_index + 1) * config.batch_size])
        inputs = run.features[indices].to(ctx.device, non_blocking=True)
        targets = run.labels[indices].to(ctx.device, non_blocking=True)
        inputs = misshape(config.inject_fault, ctx.rank, place.step, inputs)
        seed_step(config.seed, ctx.rank, place.step)
        started = time.perf_counter()
        with self._collective("a training step"):
            run.optimizer.zero_grad(set_to_none=True)
            loss = run.loss_fn(run.ddp(inputs), targets)
            loss.backward()
            run.optimizer.step()
        self._issued_update()
        seconds = time.perf_counter() - started
        place.step += 1
        place.batch = batch_index + 1
        self._book_step(place.step)
        run.window_steps += 1
        last = place.step >= run.total_steps
        logged = place.step % config.progress_every == 0 or last
        if logged:
            run.loss_value = float(loss.item())
        run.metrics.step(len(indices), seconds, loss=run.loss_value if logged else None)
        if logged:
            self._print_progress(run)
        if config.checkpoint_every and place.step % config.checkpoint_every == 0 and not last:
            self._checkpoint(run.ddp, run.optimizer, place)
        if place.step % config.stop_check_every == 0 and not last and self._agree_to_stop(run.metrics):
            return True
        if config.throttle_ms:
            time.sleep(config.throttle_ms / 1000.0)
        return False

    def _print_progress(self, run: _Run) -> None:
        """Rank 0's progress line; every rank samples DDP's logger and starts a new window."""
        averages = run.metrics.sample_logger()
        if self.is_rank0:
            elapsed = max(time.perf_counter() - run.window_start, 1e-9)
            p50 = run.metrics.allreduce_p50_seconds()
            print(
                Progress(
                    step=run.place.step,
                    epoch=run.place.epoch,
                    loss=run.loss_value,
                    samples_per_second=run.window_steps
                    * self.config.batch_size
                    * self.ctx.world_size
                    / elapsed,
                    allreduce_p50_ms=None if p50 is None else p50 * 1000.0,
                    overlap=None if averages is None else averages.ratio,
                ).line(),
                flush=True,
            )
        run.window_start, run.window_steps = time.perf_counter(), 0

    def _agree_to_stop(self, metrics: Instrumentation) -> bool:
        """Combine the SIGTERM flags; the ranks' compute times ride in the same allreduce."""
        leave = self.membership is not None and self.membership.leave_requested()
        mine = STOP_FLAG if self.stop.requested else LEAVE_FLAG if leave else 0.0
        with self._collective("the stop-flag allreduce"):
            (flag,) = metrics.exchange([mine])
        self._ensure_intact("the stop-flag allreduce")
        if flag > 0 and self.membership is not None:
            self.membership.leaving()  # agreed: the control thread stands down
        # The largest flag wins: a rank's own stop (its pod is going) over a supervisor's leave.
        self.agreed = "stopped" if flag >= STOP_FLAG else "asked"
        return flag > 0

    def _issued_update(self) -> None:
        """The host has queued an update of the state (under NCCL the device may run it later)."""
        if self.aborter is not None:
            self.aborter.fence.issued_update()

    def _ensure_intact(self, what: str) -> None:
        """Raise a lost peer where the group was aborted (here or by torch's NCCL watchdog): a
        collective it flushed returns what its buffer held, which must decide nothing."""
        if self.aborter is not None and not self.aborter.intact():
            raise PeerLostError(f"rank {self.ctx.rank}: the process group was aborted in {what}")

    def _state(self, model: nn.Module, optimizer: torch.optim.Optimizer, place: _Place) -> dict[str, Any]:
        """The training state at ``place``, as a checkpoint holds it."""
        return {**self._fields(place), "model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def _fields(self, place: _Place) -> dict[str, Any]:
        """The plain values of the training state: where training is, and what it was started with
        (a checkpoint's and an in-memory copy's alike)."""
        return {
            "step": place.step,
            "epoch": place.epoch,
            "batch_in_epoch": place.batch,
            # The world size the place counts its batches in (a held state's round's, until _plan).
            "world_size": place.world_size if place.world_size is not None else self.ctx.world_size,
            "seed": self.config.seed,
            "workload": self.config.workload,
            KEPT: self.held.kept_seconds,
        }

    def _checkpoint(
        self,
        ddp: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        place: _Place,
        final: bool = False,
    ) -> str | None:
        """Rank 0 writes; every rank waits at a barrier until it has, so a stop never races the write.

        The ``final`` barrier is held even without a checkpoint directory: the ranks leave together, so
        a rank that exits 0 knows that every peer finished its steps (and one lost here is a lost peer).
        """
        if self.checkpoint_dir is None and not final:
            return None
        path: str | None = None
        if self.is_rank0 and self.checkpoint_dir is not None:
            self._ensure_intact("a checkpoint")  # never write what an aborted collective left
            state = self._state(ddp.module, optimizer, place)
            path = str(save_checkpoint(self.checkpoint_dir, place.step, state, self.config.keep_checkpoints))
        if final:
            inject(self.config.inject_fault, self.ctx.rank, "final-barrier")
        with self._collective("the final barrier" if final else "the checkpoint barrier"):
            dist.barrier()
        return path

    def _report(
        self,
        ddp: DistributedDataParallel,
        workload: Workload,
        loss_value: float,
        steps: int,
        metrics: Instrumentation,
    ) -> None:
        print(
            format_status_line("params", {"rank": self.ctx.rank, "sha256": parameters_digest(ddp.module)}),
            flush=True,
        )
        if not self.is_rank0:
            return
        model = ddp.module
        model.eval()
        with torch.no_grad():
            features, labels = workload.test.tensors
            predictions = model(features.to(self.ctx.device)).argmax(dim=1).cpu()
            accuracy = float((predictions == labels).float().mean())
        # Exported before the line is printed: `ddpjob run` scrapes once it sees the line.
        metrics.set_eval_accuracy(accuracy)
        print(FinalResult(accuracy=accuracy, loss=loss_value, steps=steps).line(), flush=True)

    def _linger(self) -> None:
        if self.endpoint.server is not None and self.config.metrics_linger > 0:
            print(
                f"ddp_trainer: serving /metrics for {self.config.metrics_linger:g} s more (SIGTERM ends it)",
                flush=True,
            )
            self.stop.event.wait(self.config.metrics_linger)


def open_metrics_endpoint(config: TrainConfig, env: DistEnv) -> MetricsEndpoint:
    """This rank's registry and server; under a launcher the shared files are the registry."""
    try:
        return open_endpoint(config.metrics_host, env.metrics_port)
    except OSError as error:
        raise metrics_port_error(config.metrics_host, env.metrics_port, error) from None


def run_worker(config: TrainConfig, env: DistEnv) -> int:
    """Everything one rank does: setup, train, end the group; returns the exit code.

    The metrics endpoint opens first, so a port conflict is a configuration error (exit 2) found
    before this rank makes its peers wait for it. An error is either a lost peer (170, retried) or
    this rank's own (1, permanent), wherever it happens: see :func:`ddp_trainer.exitcodes.exit_code_for`.
    """
    stop = StopFlag()
    # Until the group is formed there is nothing to checkpoint, and the rank may sit in a rendezvous
    # (in C++, where no Python handler runs) for up to --init-timeout: a stop signal ends it at once,
    # by the default action (reported as 143), instead of after the pod's whole grace period.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    endpoint = open_metrics_endpoint(config, env)
    try:
        # The session ends the group on the way out; by then the Trainer and its DDP model are gone,
        # so the group's threads can be joined while the interpreter is alive.
        with process_group_session() as session:
            code = _train_in_group(config, env, stop, endpoint, session)
    finally:
        endpoint.close()
    if session.left is False:
        # Something still holds the group: a gloo thread releasing a work while the interpreter
        # finalizes would abort this finished rank, so the caller must exit without finalizing.
        log(THREADS_OUTLIVED_GROUP)
    return code


# Puts the state on the worker's local GPU whatever the backend ("cuda"; gloo carries CUDA tensors):
# how one GPU holds two ranks' device state (NCCL refuses two ranks on one device), for
# benchmarks/gpu_check.py. Unset: the backend decides.
DEVICE_ENV: Final = "DDP_DEVICE"


def _device(env: DistEnv) -> torch.device:
    """This worker's device: its local GPU under NCCL (or DDP_DEVICE=cuda), else the CPU; the same in
    every round."""
    if (
        resolve_backend(env.backend, torch.cuda.is_available()) == "nccl"
        or os.environ.get(DEVICE_ENV) == "cuda"
    ):
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def _train_in_group(
    config: TrainConfig, env: DistEnv, stop: StopFlag, endpoint: MetricsEndpoint, session: GroupSession
) -> int:
    """Train in the gang's rounds: one without the pod's supervisor; under it, after each lost peer or
    agreed leave, the next one, in this process, with the model and optimizer held where they are."""
    membership = current_membership()
    held: Held | None = None
    watchdog: Watchdog | None = None
    # Under the supervisor: what the control thread aborts a blocked group with (group_abort).
    aborter: GroupAborter | None = None
    while True:
        why: LeftReason = "peer-lost"
        if aborter is not None:
            aborter.new_round()
        try:
            context = setup(env, config)
            stop.install()
            if held is None:
                held = hold(config, context.device)
            watchdog = watchdog or Watchdog(config.watchdog_timeout, context.rank)
            if membership is not None and aborter is None:
                aborter = GroupAborter(context.backend, context.device)
                membership.watch(aborter)
            return Trainer(config, env, context, stop, endpoint, held, membership, watchdog, aborter).train()
        except LeaveGroupError as leave:
            log(f"rank {env.rank}: {leave}")
            why = leave.why
        except InjectedExitError as injected:
            # The testing aid stands for this rank's own failure with that code: it exits first, as below.
            session.abandon()
            return injected.code
        except ConfigError as error:
            # Bad input found once in the group (a dataset the user mounted): one line, no traceback, and
            # the usage code, which the ExitCode policy reads as permanent.
            log(f"bad configuration: {error}")
            session.abandon()
            return EXIT_BAD_CONFIG
        except Exception as error:
            # Whatever a group the control thread aborted raises is the lost peer it was aborted for.
            code = EXIT_PEER_LOST if aborter is not None and aborter.aborted else exit_code_for(error)
            if code != EXIT_PEER_LOST:
                log(
                    f"rank {env.rank}: an error of this rank's own code (exit {code}, permanent):\n"
                    + "".join(traceback.format_exception(error)).rstrip()
                )
                # Exit before the peers can notice: ending the group would close its connections, and
                # they could record their collateral 170 before this rank has recorded its own code.
                session.abandon()
                return code
            log(_peer_lost_message(env.rank, error))
            if membership is None:
                return code
            if aborter is not None and not aborter.state_is_exact():
                # NCCL: an update queued behind the broken collective ran on its partial result, or
                # may have (group_abort). Keeping this state would break the model's exactness.
                log(
                    f"rank {env.rank}: an update of this round may have run on an aborted collective: its "
                    f"state is not kept; exiting {EXIT_PEER_LOST} (a new worker receives the state)"
                )
                membership.leaving()
                return code
        # Here only under the supervisor, outside the handler (its traceback holds the round's DDP model).
        assert membership is not None
        next_env = _next_round(env, membership, session, held, stop, why)
        if next_env is None:
            return EXIT_STOPPED if stop.requested else EXIT_PEER_LOST
        env = next_env


def _next_round(
    env: DistEnv,
    membership: Membership,
    session: GroupSession,
    held: Held | None,
    stop: StopFlag,
    why: LeftReason,
) -> DistEnv | None:
    """Leave the broken or agreed-left group, keep ``held``, and wait for the supervisor's next round:
    the environment of this worker in it, or None when there is none."""
    membership.leaving()  # before the group ends: the control thread must not abort it meanwhile
    session.leave()  # closes the round's instrumentation, frees the round's DDP model, ends the group
    session.left = None
    step = held.step if held is not None else -1
    membership.left(step, why)
    round_ = membership.next_round(lambda: stop.requested)
    if round_ is None:
        return None
    return dataclasses.replace(
        env,
        rank=round_.rank,
        world_size=round_.world_size,
        pods=round_.members,
        pod_rank=round_.group_rank,
        master_addr=round_.master_addr,
        master_port=round_.master_port,
    )
