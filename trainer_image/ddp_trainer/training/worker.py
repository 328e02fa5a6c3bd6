"""One worker's life, whoever starts it: ``python -m ddp_trainer`` itself, or the pod's supervisor.

The supervisor (``ddp_trainer.supervisor.inplace``) does not start a new interpreter per worker: its workers
are forked from a forkserver that imported torch and the trainer once, when the supervisor started, so
a new worker does not pay the interpreter start and the torch import again (seconds, see
docs/benchmarks.md). :func:`supervised_worker` is that entry point.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from ddp_trainer.config import ConfigError, DistEnv, TrainConfig, parse_args, parse_env
from ddp_trainer.exitcodes import EXIT_BAD_CONFIG, EXIT_OK


def whole_lines(*streams: object) -> None:
    """Local workers share the pod's stdout and stderr. Under PYTHONUNBUFFERED (the env contract) a
    print() is two writes, text then newline, and another worker's line can land between them: line
    buffering hands each line to the pipe in one write, which the pipe keeps whole."""
    for stream in streams:
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def train_and_record(config: TrainConfig, env: DistEnv) -> int:
    """Train as one rank; leave the exit record for a launcher; return the exit code."""
    from ddp_trainer.control import write_exit_record
    from ddp_trainer.training.trainer import run_worker

    code = run_worker(config, env)
    write_exit_record(env.rank, code)
    return code


def forked_worker(argv: list[str]) -> int:
    """A worker forked by the pod's supervisor. Any code but 0 ends the process at once, without
    interpreter teardown, as ``python -m ddp_trainer`` does (see ddp_trainer.library.teardown); 0 is
    returned, and multiprocessing then ends the process without teardown too."""
    from ddp_trainer.library.teardown import exit_without_finalizing

    whole_lines(sys.stdout, sys.stderr)
    try:
        code = train_and_record(parse_args(argv), parse_env(os.environ))
    except ConfigError as error:
        print(f"ddp_trainer: bad configuration: {error}", file=sys.stderr, flush=True)
        code = EXIT_BAD_CONFIG
    if code != EXIT_OK:
        exit_without_finalizing(code)
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def supervised_worker(argv: list[str], environ: dict[str, str], connection: Connection) -> int:
    """A worker of the pod's supervisor: its round's variables over the forkserver's environment, its
    pipe to the supervisor (ddp_trainer.supervisor.membership), then :func:`forked_worker`."""
    from ddp_trainer.supervisor import membership

    os.environ.update(environ)
    membership.attach(connection)
    return forked_worker(argv)
