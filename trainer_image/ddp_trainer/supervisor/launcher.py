"""The pod's launcher: starts the pod's workers and exits with the code of the one that failed first.

It runs when NPROC_PER_NODE > 1 (in Recreate mode: torch's elastic launcher on a
static rendezvous, no local restarts, the operator recreates the gang) and on every pod in InPlace
mode (DDP_RESTART_MODE=InPlace, ``ddp_trainer.supervisor.inplace``: our own supervisor, whose surviving
workers keep their processes and state through a restart).

Stock torchrun exits 1 whatever its workers' codes were; the operator's restart policy needs the code
of the worker whose own failure it was (a worker's 3 is permanent, a lost peer's 170 is retryable), so
each worker records its exit code and time, and this launcher exits with the first own failure, over
its peers' collateral codes (``ddp_trainer.exitcodes.first_failure``).

The launcher serves the pod's one /metrics endpoint, combining its workers' series (prometheus-client's
multiprocess mode) and, in place, its own (restarts); it outlives the workers it restarts.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ddp_trainer.config import WORKER_MARKER, DistEnv, TrainConfig
from ddp_trainer.control import EXIT_RECORD_ENV, read_exit_records
from ddp_trainer.exitcodes import (
    EXIT_OK,
    EXIT_PEER_LOST,
    EXIT_STOPPED,
    LAUNCHER_COLLATERAL_CODES,
    first_failure_code,
    signal_exit_code,
)
from ddp_trainer.metrics import MULTIPROC_ENV
from ddp_trainer.supervisor.restarts import RestartLedger, RestartRecord
from ddp_trainer.supervisor.resume import PROGRESS_DIR_ENV, read_resume_note, resume_note_path

__all__ = ["LAUNCHER_COLLATERAL_CODES", "first_failure_code", "launch_local_workers", "signal_exit_code"]


def launch_local_workers(env: DistEnv, config: TrainConfig, argv: Sequence[str]) -> int:
    workspace = Path(tempfile.mkdtemp(prefix="ddp-trainer-", dir=_memory_dir()))
    metrics_dir, exit_dir, progress_dir = workspace / "metrics", workspace / "exits", workspace / "progress"
    for directory in (metrics_dir, exit_dir, progress_dir):
        directory.mkdir()
    # The workers inherit these: prometheus-client reads its directory when it is first imported.
    os.environ[MULTIPROC_ENV] = str(metrics_dir)
    os.environ[EXIT_RECORD_ENV] = str(exit_dir)
    os.environ[WORKER_MARKER] = "1"
    in_place = env.restart_mode == "InPlace"
    ledger = RestartLedger()
    if in_place:
        os.environ[PROGRESS_DIR_ENV] = str(progress_dir)
        from ddp_trainer.supervisor.inplace import prepare_workers

        prepare_workers(env, config)
    if in_place and env.standby_file is not None:
        from ddp_trainer.supervisor.standby import serve_as_standby

        # Ready before any failure (torch imported, the forkserver up): wait to be some pod's.
        assigned = serve_as_standby(env)
        if assigned is None:
            shutil.rmtree(workspace, ignore_errors=True)
            return EXIT_OK
        env = assigned
    server = None
    if env.metrics_port:
        from ddp_trainer.config import metrics_port_error
        from ddp_trainer.metrics import RestartCollector, serve_multiprocess

        def resume(record: RestartRecord) -> RestartRecord:
            note = read_resume_note(resume_note_path(progress_dir, 0))
            if note is None or note.restarts != record.restarts:
                return record
            return record.with_resume(note.time, note.resumed_step)

        collector = RestartCollector(ledger, env.pod_rank * env.nproc_per_node, resume) if in_place else None
        try:
            server = serve_multiprocess(str(metrics_dir), config.metrics_host, env.metrics_port, collector)
        except OSError as error:
            raise metrics_port_error(config.metrics_host, env.metrics_port, error) from None
    if in_place:
        from ddp_trainer.supervisor.inplace import run_in_place

        code = run_in_place(env, config, list(argv), exit_dir, progress_dir, ledger)
    else:
        code = _launch_static(env, config, argv, exit_dir)
    # The outcome is decided. The supervisor (or torch's static launcher) left its own SIGTERM/SIGINT
    # handlers installed: a stop signal from here on (a pod deleted after its work, a repeated SIGTERM) must not turn this
    # outcome into a traceback and exit 1. Only the linger below still listens, to end early.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    if code == EXIT_OK and server is not None and config.metrics_linger > 0:
        _linger(config.metrics_linger)
    if server is not None:
        server.shutdown()
        server.server_close()
    shutil.rmtree(workspace, ignore_errors=True)
    return code


def _memory_dir() -> str | None:
    """The pod's memory-backed /dev/shm when it can be written (the operator mounts one on every rank
    pod), else the default temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _launch_static(env: DistEnv, config: TrainConfig, argv: Sequence[str], exit_dir: Path) -> int:
    """Recreate mode: one run of the workers on a static rendezvous; the operator restarts the gang."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch_config = LaunchConfig(
        min_nodes=env.pods,
        max_nodes=env.pods,
        nproc_per_node=env.nproc_per_node,
        run_id=env.job_name or "ddp-trainer",
        rdzv_backend="static",
        rdzv_endpoint=f"{env.master_addr}:{env.master_port}",
        rdzv_configs={"rank": env.pod_rank, "timeout": int(config.init_timeout)},
        rdzv_timeout=int(config.init_timeout),
        max_restarts=0,  # the operator restarts the whole gang; a local restart would split it
        monitor_interval=0.1,
    )
    code = EXIT_OK
    try:
        elastic_launch(launch_config, sys.executable)("-m", "ddp_trainer", *argv)
    except ChildFailedError as failed:
        failures = {rank: failure.exitcode for rank, failure in failed.failures.items()}
        code = first_failure_code(failures, read_exit_records(exit_dir))
    except SignalException as stopped:
        records = read_exit_records(exit_dir)
        code = first_failure_code({}, records) if records else EXIT_STOPPED
        if stopped.sigval not in (signal.SIGTERM, signal.SIGINT) and not records:
            code = 128 + int(stopped.sigval)
    except Exception as error:  # the rendezvous with the other pods failed: retryable
        print(
            f"ddp_trainer: the local workers could not join MASTER_ADDR:MASTER_PORT = "
            f"{env.master_addr}:{env.master_port} ({type(error).__name__}: {error})",
            file=sys.stderr,
            flush=True,
        )
        code = EXIT_PEER_LOST
    return code


def _linger(seconds: float) -> None:
    import threading

    done = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(f"ddp_trainer: serving /metrics for {seconds:g} s more (SIGTERM ends it)", flush=True)
    try:
        done.wait(seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)
