"""NPROC_PER_NODE > 1: start the pod's local workers with torch.distributed's elastic launcher.

Stock torchrun exits 1 whatever its workers' codes were; the operator's restart policy needs the code
of the worker whose own failure it was (a worker's 3 is permanent, a lost peer's 170 is retryable), so
each worker records its exit code and time, and this launcher exits with the first own failure, over
its peers' collateral codes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddp_trainer.config import WORKER_MARKER, DistEnv, TrainConfig
from ddp_trainer.control import EXIT_RECORD_ENV
from ddp_trainer.exitcodes import COLLATERAL_CODES, EXIT_OK, EXIT_PEER_LOST, EXIT_STOPPED
from ddp_trainer.metrics import MULTIPROC_ENV

# A worker ends with one of these because of the others: a lost peer, an agreed stop, or the stop
# signals torch's agent sends the remaining workers once one has failed (128 + SIGTERM, + SIGINT).
LAUNCHER_COLLATERAL_CODES = COLLATERAL_CODES | {128 + signal.SIGTERM, 128 + signal.SIGINT}


def signal_exit_code(code: int) -> int:
    """torch reports a worker killed by signal N as -N; a shell would say 128 + N."""
    return 128 - code if code < 0 else code


def first_failure_code(failures: Mapping[int, int], records: Sequence[Mapping[str, Any]]) -> int:
    """The exit code of the worker whose own failure came first.

    ``records`` are the workers' own exit records (rank, exit_code, time_ns); ``failures`` maps the
    global rank of every failed worker the launcher saw to its exit code (-N for signal N). A worker's
    own failure wins over every collateral code (LAUNCHER_COLLATERAL_CODES), recorded or not: a worker
    killed (the OOM killer's SIGKILL) or crashed in native code cannot write a record, and its peers'
    recorded 170s are only the echo of it. Within each kind, recorded workers come first, by time,
    then the others by rank.
    """
    recorded = {
        int(record["rank"]): (int(record["time_ns"]), int(record["exit_code"]))
        for record in records
        if int(record["exit_code"]) != 0
    }
    # (collateral?, unrecorded?, time, rank, code): the smallest is the pod's exit code.
    candidates = [
        (code in LAUNCHER_COLLATERAL_CODES, False, time_ns, rank, code)
        for rank, (time_ns, code) in recorded.items()
    ]
    candidates += [
        (code in LAUNCHER_COLLATERAL_CODES, True, 0, rank, code)
        for rank, code in ((rank, signal_exit_code(raw)) for rank, raw in failures.items())
        if rank not in recorded
    ]
    return min(candidates)[-1] if candidates else EXIT_OK


def _read_records(directory: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(directory.glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return records


def launch_local_workers(env: DistEnv, config: TrainConfig, argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    workspace = Path(tempfile.mkdtemp(prefix="ddp-trainer-"))
    metrics_dir, exit_dir = workspace / "metrics", workspace / "exits"
    metrics_dir.mkdir()
    exit_dir.mkdir()
    # The workers inherit these: prometheus-client reads its directory when it is first imported.
    os.environ[MULTIPROC_ENV] = str(metrics_dir)
    os.environ[EXIT_RECORD_ENV] = str(exit_dir)
    os.environ[WORKER_MARKER] = "1"
    server = None
    if env.metrics_port:
        from ddp_trainer.config import ConfigError
        from ddp_trainer.metrics import serve_multiprocess

        try:
            server = serve_multiprocess(str(metrics_dir), config.metrics_host, env.metrics_port)
        except OSError as error:
            raise ConfigError(
                "DDP_METRICS_PORT",
                f"cannot serve /metrics on {config.metrics_host}:{env.metrics_port} ({error.strerror or error})",
                "choose a free port (or 0 for no endpoint)",
            ) from None
    launch_config = LaunchConfig(
        min_nodes=env.nnodes,
        max_nodes=env.nnodes,
        nproc_per_node=env.nproc_per_node,
        run_id=env.job_name or "ddp-trainer",
        rdzv_backend="static",
        rdzv_endpoint=f"{env.master_addr}:{env.master_port}",
        rdzv_configs={"rank": env.node_rank, "timeout": int(config.init_timeout)},
        rdzv_timeout=int(config.init_timeout),
        max_restarts=0,  # the operator restarts the whole gang; a local restart would split it
        monitor_interval=0.1,
    )
    code = EXIT_OK
    try:
        elastic_launch(launch_config, sys.executable)("-m", "ddp_trainer", *argv)
    except ChildFailedError as failed:
        failures = {rank: failure.exitcode for rank, failure in failed.failures.items()}
        code = first_failure_code(failures, _read_records(exit_dir))
    except SignalException as stopped:
        records = _read_records(exit_dir)
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
    # The outcome is decided. torch's agent left its own SIGTERM/SIGINT handlers installed, which raise:
    # a stop signal from here on (a pod deleted after its work, a repeated SIGTERM) must not turn this
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


def _linger(seconds: float) -> None:
    import threading

    done = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(f"ddp_trainer: serving /metrics for {seconds:g} s more (SIGTERM ends it)", flush=True)
    try:
        done.wait(seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)
