"""The trainer's configuration: the env contract (operator -> trainer) and the command line.

Pure and cheap to import: ``python -m ddp_trainer`` validates everything here before it imports torch,
so a bad environment is reported in a fraction of a second, as one line naming the variable and the fix.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from ddp_trainer.library import health
from ddp_trainer.library.straggler import parse_stall_timeout

Backend = Literal["auto", "nccl", "gloo"]
BACKENDS: Final = ("auto", "nccl", "gloo")
COMM_HOOKS: Final = ("allreduce", "fp16", "bf16", "powersgd")
SYNC_METRICS_MODES: Final = ("detailed", "light")
WORKLOADS: Final = ("digits", "mnist", "synthetic", "gcn")
GRAPH_DATA: Final = ("generated", "ogbn-products")
DEFAULT_MASTER_PORT: Final = 29500
# DDP_RESTART_MODE: how a failed worker is restarted (docs/restarts.md). InPlace: the pod's launcher
# restarts the worker group where it is, on a new round of the launchers. rendezvous (ddp_trainer.supervisor.rendezvous); Recreate: the
# process ends and the operator recreates the gang. A pod without the variable behaves as Recreate.
RestartMode = Literal["InPlace", "Recreate"]
RESTART_MODES: Final = ("InPlace", "Recreate")
# DDP_RESTART_BUDGET when unset: runPolicy.backoffLimit's default.
DEFAULT_RESTART_BUDGET: Final = 3
# DDP_REPLACEMENT_WAIT_SECONDS when unset: how long an elastic job's round waits for more pods once
# DDP_MIN_MEMBERS have joined (the rendezvous' last call, whole seconds).
DEFAULT_REPLACEMENT_WAIT: Final = 5
# An elastic job's fewest members (minReplicas). The deprecated name (docs/api.md, "Deprecated names")
# is all an older operator sets, so it is read when the first is not set.
MIN_MEMBERS_ENV: Final = "DDP_MIN_MEMBERS"
DEPRECATED_MIN_MEMBERS_ENV: Final = "DDP_MIN_NODES"
DEFAULT_MNIST_URL: Final = "https://ossci-datasets.s3.amazonaws.com/mnist/"
# The gang health check (docs/trainer.md, "Health check"): off unless the operator turns it on.
HEALTH_CHECK_ENV: Final = "DDP_HEALTH_CHECK"
HEALTH_CHECK_BYTES_ENV: Final = "DDP_HEALTH_CHECK_BYTES"
HEALTH_CHECK_SWITCH: Final[Mapping[str, bool]] = {"on": True, "off": False}
# Set by the trainer on the local workers it launches when NPROC_PER_NODE > 1.
WORKER_MARKER: Final = "DDP_TRAINER_WORKER"
# How the in-place launcher starts the forkserver its workers are forked from (ddp_trainer.supervisor.worker_forkserver):
# a fork of the launcher (default), or a new interpreter as multiprocessing starts it.
WORKER_FORKSERVER_ENV: Final = "DDP_WORKER_FORKSERVER"
# A standby pod's file of its assignment (ddp_trainer.supervisor.standby).
STANDBY_FILE_ENV: Final = "DDP_STANDBY_FILE"
WORKER_FORKSERVER_KINDS: Final = ("fork", "interpreter")


class ConfigError(Exception):
    """A bad environment variable or option: ``str()`` is one line naming it and the fix."""

    def __init__(self, variable: str, problem: str, fix: str) -> None:
        super().__init__(f"{variable}: {problem}; fix: {fix}")
        self.variable = variable
        self.problem = problem
        self.fix = fix


def metrics_port_error(host: str, port: int | None, error: OSError) -> ConfigError:
    """The metrics endpoint could not bind DDP_METRICS_PORT: a usage error, found before the rendezvous."""
    return ConfigError(
        "DDP_METRICS_PORT",
        f"cannot serve /metrics on {host}:{port} ({error.strerror or error})",
        "choose a free port (or 0 for no endpoint)",
    )


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, read from the env contract."""

    world_size: int
    pods: int
    pod_rank: int
    nproc_per_node: int
    # Global and local rank; meaningful for a process that joins the group itself (not a launcher).
    rank: int
    local_rank: int
    master_addr: str
    master_port: int
    backend: Backend
    metrics_port: int | None
    checkpoint_dir: str | None
    job_name: str | None
    namespace: str | None
    attempt: int
    launched_worker: bool
    # DDP_STALL_TIMEOUT_SECONDS (runPolicy.stallTimeoutSeconds): when to dump stacks; None: never.
    stall_timeout: float | None = None
    restart_mode: RestartMode = "Recreate"
    # DDP_RESTART_BUDGET: how many more gang restarts the job may spend (in place: the launcher's cap).
    restart_budget: int = DEFAULT_RESTART_BUDGET
    # DDP_RUN_ID: the elastic rendezvous' run id, the same on every pod of one attempt.
    run_id: str = "ddp-trainer-0"
    # DDP_MIN_MEMBERS (an elastic job's minReplicas): a round may train on min_members..pods of them;
    # None: a fixed-size job, every round has all of its pods.
    min_members: int | None = None
    # DDP_REPLACEMENT_WAIT_SECONDS: an elastic round's wait for more pods once min_members have joined.
    replacement_wait: int = DEFAULT_REPLACEMENT_WAIT
    # DDP_HEALTH_CHECK (on/off, default off) and DDP_HEALTH_CHECK_BYTES: the gang health check before
    # the first step and when a new member joins (ddp_trainer.library.health).
    health_check: bool = False
    health_check_bytes: int = health.DEFAULT_BYTES
    # DDP_RANK_ORDER_FILE: where the operator's rendezvous order key of this pod appears (a job whose
    # ranks follow the topology, ddp_trainer.supervisor.rank_order); None: the ranks follow NODE_RANK.
    rank_order_file: str | None = None
    # DDP_RENDEZVOUS_ENDPOINT (host:port): the job's rendezvous pod, whose store every launcher meets
    # at; None: NODE_RANK 0's launcher hosts the store at MASTER_ADDR:MASTER_PORT.
    rendezvous_endpoint: tuple[str, int] | None = None
    # POD_IP (the downward API): where this pod's first worker serves the workers' store when it is
    # global rank 0 and the store is apart (a replaced rank 0's DNS name may still answer its predecessor).
    pod_ip: str | None = None
    # DDP_WORKER_FORKSERVER: "fork" (the launcher forks it) or "interpreter" (multiprocessing's own).
    worker_forkserver: str = WORKER_FORKSERVER_KINDS[0]
    # DDP_STANDBY_FILE: a standby pod's launcher (ddp_trainer.supervisor.standby) waits for its rank in this file;
    # until then pod_rank and rank are placeholders (0). None: a pod with a rank of its own.
    standby_file: str | None = None

    @property
    def rendezvous_store(self) -> tuple[str, int]:
        """Where the rendezvous store listens: the rendezvous pod, or NODE_RANK 0's launcher."""
        return self.rendezvous_endpoint or (self.master_addr, self.master_port)

    @property
    def elastic(self) -> bool:
        return self.min_members is not None

    @property
    def launches_workers(self) -> bool:
        """True for the pod's main process when it must start its local workers: NPROC_PER_NODE > 1,
        or any pod that restarts its workers in place."""
        if self.launched_worker:
            return False
        return self.nproc_per_node > 1 or self.restart_mode == "InPlace"


def _lookup(env: Mapping[str, str], name: str) -> str | None:
    """A variable, falling back to its torchrun spelling (PET_*) as Kubeflow's images set it."""
    value = env.get(name)
    if value is None or value.strip() == "":
        value = env.get(f"PET_{name}")
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _int(env: Mapping[str, str], name: str, fix: str, *, default: int | None = None, minimum: int = 0) -> int:
    text = _lookup(env, name)
    if text is None:
        if default is None:
            raise ConfigError(name, "is not set", fix)
        return default
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(name, f"must be an integer, got {text!r}", fix) from None
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}", fix)
    return value


def parse_env(env: Mapping[str, str]) -> DistEnv:
    """Validate the env contract; raises ConfigError naming the first bad variable."""
    launched_worker = env.get(WORKER_MARKER) == "1"
    standby_file = None if launched_worker else _standby_file(env)
    view = _round_view(env, launched_worker)
    if standby_file is not None:
        # No rank is a standby's own until the operator assigns one (ddp_trainer.supervisor.standby).
        view = {**view, "NODE_RANK": "0", "RANK": "0"}
    world_size, nproc, pods = _world(view)
    rank, local_rank, pod_rank = _ranks(view, world_size, nproc, pods, launched_worker)
    master_addr, master_port = _rendezvous(env, world_size)
    backend_text = (env.get("DDP_BACKEND") or "auto").strip().lower()
    if backend_text not in BACKENDS:
        raise ConfigError(
            "DDP_BACKEND", f"unknown backend {backend_text!r}", "set DDP_BACKEND to one of auto, nccl, gloo"
        )
    backend: Backend = "nccl" if backend_text == "nccl" else "gloo" if backend_text == "gloo" else "auto"
    metrics_port = _int(
        env, "DDP_METRICS_PORT", "set DDP_METRICS_PORT to 1..65535, or 0 for no endpoint", default=0
    )
    if metrics_port > 65535:
        raise ConfigError(
            "DDP_METRICS_PORT", f"{metrics_port} is not a TCP port", "set DDP_METRICS_PORT to 1..65535"
        )
    attempt = _int(env, "DDPJOB_ATTEMPT", "set DDPJOB_ATTEMPT to the attempt number (>= 0)", default=0)
    try:
        stall_timeout = parse_stall_timeout(env.get("DDP_STALL_TIMEOUT_SECONDS"))
    except ValueError as error:
        raise ConfigError(
            "DDP_STALL_TIMEOUT_SECONDS", str(error), "set it to a positive number of seconds, or unset it"
        ) from None
    restart_mode, restart_budget = _restarts(env)
    min_members, replacement_wait = _elastic(env, pods, restart_mode)
    health_check, health_check_bytes = _health_check(env)
    rank_order_file = _in_place_only(env, "DDP_RANK_ORDER_FILE", restart_mode, "orders the ranks of")
    endpoint = _in_place_only(env, "DDP_RENDEZVOUS_ENDPOINT", restart_mode, "is the store of")
    job_name = env.get("DDPJOB_NAME") or None
    run_id = (env.get("DDP_RUN_ID") or "").strip() or f"{job_name or 'ddp-trainer'}-{attempt}"
    return DistEnv(
        world_size=world_size,
        pods=pods,
        pod_rank=pod_rank,
        nproc_per_node=nproc,
        rank=rank,
        local_rank=local_rank,
        master_addr=master_addr,
        master_port=master_port,
        backend=backend,
        metrics_port=metrics_port or None,
        checkpoint_dir=(env.get("DDP_CHECKPOINT_DIR") or "").strip() or None,
        job_name=job_name,
        namespace=env.get("DDPJOB_NAMESPACE") or None,
        attempt=attempt,
        launched_worker=launched_worker,
        stall_timeout=stall_timeout,
        restart_mode=restart_mode,
        restart_budget=restart_budget,
        run_id=run_id,
        min_members=min_members,
        replacement_wait=replacement_wait,
        health_check=health_check,
        health_check_bytes=health_check_bytes,
        rank_order_file=rank_order_file,
        rendezvous_endpoint=_endpoint(endpoint) if endpoint is not None else None,
        pod_ip=(env.get("POD_IP") or "").strip() or None,
        worker_forkserver=_worker_forkserver(env),
        standby_file=standby_file,
    )


def _standby_file(env: Mapping[str, str]) -> str | None:
    """DDP_STANDBY_FILE, checked against what a standby needs: restarts in place at the job's
    rendezvous pod, a fixed-size job whose ranks follow NODE_RANK, and no rank of its own."""
    value = (env.get(STANDBY_FILE_ENV) or "").strip() or None
    if value is None:
        return None
    needs = {
        "DDP_RESTART_MODE": (env.get("DDP_RESTART_MODE") or "").strip() == "InPlace",
        "DDP_RENDEZVOUS_ENDPOINT": bool((env.get("DDP_RENDEZVOUS_ENDPOINT") or "").strip()),
    }
    for name, present in needs.items():
        if not present:
            raise ConfigError(
                STANDBY_FILE_ENV,
                f"a standby pod needs {name} (restarts in place at the job's rendezvous pod)",
                f"set {name}, or unset {STANDBY_FILE_ENV}",
            )
    for name in ("DDP_MIN_MEMBERS", "DDP_RANK_ORDER_FILE", "NODE_RANK", "PET_NODE_RANK", "RANK"):
        if (env.get(name) or "").strip():
            raise ConfigError(
                STANDBY_FILE_ENV,
                f"a standby pod takes its rank from the file, and {name} is set",
                f"unset {name} on a standby pod, or unset {STANDBY_FILE_ENV}",
            )
    return value


def _worker_forkserver(env: Mapping[str, str]) -> str:
    """DDP_WORKER_FORKSERVER: fork or interpreter (case-insensitive; unset: fork)."""
    text = (env.get(WORKER_FORKSERVER_ENV) or WORKER_FORKSERVER_KINDS[0]).strip().lower()
    if text not in WORKER_FORKSERVER_KINDS:
        raise ConfigError(
            WORKER_FORKSERVER_ENV,
            f"must be fork or interpreter, got {text!r}",
            f"set {WORKER_FORKSERVER_ENV} to fork or interpreter, or unset it (fork)",
        )
    return text


def _in_place_only(env: Mapping[str, str], name: str, restart_mode: str, what: str) -> str | None:
    """A variable of the rendezvous, which only the in-place launcher uses."""
    value = (env.get(name) or "").strip() or None
    if value is not None and restart_mode != "InPlace":
        raise ConfigError(
            name,
            f"{what} the rendezvous, which only DDP_RESTART_MODE=InPlace uses",
            f"unset {name}, or set DDP_RESTART_MODE=InPlace",
        )
    return value


def _endpoint(text: str) -> tuple[str, int]:
    """DDP_RENDEZVOUS_ENDPOINT's host and port."""
    host, _, port = text.rpartition(":")
    fix = "set DDP_RENDEZVOUS_ENDPOINT to host:port (the job's rendezvous pod), or unset it"
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError("DDP_RENDEZVOUS_ENDPOINT", f"must be host:port, got {text!r}", fix)
    return host, int(port)


def _round_view(env: Mapping[str, str], launched_worker: bool) -> Mapping[str, str]:
    """The environment as a worker of a launcher sees its pod in the round: torch's agent sets
    GROUP_RANK and GROUP_WORLD_SIZE (and WORLD_SIZE) for the round it started the worker in, while
    NODE_RANK and NNODES are the pod's own (its index and the job's largest size). In an elastic
    job's smaller round the round's view is the one that adds up: NNODES x NPROC_PER_NODE ==
    WORLD_SIZE."""
    if not launched_worker:
        return env
    group_size, group_rank = _lookup(env, "GROUP_WORLD_SIZE"), _lookup(env, "GROUP_RANK")
    if group_size is None or group_rank is None:
        return env
    return {**env, "NNODES": group_size, "NODE_RANK": group_rank}


def _elastic(env: Mapping[str, str], pods: int, restart_mode: RestartMode) -> tuple[int | None, int]:
    """DDP_MIN_MEMBERS (unset: a fixed-size job) and DDP_REPLACEMENT_WAIT_SECONDS."""
    wait = _int(
        env,
        "DDP_REPLACEMENT_WAIT_SECONDS",
        "set DDP_REPLACEMENT_WAIT_SECONDS to the whole seconds a round waits for more pods (>= 1)",
        default=DEFAULT_REPLACEMENT_WAIT,
        minimum=1,
    )
    variable = _min_members_variable(env)
    if variable is None:
        return None, wait
    fix = f"set {MIN_MEMBERS_ENV} to the fewest pods the job may train on, 1..NNODES={pods}"
    min_members = _int(env, variable, fix, minimum=1)
    if min_members > pods:
        raise ConfigError(variable, f"{min_members} > NNODES={pods}", fix)
    if restart_mode != "InPlace":
        raise ConfigError(
            variable,
            f"an elastic job ({variable} set) needs DDP_RESTART_MODE=InPlace: its pods change rounds in place",
            f"set DDP_RESTART_MODE=InPlace, or unset {variable} for a fixed-size job",
        )
    return min_members, wait


def _health_check(env: Mapping[str, str]) -> tuple[bool, int]:
    """DDP_HEALTH_CHECK (on/off, case-insensitive; unset: off) and DDP_HEALTH_CHECK_BYTES, checked
    whether the check is on or not, so that a bad size is found before anyone turns it on."""
    text = (env.get(HEALTH_CHECK_ENV) or "off").strip().lower()
    if text not in HEALTH_CHECK_SWITCH:
        raise ConfigError(
            HEALTH_CHECK_ENV, f"must be on or off, got {text!r}", f"set {HEALTH_CHECK_ENV} to on or off"
        )
    fix = (
        f"set {HEALTH_CHECK_BYTES_ENV} to the bytes of the check's buffer, "
        f"{health.FEWEST_BYTES}..{health.MOST_BYTES}, or unset it ({health.DEFAULT_BYTES})"
    )
    nbytes = _int(env, HEALTH_CHECK_BYTES_ENV, fix, default=health.DEFAULT_BYTES, minimum=health.FEWEST_BYTES)
    if nbytes > health.MOST_BYTES:
        raise ConfigError(HEALTH_CHECK_BYTES_ENV, f"must be <= {health.MOST_BYTES}, got {nbytes}", fix)
    return HEALTH_CHECK_SWITCH[text], nbytes


def _min_members_variable(env: Mapping[str, str]) -> str | None:
    """The variable that sets an elastic job's fewest members: MIN_MEMBERS_ENV, else its deprecated
    name (a pod of an older operator); None when neither is set (a fixed-size job)."""
    for name in (MIN_MEMBERS_ENV, DEPRECATED_MIN_MEMBERS_ENV):
        if _lookup(env, name) is not None:
            return name
    return None


def _restarts(env: Mapping[str, str]) -> tuple[RestartMode, int]:
    """DDP_RESTART_MODE (case-insensitive; unset: Recreate) and DDP_RESTART_BUDGET."""
    text = (env.get("DDP_RESTART_MODE") or "Recreate").strip()
    if text.lower() not in {mode.lower() for mode in RESTART_MODES}:
        raise ConfigError(
            "DDP_RESTART_MODE",
            f"unknown restart mode {text!r}",
            "set DDP_RESTART_MODE to InPlace or Recreate",
        )
    budget = _int(
        env,
        "DDP_RESTART_BUDGET",
        "set DDP_RESTART_BUDGET to the restarts the job may still spend (an integer >= 0)",
        default=DEFAULT_RESTART_BUDGET,
    )
    return ("InPlace" if text.lower() == "inplace" else "Recreate"), budget


def _world(env: Mapping[str, str]) -> tuple[int, int, int]:
    """WORLD_SIZE, NPROC_PER_NODE and NNODES, checked against each other."""
    world_size = _int(
        env,
        "WORLD_SIZE",
        "set WORLD_SIZE to replicas x nprocPerNode (a positive integer; the operator sets it)",
        minimum=1,
    )
    nproc = _int(
        env, "NPROC_PER_NODE", "set NPROC_PER_NODE to the processes per pod (>= 1)", default=1, minimum=1
    )
    if world_size % nproc != 0:
        raise ConfigError(
            "WORLD_SIZE",
            f"{world_size} is not a multiple of NPROC_PER_NODE={nproc}",
            "set WORLD_SIZE to NNODES x NPROC_PER_NODE",
        )
    pods = _int(
        env, "NNODES", "set NNODES to the number of pods (replicas)", default=world_size // nproc, minimum=1
    )
    if pods * nproc != world_size:
        raise ConfigError(
            "WORLD_SIZE",
            f"{world_size} != NNODES x NPROC_PER_NODE = {pods} x {nproc}",
            "set WORLD_SIZE to NNODES x NPROC_PER_NODE",
        )
    return world_size, nproc, pods


def _ranks(
    env: Mapping[str, str], world_size: int, nproc: int, pods: int, launched_worker: bool
) -> tuple[int, int, int]:
    """RANK, LOCAL_RANK and NODE_RANK of this process (a pod that launches workers is its first one)."""
    pod_rank = _int(
        env, "NODE_RANK", "set NODE_RANK to this pod's index (0 .. NNODES-1)", default=-1, minimum=-1
    )
    if pod_rank >= pods:
        raise ConfigError(
            "NODE_RANK", f"{pod_rank} >= NNODES={pods}", f"set NODE_RANK to a value in 0..{pods - 1}"
        )
    rank_fix = f"set RANK to this process's global rank, 0..{world_size - 1}"
    if nproc == 1 or launched_worker:
        default_rank = pod_rank if pod_rank >= 0 and nproc == 1 else (0 if world_size == 1 else None)
        rank = _int(env, "RANK", rank_fix, default=default_rank)
        if rank >= world_size:
            raise ConfigError("RANK", f"{rank} >= WORLD_SIZE={world_size}", rank_fix)
        local_rank = _int(env, "LOCAL_RANK", f"set LOCAL_RANK to 0..{nproc - 1}", default=0)
        if local_rank >= nproc:
            raise ConfigError(
                "LOCAL_RANK", f"{local_rank} >= NPROC_PER_NODE={nproc}", f"set LOCAL_RANK to 0..{nproc - 1}"
            )
        if pod_rank < 0:
            pod_rank = rank // nproc
        return rank, local_rank, pod_rank
    if pod_rank < 0:
        if pods != 1:
            raise ConfigError("NODE_RANK", "is not set", "set NODE_RANK to this pod's index (0 .. NNODES-1)")
        pod_rank = 0
    return pod_rank * nproc, 0, pod_rank


def _rendezvous(env: Mapping[str, str], world_size: int) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT (a gang of one needs no address)."""
    master_addr = _lookup(env, "MASTER_ADDR")
    if master_addr is None:
        if world_size > 1:
            raise ConfigError("MASTER_ADDR", "is not set", "set MASTER_ADDR to rank 0's DNS name or address")
        master_addr = "127.0.0.1"
    master_port = _int(
        env,
        "MASTER_PORT",
        "set MASTER_PORT to rank 0's rendezvous port (1..65535)",
        default=DEFAULT_MASTER_PORT,
    )
    if not 1 <= master_port <= 65535:
        raise ConfigError("MASTER_PORT", f"{master_port} is not a TCP port", "set MASTER_PORT to 1..65535")
    return master_addr, master_port


def resolve_backend(requested: Backend, cuda_available: bool) -> Literal["nccl", "gloo"]:
    """``auto`` means NCCL where CUDA devices are visible, else gloo."""
    if requested == "auto":
        return "nccl" if cuda_available else "gloo"
    return requested


# Where a rank can be made to fail on purpose (testing): before the check-in barrier of the rendezvous,
# before the checkpoint broadcast, before DDP's constructor (which broadcasts the parameters), at a
# training step, before the final barrier, at the start of the health check.
FAULT_POINTS: Final = ("rendezvous", "resume", "ddp", "step", "final-barrier", "health")
# How: vanish (SIGKILL, like a lost node), exit with a code through the normal exit path (this rank's
# own failure: its exit record is written; steps only), exit with a code without writing an exit
# record (a crash in native code), raise a ValueError (a bug in the rank's own code), or feed the model
# a batch of the wrong shape (a RuntimeError from torch that is not about a peer; steps only), or, in
# the health check only, be slow: sleep CODE milliseconds before each of its sends (a slow link).
FAULT_ACTIONS: Final = ("kill", "exit", "crash", "value-error", "bad-shape", "slow")
# Actions that take a code (ACTION=CODE), and actions that only one point can take.
_CODED_ACTIONS: Final = ("exit", "crash", "slow")
_STEP_ACTIONS: Final = ("exit", "bad-shape")
_HEALTH_ACTIONS: Final = ("slow",)


@dataclass(frozen=True)
class InjectedFault:
    """Testing aid: global rank ``rank`` fails by ``action`` at ``point`` (at ``step`` for "step")."""

    rank: int
    point: str
    action: str
    step: int | None = None
    code: int | None = None  # for "exit" and "crash"; milliseconds for "slow"
    # ":once": only in the job's first run (attempt 0, before any in-place restart), so the restart it
    # causes can get past it; otherwise it goes off every time a run reaches its point.
    once: bool = False

    def at(self, rank: int, point: str, step: int | None = None) -> bool:
        return self.rank == rank and self.point == point and self.step == step

    def describe(self) -> str:
        where = f"step {self.step}" if self.point == "step" else self.point
        what = f"{self.action} {self.code}" if self.action in _CODED_ACTIONS else self.action
        if self.action == "slow":
            what = f"slow by {self.code} ms in each send"
        return f"{what} at {where}"


@dataclass(frozen=True)
class TrainConfig:
    """The command line of ``python -m ddp_trainer``."""

    workload: str
    max_steps: int
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    comm_hook: str
    bucket_cap_mb: float
    sync_metrics: str
    checkpoint_dir: str | None
    checkpoint_every: int
    keep_checkpoints: int
    seed: int
    progress_every: int
    stop_check_every: int
    init_timeout: float
    watchdog_timeout: float
    metrics_host: str
    metrics_linger: float
    logger_sample_every: int
    sync_time_every: int
    data_dir: str
    mnist_url: str
    synthetic_width: int
    synthetic_depth: int
    synthetic_samples: int
    graph_data: str
    graph_nodes: int
    gcn_hidden: int
    gcn_layers: int
    powersgd_rank: int
    throttle_ms: float
    inject_fault: InjectedFault | None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def parse_injected_fault(text: str) -> InjectedFault:
    """``RANK:POINT:ACTION[:once]``, POINT one of FAULT_POINTS (``step=N`` for a step), ACTION one of
    FAULT_ACTIONS (``exit=CODE``, ``crash=CODE``, ``slow=MS``); ``once``: only in the job's first run."""
    usage = (
        f"expected RANK:POINT:ACTION[:once] with POINT in {', '.join(FAULT_POINTS)} (step=N) and ACTION in "
        f"{', '.join(FAULT_ACTIONS)} (exit=CODE, crash=CODE, slow=MS; exit and bad-shape at a step, slow "
        f"at health), got {text!r}"
    )
    parts = text.split(":")
    once = len(parts) == 4 and parts[3] == "once"
    if once:
        parts = parts[:3]
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(usage)
    rank_text, point_text, action_text = parts
    point, _, step_text = point_text.partition("=")
    action, _, code_text = action_text.partition("=")
    try:
        rank = int(rank_text)
        step = int(step_text) if step_text else None
        code = int(code_text) if code_text else None
    except ValueError:
        raise argparse.ArgumentTypeError(usage) from None
    valid = (
        rank >= 0
        and point in FAULT_POINTS
        and action in FAULT_ACTIONS
        and (step is not None) == (point == "step")
        and (code is not None) == (action in _CODED_ACTIONS)
        and (action not in _STEP_ACTIONS or point == "step")
        and (action not in _HEALTH_ACTIONS or point == "health")
    )
    if not valid:
        raise argparse.ArgumentTypeError(usage)
    return InjectedFault(rank=rank, point=point, action=action, step=step, code=code, once=once)


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="python -m ddp_trainer",
        description=(
            "DDP trainer of ddp-operator: joins the process group from the env contract (WORLD_SIZE, RANK, "
            "MASTER_ADDR, ...; see docs/trainer.md), trains a workload with DistributedDataParallel and "
            "exports gradient-sync metrics on DDP_METRICS_PORT. Exit codes: 0 done, 2 bad configuration, "
            "143 stopped by SIGTERM after the checkpoint, 170 a peer was lost or a collective stalled "
            "(retryable), 1 an error of the trainer's own code (permanent)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--workload",
        choices=WORKLOADS,
        default="digits",
        help="digits: scikit-learn's 8x8 digits (offline); mnist: MNIST from --data-dir, downloaded from "
        "--mnist-url when missing; synthetic: an MLP on random data, sized by --synthetic-width/-depth; "
        "gcn: a graph convolutional network on --graph-data, each rank on its shard of the training nodes",
    )
    add(
        "--max-steps",
        type=_non_negative_int,
        default=0,
        help="stop after this many optimizer steps (0: run --epochs epochs)",
    )
    add("--epochs", type=_positive_int, default=10, help="passes over the training set")
    add("--batch-size", type=_positive_int, default=32, help="samples per rank per step")
    add("--lr", type=_positive_float, default=0.1, help="SGD learning rate")
    add("--momentum", type=_non_negative_float, default=0.9, help="SGD momentum")
    add(
        "--comm-hook",
        choices=COMM_HOOKS,
        default="allreduce",
        help="gradient allreduce: plain fp32, fp16 or bf16 compression, or PowerSGD (rank --powersgd-rank)",
    )
    add("--bucket-cap-mb", type=_positive_float, default=25.0, help="DDP gradient bucket size in MiB")
    add(
        "--sync-metrics",
        choices=SYNC_METRICS_MODES,
        default="detailed",
        help="detailed: a timing comm hook, every metric; light: no Python hook (DDP's C++ path), "
        "no per-allreduce histogram; see docs/metrics.md",
    )
    add(
        "--checkpoint-dir",
        default=env.get("DDP_CHECKPOINT_DIR") or None,
        help="where global rank 0 writes and resumes checkpoints (default: $DDP_CHECKPOINT_DIR; "
        "none: no checkpoints)",
    )
    add(
        "--checkpoint-every",
        type=_non_negative_int,
        default=0,
        help="also write a checkpoint every N steps (0: only when stopped by SIGTERM and at the end)",
    )
    add("--keep-checkpoints", type=_positive_int, default=2, help="complete checkpoints kept on the volume")
    add("--seed", type=int, default=0, help="seed of model init, data order and synthetic data")
    add(
        "--progress-every", type=_positive_int, default=50, help="rank 0 prints a progress line every N steps"
    )
    add(
        "--stop-check-every",
        type=_positive_int,
        default=5,
        help="ranks combine their SIGTERM flags every N steps (one 1-element allreduce)",
    )
    add(
        "--init-timeout",
        type=_positive_float,
        default=300.0,
        help="seconds to form the process group (reach MASTER_ADDR:MASTER_PORT) before exiting 170",
    )
    add(
        "--watchdog-timeout",
        type=_positive_float,
        default=300.0,
        help="seconds a rank may spend in one collective before the watchdog ends it with exit 170",
    )
    add(
        "--metrics-host",
        default=env.get("DDP_METRICS_HOST") or "0.0.0.0",
        help="address the /metrics endpoint binds (default: $DDP_METRICS_HOST or all addresses)",
    )
    add(
        "--metrics-linger",
        type=_non_negative_float,
        default=env.get("DDP_METRICS_LINGER") or "0",
        help="keep serving /metrics this many seconds after training ends, so a last scrape sees the final "
        "values (a SIGTERM ends it early; default: $DDP_METRICS_LINGER or 0)",
    )
    add(
        "--logger-sample-every",
        type=_positive_int,
        default=10,
        help="DDP's C++ logger times backward compute/comm/overlap every N steps",
    )
    add(
        "--sync-time-every",
        type=_non_negative_int,
        default=0,
        help="detailed mode times the buckets of one step in N and counts every step (0: --stop-check-every, "
        "so each straggler exchange has one timed step; 1: every step); see docs/metrics.md",
    )
    add(
        "--data-dir",
        default=env.get("DDP_DATA_DIR") or "/tmp/ddp-data",
        help="where the mnist workload finds (or downloads) its IDX files, and gcn with --graph-data "
        "ogbn-products the dataset (raw/ and split/ as OGB publishes it)",
    )
    add(
        "--mnist-url",
        default=env.get("DDP_MNIST_URL") or DEFAULT_MNIST_URL,
        help="base URL of the four gzipped MNIST IDX files",
    )
    add("--synthetic-width", type=_positive_int, default=1024, help="hidden width of the synthetic MLP")
    add("--synthetic-depth", type=_positive_int, default=8, help="linear layers of the synthetic MLP")
    add("--synthetic-samples", type=_positive_int, default=4096, help="samples in the synthetic training set")
    add(
        "--graph-data",
        choices=GRAPH_DATA,
        default="generated",
        help="gcn: a generated products-like graph of --graph-nodes nodes, or ogbn-products from --data-dir",
    )
    add("--graph-nodes", type=_positive_int, default=20000, help="gcn: nodes of the generated graph")
    add("--gcn-hidden", type=_positive_int, default=128, help="gcn: width of the hidden layers")
    add("--gcn-layers", type=_positive_int, default=2, help="gcn: graph convolution layers")
    add("--powersgd-rank", type=_positive_int, default=2, help="matrix approximation rank of PowerSGD")
    add(
        "--throttle-ms",
        type=_non_negative_float,
        default=0.0,
        help="testing and demos: sleep this long after each step",
    )
    add(
        "--inject-fault",
        type=parse_injected_fault,
        default=None,
        metavar="RANK:POINT:ACTION",
        help="testing: global rank RANK fails at POINT (rendezvous, resume, ddp, step=N, final-barrier, "
        "health) by ACTION (kill: SIGKILL itself; exit=CODE: exit with CODE through the normal exit path, "
        "at a step; crash=CODE: exit without an exit record; value-error: raise ValueError; bad-shape: a "
        "batch of the wrong shape, at a step; slow=MS: sleep MS milliseconds before each of its sends "
        "in the health check)",
    )
    return parser


def parse_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> TrainConfig:
    """Parse the command line (argparse exits 2 with usage on a bad option)."""
    ns = build_parser(env).parse_args(list(argv))
    if ns.sync_metrics == "light" and ns.comm_hook == "powersgd":
        raise ConfigError(
            "--sync-metrics",
            "light mode cannot derive PowerSGD's payload without a hook",
            "use --sync-metrics detailed with --comm-hook powersgd",
        )
    return TrainConfig(**{field: getattr(ns, field) for field in TrainConfig.__dataclass_fields__})
