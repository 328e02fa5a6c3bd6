"""The library API: gradient-sync metrics for any DDP script with one line.

    import ddp_trainer

    with ddp_trainer.process_group_session():          # before init_process_group
        dist.init_process_group("gloo")
        train()                                         # in it: instrument(ddp_model), step() per step

``instrument(ddp_model)`` registers the timing comm hook (wrapping the chosen built-in hook) and serves
/metrics. In detailed mode every series except ``ddp_samples_total``, ``ddp_step_duration_seconds``
and ``ddp_loss`` fills itself; call :meth:`Instrumentation.step` once per step for those (and, in light
mode, for the step counters as well, since no hook sees the steps). The built-in trainer
(``python -m ddp_trainer``) uses exactly this API.

Every ``exchange_every`` calls of ``step()`` the ranks exchange how they spent their steps (waiting in
the gradient collectives, and data, communication and compute outside them) in one small allreduce
(so every rank must call ``step()`` once per step, at the step's end), and rank 0 names the rank the
others wait for, the job's slowdown because of it and the phase it lost its time in
(``ddp_straggler_rank``, ``ddp_straggler_slowdown``, ``ddp_straggler_phase``;
``ddp_trainer.library.straggler``). With ``DDP_STALL_TIMEOUT_SECONDS`` set (the
operator sets it from ``runPolicy.stallTimeoutSeconds``) a watch thread writes every thread's stack
to stderr once no step has completed for 3/4 of it (``ddp_trainer.library.stall``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddp_trainer.library.stall import STALL_ENV, StallWatch
from ddp_trainer.library.straggler import (
    History,
    Straggler,
    Window,
    attribute,
    pack,
    parse_stall_timeout,
    unpack,
)
from ddp_trainer.library.sync import LoggerAverages, SyncRecorder, SyncSettings, attach_recorder
from ddp_trainer.library.teardown import active_session, release_group_defaults
from ddp_trainer.metrics import MetricsEndpoint, RankMetrics, create_rank_metrics, open_endpoint

# Steps between two exchanges of the ranks' step parts (one allreduce of 7 floats per rank).
DEFAULT_EXCHANGE_EVERY = 10
# Without exchanges, detailed mode times one synchronized step in this many (instrument's time_every).
DEFAULT_TIME_EVERY = 10
# Environment variables that say which pod this process runs in: torchrun's group rank, then the
# operator's env contract (docs/trainer.md). Without either every rank counts as its own pod.
POD_ENVS = ("GROUP_RANK", "NODE_RANK")


@dataclass
class Instrumentation:
    """What :func:`instrument` installed: the metrics of this rank and the endpoint that exports them."""

    recorder: SyncRecorder
    endpoint: MetricsEndpoint
    # Whether close() stops the endpoint's server: only one that instrument() opened itself.
    owns_endpoint: bool = True
    rank: int = 0
    # step() exchanges the step parts every this many steps (0: only when exchange() is called).
    exchange_every: int = DEFAULT_EXCHANGE_EVERY
    # Where the exchange's tensor lives (the model's device: NCCL reduces device memory only).
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stall: StallWatch | None = None
    # Which pod this rank runs in (ranks of one pod are late together when its node is slow).
    pod: int = 0
    steps: int = field(default=0, init=False)
    closed: bool = field(default=False, init=False)
    # time.monotonic() of the last step() (None before the first).
    last_step_at: float | None = field(default=None, init=False)
    # Rank 0's picture after the last exchange: every rank's recent steps (None: none measured),
    # pooled over the recent windows, and the rank the others wait for. Other ranks keep neither.
    rank_windows: list[Window | None] = field(default_factory=list, init=False)
    straggler: Straggler | None = field(default=None, init=False)
    history: History = field(default_factory=History, init=False)
    # An exchange on the device whose result is not read yet: (page-locked result, its CUDA event).
    in_flight: tuple[torch.Tensor, Any] | None = field(default=None, init=False)

    @property
    def metrics(self) -> RankMetrics:
        return self.recorder.metrics

    @property
    def port(self) -> int | None:
        server = self.endpoint.server
        return None if server is None else int(server.server_port)

    def step(self, samples: int, seconds: float | None = None, loss: float | None = None) -> None:
        """Account a finished optimizer step (samples of this rank; optional duration and loss)."""
        self.steps += 1
        metrics = self.recorder.metrics
        metrics.samples.inc(samples)
        if seconds is not None:
            metrics.step_duration.observe(seconds)
        self.recorder.step_done()
        if loss is not None:
            metrics.loss.set(loss)
        if self.steps % self.recorder.settings.logger_sample_every == 0:
            self.recorder.refresh_from_logger()
        self.last_step_at = time.monotonic()
        if self.exchange_every and self.steps % self.exchange_every == 0:
            self.exchange()

    def set_total_steps(self, total_steps: int | None) -> None:
        """The run's total steps (``ddp_target_steps``; None or 0: unknown), for percent done and ETA."""
        self.recorder.metrics.target_steps.set(total_steps or 0)

    def set_eval_accuracy(self, accuracy: float) -> None:
        """The held-out accuracy once training is over (``ddp_eval_accuracy``; `ddpjob run` reports it)."""
        self.recorder.metrics.eval_accuracy.set(accuracy)

    def last_progress(self) -> float | None:
        """time.monotonic() of the last completed step, by step() or by the comm hook."""
        times = [t for t in (self.last_step_at, self.recorder.last_sync_at) if t is not None]
        return max(times) if times else None

    @property
    def rank_compute_seconds(self) -> list[float]:
        """Rank 0: every rank's compute time per step in the last picture (0: none measured)."""
        return [w.per_step().compute if w is not None else 0.0 for w in self.rank_windows]

    def exchange(self, flags: Sequence[float] = ()) -> list[float]:
        """Exchange the step parts with every rank (one allreduce, MAX); returns ``flags`` combined by MAX.

        A collective: every rank calls it at the same step boundary (``step()`` does every
        ``exchange_every`` steps). ``flags`` rides along in the same tensor, so a caller that already
        combines something per step boundary (the built-in trainer's stop flag) pays no second
        collective. Rank 0 then exports every rank's picture and the straggler. The time blocked in
        this collective counts as a wait of the next step (every collective a slow rank holds up
        slows the job).
        """
        window = self.recorder.take_window()
        metrics = self.recorder.metrics
        if window is not None:
            metrics.show_window(window)
        world = self.recorder.settings.world_size
        values = pack(self.rank, world, window, self.pod, flags)
        if world > 1 and self.device.type != "cpu" and not flags:
            self._exchange_on_device(values)
            return []
        if world > 1:
            with self.recorder.collective_between_steps() as issued:
                tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
                group = self.recorder.settings.process_group
                work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
                issued()
                if work is not None:
                    work.wait()
                values = tensor.tolist() if tensor.device.type == "cpu" else tensor.cpu().tolist()
        return self._show_exchange(values)

    def _show_exchange(self, values: list[float]) -> list[float]:
        """The exchange's combined values: rank 0 updates its picture; returns the combined flags."""
        windows, pods, combined = unpack(values, self.recorder.settings.world_size)
        metrics = self.recorder.metrics
        if metrics.straggler is not None:
            self.rank_windows = self.history.add(windows)
            self.straggler = attribute(self.rank_windows, pods)
            metrics.straggler.show(self.rank_windows, self.straggler)
        return combined

    def _exchange_on_device(self, values: list[float]) -> None:
        """The exchange without stopping the host (NCCL, no flags to return): the tensor goes to the
        device and back through page-locked memory, queued behind the step, and the result is read at
        the next exchange (or flush), ``exchange_every`` steps later, when it is long done. A blocking
        read here would wait for every kernel the host has queued, which on a GPU is a step's worth.
        Every rank issues it at the same step boundary, whatever its previous one's state."""
        self._take_exchange(wait=True)
        with self.recorder.collective_between_steps() as issued:
            source = torch.tensor(values, dtype=torch.float64).pin_memory()
            tensor = source.to(self.device, non_blocking=True)
            group = self.recorder.settings.process_group
            work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
            issued()
            if work is not None:
                work.wait()  # on NCCL: the current stream waits for the collective, the host does not
            result = torch.empty(len(values), dtype=torch.float64, pin_memory=True)
            result.copy_(tensor, non_blocking=True)
            cuda: Any = torch.cuda  # its Event is untyped
            done = cuda.Event()
            done.record()
        self.in_flight = (result, done)

    def _take_exchange(self, wait: bool) -> None:
        """Show the exchange still in flight once it is done (``wait``: wait for it)."""
        if self.in_flight is None:
            return
        result, done = self.in_flight
        if not wait and not done.query():
            return
        done.synchronize()
        self.in_flight = None
        self._show_exchange(result.tolist())

    def sample_logger(self) -> LoggerAverages | None:
        """Copy DDP's logger averages into the gauges now; returns them (None before its first sample)."""
        return self.recorder.refresh_from_logger()

    def allreduce_p50_seconds(self) -> float | None:
        """Median service time of the recent bucket allreduces (None in light mode)."""
        return self.recorder.allreduce_p50_seconds()

    def flush(self) -> LoggerAverages | None:
        """Bring every series up to date: wait for timings still pending and for an exchange in
        flight, copy the logger's averages."""
        self.recorder.flush()
        self._take_exchange(wait=True)
        return self.recorder.refresh_from_logger()

    def render(self) -> str:
        """The Prometheus text exposition of this rank's series (what /metrics serves)."""
        from prometheus_client import generate_latest

        self.flush()
        if self.endpoint.registry is None:
            raise RuntimeError("in multiprocess mode the launcher's endpoint renders the metrics")
        return generate_latest(self.endpoint.registry).decode()

    def close(self) -> None:
        """Stop serving /metrics (if instrument() started the server) and let go of the DDP model.

        A :func:`ddp_trainer.process_group_session` calls it on its way out; call it yourself before
        ``destroy_process_group()`` otherwise: a group that something still holds outlives its
        destruction, and its threads can then abort the process at exit (see ``ddp_trainer.library.teardown``).
        Calling it again does nothing.
        """
        if self.closed:
            return
        self.closed = True
        if self.stall is not None:
            self.stall.stop()
        if self.owns_endpoint:
            self.endpoint.close()
        self.recorder.detach()
        release_group_defaults()


def _pod_index(rank: int) -> int:
    """This process's pod index, from the first of POD_ENVS that is set; else its rank."""
    for name in POD_ENVS:
        text = os.environ.get(name, "").strip()
        if text.isdigit():
            return int(text)
    return rank


def _default_port() -> int | None:
    text = os.environ.get("DDP_METRICS_PORT", "").strip()
    if not text or int(text) == 0:
        return None
    # Under torchrun with several local workers and no shared multiprocess directory, each worker
    # needs its own port: DDP_METRICS_PORT + LOCAL_RANK.
    return int(text) + int(os.environ.get("LOCAL_RANK", "0") or 0)


def _time_every(exchange_every: int, time_every: int | None) -> int:
    """instrument()'s sampling period, checked with the exchange period it defaults to."""
    if exchange_every < 0:
        raise ValueError(f"exchange_every must be >= 0, got {exchange_every}")
    if time_every is None:
        return exchange_every or DEFAULT_TIME_EVERY
    if time_every < 1:
        raise ValueError(f"time_every must be >= 1, got {time_every}")
    return time_every


def instrument(
    ddp_model: DistributedDataParallel,
    *,
    comm_hook: str = "allreduce",
    mode: str = "detailed",
    port: int | None = None,
    host: str | None = None,
    endpoint: MetricsEndpoint | None = None,
    logger_sample_every: int = 10,
    powersgd_rank: int = 2,
    process_group: dist.ProcessGroup | None = None,
    total_steps: int | None = None,
    exchange_every: int = DEFAULT_EXCHANGE_EVERY,
    time_every: int | None = None,
    stall_timeout: float | None = None,
) -> Instrumentation:
    """Install gradient-sync metrics on ``ddp_model`` and serve them on ``port``.

    ``port``: None reads ``DDP_METRICS_PORT`` (plus ``LOCAL_RANK``); 0 serves nothing (use
    :meth:`Instrumentation.render`). ``host``: None reads ``DDP_METRICS_HOST``, else all addresses.
    ``endpoint``: an endpoint opened earlier (:func:`ddp_trainer.metrics.open_endpoint`, e.g. to find a
    taken port before joining the group); its series go there, and ``port`` and ``host`` are unused.
    Call it once, after wrapping the model in DDP and before its first forward. Inside a
    :func:`ddp_trainer.process_group_session` the session closes it.

    ``total_steps``: the run's total steps when known (``ddp_target_steps``: percent done and ETA in
    the DDPJob's status). ``exchange_every``: steps between exchanges of the ranks' step parts (0:
    never from ``step()``; call :meth:`Instrumentation.exchange` yourself). ``time_every``: detailed mode
    times one step in this many, counts all (docs/metrics.md; None: ``exchange_every``, or 10; 1: all).
    ``stall_timeout``: seconds;
    None reads ``DDP_STALL_TIMEOUT_SECONDS``, 0 turns the stack dumps off.
    """
    time_every = _time_every(exchange_every, time_every)
    if stall_timeout is None:
        try:
            stall_timeout = parse_stall_timeout(os.environ.get(STALL_ENV))
        except ValueError as error:
            raise ValueError(f"{STALL_ENV}: {error}") from None
    rank = dist.get_rank(process_group)
    world_size = dist.get_world_size(process_group)
    backend = str(dist.get_backend(process_group))
    owns_endpoint = endpoint is None
    if endpoint is None:
        chosen_port = _default_port() if port is None else (port or None)
        bind = host if host is not None else (os.environ.get("DDP_METRICS_HOST") or "0.0.0.0")
        endpoint = open_endpoint(bind, chosen_port)
    metrics = create_rank_metrics(
        rank, backend, comm_hook, torch.__version__, endpoint.registry, per_allreduce=mode == "detailed"
    )
    settings = SyncSettings(
        world_size=world_size,
        comm_hook=comm_hook,
        logger_sample_every=logger_sample_every,
        powersgd_rank=powersgd_rank,
        time_every=time_every,
        process_group=process_group,
    )
    try:
        recorder = attach_recorder(ddp_model, metrics, settings, mode)
    except ValueError:
        if owns_endpoint:
            endpoint.close()
        raise
    device = next((p.device for p in ddp_model.parameters()), torch.device("cpu"))
    instrumentation = Instrumentation(
        recorder=recorder,
        endpoint=endpoint,
        owns_endpoint=owns_endpoint,
        rank=rank,
        exchange_every=exchange_every,
        device=device if backend == "nccl" else torch.device("cpu"),
        pod=_pod_index(rank),
    )
    instrumentation.set_total_steps(total_steps)
    if stall_timeout:
        instrumentation.stall = StallWatch(stall_timeout, rank, instrumentation.last_progress).start()
    session = active_session()
    if session is not None:
        session.on_leave(instrumentation.close)
    return instrumentation
