"""The library API: gradient-sync metrics for any DDP script with one line.

    import ddp_trainer
    metrics = ddp_trainer.instrument(ddp_model)   # before the first forward

registers the timing comm hook (wrapping the chosen built-in hook) and serves /metrics. In detailed
mode every series except ``ddp_samples_total``, ``ddp_step_duration_seconds`` and ``ddp_loss`` fills
itself; call :meth:`Instrumentation.step` once per step for those (and, in light mode, for the step
counters as well, since no hook sees the steps).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, generate_latest
from torch.nn.parallel import DistributedDataParallel

from ddp_trainer.metrics import RankMetrics, create_rank_metrics, multiprocess_dir, serve_registry
from ddp_trainer.sync import SyncRecorder
from ddp_trainer.teardown import release_group_defaults


@dataclass
class Instrumentation:
    """What :func:`instrument` installed: the metrics of this rank and the server that exports them."""

    recorder: SyncRecorder
    registry: CollectorRegistry | None
    server: Any = None
    port: int | None = None
    _steps: int = field(default=0, init=False)

    @property
    def metrics(self) -> RankMetrics:
        return self.recorder.metrics

    def step(self, samples: int, seconds: float | None = None, loss: float | None = None) -> None:
        """Account a finished optimizer step (samples of this rank; optional duration and loss)."""
        self._steps += 1
        self.recorder.metrics.samples.inc(samples)
        if seconds is not None:
            self.recorder.metrics.step_duration.observe(seconds)
        if self.recorder.mode == "light":
            self.recorder.account_light_step()
        if loss is not None:
            self.recorder.metrics.loss.set(loss)
        if self._steps % self.recorder.logger_sample_every == 0:
            self.recorder.refresh_from_logger()

    def render(self) -> str:
        """The Prometheus text exposition of this rank's series (what /metrics serves)."""
        self.recorder.resolve_ready_events(wait=True)
        self.recorder.refresh_from_logger()
        if self.registry is None:
            raise RuntimeError("in multiprocess mode the launcher's endpoint renders the metrics")
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        """Stop serving /metrics and let go of the DDP model and the process group.

        Call it before ``destroy_process_group()`` (or :func:`ddp_trainer.leave_process_group`): a
        group that something still holds outlives its destruction, and its threads can then abort the
        process at exit (see ``ddp_trainer.teardown``).
        """
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
        self.recorder.detach()
        release_group_defaults()


def _default_port() -> int | None:
    text = os.environ.get("DDP_METRICS_PORT", "").strip()
    if not text or int(text) == 0:
        return None
    # Under torchrun with several local workers and no shared multiprocess directory, each worker
    # needs its own port: DDP_METRICS_PORT + LOCAL_RANK.
    return int(text) + int(os.environ.get("LOCAL_RANK", "0") or 0)


def instrument(
    ddp_model: DistributedDataParallel,
    *,
    comm_hook: str = "allreduce",
    mode: str = "detailed",
    port: int | None = None,
    host: str | None = None,
    logger_sample_every: int = 10,
    powersgd_rank: int = 2,
    process_group: Any = None,
) -> Instrumentation:
    """Install gradient-sync metrics on ``ddp_model`` and serve them on ``port``.

    ``port``: None reads ``DDP_METRICS_PORT`` (plus ``LOCAL_RANK``); 0 serves nothing (use
    :meth:`Instrumentation.render`). ``host``: None reads ``DDP_METRICS_HOST``, else all addresses.
    Call it once, after wrapping the model in DDP and before its first forward.
    """
    rank = dist.get_rank(process_group) if process_group is not None else dist.get_rank()
    world_size = dist.get_world_size(process_group) if process_group is not None else dist.get_world_size()
    backend = str(dist.get_backend(process_group))
    registry = None if multiprocess_dir() else CollectorRegistry(auto_describe=True)
    metrics = create_rank_metrics(
        rank, backend, comm_hook, torch.__version__, registry, per_allreduce=mode == "detailed"
    )
    recorder = SyncRecorder(
        metrics,
        world_size=world_size,
        comm_hook=comm_hook,
        mode=mode,
        logger_sample_every=logger_sample_every,
        powersgd_rank=powersgd_rank,
        process_group=process_group,
    )
    recorder.install(ddp_model)
    chosen_port = _default_port() if port is None else (port or None)
    server = None
    if chosen_port is not None and registry is not None:
        bind = host if host is not None else (os.environ.get("DDP_METRICS_HOST") or "0.0.0.0")
        server = serve_registry(registry, bind, chosen_port)
    return Instrumentation(recorder=recorder, registry=registry, server=server, port=chosen_port)
