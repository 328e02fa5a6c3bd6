"""The gang health check's arithmetic and verdict (ddp_trainer.library.health), its switch in the env contract,
its testing aid (``--inject-fault RANK:health:slow=MS``), its series and its status line."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from ddp_trainer.config import ConfigError, InjectedFault, parse_env, parse_injected_fault
from ddp_trainer.library import health
from ddp_trainer.library.health import NO_SLOW_RANK, HealthResult
from ddp_trainer.metrics import create_health_metrics
from ddp_trainer.progress import format_status_line, parse_status_line
from ddp_trainer.training import faults

pytestmark = pytest.mark.unit

MIB = 1 << 20
# Bandwidths of a link (bytes per second) and the round trips of 1 MiB that give them.
FAST, SLOW = 1e9, 1e8
FAST_TRIP, SLOW_TRIP = 2 * MIB / FAST, 2 * MIB / SLOW


@pytest.mark.parametrize(
    ("nbytes", "world_size", "seconds", "expected"),
    [
        pytest.param(MIB, 2, 0.001, MIB / 0.001, id="two-ranks-busbw-is-algbw"),
        pytest.param(MIB, 4, 0.001, MIB / 0.001 * 1.5, id="four-ranks-times-2(n-1)/n"),
        pytest.param(MIB, 8, 0.002, MIB / 0.002 * 1.75, id="eight-ranks"),
        pytest.param(MIB, 1, 0.001, 0.0, id="one-rank-moves-nothing"),
        pytest.param(MIB, 4, 0.0, 0.0, id="no-time-measured"),
    ],
)
def test_bus_bandwidth_follows_nccl_tests(
    nbytes: int, world_size: int, seconds: float, expected: float
) -> None:
    assert health.bus_bandwidth(nbytes, world_size, seconds) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("warm_up", "budget", "expected"),
    [
        pytest.param(0.01, 0.4, health.MOST_ITERATIONS, id="fast-capped-at-most"),
        pytest.param(0.05, 0.4, 8, id="as-many-as-fit"),
        pytest.param(0.2, 0.4, health.FEWEST_ITERATIONS, id="slow-gets-the-fewest"),
        pytest.param(5.0, 0.4, health.FEWEST_ITERATIONS, id="very-slow-still-the-fewest"),
        pytest.param(0.0, 0.4, health.FEWEST_ITERATIONS, id="no-time-measured"),
        pytest.param(math.inf, 0.4, health.FEWEST_ITERATIONS, id="infinite"),
        pytest.param(math.nan, 0.4, health.FEWEST_ITERATIONS, id="nan"),
    ],
)
def test_iterations_fit_the_budget_within_bounds(warm_up: float, budget: float, expected: int) -> None:
    assert health.iterations_within(warm_up, budget) == expected


@pytest.mark.parametrize(
    ("world_size", "expected"),
    [
        pytest.param(1, [], id="one-rank-no-link"),
        pytest.param(2, [[0], [1]], id="two-ranks-each-way"),
        pytest.param(3, [[0], [1], [2]], id="odd-ring-three-rounds"),
        pytest.param(4, [[0, 2], [1, 3]], id="even-ring-two-rounds"),
        pytest.param(5, [[0, 2], [1, 3], [4]], id="odd-ring-last-link-alone"),
        pytest.param(8, [[0, 2, 4, 6], [1, 3, 5, 7]], id="eight-ranks"),
    ],
)
def test_ring_rounds(world_size: int, expected: list[list[int]]) -> None:
    assert health.ring_rounds(world_size) == expected


@pytest.mark.parametrize("world_size", [pytest.param(size, id=f"{size}-ranks") for size in range(2, 12)])
def test_every_link_is_timed_once_and_no_rank_is_on_two_links_of_a_round(world_size: int) -> None:
    rounds = health.ring_rounds(world_size)
    assert sorted(link for links in rounds for link in links) == list(range(world_size))
    for links in rounds:
        ends = [rank for link in links for rank in (link, (link + 1) % world_size)]
        assert len(ends) == len(set(ends))


@pytest.mark.parametrize(
    ("links", "expected"),
    [
        pytest.param([FAST, FAST, FAST], [FAST, FAST, FAST], id="quiet"),
        pytest.param([SLOW, SLOW, FAST, FAST], [FAST, SLOW, FAST, FAST], id="rank-1-on-two-slow-links"),
        pytest.param(
            [FAST, SLOW, FAST, FAST], [FAST, FAST, FAST, FAST], id="one-slow-link-each-end-has-another"
        ),
    ],
)
def test_a_rank_is_as_good_as_its_better_link(links: list[float], expected: list[float]) -> None:
    assert health.rank_bandwidths(links) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        pytest.param([1.0, 1.0, 1.0, 1.0], None, id="all-equal"),
        pytest.param([1.0, 0.9, 1.1, 0.5], None, id="half-the-median-is-noise"),
        pytest.param([1.0, 1.0, 0.1, 1.0], 2, id="a-tenth-is-far-below"),
        pytest.param([1.0, 1.0, 0.25, 1.0], None, id="exactly-the-fraction-is-not-below"),
        pytest.param([1.0, 0.2, 0.1, 1.0, 1.0], 2, id="the-lowest-of-two-low"),
        pytest.param([1.0, 0.01], None, id="two-values-no-majority"),
        pytest.param([], None, id="none"),
    ],
)
def test_far_below_the_median(values: list[float], expected: int | None) -> None:
    assert health.far_below(values) == expected


def trips(*per_rank: float, iterations: int = 3) -> list[list[float]]:
    return [[trip] * iterations for trip in per_rank]


@pytest.mark.parametrize(
    ("round_trips", "slow_rank", "slow_link"),
    [
        pytest.param(trips(FAST_TRIP, FAST_TRIP, FAST_TRIP, FAST_TRIP), NO_SLOW_RANK, None, id="quiet-4"),
        # Rank 2 is slow: link 1 (rank 1 pings 2) and link 2 (rank 2 pings 3).
        pytest.param(trips(FAST_TRIP, SLOW_TRIP, SLOW_TRIP, FAST_TRIP), 2, None, id="slow-rank-2-of-4"),
        pytest.param(trips(FAST_TRIP, SLOW_TRIP, SLOW_TRIP), 2, None, id="slow-rank-2-of-3"),
        # Rank 0 is slow: link 7 (rank 7 pings 0, around the ring) and link 0. Both are far below the
        # median of 8 links, but they are slow because of rank 0: no link is named on its own.
        pytest.param(
            trips(SLOW_TRIP, *[FAST_TRIP] * 6, SLOW_TRIP * 2), 0, None, id="slow-rank-0-of-8-around-the-ring"
        ),
        pytest.param(
            trips(FAST_TRIP, FAST_TRIP, SLOW_TRIP, FAST_TRIP, FAST_TRIP), NO_SLOW_RANK, 2, id="slow-link"
        ),
        pytest.param(trips(SLOW_TRIP, SLOW_TRIP), NO_SLOW_RANK, None, id="two-ranks-cannot-tell"),
        # One round trip of three is slow (a descheduled rank): the median keeps the link fast.
        pytest.param(
            [[FAST_TRIP] * 3, [FAST_TRIP, SLOW_TRIP * 10, FAST_TRIP], [FAST_TRIP] * 3, [FAST_TRIP] * 3],
            NO_SLOW_RANK,
            None,
            id="one-slow-iteration-is-noise",
        ),
    ],
)
def test_judge_names_the_slow_rank_and_link(
    round_trips: list[list[float]], slow_rank: int, slow_link: int | None
) -> None:
    world_size = len(round_trips)
    result = health.judge(world_size, MIB, [[0.001] * 3] * world_size, round_trips)
    assert (result.slow_rank, result.slow_link) == (slow_rank, slow_link)
    assert len(result.links) == world_size


def test_an_all_reduce_iteration_takes_its_slowest_ranks_time() -> None:
    # Iteration times per rank: the group's are 3, 2 and 4 ms; the median is 3 ms.
    seconds = [[0.001, 0.002, 0.004], [0.003, 0.001, 0.001], [0.002, 0.001, 0.001]]
    result = health.judge(3, MIB, seconds, trips(FAST_TRIP, FAST_TRIP, FAST_TRIP))
    assert result.allreduce_seconds == pytest.approx(0.003)
    assert result.busbw == pytest.approx(MIB / 0.003 * 4 / 3)
    assert result.links == pytest.approx((FAST, FAST, FAST))


@pytest.mark.parametrize(
    ("allreduce", "round_trips"),
    [
        pytest.param([[0.001]] * 2, trips(FAST_TRIP, FAST_TRIP, FAST_TRIP), id="too-few-all-reduce-rows"),
        pytest.param([[0.001]] * 3, trips(FAST_TRIP, FAST_TRIP), id="too-few-round-trip-rows"),
        pytest.param([[0.001], [0.001, 0.002], [0.001]], trips(FAST_TRIP, FAST_TRIP, FAST_TRIP), id="ragged"),
    ],
)
def test_judge_refuses_timings_of_another_group(
    allreduce: Sequence[Sequence[float]], round_trips: Sequence[Sequence[float]]
) -> None:
    with pytest.raises(ValueError):
        health.judge(3, MIB, allreduce, round_trips)


def test_the_status_fields_name_the_slow_link_by_its_ends_around_the_ring() -> None:
    result = HealthResult(4, MIB, 2e9, 0.001, (FAST, FAST, FAST, SLOW), slow_rank=NO_SLOW_RANK, slow_link=3)
    line = format_status_line("health", result.status_fields(0.5))
    assert parse_status_line(line) == (
        "health",
        {
            "world_size": "4",
            "bytes": str(MIB),
            "busbw_bytes_per_s": "2e+09",
            "link_median_bytes_per_s": "1e+09",
            "link_min_bytes_per_s": "1e+08",
            "slow_rank": "-1",
            "slow_link": "3-0",
            "seconds": "0.5",
        },
    )


def test_a_pod_is_new_until_its_workers_were_in_a_checked_group(tmp_path: Path) -> None:
    assert health.pod_is_new(None)
    assert health.pod_is_new(tmp_path)
    health.mark_joined(tmp_path)
    assert not health.pod_is_new(tmp_path)
    health.mark_joined(None)  # nowhere to keep it: every run of the process is a new group
    assert health.pod_is_new(None)
    health.mark_joined(tmp_path / "gone")  # an unwritable workspace costs a check, not an error
    assert health.pod_is_new(tmp_path / "gone")


BASE = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        pytest.param({}, (False, health.DEFAULT_BYTES), id="unset-off"),
        pytest.param({"DDP_HEALTH_CHECK": "on"}, (True, health.DEFAULT_BYTES), id="on"),
        pytest.param({"DDP_HEALTH_CHECK": " ON "}, (True, health.DEFAULT_BYTES), id="case-and-space"),
        pytest.param({"DDP_HEALTH_CHECK": "off"}, (False, health.DEFAULT_BYTES), id="off"),
        pytest.param({"DDP_HEALTH_CHECK": ""}, (False, health.DEFAULT_BYTES), id="empty-off"),
        pytest.param(
            {"DDP_HEALTH_CHECK": "on", "DDP_HEALTH_CHECK_BYTES": "4194304"}, (True, 4 * MIB), id="bytes"
        ),
        pytest.param({"DDP_HEALTH_CHECK_BYTES": "1024"}, (False, 1024), id="fewest-bytes-while-off"),
    ],
)
def test_the_switch_and_size_in_the_env_contract(env: Mapping[str, str], expected: tuple[bool, int]) -> None:
    parsed = parse_env({**BASE, **env})
    assert (parsed.health_check, parsed.health_check_bytes) == expected


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        pytest.param({"DDP_HEALTH_CHECK": "yes"}, "DDP_HEALTH_CHECK", id="not-on-or-off"),
        pytest.param({"DDP_HEALTH_CHECK_BYTES": "1MiB"}, "DDP_HEALTH_CHECK_BYTES", id="bytes-not-an-integer"),
        pytest.param({"DDP_HEALTH_CHECK_BYTES": "1023"}, "DDP_HEALTH_CHECK_BYTES", id="bytes-too-few"),
        pytest.param(
            {"DDP_HEALTH_CHECK_BYTES": str((1 << 30) + 1)}, "DDP_HEALTH_CHECK_BYTES", id="bytes-too-many"
        ),
    ],
)
def test_a_bad_switch_or_size_names_its_variable(env: Mapping[str, str], variable: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_env({**BASE, **env})
    assert raised.value.variable == variable


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("2:health:slow=200", InjectedFault(2, "health", "slow", code=200), id="slow"),
        pytest.param("1:health:kill", InjectedFault(1, "health", "kill"), id="kill-at-health"),
        pytest.param(
            "0:health:slow=5:once", InjectedFault(0, "health", "slow", code=5, once=True), id="slow-once"
        ),
    ],
)
def test_the_health_point_and_the_slow_action_parse(text: str, expected: InjectedFault) -> None:
    assert parse_injected_fault(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("2:health:slow", id="slow-without-milliseconds"),
        pytest.param("2:step=3:slow=10", id="slow-at-a-step"),
        pytest.param("2:ddp:slow=10", id="slow-elsewhere"),
        pytest.param("2:health:exit=3", id="exit-outside-the-loop"),
    ],
)
def test_the_slow_action_is_refused_elsewhere(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_injected_fault(text)


@pytest.mark.parametrize(
    ("fault", "rank", "expected"),
    [
        pytest.param(InjectedFault(2, "health", "slow", code=250), 2, 0.25, id="its-rank"),
        pytest.param(InjectedFault(2, "health", "slow", code=250), 1, 0.0, id="another-rank"),
        pytest.param(InjectedFault(2, "health", "kill"), 2, 0.0, id="another-action"),
        pytest.param(None, 2, 0.0, id="no-fault"),
    ],
)
def test_only_the_slow_rank_is_late_in_its_sends(
    fault: InjectedFault | None, rank: int, expected: float
) -> None:
    assert faults.send_delay(fault, rank) == expected


def test_a_slow_rank_fails_nothing_at_the_health_point() -> None:
    faults.inject(InjectedFault(2, "health", "slow", code=250), 2, "health")


def test_the_health_series_carry_the_verdict_and_this_ranks_link() -> None:
    registry = CollectorRegistry(auto_describe=True)
    result = HealthResult(3, MIB, 2e9, 0.001, (FAST, SLOW, SLOW), slow_rank=2, slow_link=None)
    create_health_metrics(2, registry).show(result, seconds=0.75, timestamp=1.7e9)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"rank": "2", **labels})

    assert value("ddp_health_busbw_bytes_per_second") == 2e9
    assert value("ddp_health_allreduce_seconds") == 0.001
    assert value("ddp_health_link_bandwidth_bytes_per_second", peer="0") == SLOW
    assert value("ddp_health_slow_rank") == 2
    assert value("ddp_health_slow_link") == -1
    assert value("ddp_health_check_seconds") == 0.75
    assert value("ddp_health_check_timestamp_seconds") == 1.7e9
