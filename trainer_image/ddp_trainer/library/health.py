"""The gang health check, the pure part: how long to measure, what the timings mean, who is slow.

Before the first training step, and when a group re-forms with a member new to it (a replacement pod,
an elastic grow), the ranks measure their links (``ddp_trainer.training.health_check`` runs the collectives;
docs/trainer.md, "Health check"):

- **all-reduce bus bandwidth**: a few ``all_reduce`` calls on one buffer after a warm-up. An
  iteration ends on the group when its last rank is done, so its time is the slowest rank's; the
  result is the median over the iterations, reported the way NCCL's tests do: the bus bandwidth,
  ``bytes x 2(n-1)/n / seconds``, which a ring all-reduce makes comparable across group sizes;
- **a ping-pong ring**: every rank sends a message to the next rank, which echoes it back, and times
  the round trip on its own clock (no clock is compared across nodes). Link ``r`` joins rank ``r`` and
  rank ``r + 1``; the links are timed in rounds (:func:`ring_rounds`) in which no rank is on two. A
  rank with a slow link to everything (a degraded NIC, a starved CPU) slows both of its links, a
  neighbour only one of its own: a rank whose *better* link is far below the group's median is the
  slow rank; without one, a single link far below the median of links is named on its own (a bad
  cable, a congested switch port), by its two ends.

Every rank computes the verdict from the same gathered timings, so every rank names the same rank.
How long it takes is bounded: each part runs one warm-up, then as many iterations as its share of
the budget allows at the warm-up's pace (between FEWEST and MOST), agreed by the whole group.

Pure and torch-free: the trainer's config reads the switch from here too.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

NO_SLOW_RANK: Final = -1
# DDP_HEALTH_CHECK_BYTES when unset, and its bounds: at 1 MiB bandwidth rather than latency sets the
# time on loopback and on TCP networks, and the check stays under a second on 8 gloo ranks sharing 2
# cores (docs/benchmarks.md); a fast fabric (InfiniBand, NVLink) needs tens of MiB for the same.
DEFAULT_BYTES: Final = 1 << 20
FEWEST_BYTES: Final = 1 << 10
MOST_BYTES: Final = 1 << 30
# Seconds of measured iterations each part may spend (warm-up excluded) when its iterations are slow,
# and how many it runs: at least FEWEST, whatever the budget, at most MOST, however fast they are.
PART_BUDGET: Final = 0.4
FEWEST_ITERATIONS: Final = 3
MOST_ITERATIONS: Final = 10
# "Far below the median": a rank or link at under this fraction of the group's median bandwidth. In
# quiet groups on the loaded 2-core machine the lowest rank stayed above 0.6 of the median, a rank 50
# ms late in its sends fell to 0.07 (docs/benchmarks.md);
# what it is meant to find (a NIC negotiated down from 100 to 25 Gb/s, RDMA falling back to TCP) is
# usually 4x or worse.
SLOW_FRACTION: Final = 0.25
# A file in the pod's launcher workspace (DDP_TRAINER_PROGRESS_DIR) once the pod's workers have been
# in a checked group: a pod without it is new to the gang.
JOINED_MARKER: Final = "health-joined"


def bus_bandwidth(nbytes: int, world_size: int, seconds: float) -> float:
    """Bytes per second over the bus of an all-reduce of ``nbytes`` that took ``seconds``: the
    algorithm bandwidth (bytes over time) times ``2(n-1)/n``, the share of the buffer a ring
    all-reduce moves over each rank's link (NCCL tests' convention). 0 for one rank."""
    if world_size < 2 or seconds <= 0:
        return 0.0
    return nbytes / seconds * 2 * (world_size - 1) / world_size


def iterations_within(warm_up_seconds: float, budget: float = PART_BUDGET) -> int:
    """How many measured iterations fit ``budget`` at the pace of the slowest rank's warm-up, at
    least FEWEST_ITERATIONS (a median of fewer says little), at most MOST_ITERATIONS."""
    if not warm_up_seconds > 0 or math.isinf(warm_up_seconds):
        return FEWEST_ITERATIONS
    fits = int(budget / warm_up_seconds)
    return max(FEWEST_ITERATIONS, min(MOST_ITERATIONS, fits))


def ring_rounds(world_size: int) -> list[list[int]]:
    """The links timed together, round by round: link ``r`` is rank ``r`` pinging rank ``r + 1``, and
    no rank is on two links of one round (it would time one while it echoes the other). A ring of an
    even size takes two rounds (even links, odd links); an odd one a third for its last link."""
    if world_size < 2:
        return []
    rounds: list[list[int]] = [[], [], []]
    for link in range(world_size):
        last_of_odd_ring = world_size % 2 == 1 and link == world_size - 1
        rounds[2 if last_of_odd_ring else link % 2].append(link)
    return [links for links in rounds if links]


def link_bandwidth(nbytes: int, round_trip_seconds: float) -> float:
    """Bytes per second of a link whose ping-pong of ``nbytes`` each way took ``round_trip_seconds``."""
    return 2 * nbytes / round_trip_seconds if round_trip_seconds > 0 else math.inf


def rank_bandwidths(links: Sequence[float]) -> list[float]:
    """Each rank's better link: rank ``r`` is on links ``r - 1`` and ``r``."""
    count = len(links)
    return [max(links[rank], links[(rank - 1) % count]) for rank in range(count)]


def far_below(values: Sequence[float], fraction: float = SLOW_FRACTION) -> int | None:
    """The index of the lowest value when it is under ``fraction`` of the median of ``values``."""
    if len(values) < 3:
        return None  # two values have no majority to compare against
    median = statistics.median(values)
    lowest = min(range(len(values)), key=lambda index: values[index])
    return lowest if values[lowest] < fraction * median else None


@dataclass(frozen=True)
class HealthResult:
    """What the group measured, the same on every rank."""

    world_size: int
    nbytes: int
    busbw: float  # bytes per second, the all-reduce's median iteration
    allreduce_seconds: float  # that iteration's time
    links: tuple[float, ...]  # bytes per second of link r (rank r <-> rank r + 1), as rank r timed it
    slow_rank: int = NO_SLOW_RANK
    slow_link: int | None = None  # link r: ranks r and r + 1

    def link_peer(self, rank: int) -> int:
        return (rank + 1) % self.world_size

    def status_fields(self, seconds: float) -> dict[str, object]:
        """The ``health`` status line's fields (docs/trainer.md, "Output format")."""
        slow_link = None if self.slow_link is None else f"{self.slow_link}-{self.link_peer(self.slow_link)}"
        finite = [link for link in self.links if math.isfinite(link)]
        return {
            "world_size": self.world_size,
            "bytes": self.nbytes,
            "busbw_bytes_per_s": self.busbw,
            "link_median_bytes_per_s": statistics.median(finite) if finite else None,
            "link_min_bytes_per_s": min(finite) if finite else None,
            "slow_rank": self.slow_rank,
            "slow_link": slow_link,
            "seconds": seconds,
        }


def judge(
    world_size: int,
    nbytes: int,
    allreduce_seconds: Sequence[Sequence[float]],
    round_trips: Sequence[Sequence[float]],
    fraction: float = SLOW_FRACTION,
) -> HealthResult:
    """The verdict from every rank's timings (index: rank, then iteration): the all-reduce's
    iterations and its round trips to the next rank."""
    if len(allreduce_seconds) != world_size or len(round_trips) != world_size:
        raise ValueError(
            f"timings of {len(allreduce_seconds)} and {len(round_trips)} ranks, not {world_size}"
        )
    # An iteration is over for the group when its slowest rank is done.
    iterations = [max(column) for column in zip(*allreduce_seconds, strict=True)]
    median = statistics.median(iterations) if iterations else math.nan
    links = tuple(link_bandwidth(nbytes, statistics.median(trips)) for trips in round_trips)
    slow_rank = far_below(rank_bandwidths(links), fraction)
    return HealthResult(
        world_size=world_size,
        nbytes=nbytes,
        busbw=bus_bandwidth(nbytes, world_size, median),
        allreduce_seconds=median,
        links=links,
        slow_rank=NO_SLOW_RANK if slow_rank is None else slow_rank,
        # A slow rank's links are slow because of it: a link is named on its own only without one.
        slow_link=far_below(links, fraction) if slow_rank is None else None,
    )


def pod_is_new(progress_dir: Path | None) -> bool:
    """Whether this rank's pod is new to the gang: no worker of it was in a checked group before.

    Without the in-place launcher's workspace every run of the process is a new group (the operator
    recreated the gang, or a launcher without restarts started it): new."""
    return progress_dir is None or not (progress_dir / JOINED_MARKER).exists()


def mark_joined(progress_dir: Path | None) -> None:
    """This pod's workers were in a checked group (the workspace outlives them, not the pod)."""
    if progress_dir is None:
        return
    with contextlib.suppress(OSError):  # then the next round checks again: a cost, not an error
        (progress_dir / JOINED_MARKER).touch()
