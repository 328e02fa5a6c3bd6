"""The operator's own Prometheus metrics (docs/operator.md lists them).

Every series lives in a registry owned by one `OperatorMetrics`, not in prometheus-client's global one, so
two operators in one process (tests) never share counters. `ddpjob_jobs` is computed at scrape time from
the controller's job cache instead of being incremented and decremented, so it cannot drift.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ddp_operator import names

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ddp_operator.decision import Report

PHASES: tuple[str, ...] = names.PHASES

# Reconciles are in-memory decisions plus a few API calls; a 1024-rank create takes seconds. The
# trainer's step ladder (ddp_trainer.metrics.STEP_BUCKETS) up to 30 s, written out because the operator
# never imports the trainer package (it runs without the trainer's dependencies); a unit test
# (tests/unit/test_histogram_buckets.py) keeps the two equal.
RECONCILE_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)
# A restart in place takes seconds; a whole gang's, with new pods on a large cluster, minutes.
RESTART_BUCKETS: tuple[float, ...] = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300, 600)
# Scheduling and pulling images dominate: seconds to an hour.
TIME_TO_RUNNING_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class OperatorMetrics:
    """The operator's series; `phase_counts` is called at scrape time and returns {phase: jobs}."""

    def __init__(self, phase_counts: Callable[[], Mapping[str, int]]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=True)
        self._phase_counts = phase_counts
        self.registry.register(_JobsCollector(phase_counts))
        self.reconcile_duration = Histogram(
            "ddpjob_reconcile_duration_seconds",
            "Seconds one reconcile of a DDPJob took: decision plus the API calls it made.",
            buckets=RECONCILE_BUCKETS,
            registry=self.registry,
        )
        self.pods_created = Counter(
            "ddpjob_pods_created",
            "Rank pods the operator created (201 answers; a 409 for a pod that is already ours is not counted).",
            registry=self.registry,
        )
        self.gang_restarts = Counter(
            "ddpjob_gang_restarts",
            "Gang restarts: an attempt whose pods were all deleted so that the next attempt could start.",
            registry=self.registry,
        )
        self.restart_duration = Histogram(
            "ddpjob_restart_duration_seconds",
            "Seconds from a rank's failure to the first training step after the resume, by recovery mode "
            "(InPlace, PodReplaced, WholeGang; docs/restarts.md).",
            ["mode"],
            buckets=RESTART_BUCKETS,
            registry=self.registry,
        )
        self.goodput = Gauge(
            "ddpjob_goodput_ratio",
            "Share of a DDPJob's wall time spent in training steps it kept (status.goodput).",
            ["namespace", "job"],
            registry=self.registry,
        )
        self.time_to_running = Histogram(
            "ddpjob_time_to_running_seconds",
            "Seconds from a DDPJob's creation to its first Running phase (every rank Running).",
            buckets=TIME_TO_RUNNING_BUCKETS,
            registry=self.registry,
        )
        self.leader = Gauge(
            "ddpjob_operator_leader",
            "1 while this operator process holds the leader Lease (always, without leader election), "
            "0 while it waits for it.",
            registry=self.registry,
        )
        self.follow_leadership(None)

    def follow_leadership(self, leadership: threading.Event | None) -> None:
        """`ddpjob_operator_leader` reads the elector's event at scrape time (None: no election, so
        this process acts), so it cannot disagree with leader.py, which alone sets and clears it."""
        self.leader.set_function(lambda: 1.0 if leadership is None or leadership.is_set() else 0.0)

    def observe_restarts(self, key: tuple[str, str], report: Report) -> None:
        """What a written status says of restarts: a gang torn down, a restart's cost, the goodput."""
        if report.gang_restart:
            self.gang_restarts.inc()
        if report.restart_measured is not None:
            mode, seconds = report.restart_measured
            self.restart_duration.labels(mode).observe(seconds)
        goodput = report.status.get("goodput")
        if goodput is not None:
            with contextlib.suppress(ValueError):
                self.goodput.labels(*key).set(float(goodput))

    def forget(self, key: tuple[str, str]) -> None:
        """A job that is gone leaves no series behind."""
        with contextlib.suppress(KeyError):
            self.goodput.remove(*key)

    def serve(self, port: int, address: str) -> None:
        """Serve /metrics on a background thread (prometheus-client's own server)."""
        from prometheus_client import start_http_server

        start_http_server(port, addr=address, registry=self.registry)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        body: bytes = generate_latest(self.registry)
        return body


class _JobsCollector:
    """`ddpjob_jobs{phase}`: one sample per phase, zeros included, so dashboards see every phase."""

    def __init__(self, phase_counts: Callable[[], Mapping[str, int]]) -> None:
        self._phase_counts = phase_counts

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        counts = dict(self._phase_counts())
        family = GaugeMetricFamily(
            "ddpjob_jobs", "DDPJobs the operator knows, by status phase.", labels=["phase"]
        )
        for phase in PHASES:
            family.add_metric([phase], float(counts.pop(phase, 0)))
        for phase, count in sorted(counts.items()):  # a job not yet reconciled has phase ""
            family.add_metric([phase or "Unknown"], float(count))
        yield family
