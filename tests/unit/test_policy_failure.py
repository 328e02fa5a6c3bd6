"""Which failure decides an attempt, and whether the gang is retried (policies/failure.py)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import at, observe, pod

from ddp_operator.policies.failure import (
    RankFailure,
    exit_code_from_returncode,
    failure_of,
    first_failure,
    is_retryable,
    judge_failures,
)

pytestmark = pytest.mark.unit


def code(rank: int, exit_code: int, at: float, reason: str = "Error") -> RankFailure:
    return RankFailure(rank=rank, finish_key=at, exit_code=exit_code, container_reason=reason)


def disrupted(rank: int, what: str, at: float) -> RankFailure:
    return RankFailure(rank=rank, finish_key=at, disruption=what)


@pytest.mark.parametrize(
    ("failures", "deciding_rank"),
    [
        pytest.param([code(1, 1, 10), code(0, 170, 11)], 1, id="permanent-first"),
        pytest.param([code(0, 170, 11), code(1, 137, 10)], 1, id="ordered-by-time-not-list"),
        pytest.param([code(0, 1, 12), code(1, 137, 10)], 1, id="retryable-first-permanent-collateral"),
        pytest.param([code(0, 170, 10), code(1, 1, 10)], 1, id="tie-goes-to-the-permanent-code"),
        pytest.param([code(3, 137, 10), code(2, 143, 10)], 2, id="tie-between-retryable-goes-to-lower-rank"),
        pytest.param([disrupted(2, "Evicted", 5), code(0, 170, 6)], 2, id="eviction-first"),
    ],
)
def test_first_failure(failures: list[RankFailure], deciding_rank: int) -> None:
    assert first_failure(failures).rank == deciding_rank


def test_no_failures_has_no_first() -> None:
    with pytest.raises(ValueError):
        first_failure([])


@pytest.mark.parametrize(
    ("policy", "failure", "retryable"),
    [
        pytest.param("ExitCode", code(0, 1, 0), False, id="exitcode-1-permanent"),
        pytest.param("ExitCode", code(0, 2, 0), False, id="exitcode-2-bad-config-permanent"),
        pytest.param("ExitCode", code(0, 127, 0), False, id="exitcode-127-permanent"),
        pytest.param("ExitCode", code(0, 128, 0), True, id="exitcode-128-retried"),
        pytest.param("ExitCode", code(0, 137, 0, "OOMKilled"), True, id="exitcode-oom-retried"),
        pytest.param("ExitCode", code(0, 143, 0), True, id="exitcode-sigterm-retried"),
        pytest.param("ExitCode", code(0, 170, 0), True, id="exitcode-peer-lost-retried"),
        pytest.param("ExitCode", code(0, 1, 0, "OOMKilled"), True, id="exitcode-oom-with-odd-code-retried"),
        pytest.param("ExitCode", disrupted(0, "Evicted", 0), True, id="exitcode-eviction-retried"),
        pytest.param("ExitCode", disrupted(0, "Preempted", 0), True, id="exitcode-preemption-retried"),
        pytest.param("ExitCode", disrupted(0, "PodDeleted", 0), True, id="exitcode-deleted-retried"),
        pytest.param("ExitCode", RankFailure(rank=0, finish_key=0), True, id="exitcode-no-code-retried"),
        pytest.param("OnFailure", code(0, 1, 0), True, id="onfailure-retries-1"),
        pytest.param("OnFailure", code(0, 137, 0), True, id="onfailure-retries-137"),
        pytest.param("Never", code(0, 137, 0), False, id="never-137"),
        pytest.param("Never", disrupted(0, "Evicted", 0), False, id="never-eviction"),
    ],
)
def test_is_retryable(policy: str, failure: RankFailure, retryable: bool) -> None:
    assert is_retryable(policy, failure) is retryable


@pytest.mark.parametrize(
    ("policy", "backoff", "restarts", "failures", "retry", "reason", "in_message"),
    [
        pytest.param(
            "ExitCode",
            3,
            0,
            [code(1, 1, 10), code(0, 170, 11)],
            False,
            "ExitCode",
            "rank 1 exited with code 1",
            id="permanent-fails-naming-rank-and-code",
        ),
        pytest.param(
            "ExitCode",
            3,
            0,
            [code(1, 137, 10), code(0, 1, 11)],
            True,
            "ExitCode",
            "rank 1 exited with code 137",
            id="retryable-first-restarts",
        ),
        pytest.param(
            "ExitCode",
            3,
            2,
            [code(0, 137, 10)],
            True,
            "ExitCode",
            "restart 3 of 3",
            id="last-restart-allowed",
        ),
        pytest.param(
            "ExitCode",
            3,
            3,
            [code(0, 137, 10)],
            False,
            "BackoffLimitExceeded",
            "backoffLimit 3",
            id="backoff-spent",
        ),
        pytest.param(
            "ExitCode",
            0,
            0,
            [code(0, 143, 10)],
            False,
            "BackoffLimitExceeded",
            "backoffLimit 0",
            id="backoff-zero",
        ),
        pytest.param(
            "ExitCode",
            3,
            1,
            [code(0, 137, 10, "OOMKilled")],
            True,
            "OOMKilled",
            "OOMKilled",
            id="oom-restarts",
        ),
        pytest.param(
            "ExitCode",
            2,
            2,
            [code(0, 137, 10, "OOMKilled")],
            False,
            "OOMKilled",
            "backoffLimit 2",
            id="oom-keeps-its-reason-when-backoff-spent",
        ),
        pytest.param(
            "ExitCode",
            3,
            0,
            [disrupted(1, "Evicted", 10)],
            True,
            "Evicted",
            "rank 1's pod was evicted",
            id="eviction-restarts",
        ),
        pytest.param(
            "Never",
            3,
            0,
            [code(1, 143, 10)],
            False,
            "ExitCode",
            "restartPolicy Never",
            id="never-fails-at-once",
        ),
        pytest.param(
            "OnFailure",
            3,
            0,
            [code(1, 1, 10)],
            True,
            "ExitCode",
            "attempt 5",
            id="onfailure-retries-permanent",
        ),
        pytest.param(
            "ExitCode",
            3,
            0,
            [code(0, 137, 10), code(1, 170, 11), code(2, 170, 11)],
            True,
            "ExitCode",
            "2 later failures of other ranks ignored",
            id="collateral-counted-in-message",
        ),
    ],
)
def test_judge_failures(
    policy: str,
    backoff: int,
    restarts: int,
    failures: list[RankFailure],
    retry: bool,
    reason: str,
    in_message: str,
) -> None:
    verdict = judge_failures(policy, backoff, restarts, failures, attempt=4)
    assert verdict.retry is retry
    assert verdict.reason == reason
    assert in_message in verdict.message


@pytest.mark.parametrize(
    ("returncode", "exit_code"),
    [
        pytest.param(0, 0, id="success"),
        pytest.param(1, 1, id="plain-code"),
        pytest.param(-9, 137, id="sigkill"),
        pytest.param(-15, 143, id="sigterm"),
    ],
)
def test_local_return_codes_map_like_containers(returncode: int, exit_code: int) -> None:
    assert exit_code_from_returncode(returncode) == exit_code


@pytest.mark.parametrize(
    ("observed", "expected"),
    [
        pytest.param(pod(1), None, id="running"),
        pytest.param(pod(1, exit_code=0), None, id="succeeded"),
        pytest.param(pod(1, exit_code=1, finished=12), (1, None, 12.0), id="exited"),
        pytest.param(pod(1, deleting_at=20), (None, "PodDeleted", 20.0), id="deleted-under-the-job"),
        pytest.param(
            pod(1, exit_code=143, finished=21, deleting_at=20),
            (143, "PodDeleted", 21.0),
            id="the-deletions-sigterm-is-not-the-process",
        ),
        pytest.param(
            pod(1, exit_code=1, finished=12, deleting_at=20),
            (1, None, 12.0),
            id="ended-before-it-was-deleted",
        ),
        pytest.param(pod(1, phase="Failed", pod_reason="Evicted"), (None, "Evicted", 99.0), id="evicted"),
    ],
)
def test_the_failure_a_pod_shows(observed: dict[str, Any], expected: tuple[Any, ...] | None) -> None:
    (observation,) = observe(observed)
    result = failure_of(observation, at(99))
    if expected is None:
        assert result is None
        return
    assert result is not None and result.rank == 1
    assert (result.exit_code, result.disruption, result.finish_key - at(0).timestamp()) == expected
