"""Which exit code a rank's error maps to, and which code a pod of several workers reports (no torch).

The messages are the ones torch 2.15 raises (gloo's checked on real process groups; see
tests/trainer/test_exit_codes.py for the end-to-end checks).
"""

from __future__ import annotations

import pytest

from ddp_trainer.exitcodes import EXIT_OWN_ERROR, EXIT_PEER_LOST, PeerLostError, exit_code_for
from ddp_trainer.supervisor.launcher import first_failure_code

pytestmark = pytest.mark.unit

GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
    "[127.0.0.1]:57478. This is typically caused by a remote worker crashing."
)
GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms "
    "for recv operation to complete"
)


# Stand-ins for torch.distributed's classes: the classifier goes by class name, so it needs no torch.
class DistError(RuntimeError):
    pass


class DistBackendError(DistError):
    pass


class DistNetworkError(DistError):
    pass


class OutOfMemoryError(RuntimeError):
    pass


def raised_from(error: BaseException, cause: BaseException) -> BaseException:
    try:
        raise error from cause
    except BaseException as raised:
        return raised


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        pytest.param(RuntimeError(GLOO_CLOSED), EXIT_PEER_LOST, id="gloo-connection-closed"),
        pytest.param(RuntimeError(GLOO_TIMEOUT), EXIT_PEER_LOST, id="gloo-collective-timeout"),
        pytest.param(RuntimeError("Connection reset by peer"), EXIT_PEER_LOST, id="connection-reset"),
        pytest.param(
            DistBackendError("NCCL error: remote process exited or there was a network error"),
            EXIT_PEER_LOST,
            id="nccl-backend-error",
        ),
        pytest.param(DistNetworkError("failed to connect"), EXIT_PEER_LOST, id="store-network-error"),
        pytest.param(PeerLostError("could not form the group"), EXIT_PEER_LOST, id="rendezvous"),
        pytest.param(
            raised_from(ValueError("while stopping"), RuntimeError(GLOO_CLOSED)),
            EXIT_PEER_LOST,
            id="raised-from-a-lost-peer",
        ),
        pytest.param(
            RuntimeError("mat1 and mat2 shapes cannot be multiplied (32x56 and 64x10)"),
            EXIT_OWN_ERROR,
            id="shape-error",
        ),
        pytest.param(
            OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), EXIT_OWN_ERROR, id="cuda-oom"
        ),
        pytest.param(
            DistBackendError("NCCL error: unhandled cuda error, NCCL version 2.21: out of memory"),
            EXIT_OWN_ERROR,
            id="nccl-out-of-memory",
        ),
        pytest.param(DistBackendError("ncclInvalidUsage: bad call"), EXIT_OWN_ERROR, id="nccl-invalid-usage"),
        pytest.param(ValueError("bad label"), EXIT_OWN_ERROR, id="value-error"),
        pytest.param(ConnectionResetError("Connection reset by peer"), EXIT_OWN_ERROR, id="not-a-collective"),
        pytest.param(
            raised_from(RuntimeError("shape"), ValueError("bad input")), EXIT_OWN_ERROR, id="own-chain"
        ),
    ],
)
def test_exit_code_for(error: BaseException, expected: int) -> None:
    assert exit_code_for(error) == expected


def record(rank: int, code: int, time_ns: int) -> dict[str, int]:
    return {"rank": rank, "exit_code": code, "time_ns": time_ns}


@pytest.mark.parametrize(
    ("failures", "records", "expected"),
    [
        pytest.param({1: 3}, [record(1, 3, 10)], 3, id="one-worker-exit-3"),
        pytest.param({0: 170, 1: 3}, [record(0, 170, 20), record(1, 3, 10)], 3, id="earliest-record-wins"),
        pytest.param({0: 170, 1: 3}, [record(0, 170, 10), record(1, 3, 20)], 3, id="own-over-earlier-170"),
        pytest.param({0: -9}, [], 137, id="sigkill-without-record"),
        pytest.param({0: 170, 1: -9}, [record(0, 170, 10)], 137, id="killed-worker-over-recorded-170"),
        pytest.param({0: 170, 1: 3}, [record(0, 170, 10)], 3, id="unrecorded-exit-over-recorded-170"),
        pytest.param({0: 170, 1: -15, 2: -9}, [record(0, 170, 10)], 137, id="killed-over-the-agents-sigterm"),
        pytest.param({0: 1, 1: -9}, [record(0, 1, 10)], 1, id="recorded-own-over-unrecorded-own"),
        pytest.param({0: 1, 1: 3}, [record(0, 1, 20), record(1, 3, 10)], 3, id="earliest-own"),
        pytest.param({0: 143, 1: 143}, [record(0, 143, 20), record(1, 143, 10)], 143, id="agreed-stop"),
        pytest.param({0: -15, 1: 170}, [record(1, 170, 10)], 170, id="recorded-170-over-agents-sigterm"),
        pytest.param({}, [], 0, id="nothing-failed"),
    ],
)
def test_first_failure_code(failures: dict[int, int], records: list[dict[str, int]], expected: int) -> None:
    assert first_failure_code(failures, records) == expected


def test_the_entry_point_takes_sigterm_before_anything_else() -> None:
    """In a container the trainer is PID 1, and the kernel drops a signal PID 1 has no handler for:
    the entry point must catch SIGTERM before its slow imports, or a pod stopped while starting (a
    standby preempted for a rank) waits out its grace period."""
    import signal

    from ddp_trainer import __main__ as entry

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # A bad option ends main() right after its first lines, before any import of torch.
        assert entry.main(["--sync-metrics", "light", "--comm-hook", "powersgd"]) == 2
        assert signal.getsignal(signal.SIGTERM) == entry._stopped_while_starting
    finally:
        signal.signal(signal.SIGTERM, before)
