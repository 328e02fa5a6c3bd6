"""`ddpjob top JOB`: each rank pod's own figures (steps, samples, allreduce bytes and p50, compute,
loss, exit), read from its /metrics through the apiserver's pod proxy, refreshed like `top`; the same
table `ddpjob run` prints at its end (docs/cli.md)."""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from ddp_operator.commands import cluster_access

if TYPE_CHECKING:
    from ddp_operator.progress.exposition import PodScrape

DESCRIPTION = (
    "Show each rank's figures from its pod's /metrics (through the apiserver's pod proxy: needs "
    "`get` on pods/proxy), refreshed every --interval seconds until the job finishes or Ctrl-C."
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("job", metavar="JOB")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period (2)")
    parser.add_argument("--once", action="store_true", help="print one table and exit")
    cluster_access.add_connection_args(parser)


def _scrape(session: cluster_access.Session, pod: str, port: int) -> PodScrape | None:
    from ddp_operator.kube_api import ApiError
    from ddp_operator.progress.exposition import reduce_text

    try:
        return reduce_text(session.api.pod_proxy_text(session.namespace, pod, port, "/metrics"))
    except (ApiError, OSError, ValueError):
        return None


def screen(
    session: cluster_access.Session, name: str, pool: concurrent.futures.Executor
) -> tuple[str, bool] | None:
    """The text of one refresh and whether the job has finished; None when the job is gone."""
    from ddp_operator import jobview, names
    from ddp_operator.progress.render import RankResult

    read = cluster_access.read_job(session, name)
    if read is None:
        return None
    current = jobview.rank_pods(read.job, read.pods)
    futures = {}
    for rank, pod in current.items():
        port = jobview.metrics_port(read.raw[pod.name])
        if port is not None and pod.phase == "Running" and not pod.deleting:
            futures[rank] = pool.submit(_scrape, session, pod.name, port)
    results = [
        RankResult(
            attempt=pod.attempt or 0,
            rank=rank,
            pod_name=pod.name,
            exit_code=pod.exit_code if pod.terminated else None,
            metrics=futures[rank].result() if rank in futures else None,
        )
        for rank, pod in sorted(current.items())
    ]
    finished = (read.job.get("status") or {}).get("phase") in names.FINISHED_PHASES
    return jobview.top_screen(read.job, results, datetime.now(UTC)), finished


def main(args: argparse.Namespace) -> int:
    from ddp_operator.kube_api import ApiError

    session = cluster_access.connect(args)
    live = sys.stdout.isatty() and not args.once
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            while True:
                shown = screen(session, args.job, pool)
                if shown is None:
                    return cluster_access.no_such_job(session, args.job)
                text, finished = shown
                # A terminal is redrawn in place; a pipe gets one table per refresh.
                print(("\x1b[H\x1b[2J" if live else "") + text + ("" if live else "\n"), flush=True)
                if args.once or finished:
                    return cluster_access.EXIT_OK
                time.sleep(args.interval)
    except (ApiError, OSError) as error:
        return cluster_access.api_failure(error)
    except KeyboardInterrupt:
        return cluster_access.EXIT_OK
    finally:
        session.api.close()
