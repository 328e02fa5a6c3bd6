"""Runs every benchmark of the project in turn; each prints its own tables.

`make bench` calls this. The results go, by hand and with the date and machine load, into
docs/benchmarks.md: a benchmark is a measurement to read, never an assertion.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "bench_sync_overhead.py",
    "bench_straggler.py",
    "bench_straggler_quiet.py",  # 30 minutes: the false-positive count under the default thresholds
    "bench_gcn_sync.py",
    "bench_operator_scale.py",
    "bench_restart_latency.py",
    "bench_gang_admission.py",
    "bench_inplace_restart.py",
    "bench_pod_start.py",
    "bench_health_check.py",
    "bench_rendezvous_scale.py",
)


def main() -> int:
    worst = 0
    for script in BENCHMARKS:
        print(f"\n### {script}\n", flush=True)
        worst = max(worst, subprocess.call([sys.executable, str(HERE / script)]))
    return worst


if __name__ == "__main__":
    sys.exit(main())
