"""Gang-restart latency on the local control plane, with the operator's decision window and without.

For each R (ranks), each run, and each scenario in turn (interleaved, so the three see the same load):
start `ddpjob operator` (a fresh process, its own client certificate), create a DDPJob of R ranks, wait
until its R pods of attempt 0 are Running, then fail the attempt the way our trainer does: rank 0 exits
137 (annotated at t0, with finishedAt t0), and `--peer-delay` seconds later every other rank exits 170
(lost peer), all annotated at once with `--concurrency` requests in flight. Measured from t0, by a
server-side watch on the job's attempt-1 pods: seconds until every pod of the next attempt was created,
and until all of them were Running.

Scenarios:
1. `--decision-window 0`: the attempt is judged as soon as the first failure is seen (the old behaviour);
2. the operator's default window, every rank reports: judged once the last 170 has been reported;
3. the default window, one rank (the last) hangs and never reports: judged when the window runs out.

The fake nodes report like a real cluster's kubelets (the harness's default `ReportLatency`: node i
reports each pod change after i x 300 ms plus up to 900 ms of jitter), so t0 is when the container
ended, not when the apiserver heard of it. Medians over the runs and the ratio to scenario 1 of the same
runs are printed as a table.

    python benchmarks/bench_restart_latency.py --ranks 8,256,1024 --runs 3
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench_operator_scale import (
    OPERATOR_USER,
    PodClock,
    _jobs_path,
    _median,
    add_cluster_arguments,
    close_cluster,
    delete_job_and_wait,
    end_pods,
    ensure_namespace,
    identity_kubeconfig,
    job_manifest,
    open_cluster,
    operator_process,
)
from ddp_harness import EXIT_CODE_ANNOTATION, FINISHED_AT_ANNOTATION

NAMESPACE = "bench-restart"
FIRST_EXIT_CODE = 137  # rank 0: killed (OOM, SIGKILL): retried
PEER_EXIT_CODE = 170  # the trainer's lost-peer code: retried


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    operator_flags: tuple[str, ...]  # () runs the operator's default window
    one_rank_hangs: bool


SCENARIOS = (
    Scenario("no-window", "1. no window (--decision-window 0)", ("--decision-window", "0"), False),
    Scenario("all-report", "2. default window, every rank reports", (), False),
    Scenario("one-hangs", "3. default window, one rank never reports", (), True),
)


@dataclass
class RestartResult:
    """Seconds from the first failing container's end (t0)."""

    to_created: float  # every pod of the next attempt created
    to_running: float  # every pod of the next attempt Running
    peers_ended: float  # the last peer's annotation (exit 170) accepted by the apiserver


def _ending(code: int, finished_at: datetime) -> dict[str, str]:
    """kwok's annotations for a container that exited `code` at `finished_at` (whole seconds, as
    Kubernetes records it)."""
    return {
        EXIT_CODE_ANNOTATION: str(code),
        FINISHED_AT_ANNOTATION: finished_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def restart_run(
    admin: Any,
    kubeconfig: Path,
    name: str,
    replicas: int,
    scenario: Scenario,
    args: argparse.Namespace,
) -> RestartResult:
    from ddp_operator import names

    selector = names.label_selector(name)
    log = Path(args.workdir) / f"operator-{name}.log"
    with operator_process(kubeconfig, NAMESPACE, log, args, scenario.operator_flags):
        first = PodClock(admin, NAMESPACE, selector, replicas)
        admin.request("POST", _jobs_path(NAMESPACE), body=job_manifest(name, replicas))
        first.wait(args.timeout)
        following = PodClock(admin, NAMESPACE, f"{selector},{names.LABEL_ATTEMPT}=1", replicas)

        t0_wall, t0 = datetime.now(UTC), time.monotonic()
        end_pods(admin, NAMESPACE, [names.pod_name(name, 0, 0)], 1, _ending(FIRST_EXIT_CODE, t0_wall))
        time.sleep(max(0.0, t0 + args.peer_delay - time.monotonic()))
        hung = replicas - 1 if scenario.one_rank_hangs else None
        peers = [names.pod_name(name, r, 0) for r in range(1, replicas) if r != hung]
        peers_at = _ending(PEER_EXIT_CODE, t0_wall + timedelta(seconds=args.peer_delay))
        # Without a window the operator may already be deleting the attempt: a peer can be gone.
        end_pods(admin, NAMESPACE, peers, args.concurrency, peers_at, missing_ok=True)
        peers_ended = time.monotonic() - t0

        following.wait(args.timeout)
        result = RestartResult(following.created_at - t0, following.running_at - t0, peers_ended)
    delete_job_and_wait(admin, NAMESPACE, name, selector, args.timeout)
    return result


# ---- the table -------------------------------------------------------------------------------------


def summarize(ranks: int, results: Mapping[str, Sequence[RestartResult]]) -> list[dict[str, Any]]:
    """One row per scenario: medians, and their ratio to scenario 1's medians of the same runs."""
    base = results[SCENARIOS[0].key]
    base_created = _median([r.to_created for r in base])
    base_running = _median([r.to_running for r in base])
    rows = []
    for scenario in SCENARIOS:
        runs = results[scenario.key]
        created = _median([r.to_created for r in runs])
        running = _median([r.to_running for r in runs])
        rows.append(
            {
                "ranks": ranks,
                "scenario": scenario.title,
                "runs": len(runs),
                "created": created,
                "created_ratio": created / base_created,
                "created_extra": created - base_created,
                "running": running,
                "running_ratio": running / base_running,
                "running_extra": running - base_running,
                "peers_ended": _median([r.peers_ended for r in runs]),
            }
        )
    return rows


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| R | scenario | runs | all created s | vs 1 | all Running s | vs 1 | last 170 annotated s |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['ranks']} | {row['scenario']} | {row['runs']} "
            f"| {row['created']:.2f} | {row['created_ratio']:.2f} ({row['created_extra']:+.2f}) "
            f"| {row['running']:.2f} | {row['running_ratio']:.2f} ({row['running_extra']:+.2f}) "
            f"| {row['peers_ended']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from ddp_operator.decision import DEFAULT_TIMING
    from ddp_operator.kube_api import KubeApi

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 256, 1024])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--peer-delay", type=float, default=0.5, help="seconds from rank 0's exit to its peers' 170s"
    )
    add_cluster_arguments(parser)
    args = parser.parse_args(argv)
    args.unrelated = 0  # start_cluster's sizing: no unrelated pods here

    cluster = open_cluster(args, "ddp-bench-restart-")
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    try:
        admin = KubeApi.connect(str(cluster.kubeconfig), concurrency=args.concurrency)
        ensure_namespace(admin, NAMESPACE)
        kubeconfig = identity_kubeconfig(cluster, OPERATOR_USER, Path(args.workdir))
        for ranks in args.ranks:
            results: dict[str, list[RestartResult]] = {s.key: [] for s in SCENARIOS}
            for run in range(args.runs):
                for index, scenario in enumerate(SCENARIOS):
                    result = restart_run(
                        admin, kubeconfig, f"r{ranks}s{index + 1}n{run}", ranks, scenario, args
                    )
                    results[scenario.key].append(result)
                    raw.append({"ranks": ranks, "run": run, "scenario": scenario.key, **asdict(result)})
                    print(
                        f"[bench] R={ranks} run {run} {scenario.key}: created {result.to_created:.2f}s "
                        f"running {result.to_running:.2f}s (peers annotated by {result.peers_ended:.2f}s)",
                        file=sys.stderr,
                    )
            rows.extend(summarize(ranks, results))
            print(table(rows), file=sys.stderr)
    finally:
        close_cluster(args, {"rows": rows, "runs": raw})
    print(
        f"\nmedians of {args.runs} run(s); seconds from rank 0's exit (137) to every pod of the next attempt "
        f"created / Running; peers exit 170 {args.peer_delay:g} s after rank 0; default window "
        f"{DEFAULT_TIMING.decision_window_seconds:g} s; fake nodes report with the harness's default latency; "
        "vs 1 = ratio to scenario 1 (difference in seconds)\n"
    )
    print(table(rows))
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
