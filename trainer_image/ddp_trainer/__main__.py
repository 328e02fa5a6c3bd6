"""``python -m ddp_trainer``: validate the configuration, then train (or launch the local workers)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Final

from ddp_trainer.config import ConfigError, parse_args, parse_env
from ddp_trainer.exitcodes import EXIT_BAD_CONFIG, write_launcher_exit
from ddp_trainer.training.worker import whole_lines

_ENTRY_PID: Final = os.getpid()


def _stopped_while_starting(signum: int, frame: FrameType | None) -> None:
    """A pod stopped before its launcher installed its own handlers (torch takes seconds to import):
    nothing has started, so it ends at once, 143 as for any SIGTERM. In a fork that has not reset its
    handlers yet (the workers' forkserver) it only ends that process: the launcher's record is the
    launcher's to write."""
    if os.getpid() == _ENTRY_PID:
        write_launcher_exit(128 + signum, os.environ)
    os._exit(128 + signum)


# The workers' forkserver may be forked while this handler is in place (ddp_trainer.supervisor.worker_forkserver).
_stopped_while_starting.fork_safe = True  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    # In a container this process is PID 1, and the kernel drops a signal that PID 1 has no handler
    # for: a SIGTERM during start-up (a standby preempted for a rank, a job deleted) would be lost and
    # the pod would wait out its whole grace period. The launcher replaces this handler with its own.
    signal.signal(signal.SIGTERM, _stopped_while_starting)
    whole_lines(sys.stdout, sys.stderr)
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        config = parse_args(arguments)
        env = parse_env(os.environ)
        # Everything above is pure and torch-free: a bad environment costs a fraction of a second.
        if env.launches_workers:
            from ddp_trainer.supervisor.launcher import launch_local_workers

            code = launch_local_workers(env, config, arguments)
            write_launcher_exit(code, os.environ)
            return code
        from ddp_trainer.library.teardown import exit_without_finalizing
        from ddp_trainer.training.worker import train_and_record

        code = train_and_record(config, env)
        # Whatever still holds the process group (see ddp_trainer.library.teardown), and even if nothing does:
        # the exit code is decided and everything that matters is on disk (checkpoints fsynced, the
        # exit record written). Finalizing torch takes a noticeable time during which Python has reset
        # the signal handlers: a SIGTERM then (the operator or `ddpjob run` stopping the collateral
        # ranks of a failed attempt) would turn 170 into 143. Exit now instead.
        exit_without_finalizing(code)
    except ConfigError as error:
        print(f"ddp_trainer: bad configuration: {error}", file=sys.stderr, flush=True)
        return EXIT_BAD_CONFIG


if __name__ == "__main__":
    sys.exit(main())
