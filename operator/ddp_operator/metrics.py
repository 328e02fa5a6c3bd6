"""The operator's own Prometheus metrics (docs/operator.md lists them).

Every series lives in a registry owned by one `OperatorMetrics`, not in prometheus-client's global one, so
two operators in one process (tests) never share counters. `ddpjob_jobs` is computed at scrape time from
the controller's job cache instead of being incremented and decremented, so it cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ddp_operator import names

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

PHASES: tuple[str, ...] = names.PHASES

# Reconciles are in-memory decisions plus a few API calls; a 1024-rank create takes seconds.
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
# Scheduling and pulling images dominate: seconds to an hour.
TIME_TO_RUNNING_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)


class OperatorMetrics:
    """The operator's series; `phase_counts` is called at scrape time and returns {phase: jobs}."""

    def __init__(self, phase_counts: Callable[[], Mapping[str, int]]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

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
        self.time_to_running = Histogram(
            "ddpjob_time_to_running_seconds",
            "Seconds from a DDPJob's creation to its first Running phase (every rank Running).",
            buckets=TIME_TO_RUNNING_BUCKETS,
            registry=self.registry,
        )

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
