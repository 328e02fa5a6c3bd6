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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from wsgiref.simple_server import WSGIServer

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


# Bytes per element that a compressing comm hook sends, whatever the gradients' own dtype: fp16 and
# bf16 both cast the bucket to a 2-byte type (a bucket already in that type is sent as it is).
COMPRESSED_ELEMENT_BYTES: Final[Mapping[str, int]] = {"fp16": 2, "bf16": 2}


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def payload_bytes(comm_hook: str, gradient_bytes: int, elements: int) -> int:
    """Payload of reducing ``elements`` gradient elements that take ``gradient_bytes`` uncompressed.

    Counted from the element count, not as a fraction of the gradient bytes: fp16 compression of fp64
    gradients sends a quarter of them, of fp16 gradients all of them. PowerSGD is counted by its hook.
    """
    element_bytes = COMPRESSED_ELEMENT_BYTES.get(comm_hook)
    return gradient_bytes if element_bytes is None else elements * element_bytes


class Absent:
    """Stands in for the series light mode does not export (it has no hook to time allreduces)."""

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


@dataclass(frozen=True)
class StragglerMetrics:
    """Global rank 0's view of every rank's compute time, from the exchange (docs/metrics.md)."""

    rank_compute_seconds: Gauge  # the parent: one child per peer rank
    straggler_rank: Gauge
    straggler_slowdown: Gauge
    rank: str

    def show(self, compute_seconds: list[float], slowest: tuple[int, float] | None) -> None:
        for peer, seconds in enumerate(compute_seconds):
            if seconds > 0:
                self.rank_compute_seconds.labels(rank=self.rank, peer=str(peer)).set(seconds)
        if slowest is None:
            self.straggler_rank.set(-1)
            self.straggler_slowdown.set(math.nan)
        else:
            self.straggler_rank.set(slowest[0])
            self.straggler_slowdown.set(slowest[1])


@dataclass(frozen=True)
class RankMetrics:
    """The series of one global rank (every metric's ``rank`` child)."""

    sync_steps: Counter
    allreduce_bytes: Counter
    gradient_bytes: Counter
    allreduce_calls: Counter
    allreduce_service_seconds: Counter | Absent
    samples: Counter
    step_duration: Histogram
    allreduce_duration: Histogram | Absent
    buckets: Gauge
    bucket_cap_bytes: Gauge
    world_size: Gauge
    backward_compute_seconds: Gauge
    backward_comm_seconds: Gauge
    backward_overlap_seconds: Gauge
    comm_overlap_ratio: Gauge
    last_sync_timestamp: Gauge
    loss: Gauge
    target_steps: Gauge
    compute_seconds: Gauge
    # Only global rank 0 exports the per-rank picture and the straggler.
    straggler: StragglerMetrics | None
    registry: CollectorRegistry | None


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

    def counter(name: str, doc: str) -> Counter:
        return Counter(name, doc, ["rank"], registry=registry).labels(**label)

    def gauge(name: str, doc: str) -> Gauge:
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
        target_steps=gauge("ddp_target_steps", "Total optimizer steps of the run when known (0: unknown)."),
        compute_seconds=gauge(
            "ddp_compute_seconds",
            "This rank's compute time per step (forward + backward up to its first gradient bucket "
            "being ready), mean over the last straggler-exchange window.",
        ),
        straggler=_straggler_metrics(rank, registry) if rank == 0 else None,
        registry=registry,
    )
    # No loss is known before the first logged step; 0 would read as a perfect one.
    metrics.loss.set(math.nan)
    return metrics


def _straggler_metrics(rank: int, registry: CollectorRegistry | None) -> StragglerMetrics:
    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["rank"], registry=registry, multiprocess_mode="mostrecent").labels(
            rank=str(rank)
        )

    metrics = StragglerMetrics(
        rank_compute_seconds=Gauge(
            "ddp_rank_compute_seconds",
            "Every rank's compute time per step as exchanged (label peer: that rank), on rank 0 only.",
            ["rank", "peer"],
            registry=registry,
            multiprocess_mode="mostrecent",
        ),
        straggler_rank=gauge(
            "ddp_straggler_rank", "The rank with the longest compute time per step (-1: not known yet)."
        ),
        straggler_slowdown=gauge(
            "ddp_straggler_slowdown", "The slowest rank's compute time per step over the median rank's."
        ),
        rank=str(rank),
    )
    metrics.show([], None)
    return metrics


def serve_registry(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve ``registry`` on http://host:port/metrics from a daemon thread; returns the server."""
    server, _thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return server


def stop_server(server: WSGIServer | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


@dataclass
class MetricsEndpoint:
    """Where a process's series live and who serves them.

    ``registry`` is None in multiprocess mode (the launcher's endpoint reads the workers' files);
    ``server`` is None when nothing is served (no port, or multiprocess mode).
    """

    registry: CollectorRegistry | None
    server: WSGIServer | None = None

    def close(self) -> None:
        stop_server(self.server)
        self.server = None


def open_endpoint(host: str, port: int | None) -> MetricsEndpoint:
    """A fresh registry, served on ``host:port`` when a port is given (OSError when it is taken)."""
    if multiprocess_dir():
        return MetricsEndpoint(registry=None)
    registry = CollectorRegistry(auto_describe=True)
    server = serve_registry(registry, host, port) if port else None
    return MetricsEndpoint(registry=registry, server=server)


def serve_multiprocess(directory: str, host: str, port: int) -> WSGIServer:
    """Serve the combined series of every worker that writes to ``directory``."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return serve_registry(registry, host, port)
