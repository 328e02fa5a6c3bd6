"""`ddpjob describe JOB`: one screen of a DDPJob: phase and its reason, conditions, progress, the last
restart's anatomy, goodput, the straggler, each rank's pod and the recent Events (docs/cli.md)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime

from ddp_operator.commands import cluster_access

DESCRIPTION = "Show one DDPJob: phase, conditions, last restart, goodput, straggler, rank pods, Events."


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("job", metavar="JOB")
    parser.add_argument("--events", type=int, default=15, metavar="N", help="the N most recent Events (15)")
    cluster_access.add_connection_args(parser)


def main(args: argparse.Namespace) -> int:
    from ddp_operator import jobview, names
    from ddp_operator.kube_api import ApiError

    session = cluster_access.connect(args)
    try:
        read = cluster_access.read_job(session, args.job)
        if read is None:
            return cluster_access.no_such_job(session, args.job)
        uid = (read.job.get("metadata") or {}).get("uid")
        events = session.api.list_events_blocking(session.namespace, names.KIND, args.job, uid)
    except (ApiError, OSError) as error:
        return cluster_access.api_failure(error)
    finally:
        session.api.close()
    print(jobview.describe(read.job, read.pods, events, datetime.now(UTC), max_events=args.events))
    return cluster_access.EXIT_OK
