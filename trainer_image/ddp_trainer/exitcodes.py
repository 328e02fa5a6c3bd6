"""Exit codes of ``python -m ddp_trainer``: the operator's restart policy reads them.

Codes 1-127 are permanent failures for the ``ExitCode`` restart policy, 128 and above are retried, so
every failure that is not the job's own fault (a signal, a lost peer) must land at 128 or above, and an
error of the rank's own code (a shape error, CUDA out of memory, a bug) below it.

Which is which is decided here, from the exception alone, without importing torch: gloo reports a
vanished peer as a plain ``RuntimeError`` whose message names the broken connection ("Connection
closed by peer", "Timed out waiting ... for recv operation"), NCCL and the rendezvous store as
``torch.distributed.DistError`` subclasses.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any, Final

EXIT_OK: Final = 0
# An error of the rank's own code (the traceback is on stderr): retrying the same code cannot help.
EXIT_OWN_ERROR: Final = 1
# Bad configuration (env contract or CLI): retrying cannot help.
EXIT_BAD_CONFIG: Final = 2
# Stopped by SIGTERM after every rank agreed to stop and rank 0 wrote its checkpoint (128 + 15).
EXIT_STOPPED: Final = 143
# A peer was lost at any point (rendezvous, checkpoint broadcast, DDP construction, the training loop,
# the final barrier), the watchdog ended a rank stuck in a collective (a stall), or the process group
# could not be formed within the init timeout: the gang has to be restarted as a whole.
EXIT_PEER_LOST: Final = 170

RETRYABLE_THRESHOLD: Final = 128

# The launcher's last word: what it writes to the container's termination message whenever it exits by
# its own decision (every code above, a worker's code it passes on). A trainer container that ended by
# a signal without it was killed from outside, launcher and all (the pod's memory limit, a kill of the
# container): it restarted nothing in place, and under InPlace the operator replaces that pod alone
# like a lost one (docs/restarts.md). Kept equal to the operator's copy (observe.LAUNCHER_EXIT_MARKER)
# by a unit test.
LAUNCHER_EXIT_MARKER: Final = "ddp-launcher-exit"
# Where the message goes: Kubernetes' default terminationMessagePath; absent outside a container.
TERMINATION_MESSAGE_ENV: Final = "DDP_TERMINATION_MESSAGE_PATH"
DEFAULT_TERMINATION_MESSAGE_PATH: Final = "/dev/termination-log"

# Codes a rank exits with because of something that happened to another rank or to the whole gang,
# never because of its own code: when workers of one pod fail together, they are not the cause.
COLLATERAL_CODES: Final = frozenset({EXIT_PEER_LOST, EXIT_STOPPED})
# What a pod's launcher counts as collateral among its workers: also the stop signals torch's agent
# sends the remaining workers once one has failed (128 + SIGTERM, + SIGINT).
LAUNCHER_COLLATERAL_CODES: Final = COLLATERAL_CODES | {128 + signal.SIGTERM, 128 + signal.SIGINT}

# What gloo, NCCL and the TCP store say when the other end of a connection went away or never
# answered (matched case-insensitively anywhere in the message).
PEER_LOST_MESSAGES: Final = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "timed out waiting",  # gloo: "Timed out waiting 300000ms for recv operation to complete"
    "application timeout caused pair closure",
    "socket timeout",
    "the client socket has timed out",
    "failed to recv",
    "watchdog caught collective operation timeout",  # NCCL's collective timeout
    "ncclremoteerror",
    "remote process exited",
    "communicator was aborted",
    "nccl communicator is aborted",
)
# torch.distributed's own exception classes (by name, so that this module needs no torch).
DIST_ERROR_CLASSES: Final = frozenset({"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"})
# Errors a distributed class may still carry that are this rank's own doing (retrying cannot help).
OWN_ERROR_MESSAGES: Final = ("out of memory", "ncclinvalidusage", "ncclinvalidargument")


class PeerLostError(Exception):
    """The process group could not be formed, or a collective found a peer gone: exit EXIT_PEER_LOST."""


def is_retryable(exit_code: int) -> bool:
    """What the ``ExitCode`` restart policy decides for one rank's exit code."""
    return exit_code >= RETRYABLE_THRESHOLD


def _chain(error: BaseException) -> list[BaseException]:
    """The error and what it was raised from or while handling, innermost last (cycles cut)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not other for other in seen) and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _says_peer_lost(error: BaseException) -> bool:
    if isinstance(error, PeerLostError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    message = str(error).lower()
    if any(marker in message for marker in OWN_ERROR_MESSAGES):
        return False
    if any(cls.__name__ in DIST_ERROR_CLASSES for cls in type(error).__mro__):
        return True
    return any(marker in message for marker in PEER_LOST_MESSAGES)


def is_peer_lost(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) says a peer went away or stopped answering."""
    return any(_says_peer_lost(link) for link in _chain(error))


def exit_code_for(error: BaseException) -> int:
    """The exit code of a rank that ends with ``error``: a lost peer is retried, anything else is the
    rank's own error, permanent (a RuntimeError from torch included: a shape error, CUDA OOM)."""
    return EXIT_PEER_LOST if is_peer_lost(error) else EXIT_OWN_ERROR


def signal_exit_code(code: int) -> int:
    """torch reports a worker killed by signal N as -N; a shell would say 128 + N."""
    return 128 - code if code < 0 else code


def first_failure(
    failures: Mapping[int, int], records: Sequence[Mapping[str, Any]]
) -> tuple[int, int] | None:
    """The global rank and exit code of the pod's worker whose own failure came first, or None.

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
    # (collateral?, unrecorded?, time, rank, code): the smallest decides.
    candidates = [
        (code in LAUNCHER_COLLATERAL_CODES, False, time_ns, rank, code)
        for rank, (time_ns, code) in recorded.items()
    ]
    candidates += [
        (code in LAUNCHER_COLLATERAL_CODES, True, 0, rank, code)
        for rank, code in ((rank, signal_exit_code(raw)) for rank, raw in failures.items())
        if rank not in recorded
    ]
    if not candidates:
        return None
    chosen = min(candidates)
    return chosen[3], chosen[4]


def first_failure_code(failures: Mapping[int, int], records: Sequence[Mapping[str, Any]]) -> int:
    """The pod's exit code: that of :func:`first_failure`, or EXIT_OK when no worker failed."""
    found = first_failure(failures, records)
    return EXIT_OK if found is None else found[1]


def launcher_exit_message(code: int) -> str:
    return f"{LAUNCHER_EXIT_MARKER} code={code}\n"


def write_launcher_exit(code: int, environ: Mapping[str, str]) -> bool:
    """Leave the launcher's last word in the container's termination message; False where there is no
    such file (``ddpjob run``'s local processes) or it cannot be written."""
    path = environ.get(TERMINATION_MESSAGE_ENV) or DEFAULT_TERMINATION_MESSAGE_PATH
    if not os.path.exists(path):
        return False
    try:
        with open(path, "w", encoding="utf-8") as message:
            message.write(launcher_exit_message(code))
    except OSError:
        return False
    return True
