"""The gradient-sync metrics of docs/metrics.md: definitions and the /metrics endpoint.

Single-process pods keep their series in a private registry served by this process. With
NPROC_PER_NODE > 1 the launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the workers: each
worker's prometheus-client then writes its series to memory-mapped files there, and the launcher serves
one endpoint that combines them (every series carries the worker's global ``rank`` label, so nothing
is summed across workers).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Final

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
# From 100 us to 10 s, as DESIGN.md fixes for the allreduce histogram.
ALLREDUCE_BUCKETS: Final = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
STEP_BUCKETS: Final = (1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# `_created` samples double every counter and histogram and mean nothing for a pod's lifetime.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


@dataclass(frozen=True)
class RankMetrics:
    """The series of one global rank (every metric's ``rank`` child)."""

    sync_steps: Any
    allreduce_bytes: Any
    gradient_bytes: Any
    allreduce_calls: Any
    allreduce_service_seconds: Any
    samples: Any
    step_duration: Any
    allreduce_duration: Any
    buckets: Any
    bucket_cap_bytes: Any
    world_size: Any
    backward_compute_seconds: Any
    backward_comm_seconds: Any
    backward_overlap_seconds: Any
    comm_overlap_ratio: Any
    last_sync_timestamp: Any
    loss: Any
    registry: CollectorRegistry | None


class Absent:
    """Stands in for the series light mode does not export (it has no hook to time allreduces)."""

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


def create_rank_metrics(
    rank: int,
    backend: str,
    comm_hook: str,
    torch_version: str,
    registry: CollectorRegistry | None,
    per_allreduce: bool = True,
) -> RankMetrics:
    """Create every metric in ``registry`` (None in multiprocess mode: the files are the registry).

    ``per_allreduce`` False (light mode) leaves out the allreduce histogram and service time.
    """
    label = {"rank": str(rank)}

    def counter(name: str, doc: str) -> Any:
        return Counter(name, doc, ["rank"], registry=registry).labels(**label)

    def gauge(name: str, doc: str) -> Any:
        return Gauge(name, doc, ["rank"], registry=registry, multiprocess_mode="mostrecent").labels(**label)

    build_info = Gauge(
        "ddp_build_info",
        "Always 1; the labels say which backend, comm hook and torch version this rank runs.",
        ["rank", "backend", "comm_hook", "torch_version"],
        registry=registry,
        multiprocess_mode="mostrecent",
    )
    build_info.labels(rank=str(rank), backend=backend, comm_hook=comm_hook, torch_version=torch_version).set(
        1
    )
    metrics = RankMetrics(
        sync_steps=counter("ddp_sync_steps", "Training steps whose gradients were synchronized."),
        allreduce_bytes=counter(
            "ddp_allreduce_bytes", "Payload bytes of the gradient buckets reduced, after compression."
        ),
        gradient_bytes=counter("ddp_gradient_bytes", "Bytes of the gradient buckets, before compression."),
        allreduce_calls=counter("ddp_allreduce_calls", "Bucket allreduces issued by DDP."),
        allreduce_service_seconds=counter(
            "ddp_allreduce_service_seconds",
            "Seconds spent in bucket allreduces, not counting time queued behind an earlier bucket.",
        )
        if per_allreduce
        else Absent(),
        samples=counter("ddp_samples", "Training samples processed by this rank."),
        step_duration=Histogram(
            "ddp_step_duration_seconds",
            "Wall-clock seconds of one training step (forward, backward with sync, optimizer).",
            ["rank"],
            registry=registry,
            buckets=STEP_BUCKETS,
        ).labels(**label),
        allreduce_duration=Histogram(
            "ddp_allreduce_duration_seconds",
            "Seconds from issuing one bucket allreduce to its completion (detailed mode only).",
            ["rank"],
            registry=registry,
            buckets=ALLREDUCE_BUCKETS,
        ).labels(**label)
        if per_allreduce
        else Absent(),
        buckets=gauge("ddp_buckets", "Gradient buckets DDP reduces per step (after its bucket rebuild)."),
        bucket_cap_bytes=gauge("ddp_bucket_cap_bytes", "DDP's bucket size cap in bytes."),
        world_size=gauge("ddp_world_size", "Processes in the DDP process group."),
        backward_compute_seconds=gauge(
            "ddp_backward_compute_seconds", "Backward compute time per step, DDP logger average."
        ),
        backward_comm_seconds=gauge(
            "ddp_backward_comm_seconds", "Backward gradient communication time per step, DDP logger average."
        ),
        backward_overlap_seconds=gauge(
            "ddp_backward_overlap_seconds",
            "Time per step where backward compute and communication overlapped, DDP logger average.",
        ),
        comm_overlap_ratio=gauge(
            "ddp_comm_overlap_ratio",
            "Fraction of the communication time hidden behind backward compute (0..1).",
        ),
        last_sync_timestamp=gauge(
            "ddp_last_sync_timestamp_seconds", "Unix time at which the last gradient synchronization ended."
        ),
        loss=gauge("ddp_loss", "Training loss of this rank's last logged step (NaN before the first)."),
        registry=registry,
    )
    # No loss is known before the first logged step; 0 would read as a perfect one.
    metrics.loss.set(math.nan)
    return metrics


def serve_registry(registry: CollectorRegistry, host: str, port: int) -> Any:
    """Serve ``registry`` on http://host:port/metrics from a daemon thread; returns the server."""
    server, _thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return server


def serve_multiprocess(directory: str, host: str, port: int) -> Any:
    """Serve the combined series of every worker that writes to ``directory``."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return serve_registry(registry, host, port)
