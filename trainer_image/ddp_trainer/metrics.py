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
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddp_trainer.library.health import NO_SLOW_RANK, HealthResult
from ddp_trainer.library.straggler import NO_STRAGGLER, PHASES, Straggler, Window, own_stalls

# Types only: a user's script that imports the library must not load the supervisor.
if TYPE_CHECKING:
    from ddp_trainer.supervisor.restarts import RestartLedger, RestartRecord

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
# The one ladder of bounds for every duration histogram of ours: 1, 2.5 and 5 per decade, here from
# 100 us to 10 s (docs/metrics.md). The step histogram takes it from 1 ms and goes on to a minute; the
# operator's reconcile histogram writes the same ladder out (the operator never imports this package),
# and tests/unit/test_histogram_buckets.py keeps them, and the page's ranges, equal.
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
STEP_BUCKETS: Final = (*ALLREDUCE_BUCKETS[ALLREDUCE_BUCKETS.index(1e-3) :], 30.0, 60.0)

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


# The parts of a step each rank exports (``ddp_step_phase_seconds{phase}``): the straggler's
# phases and the wait in the step's collectives.
STEP_PARTS: Final = (*PHASES, "wait")


def part_seconds(window: Window, part: str) -> float:
    return window.wait if part == "wait" else window.phase(part)


@dataclass(frozen=True)
class StragglerMetrics:
    """Global rank 0's view of every rank's steps and of the straggler, from the exchange (docs/metrics.md)."""

    rank_compute_seconds: Gauge  # the parents: one child per peer rank
    rank_wait_seconds: Gauge
    straggler_rank: Gauge
    straggler_slowdown: Gauge
    straggler_phase: Gauge  # the parent: one child per phase, 1 for the straggler's
    rank: str

    def show(self, windows: list[Window | None], found: Straggler | None) -> None:
        measured = [(peer, w.per_step()) for peer, w in enumerate(windows) if w is not None and w.steps > 0]
        stalls = own_stalls([mean for _, mean in measured])
        for (peer, mean), stall in zip(measured, stalls, strict=True):
            self.rank_compute_seconds.labels(rank=self.rank, peer=str(peer)).set(mean.compute)
            self.rank_wait_seconds.labels(rank=self.rank, peer=str(peer)).set(mean.wait - stall)
        self.straggler_rank.labels(rank=self.rank).set(NO_STRAGGLER if found is None else found.rank)
        self.straggler_slowdown.labels(rank=self.rank).set(math.nan if found is None else found.slowdown)
        for phase in PHASES:
            shown = found is not None and found.phase == phase
            self.straggler_phase.labels(rank=self.rank, phase=phase).set(1 if shown else 0)


@dataclass(frozen=True)
class RankMetrics:
    """The series of one global rank (every metric's ``rank`` child)."""

    sync_steps: Counter
    allreduce_bytes: Counter
    gradient_bytes: Counter
    allreduce_calls: Counter
    allreduce_service_seconds: Counter | Absent
    timed_steps: Counter | Absent
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
    eval_accuracy: Gauge
    step_phase_seconds: Mapping[str, Gauge]  # one child per part of STEP_PARTS
    cpu_wait_seconds: Gauge
    # Only global rank 0 exports the per-rank picture and the straggler.
    straggler: StragglerMetrics | None
    registry: CollectorRegistry | None

    def show_window(self, window: Window) -> None:
        """This rank's steps of the last exchange window, per step."""
        mean = window.per_step()
        self.compute_seconds.set(mean.compute)
        for part, child in self.step_phase_seconds.items():
            child.set(part_seconds(mean, part))
        self.cpu_wait_seconds.set(mean.stall)


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
    step_phases = Gauge(
        "ddp_step_phase_seconds",
        "This rank's step split into data, compute, communication (in the comm hook before its "
        "collectives ran) and wait (blocked in them), seconds per step over the last exchange window.",
        ["rank", "phase"],
        registry=registry,
        multiprocess_mode="mostrecent",
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
            "Seconds spent in bucket allreduces, not counting time queued behind an earlier bucket "
            "(estimated: each timed step's counts for the steps it samples).",
        )
        if per_allreduce
        else Absent(),
        timed_steps=counter(
            "ddp_sync_timed_steps",
            "Synchronized steps whose bucket allreduces were timed (one in --sync-time-every; detailed mode only).",
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
            "Seconds from issuing one bucket allreduce to its completion, in the timed steps (detailed mode only).",
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
            "This rank's compute time per step outside the gradient collectives (forward, backward, "
            "optimizer), mean over the last straggler-exchange window.",
        ),
        step_phase_seconds={part: step_phases.labels(rank=str(rank), phase=part) for part in STEP_PARTS},
        cpu_wait_seconds=gauge(
            "ddp_collective_cpu_wait_seconds",
            "Seconds per step this rank's gloo threads waited for a CPU (Linux run-queue time, CPU-limit "
            "throttling included), over the last exchange window; 0 on NCCL.",
        ),
        eval_accuracy=gauge(
            "ddp_eval_accuracy",
            "Held-out accuracy of the trained model, once training is over (NaN before; the built-in "
            "trainer: rank 0 only).",
        ),
        straggler=_straggler_metrics(rank, registry) if rank == 0 else None,
        registry=registry,
    )
    # No loss is known before the first logged step; 0 would read as a perfect one. Nor an accuracy.
    metrics.loss.set(math.nan)
    metrics.eval_accuracy.set(math.nan)
    return metrics


def _straggler_metrics(rank: int, registry: CollectorRegistry | None) -> StragglerMetrics:
    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["rank"], registry=registry, multiprocess_mode="mostrecent")

    def per_peer(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["rank", "peer"], registry=registry, multiprocess_mode="mostrecent")

    metrics = StragglerMetrics(
        rank_compute_seconds=per_peer(
            "ddp_rank_compute_seconds",
            "Every rank's ddp_compute_seconds as the ranks exchanged it (label peer: that rank), on rank 0 only.",
        ),
        rank_wait_seconds=per_peer(
            "ddp_rank_wait_seconds",
            "How long every rank waited per step for the others in the gradient collectives (label peer: "
            "that rank), on rank 0 only; the rank that waits least is the one the others wait for.",
        ),
        straggler_rank=gauge(
            "ddp_straggler_rank",
            "The rank the others wait for in the gradient collectives (-1: not known yet).",
        ),
        straggler_slowdown=gauge(
            "ddp_straggler_slowdown",
            "The job's step time over its estimated step time without the straggler (1: it holds nobody up).",
        ),
        straggler_phase=Gauge(
            "ddp_straggler_phase",
            "1 for the phase the straggler lost its time in (data, compute, communication), 0 for the others.",
            ["rank", "phase"],
            registry=registry,
            multiprocess_mode="mostrecent",
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


def serve_multiprocess(directory: str, host: str, port: int, extra: Collector | None = None) -> WSGIServer:
    """Serve the combined series of every worker that writes to ``directory`` (and ``extra``'s: the
    launcher's own)."""
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    if extra is not None:
        registry.register(extra)
    return serve_registry(registry, host, port)


def kept_step_seconds_gauge(rank: int, registry: CollectorRegistry | None) -> Gauge:
    """``ddp_kept_step_seconds`` (rank 0 only; see ddp_trainer.supervisor.resume)."""
    return Gauge(
        "ddp_kept_step_seconds",
        "Seconds spent in the training steps that the current training state includes (restored from "
        "the checkpoint on resume); over the job's wall time it is the goodput.",
        ["rank"],
        registry=registry,
        multiprocess_mode="mostrecent",
    ).labels(rank=str(rank))


def resumed_timestamp_gauge(rank: int, registry: CollectorRegistry | None) -> Gauge:
    """``ddp_resumed_timestamp_seconds`` (rank 0 only): when its first step after loading a checkpoint
    ended, whatever brought the process back (an in-place restart or new pods); absent on a fresh start."""
    return Gauge(
        "ddp_resumed_timestamp_seconds",
        "Unix time at which rank 0's first training step after resuming from a checkpoint ended.",
        ["rank"],
        registry=registry,
        multiprocess_mode="mostrecent",
    ).labels(rank=str(rank))


@dataclass(frozen=True)
class HealthMetrics:
    """One rank's series of the gang health check (docs/metrics.md, "Health check"): the group's
    verdict, the same on every rank, and this rank's own link and wall time."""

    busbw: Gauge
    allreduce_seconds: Gauge
    link_bandwidth: Gauge  # the parent: one child, this rank's link to the next rank
    slow_rank: Gauge
    slow_link: Gauge
    seconds: Gauge
    timestamp: Gauge
    rank: int

    def show(self, result: HealthResult, seconds: float, timestamp: float) -> None:
        self.busbw.set(result.busbw)
        self.allreduce_seconds.set(result.allreduce_seconds)
        peer = str(result.link_peer(self.rank))
        self.link_bandwidth.labels(rank=str(self.rank), peer=peer).set(result.links[self.rank])
        self.slow_rank.set(result.slow_rank)
        self.slow_link.set(NO_SLOW_RANK if result.slow_link is None else result.slow_link)
        self.seconds.set(seconds)
        self.timestamp.set(timestamp)


def create_health_metrics(rank: int, registry: CollectorRegistry | None) -> HealthMetrics:
    """The health check's series, created when a check has run (absent while the check is off)."""
    label = {"rank": str(rank)}

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, ["rank"], registry=registry, multiprocess_mode="mostrecent").labels(**label)

    return HealthMetrics(
        busbw=gauge(
            "ddp_health_busbw_bytes_per_second",
            "The health check's all-reduce bus bandwidth: bytes x 2(n-1)/n over the median iteration's "
            "time (NCCL tests' convention); the same on every rank.",
        ),
        allreduce_seconds=gauge(
            "ddp_health_allreduce_seconds",
            "The health check's median all-reduce time of DDP_HEALTH_CHECK_BYTES (the slowest rank's).",
        ),
        link_bandwidth=Gauge(
            "ddp_health_link_bandwidth_bytes_per_second",
            "Bytes per second of this rank's link to rank peer (the next rank), from a timed ping-pong.",
            ["rank", "peer"],
            registry=registry,
            multiprocess_mode="mostrecent",
        ),
        slow_rank=gauge(
            "ddp_health_slow_rank",
            "The rank whose links are all far below the group's median in the last health check "
            "(-1: none); the same on every rank.",
        ),
        slow_link=gauge(
            "ddp_health_slow_link",
            "The slowest link when far below the median of links: its first rank r (link r <-> r+1), "
            "-1: none; the same on every rank.",
        ),
        seconds=gauge(
            "ddp_health_check_seconds", "Wall-clock seconds this rank spent in the last health check."
        ),
        timestamp=gauge(
            "ddp_health_check_timestamp_seconds", "Unix time at which this rank's last health check ended."
        ),
        rank=rank,
    )


def _optional(value: int | None) -> float | None:
    return None if value is None else float(value)


# The launcher's series that are also exported under a deprecated name, with the same value
# (docs/metrics.md, "Deprecated names"): dashboards and operators that know only that one keep working.
DEPRECATED_ALIASES: Final[Mapping[str, str]] = {
    "ddp_group_members": "ddp_group_nodes",
    "ddp_last_restart_members_before": "ddp_last_restart_nodes_before",
    "ddp_last_restart_members_after": "ddp_last_restart_nodes_after",
}


def _gauges(name: str, meaning: str, labels: Mapping[str, str], value: float) -> Iterator[Metric]:
    """The gauge ``name`` and, when it has one, its deprecated alias with the same value."""
    shown = [(name, meaning)]
    if name in DEPRECATED_ALIASES:
        shown.append((DEPRECATED_ALIASES[name], f"Deprecated, the same as {name}: {meaning}"))
    for series, text in shown:
        family = GaugeMetricFamily(series, text, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        yield family


class RestartCollector(Collector):
    """The in-place launcher's series (docs/metrics.md, "In-place restarts").

    ``ddp_group_restarts_total``, ``ddp_group_grows_total``, ``ddp_group_resizes_total`` and
    ``ddp_group_members`` on every pod; the
    ``ddp_last_restart_*`` series on rank 0's pod only, absent until a restart. ``rank`` is the pod's
    first global rank in the largest group (NODE_RANK x NPROC_PER_NODE). ``resume`` returns rank 0's
    worker's note of the last resume: its time and the step it resumed from.

    A scrape renders one :class:`~ddp_trainer.supervisor.restarts.LedgerState`, taken from the ledger once: the
    supervisor's thread may replace it meanwhile, and the counts and the record of two rounds must not mix.
    """

    def __init__(
        self,
        ledger: RestartLedger,
        rank: int,
        resume: Callable[[RestartRecord], RestartRecord] | None = None,
    ) -> None:
        self.ledger = ledger
        self.rank = str(rank)
        self.resume = resume

    def describe(self) -> list[Metric]:
        return []  # an unchecked collector: its series come and go with the restarts

    def collect(self) -> Iterator[Metric]:
        state = self.ledger.state  # the one read of the ledger in this scrape
        labels = {"rank": self.rank}
        counters = [
            (
                "ddp_group_restarts",
                "In-place restarts of the worker group since this attempt's first rendezvous round "
                "(the same on every pod).",
                state.restarts,
            ),
            (
                "ddp_group_grows_total",
                "Of the in-place restarts, the grows: a pod joined a healthy group and the next round was "
                "larger (an elastic job; not counted against the restart budget; the same on every pod).",
                state.grows,
            ),
            (
                "ddp_group_resizes_total",
                "Of the in-place restarts, the resizes: the round formed with another number of pods than "
                "the one before (an elastic job's shrinks and grows; the same on every pod).",
                state.resizes,
            ),
        ]
        for name, meaning, count in counters:
            family = CounterMetricFamily(name, meaning, labels=list(labels))
            family.add_metric(list(labels.values()), float(count))
            yield family
        yield from _gauges(
            "ddp_group_members",
            "Members of the current rendezvous round: pods in it (0 before the first one is complete).",
            labels,
            float(state.members),
        )
        record = state.record
        if record is None:
            return
        if self.resume is not None:
            record = self.resume(record)
        gauges = [
            (
                "failure_timestamp_seconds",
                record.failure,
                "when the failed worker ended, as its supervisor saw it",
            ),
            ("stopped_timestamp_seconds", record.stopped, "when every surviving pod's workers were stopped"),
            ("reformed_timestamp_seconds", record.reformed, "when the new rendezvous round was complete"),
            (
                "resumed_timestamp_seconds",
                record.resumed,
                "when rank 0 finished its first step after the resume",
            ),
            (
                "steps_redone",
                _optional(record.steps_redone),
                "steps done before the failure that the checkpoint resumed from did not keep",
            ),
            ("members_before", _optional(record.members_before), "members of the round it left"),
            ("members_after", _optional(record.members_after), "members of the round it formed"),
        ]
        for suffix, value, meaning in gauges:
            if value is not None:
                yield from _gauges(
                    f"ddp_last_restart_{suffix}", f"The last in-place restart: {meaning}.", labels, value
                )
        info = GaugeMetricFamily(
            "ddp_last_restart_info",
            "The last in-place restart (always 1): its cause, the global rank that failed and its exit code "
            "(both empty when no worker failed).",
            labels=["rank", "cause", "failed_rank", "exit_code"],
        )
        info.add_metric(
            [
                self.rank,
                record.cause,
                "" if record.failed_rank is None else str(record.failed_rank),
                "" if record.exit_code is None else str(record.exit_code),
            ],
            1.0,
        )
        yield info
