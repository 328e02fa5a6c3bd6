"""The operator's fetch (progress/pull.py) over a fake endpoint and clock: what it reads, what it hands
decide(), and when it kicks the job. Real endpoints: tests/integration/test_progress.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import pytest
from tests.unit.kube_factories import at

from ddp_operator.progress.pull import ProgressScraper, Target
from ddp_operator.progress.tracker import ProgressObservation

pytestmark = pytest.mark.unit

KEY = ("team-a", "mnist")
RANK0, RANK1 = "http://10.0.0.1:9400/metrics", "http://10.0.0.2:9400/metrics"


def exposition(rank: int, steps: int) -> str:
    return f'ddp_sync_steps_total{{rank="{rank}"}} {steps}\nddp_samples_total{{rank="{rank}"}} {steps * 32}\n'


def test_rank_zero_every_interval_every_rank_once_a_stall_is_suspected_and_a_kick_per_change() -> None:
    answers = {RANK0: exposition(0, 120), RANK1: exposition(1, 119)}
    fetched: list[str] = []
    kicked: list[tuple[str, str]] = []
    now = [at(0)]

    def fetch(url: str) -> str:
        fetched.append(url)
        return answers[url]

    scraper = ProgressScraper(kicked.append, clock=lambda: now[0], fetch=fetch)
    scraper.track(
        KEY,
        Target(
            0,
            RANK0,
            pods=2,
            world_size=2,
            stall_timeout=60,
            pod_urls={"mnist-0-0": RANK0, "mnist-1-0": RANK1},
        ),
    )
    seen = []
    for seconds in (0, 15, 30, 45):  # the step stands at 120 from 0 s: half the timeout is 30 s
        now[0] = at(seconds)
        asyncio.run(scraper.scrape_all())
        seen.append((fetched[:], len(kicked), scraper.observation(KEY)))
        fetched.clear()
    scraper.stop()
    assert [urls for urls, _, _ in seen] == [[RANK0], [RANK0], [RANK0, RANK0, RANK1], [RANK0, RANK0, RANK1]]
    # A kick for the first read, one for the first rate, one when every rank's step was read; none after.
    assert [kicks for _, kicks, _ in seen] == [1, 2, 3, 3]
    last = seen[-1][2]
    assert last is not None and (last.step, last.step_changed_at) == (120, at(0))
    assert last.rank_steps == {0: 120, 1: 119}
    assert last.rank_pods == {0: "mnist-0-0", 1: "mnist-1-0"}
    assert last.status is not None and last.status["step"] == 120


def test_a_new_attempt_starts_a_new_tracker() -> None:
    answers = {RANK0: exposition(0, 500)}
    now = [at(0)]
    scraper = ProgressScraper(lambda _key: None, clock=lambda: now[0], fetch=answers.__getitem__)
    scraper.track(KEY, Target(0, RANK0, pods=1, world_size=1))
    asyncio.run(scraper.scrape_all())
    answers[RANK0] = exposition(0, 3)  # attempt 1's processes count from 0
    scraper.track(KEY, Target(1, RANK0, pods=1, world_size=1))
    now[0] = at(15)
    asyncio.run(scraper.scrape_all())
    scraper.stop()
    observation = scraper.observation(KEY)
    assert observation is not None
    assert (observation.attempt, observation.step, observation.step_changed_at) == (1, 3, at(15))


POD2 = "http://10.0.0.3:9400/metrics"


def straggling(steps: int, rank: int) -> str:
    """Rank 0's pod naming ``rank`` three times slower in compute, at ``steps``."""
    return exposition(0, steps) + (
        f'ddp_straggler_rank{{rank="0"}} {rank}\nddp_straggler_slowdown{{rank="0"}} 3.0\n'
        'ddp_straggler_phase{phase="compute",rank="0"} 1.0\n'
    )


def read_rounds(
    rank0: Callable[[int], str], elastic: bool, times: tuple[int, ...]
) -> tuple[list[str], ProgressObservation | None]:
    """Reads of a shrunk 3-pod group (pod rank 1 gone: the round's rank 1 runs in pod 2), rank 0's
    endpoint answering ``rank0(seconds)`` at each of ``times``: the URLs fetched and the observation."""
    answers = {POD2: exposition(1, 100)}
    fetched: list[str] = []
    now = [at(0)]

    def fetch(url: str) -> str:
        fetched.append(url)
        return answers[url]

    scraper = ProgressScraper(lambda _key: None, clock=lambda: now[0], fetch=fetch)
    pods = {"mnist-0-0": RANK0, "mnist-2-0": POD2}
    scraper.track(KEY, Target(0, RANK0, pods=3, world_size=3, pod_urls=pods, elastic=elastic))
    for seconds in times:
        now[0] = at(seconds)
        answers[RANK0] = rank0(seconds)
        asyncio.run(scraper.scrape_all())
    scraper.stop()
    return fetched, scraper.observation(KEY)


MEMBERSHIP_READS = [
    pytest.param(True, 1, id="elastic-reads-the-round-once"),
    pytest.param(False, 0, id="fixed-size-needs-no-read"),
]


@pytest.mark.parametrize(("elastic", "reads_of_every_pod"), MEMBERSHIP_READS)
def test_a_straggler_of_a_shrunk_group_is_mapped_to_the_pod_its_endpoint_names(
    elastic: bool, reads_of_every_pod: int
) -> None:
    """After a shrink, the round's rank 1 runs in the pod of rank 2 (pod rank 1 is gone): the pods'
    own endpoints say so; a fixed-size job's layout needs no read."""
    fetched, observation = read_rounds(lambda seconds: straggling(100 + seconds, 1), elastic, (0, 15, 30))
    assert observation is not None and observation.straggler is not None
    assert fetched.count(POD2) == reads_of_every_pod
    assert observation.rank_pods == ({0: "mnist-0-0", 1: "mnist-2-0"} if elastic else {})


def checked_slow(steps: int, rank: int) -> str:
    """Rank 0's pod after a gang health check that found ``rank``'s links far below the others'."""
    return exposition(0, steps) + (
        f'ddp_health_slow_rank{{rank="0"}} {rank}\nddp_health_check_timestamp_seconds{{rank="0"}} 1.0e9\n'
    )


@pytest.mark.parametrize(("elastic", "reads_of_every_pod"), MEMBERSHIP_READS)
def test_the_health_checks_slow_rank_of_a_shrunk_group_is_mapped_to_its_pod(
    elastic: bool, reads_of_every_pod: int
) -> None:
    """The check names a rank of the current round, as a straggler is: an elastic job's rank is mapped
    to its pod by the pods' own endpoints (without the read, Shrink could not find the pod)."""
    fetched, observation = read_rounds(lambda seconds: checked_slow(100 + seconds, 1), elastic, (0, 15))
    assert observation is not None and observation.health is not None
    assert observation.health.slow_rank == 1
    assert fetched.count(POD2) == reads_of_every_pod
    assert observation.rank_pods == ({0: "mnist-0-0", 1: "mnist-2-0"} if elastic else {})


def silent(url: str) -> str:
    raise TimeoutError(f"{url} did not answer")  # a frozen process: its kernel accepts, nothing answers


@pytest.mark.parametrize(
    ("frozen", "rank_steps"),
    [
        pytest.param(RANK1, {0: 120}, id="rank-1s-pod-silent"),
        pytest.param(RANK0, {1: 119}, id="rank-0s-pod-silent-the-others-still-read"),
    ],
)
def test_a_read_of_every_pod_asked_for_comes_at_its_time_once_and_is_handed_on(
    frozen: str, rank_steps: dict[int, int]
) -> None:
    answers = {RANK0: exposition(0, 120), RANK1: exposition(1, 119)}
    fetched: list[str] = []
    kicked: list[tuple[str, str]] = []
    now = [at(0)]

    def fetch(url: str) -> str:
        fetched.append(url)
        return answers[url] if url != frozen or now[0] == at(0) else silent(url)

    scraper = ProgressScraper(kicked.append, clock=lambda: now[0], fetch=fetch)
    pods = {"mnist-0-0": RANK0, "mnist-1-0": RANK1}
    target = Target(0, RANK0, pods=2, world_size=2, stall_timeout=60, pod_urls=pods)
    scraper.track(KEY, target)
    asyncio.run(scraper.scrape_all())  # at 0 s: rank 0's pod, as every interval
    scraper.track(KEY, replace(target, read_every_pod_at=at(57)))
    reads = []
    for seconds in (56, 57, 58):
        now[0] = at(seconds)
        fetched.clear()
        kicks = len(kicked)
        asyncio.run(scraper.read_asked())
        reads.append((sorted(fetched), len(kicked) - kicks))
    scraper.stop()
    # Not before its time; at it, every pod once and a kick though the step stood; then not again.
    assert reads == [([], 0), ([RANK0, RANK1], 1), ([], 0)]
    observation = scraper.observation(KEY)
    assert observation is not None
    assert (observation.step, observation.rank_steps, observation.rank_steps_read_at) == (
        120,
        rank_steps,
        at(57),
    )
