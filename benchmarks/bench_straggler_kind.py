"""Stragglers acted on, on kind (a real kubelet, our images): how fast a slow pod is found and replaced,
and how much of a clean run's throughput comes back.

The job is the digits example on 3 ranks (``--throttle-ms 20``, a checkpoint volume), with
``stragglerPolicy: {action: Replace, slowdownPercent: 300, sustainedSeconds: 60}`` and the gang health
check on (``DDP_HEALTH_CHECK=on``). Each run is a pair on the same manifest:

- *clean*: nothing done to it; its step rate (rank 0's ``ddp_sync_steps_total``, read every second
  through the apiserver's pod proxy, in 10 s windows) is the baseline;
- *slowed*: once rank 0's straggler exchange runs, rank 1's container gets ``--cpu-percent`` of a CPU
  (its CFS quota cut from the node, ``ddp_harness.kind_faults.throttle_cpu``); once the operator names
  rank 1 (``status.straggler``), rank 2's interface is rate-limited to ``--link-rate`` (a ``tbf`` qdisc in
  its network namespace, ``kind_faults.limit_link``), which no step's timing pins on one rank: the health
  check that rank 1's replacement brings when it joins names it.

Per slowed run: *named* (the CPU cut to ``status.straggler`` naming rank 1), *CPU replaced* (to
``stragglerReplacements`` 1), *link replaced* (the link limited to ``stragglerReplacements`` 2), the
health check that caught the link (its seconds, the slow link's bandwidth against the median link's),
*slowed rate* (the median window between the cut and the first replacement, over the clean median),
*recovered* (the cut to the first window back at 90% of the clean median after the last replacement)
and *rate at the end* (the median of the windows after that, over the clean median); and the wall time
of the whole job against the clean one's. No window is a wall-clock assertion: these are figures.

Needs a kind cluster with both images loaded and the chart installed (docs/benchmarks.md):

    python benchmarks/bench_straggler_kind.py --context kind-ddp-bench --cluster ddp-bench --runs 3
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench_recovery_kind import NAMESPACE, Kube, kind_cluster, kind_parser, manifest, rank0_metrics, wait_for
from ddp_harness import kind_faults

WINDOW_S = 10.0
RECOVERED_SHARE = 0.9


def _job_manifest(name: str, epochs: int, image: str) -> dict[str, Any]:
    job = manifest(name, "in-place", 4, image)
    job["spec"]["replicas"] = 3
    job["spec"]["runPolicy"]["stragglerPolicy"] = {
        "action": "Replace",
        "slowdownPercent": 300,
        "sustainedSeconds": 60,
    }
    trainer = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    trainer["command"] = [
        "python", "-m", "ddp_trainer", "--workload", "digits", "--epochs", str(epochs),
        "--throttle-ms", "20", "--checkpoint-every", "50",
    ]  # fmt: skip
    trainer["resources"]["requests"]["cpu"] = "300m"
    trainer.setdefault("env", []).append({"name": "DDP_HEALTH_CHECK", "value": "on"})
    return job


def _status(kube: Kube, job: str) -> dict[str, Any]:
    status: dict[str, Any] = kube.json("get", "ddpjob", job, "-n", NAMESPACE).get("status") or {}
    return status


@dataclass
class Steps:
    """Rank 0's synchronized steps on this machine's clock, summed across its workers' restarts (each new
    worker's counter starts at 0; no step is redone, so the sum is the job's steps)."""

    kube: Kube
    job: str
    samples: list[tuple[float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _base: float = 0.0
    _last: float = 0.0

    def start(self) -> Steps:
        threading.Thread(target=self._poll, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _poll(self) -> None:
        while not self._stop.is_set():
            value = rank0_metrics(self.kube, self.job).get("ddp_sync_steps_total")
            if value is not None:
                if value < self._last:
                    self._base += self._last
                self._last = value
                self.samples.append((time.time(), self._base + value))
            self._stop.wait(1.0)

    def rates(self, start: float, end: float) -> list[tuple[float, float]]:
        """(window end, steps per second) over consecutive windows of at least WINDOW_S in [start, end]."""
        points = [(t, s) for t, s in self.samples if start <= t <= end]
        out: list[tuple[float, float]] = []
        if not points:
            return out
        t0, s0 = points[0]
        for t, s in points[1:]:
            if t - t0 >= WINDOW_S:
                out.append((t, (s - s0) / (t - t0)))
                t0, s0 = t, s
        return out


@dataclass
class Slowed:
    wall_s: float
    named_s: float
    cpu_replaced_s: float
    link_replaced_s: float
    slowed_rate: float | None
    recovered_s: float | None
    end_rate: float | None
    check_s: float | None
    busbw_share: float | None
    phase: str


def _replaced(kube: Kube, job: str, count: int) -> dict[str, Any] | None:
    status = _status(kube, job)
    if status.get("phase") in ("Succeeded", "Failed"):
        raise RuntimeError(f"{job} ended before {count} straggler replacement(s): {json.dumps(status)}")
    return status if int(status.get("stragglerReplacements") or 0) >= count else None


def _run(kube: Kube, job: str, epochs: int, image: str) -> tuple[float, Steps, float]:
    kube.run("delete", "ddpjob", job, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    applied = time.time()
    kube.run("apply", "-f", "-", stdin=json.dumps(_job_manifest(job, epochs, image)))
    steps = Steps(kube, job).start()
    wait_for(
        "rank 0's exchange under way",
        lambda: rank0_metrics(kube, job).get("ddp_straggler_rank") is not None or None,
        timeout=600,
        interval=1.0,
    )
    return applied, steps, time.time()


def _end(kube: Kube, job: str, steps: Steps, applied: float) -> float:
    status = wait_for(
        f"{job} finished",
        lambda: s if (s := _status(kube, job)).get("phase") in ("Succeeded", "Failed") else None,
        timeout=1800,
        interval=1.0,
    )
    wall = time.time() - applied
    steps.stop()
    if status.get("phase") != "Succeeded":
        raise RuntimeError(f"{job} did not succeed: {json.dumps(status)}")
    return wall


def clean_run(kube: Kube, epochs: int, image: str) -> tuple[float, float]:
    """Wall seconds and the median step rate of the clean job."""
    job = "straggler-clean"
    applied, steps, training = _run(kube, job, epochs, image)
    wall = _end(kube, job, steps, applied)
    rates = [r for _, r in steps.rates(training + WINDOW_S, time.time())]
    return wall, statistics.median(rates)


def slowed_run(
    kube: Kube, cluster: str, epochs: int, image: str, clean_rate: float, cpu_percent: int, link_rate: str
) -> Slowed:
    job = "straggler-slowed"
    applied, steps, _ = _run(kube, job, epochs, image)
    cut = time.time()
    kind_faults.throttle_cpu(cluster, NAMESPACE, f"{job}-1-0", cpu_percent)
    named = wait_for(
        "rank 1 named",
        lambda: s if ((s := _status(kube, job)).get("straggler") or {}).get("rank") == 1 else None,
        timeout=600,
        interval=0.5,
    )
    named_at = time.time()
    kind_faults.limit_link(cluster, NAMESPACE, f"{job}-2-0", link_rate)
    limited = time.time()
    wait_for("rank 1's pod replaced", lambda: _replaced(kube, job, 1), timeout=900, interval=0.5)
    first = time.time()
    wait_for("rank 2's pod replaced", lambda: _replaced(kube, job, 2), timeout=900, interval=0.5)
    second = time.time()
    wall = _end(kube, job, steps, applied)
    slowed = [r for _, r in steps.rates(cut + WINDOW_S, first)]
    after = steps.rates(second, time.time())
    back = next((t for t, r in after if r >= RECOVERED_SHARE * clean_rate), None)
    tail = [r for t, r in after if back is not None and t >= back]
    logs = kube.run("logs", "-n", NAMESPACE, f"{job}-0-0", "-c", "trainer", check=False)
    checks = [
        dict(f.split("=", 1) for f in line.split()[1:])
        for line in logs.splitlines()
        if line.startswith("health ")
    ]
    caught = next((c for c in checks if c.get("slow_rank") == "2"), None)
    share = None
    if caught is not None and checks:
        try:
            share = float(caught["busbw_bytes_per_s"]) / float(checks[0]["busbw_bytes_per_s"])
        except (KeyError, ValueError, ZeroDivisionError):
            share = None
    return Slowed(
        wall_s=wall,
        named_s=named_at - cut,
        cpu_replaced_s=first - cut,
        link_replaced_s=second - limited,
        slowed_rate=statistics.median(slowed) / clean_rate if slowed else None,
        recovered_s=None if back is None else back - cut,
        end_rate=statistics.median(tail) / clean_rate if tail else None,
        check_s=float(caught["seconds"]) if caught is not None else None,
        busbw_share=share,
        phase=str((named.get("straggler") or {}).get("phase")),
    )


def _median(values: Sequence[float | None], digits: int = 2) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.{digits}f}" if known else "-"


def report(clean: list[tuple[float, float]], slowed: list[Slowed]) -> str:
    rows = [
        "| run | clean wall (s) | slowed wall (s) | named (s) | CPU replaced (s) | link replaced (s) | slowed rate | "
        "recovered (s) | rate at the end | check (s) | its busbw / the first check's | phase |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for index, ((wall, _), run) in enumerate(zip(clean, slowed, strict=True), start=1):
        rows.append(
            f"| {index} | {wall:.1f} | {run.wall_s:.1f} | {run.named_s:.1f} | {run.cpu_replaced_s:.1f} | "
            f"{run.link_replaced_s:.1f} | {_fmt(run.slowed_rate)} | {_fmt(run.recovered_s, 1)} | "
            f"{_fmt(run.end_rate)} | {_fmt(run.check_s)} | {_fmt(run.busbw_share, 4)} | {run.phase} |"
        )
    rows.append(
        f"| median | {_median([w for w, _ in clean])} | {_median([r.wall_s for r in slowed])} | "
        f"{_median([r.named_s for r in slowed])} | {_median([r.cpu_replaced_s for r in slowed])} | "
        f"{_median([r.link_replaced_s for r in slowed])} | {_median([r.slowed_rate for r in slowed])} | "
        f"{_median([r.recovered_s for r in slowed])} | {_median([r.end_rate for r in slowed])} | "
        f"{_median([r.check_s for r in slowed])} | {_median([r.busbw_share for r in slowed], 4)} | |"
    )
    return "\n".join(rows)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = kind_parser(__doc__)
    parser.add_argument("--cluster", default="ddp", help="kind cluster name, for the node's container [ddp]")
    parser.add_argument("--runs", type=int, default=3, help="clean and slowed pairs [3]")
    parser.add_argument("--epochs", type=int, default=200, help="the job's work [200]")
    parser.add_argument("--cpu-percent", type=int, default=5, help="rank 1's CPU quota, percent of one [5]")
    parser.add_argument("--link-rate", default="20mbit", help="rank 2's link, tc's syntax [20mbit]")
    args = parser.parse_args(argv)
    kube = kind_cluster(args)
    clean: list[tuple[float, float]] = []
    slowed: list[Slowed] = []
    for index in range(args.runs):
        clean.append(clean_run(kube, args.epochs, args.image))
        print(f"clean run {index + 1}: {clean[-1][0]:.1f} s, {clean[-1][1]:.2f} steps/s", file=sys.stderr)
        slowed.append(
            slowed_run(
                kube, args.cluster, args.epochs, args.image, clean[-1][1], args.cpu_percent, args.link_rate
            )
        )
        print(f"slowed run {index + 1}: {slowed[-1]}", file=sys.stderr, flush=True)
    print(report(clean, slowed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
