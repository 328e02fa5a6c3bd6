"""`ddpjob get [JOB]`: DDPJobs with their phase, attempt, restarts, training step, progress, samples
per second and straggler, one line each (docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from ddp_operator.commands import cluster_access

DESCRIPTION = "List DDPJobs (or one) with their training progress, like `kubectl get ddpj` with more."


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("job", metavar="JOB", nargs="?", help="one job (default: every job of the namespace)")
    parser.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="table (default) or json"
    )
    cluster_access.add_connection_args(parser, all_namespaces=True)


def main(args: argparse.Namespace) -> int:
    from ddp_operator import jobview
    from ddp_operator.kube_api import ApiError

    session = cluster_access.connect(args)
    try:
        if args.job:
            job = session.api.get_job_blocking(session.namespace, args.job)
            if job is None:
                return cluster_access.no_such_job(session, args.job)
            jobs = [job]
        else:
            jobs = session.api.list_jobs_blocking(None if args.all_namespaces else session.namespace)
    except (ApiError, OSError) as error:
        return cluster_access.api_failure(error)
    finally:
        session.api.close()
    if args.output == "json":
        print(json.dumps(jobs[0] if args.job else {"items": jobs}, indent=2))
    elif not jobs:
        where = "any namespace" if args.all_namespaces else f"namespace {session.namespace!r}"
        print(f"No DDPJobs in {where}.", file=sys.stderr)
    else:
        print(jobview.get_table(jobs, datetime.now(UTC), with_namespace=args.all_namespaces))
    return cluster_access.EXIT_OK
