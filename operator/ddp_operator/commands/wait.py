"""`ddpjob wait JOB --for=PHASE --timeout=DURATION`: block until the job reaches a phase; exit 0 when
it does, 1 when it ends in another phase, is deleted, or the timeout passes (with the reason), like
`kubectl wait` (docs/cli.md)."""

from __future__ import annotations

import argparse
import re
import sys
import time

from ddp_operator import names
from ddp_operator.commands import cluster_access

DESCRIPTION = (
    "Wait for a DDPJob to reach a phase (Succeeded by default). Exit status: 0 it did; 1 it finished "
    "otherwise, was deleted, or the timeout passed (the reason on stderr); 2 bad flags or no such job."
)
POLL_SECONDS = 1.0


def duration(text: str) -> float:
    """kubectl's durations: 30s, 5m, 1h, 1h30m, or plain seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if not text or parts is None:
        raise argparse.ArgumentTypeError(f"expected a duration like 30s, 10m or 1h30m, got {text!r}")
    hours, minutes, seconds = (int(p or 0) for p in parts.groups())
    return float(hours * 3600 + minutes * 60 + seconds)


def _phase(text: str) -> str:
    value = text.removeprefix("phase=").removeprefix("jsonpath={.status.phase}=")
    match = next((p for p in names.PHASES if p.lower() == value.lower()), None)
    if match is None:
        raise argparse.ArgumentTypeError(f"--for: expected one of {', '.join(names.PHASES)}, got {text!r}")
    return match


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("job", metavar="JOB")
    parser.add_argument(
        "--for", dest="phase", type=_phase, default=names.PHASE_SUCCEEDED, metavar="PHASE",
        help=f"the phase to wait for: {', '.join(names.PHASES)} (default Succeeded)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=duration, default=None, help="give up after this long (default: never)"
    )
    cluster_access.add_connection_args(parser)


def main(args: argparse.Namespace) -> int:
    from ddp_operator import jobview
    from ddp_operator.kube_api import ApiError

    session = cluster_access.connect(args)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        job = session.api.get_job_blocking(session.namespace, args.job)
        if job is None:
            return cluster_access.no_such_job(session, args.job)
        while True:
            verdict = jobview.wait_verdict(job, args.phase)
            if verdict.done:
                if verdict.met:
                    print(f"ddpjob/{args.job}: {verdict.message}")
                    return cluster_access.EXIT_OK
                print(f"ddpjob: {args.job} will not reach {args.phase}: {verdict.message}", file=sys.stderr)
                return cluster_access.EXIT_NOT_MET
            if deadline is not None and time.monotonic() >= deadline:
                print(
                    f"ddpjob: timed out after {args.timeout:g}s waiting for {args.job} to reach "
                    f"{args.phase}: {verdict.message}",
                    file=sys.stderr,
                )
                return cluster_access.EXIT_NOT_MET
            time.sleep(
                POLL_SECONDS if deadline is None else max(min(POLL_SECONDS, deadline - time.monotonic()), 0)
            )
            job = session.api.get_job_blocking(session.namespace, args.job)
    except (ApiError, OSError) as error:
        return cluster_access.api_failure(error)
    except KeyboardInterrupt:
        return 130
    finally:
        session.api.close()
