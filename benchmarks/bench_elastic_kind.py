"""An elastic job's resizes on kind (a real kubelet, our images): loss to training on fewer pods, and
capacity back to training on all of them (docs/elastic.md).

One digits job of 2..3 pods (``replacementWaitSeconds`` 10, a checkpoint every 20 steps) goes through
``--runs`` cycles, each once it has trained since the last:

- **shrink**: the node is cordoned and rank 2's pod deleted; its replacement cannot be placed, so ranks 0
  and 1 re-form a group of 2 once the replacement wait has passed. Measured from the deletion to rank 0's
  first training step in the group of 2 (``ddp_group_members`` 2 and ``ddp_resumed_timestamp_seconds``
  after the deletion), so the replacement wait is included: it is what the user chose to wait.
- **grow**: the node is uncordoned; the replacement starts (its container, the interpreter, torch), joins
  the rendezvous, and the group re-forms with 3. Measured from the uncordon to rank 0's first step in the
  group of 3.

Times are this machine's clock, which kind's node shares; rank 0's series are read through the apiserver's
pod proxy. Prints the medians and the ratio of each to the whole-gang recreate's failure-to-training time
measured in the same run (``bench_recovery_kind.py``'s whole-gang mode, ``--baseline-runs`` of them).

Needs a kind cluster with both images loaded and the chart installed (``make kind-up``, then
``helm install ddp-operator charts/ddp-operator -n ddp-system --create-namespace --wait``):

    python benchmarks/bench_elastic_kind.py --context kind-ddp --runs 5
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench_recovery_kind import (
    NAMESPACE,
    Kube,
    bench_mode,
    kind_cluster,
    kind_parser,
    manifest,
    rank0_metrics,
    wait_for,
)

JOB = "elastic-bench"
WAIT_SECONDS = 10


@dataclass
class Cycle:
    shrink_s: float
    grow_s: float


def elastic_manifest(runs: int, image: str) -> dict[str, Any]:
    job = manifest(JOB, "in-place", runs * 2, image)
    del job["spec"]["replicas"]
    job["spec"]["elastic"] = {"minReplicas": 2, "maxReplicas": 3, "replacementWaitSeconds": WAIT_SECONDS}
    trainer = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    trainer.setdefault("resources", {}).setdefault("requests", {})["cpu"] = "200m"
    return job


def training_on(kube: Kube, pods: int, since: float) -> float | None:
    """Rank 0's first step in a group of ``pods`` pods after ``since``, once it happened."""
    values = rank0_metrics(kube, JOB)
    resumed = values.get("ddp_resumed_timestamp_seconds")
    if values.get("ddp_group_members") != pods or resumed is None or resumed <= since:
        return None
    return resumed


def live_rank_2(kube: Kube) -> str:
    pods = kube.json("get", "pods", "-n", NAMESPACE, "-l", f"ddp.dev/job-name={JOB},ddp.dev/rank=2")["items"]
    return next(
        p["metadata"]["name"]
        for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    )


def one_cycle(kube: Kube, node: str) -> Cycle:
    steps = rank0_metrics(kube, JOB).get("ddp_sync_steps_total", 0)
    wait_for(
        "training since the last cycle",
        lambda: (rank0_metrics(kube, JOB).get("ddp_sync_steps_total", 0) > steps + 40) or None,
    )
    victim = live_rank_2(kube)
    kube.run("cordon", node)
    try:
        kube.run("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")
        lost = time.time()
        shrunk = wait_for("training on 2 pods", lambda: training_on(kube, 2, lost), timeout=300)
    finally:
        kube.run("uncordon", node)
    back = time.time()
    grown = wait_for("training on 3 pods", lambda: training_on(kube, 3, back), timeout=300)
    return Cycle(shrunk - lost, grown - back)


def bench(kube: Kube, runs: int, image: str) -> list[Cycle]:
    kube.run("delete", "ddpjob", JOB, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    kube.run("apply", "-f", "-", stdin=json.dumps(elastic_manifest(runs, image)))
    wait_for("a group of 3", lambda: (rank0_metrics(kube, JOB).get("ddp_group_members") == 3) or None)
    node = kube.json("get", "pod", f"{JOB}-0-0", "-n", NAMESPACE)["spec"]["nodeName"]
    cycles = [one_cycle(kube, node) for _ in range(runs)]
    kube.run("delete", "ddpjob", JOB, "-n", NAMESPACE, "--wait=false")
    return cycles


def table(cycles: Sequence[Cycle], whole_gang_s: float | None) -> str:
    shrink = statistics.median(c.shrink_s for c in cycles)
    grow = statistics.median(c.grow_s for c in cycles)

    def ratio(value: float) -> str:
        return "-" if not whole_gang_s else f"{value / whole_gang_s:.2f}"

    return "\n".join(
        [
            "| resize | runs | median s | min s | max s | vs whole-gang recreate |",
            "|---|---|---|---|---|---|",
            f"| shrink: pod lost to training on 2 (incl. {WAIT_SECONDS} s wait) | {len(cycles)} | {shrink:.2f} | "
            f"{min(c.shrink_s for c in cycles):.2f} | {max(c.shrink_s for c in cycles):.2f} | {ratio(shrink)} |",
            f"| grow: capacity back to training on 3 | {len(cycles)} | {grow:.2f} | "
            f"{min(c.grow_s for c in cycles):.2f} | {max(c.grow_s for c in cycles):.2f} | {ratio(grow)} |",
            f"| whole-gang recreate (baseline, same run) | - | {'-' if whole_gang_s is None else f'{whole_gang_s:.2f}'} | | | 1.00 |",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = kind_parser(__doc__)
    parser.add_argument("--runs", type=int, default=5, help="shrink-and-grow cycles [5]")
    parser.add_argument("--baseline-runs", type=int, default=3, help="whole-gang recreates for the ratio [3]")
    args = parser.parse_args(argv)
    kube = kind_cluster(args)
    cycles = bench(kube, args.runs, args.image)
    baseline = bench_mode(kube, "whole-gang", args.baseline_runs, args.image) if args.baseline_runs else []
    whole = statistics.median(r.resumed_s for r in baseline) if baseline else None
    print(table(cycles, whole))
    return 0


if __name__ == "__main__":
    sys.exit(main())
