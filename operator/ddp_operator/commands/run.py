"""`ddpjob run FILE`: run a DDPJob manifest as local processes, no cluster needed.

The manifest is validated by the operator's own parser and each rank pod is built by the operator's
own builders; the pod's `trainer` container then runs here, in this Python environment, with the
addresses rewritten for one machine. Heavy imports stay out of this module: ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from ddp_operator.local.run_policy import RUN_POLICY
from ddp_operator.local.run_policy import warnings as run_policy_warnings

_HONOURED = ", ".join(name for name, support in RUN_POLICY.items() if support.honoured)
_IGNORED = ", ".join(name for name, support in RUN_POLICY.items() if not support.honoured)
DESCRIPTION = f"""\
Run a DDPJob manifest (the file you would `kubectl apply`) on this machine, one local process per
rank pod, and restart the gang on retryable failures exactly like the operator would.

The container image is NOT used: each pod's `trainer` container command and args run in this Python
environment (`python` and `torchrun` mean this interpreter; a container without `command` runs
`python -m ddp_trainer`, the trainer image's entrypoint). Addresses are rewritten for one machine:
MASTER_ADDR/PET_MASTER_ADDR=127.0.0.1, a free rendezvous port per attempt, a free metrics port per pod
and a local checkpoint directory (WORKDIR/checkpoints) in DDP_CHECKPOINT_DIR.

runPolicy: {_HONOURED} act as on a cluster; {_IGNORED} have no local meaning
(a warning names each one the manifest sets).

Exit status: 0 the job succeeded; 1 it failed (permanent exit code, backoffLimit,
activeDeadlineSeconds, or a stall under restartPolicy Never); 2 the manifest is invalid or cannot run
locally; 128+N stopped by signal N (130 for Ctrl-C) after SIGTERM to every rank."""


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("file", metavar="FILE", help="a DDPJob manifest (YAML or JSON; '-' reads stdin)")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where checkpoints go (default: ./.ddpjob/<job name>)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep WORKDIR/checkpoints from an earlier run and resume from them (default: start fresh)",
    )
    parser.add_argument(
        "-e",
        "--env",
        action="append",
        type=_env_pair,
        default=[],
        metavar="NAME=VALUE",
        help="set a variable on every rank (e.g. the value of a secretKeyRef, which needs a cluster)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long ranks get after SIGTERM before SIGKILL (default: the pod's terminationGracePeriodSeconds)",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not show the progress line")
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="when the output is not a terminal, print the progress line this often (default: 10)",
    )


def load_manifest(path: str, stdin: TextIO | None = None) -> Mapping[str, Any]:
    """The DDPJob document of a (possibly multi-document) YAML file; raises ValueError naming what is wrong."""
    import yaml

    text = (stdin or sys.stdin).read() if path == "-" else Path(path).read_text()
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    jobs = [d for d in documents if isinstance(d, Mapping) and d.get("kind") == "DDPJob"]
    if not jobs:
        kinds = ", ".join(str(d.get("kind")) for d in documents if isinstance(d, Mapping)) or "nothing"
        raise ValueError(f"kind: {path} holds no DDPJob (found {kinds})")
    if len(jobs) > 1:
        raise ValueError(f"kind: {path} holds {len(jobs)} DDPJobs; put the one to run in its own file")
    return jobs[0]


def main(args: argparse.Namespace) -> int:
    from ddp_operator.local.console import Console
    from ddp_operator.local.plan import PlanError
    from ddp_operator.local.runner import EXIT_INVALID, LocalJobRunner, RunOptions, StopRequest
    from ddp_operator.spec import SpecError, parse_job, unknown_fields

    try:
        manifest = load_manifest(args.file)
        unknown = unknown_fields(manifest)
        if unknown:
            raise unknown[0]
        job = parse_job(manifest)
    except (SpecError, ValueError) as exc:
        print(f"ddpjob run: invalid manifest: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except OSError as exc:
        print(f"ddpjob run: cannot read {args.file}: {exc}", file=sys.stderr)
        return EXIT_INVALID

    for warning in run_policy_warnings(manifest):
        print(f"ddpjob run: warning: {warning}", file=sys.stderr)
    if job.run_policy.suspend:
        print(f"ddpjob run: {job.name} has spec.runPolicy.suspend: true; nothing to run", file=sys.stderr)
        return 0
    if job.backend == "nccl":
        print(
            "ddpjob run: note: the backend resolves to nccl (the trainer container asks for nvidia.com/gpu); "
            "this machine needs CUDA GPUs for it",
            file=sys.stderr,
        )

    workdir = args.workdir if args.workdir is not None else Path(".ddpjob") / job.name
    live = sys.stdout.isatty() and os.environ.get("TERM") != "dumb"
    console = Console(sys.stdout, live=live, plain_interval=args.progress_interval)
    options = RunOptions(
        workdir=workdir,
        resume=args.resume,
        env=dict(args.env),
        grace_seconds=args.grace_period,
        progress=not args.no_progress,
        live_progress=live,
    )
    stop = StopRequest()
    runner = LocalJobRunner(job, options, console, stop)
    try:
        runner.check()
    except PlanError as exc:
        print(f"ddpjob run: cannot run this manifest locally: {exc}", file=sys.stderr)
        return EXIT_INVALID
    previous = {signum: signal.signal(signum, stop.handle) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = runner.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    console.line("")
    console.line(runner.summary(result))
    return result.exit_code
