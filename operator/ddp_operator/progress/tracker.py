"""Reads of one attempt over time: rates, percent done, the straggler and the step a stall counts from.

Pure: the fetcher hands in each round of reads with the time it was taken; nothing here reads a
clock or a socket. Both fetchers use it alike: the operator hands in rank 0's pod every interval
(rank 0's pod holds the job-wide view: its own counters, every rank taking the same steps with the
same batch size, and the straggler rank 0 names from the ranks' exchange), `ddpjob run` every pod
every second. A rate is taken over the pods read at both ends of the window and scaled to all the
job's pods, so the two give the same numbers for the same training.

Times are ``datetime`` (timezone-aware): the operator's clock, and `ddpjob run`'s, is the wall clock
of the machine that reads, never a node's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, NamedTuple

from ddp_operator.policies.accounting import GroupRestartReport
from ddp_operator.progress import histogram
from ddp_operator.progress.exposition import HealthCheck, PodScrape

# A rank is a straggler when rank 0's exchange names it as the rank the others wait for, and the
# job's step is at least this many times longer with it than it would be without it (the operator's
# --straggler-threshold)...
STRAGGLER_THRESHOLD: Final = 1.5
# ... for this long (the operator's --straggler-window): one slow exchange is noise (a page fault, a
# neighbour's burst), three reads at the operator's 15 s interval are not; `ddpjob run` reads every
# second and waits as long, so both name the same rank after the same time.
STRAGGLER_WINDOW_SECONDS: Final = 30.0
# Rates and the allreduce p50 cover the reads of the last this-many seconds (always at least the last
# two): `ddpjob run`'s line, read every second, is smoothed over 10 s; the operator, reading every
# 15 s by default, gets the rate between its last two reads.
RATE_WINDOW_SECONDS: Final = 10.0


class SlowRank(NamedTuple):
    """The rank rank 0's last exchange named: the others wait for it (docs/metrics.md)."""

    rank: int
    # The job's step time with it over the estimated step time without it.
    slowdown: float
    # Where it lost its time: data, compute or communication (None from a trainer that does not say).
    phase: str | None = None


@dataclass(frozen=True)
class StragglerSighting:
    """A slow rank as rank 0 last named it, and since when it has been named, persistently slow."""

    rank: int
    slowdown: float
    since: datetime
    phase: str | None = None
    # When the reads last saw the group re-form (None: not since the attempt's first round): a pod that
    # joined later is in the group only from then on.
    group_since: datetime | None = None


def slow_rank(rank_zero: PodScrape | None, threshold: float) -> SlowRank | None:
    """The rank rank 0's last exchange named, when it slows the job at least ``threshold`` times."""
    if rank_zero is None:
        return None
    rank, slowdown = rank_zero.straggler_rank, rank_zero.straggler_slowdown
    if rank is None or slowdown is None or not math.isfinite(slowdown) or slowdown < threshold:
        return None
    return SlowRank(rank, slowdown, rank_zero.straggler_phase)


def follow_straggler(
    previous: StragglerSighting | None,
    rank_zero: PodScrape,
    now: datetime,
    threshold: float,
    group_since: datetime | None = None,
) -> StragglerSighting | None:
    """Follow one slow rank across reads (its slowdown and phase as last read); another rank named, or
    a group re-formed since (``group_since``: a new round, whose members' windows start afresh),
    starts anew."""
    slow = slow_rank(rank_zero, threshold)
    if slow is None:
        return None
    same = previous is not None and previous.rank == slow.rank and previous.group_since == group_since
    since = previous.since if same and previous is not None else now
    return StragglerSighting(slow.rank, slow.slowdown, since, slow.phase, group_since)


def persistence_left(sighting: StragglerSighting | None, window: float, now: datetime) -> float | None:
    """Seconds until the sighting has lasted ``window`` (0: it has, it is the straggler); None: none."""
    if sighting is None:
        return None
    return max(0.0, window - (now - sighting.since).total_seconds())


@dataclass(frozen=True)
class ProgressObservation:
    """What the operator has seen of one attempt's training, as ``decide`` reads it.

    ``step_changed_at``: when the current step was made, on the operator's clock (``stepped_at``: the
    ranks' own time of it where it agrees with the reads, else when a read first showed it). ``rank_steps``: every rank's step, read only while a
    stall is suspected, to name the ranks furthest behind.
    """

    attempt: int
    step: int
    step_changed_at: datetime
    status: Mapping[str, object] | None = None
    straggler: StragglerSighting | None = None
    rank_steps: Mapping[int, int] = field(default_factory=dict)
    # When the read of every pod that gave ``rank_steps`` started: a stall is judged on a read that
    # late (policies.stall.verdict_left).
    rank_steps_read_at: datetime | None = None
    # What rank 0's pod says of its group's restarts, and the kept step time (goodput).
    restart: GroupRestartReport | None = None
    # The attempt's seconds per step as the reads saw it made (ProgressTracker.step_seconds): the pace
    # the stall limit follows without stallTimeoutSeconds (policies.stall.limit).
    step_seconds: float | None = None
    # When the reads last saw the group change (an in-place restart or a resize counted by rank 0's
    # pod): a re-formed group's first steps are not late, so the stall clock starts again there.
    group_changed_at: datetime | None = None
    # Training is over (the step reached the target the ranks export): nothing can stall any more.
    finished: bool = False
    # Global rank -> pod name in the current round, as the pods' endpoints last said (ranks.py):
    # which pod a straggler or a stalled rank of an elastic job is.
    rank_pods: Mapping[int, str] = field(default_factory=dict)
    # Rank 0's last gang health check, when it found a rank far below the group (policies.straggler).
    health: HealthCheck | None = None


@dataclass(frozen=True)
class ProgressView:
    """What the reads of an attempt show now; None where they cannot tell (yet)."""

    pods_total: int
    pods_reporting: int = 0
    observed_at: datetime | None = None
    step: int | None = None
    target_steps: int | None = None
    percent_complete: int | None = None
    seconds_remaining: int | None = None
    samples_per_second: float | None = None
    loss: float | None = None
    overlap: float | None = None
    allreduce_p50: float | None = None
    bus_bandwidth: float | None = None
    last_sync: datetime | None = None
    # The slow rank as followed; whether it lasted the window is the reader's call (persistence_left).
    straggler: StragglerSighting | None = None


@dataclass(frozen=True)
class _Round:
    at: datetime
    pods: Mapping[int, PodScrape]

    @property
    def step(self) -> float | None:
        return _max(p.steps for p in self.pods.values())


def stepped_at(last_sync: float | None, now: datetime, before: datetime | None) -> datetime:
    """When the step a read (at ``now``) shows first was made, on the operator's clock. The read
    before it (at ``before``) did not show it, so it was made between the two: the ranks' own time of
    their last synchronized step (``ddp_last_sync_timestamp_seconds``, a node's clock) is taken when it
    falls there, and the read's time otherwise (a node clock that disagrees is not trusted). Taking the
    read's time alone put the stall clock's start up to one read interval after a hang, and the hang's
    detection that much past its limit (docs/restarts.md)."""
    if last_sync is None or before is None:
        return now
    made = datetime.fromtimestamp(last_sync, UTC)
    return made if before < made <= now else now


def _max(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _mean(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


Pairs = Sequence[tuple[PodScrape, PodScrape]]


def _increase(pairs: Pairs, counter: Callable[[PodScrape], float | None]) -> tuple[float, int] | None:
    """How much a counter grew across the pods read at both ends, and over how many pods.

    None when no pod has it at both ends, or when it went back in one: that is a new process.
    """
    known = [
        (n, o)
        for n, o in ((counter(new), counter(old)) for new, old in pairs)
        if n is not None and o is not None
    ]
    if not known or any(n < o for n, o in known):
        return None
    return sum(n - o for n, o in known), len(known)


class ProgressTracker:
    """The reads of one attempt of one job (a new attempt: a new tracker, or ``reset``)."""

    def __init__(
        self,
        pods: int,
        world_size: int,
        *,
        threshold: float = STRAGGLER_THRESHOLD,
        rate_window_seconds: float = RATE_WINDOW_SECONDS,
    ) -> None:
        self.pods = pods
        self.world_size = world_size
        self.threshold = threshold
        self.rate_window_seconds = rate_window_seconds
        self._rounds: deque[_Round] = deque()
        # Every pod's last answer in this attempt, kept after it goes quiet (the summary's numbers).
        self.latest: dict[int, PodScrape] = {}
        # The furthest synchronized step read in this attempt, and when a read first showed it.
        self.step = 0
        self.step_changed_at: datetime | None = None
        self.straggler: StragglerSighting | None = None
        # The first read that showed a step, for the attempt's pace (step_seconds).
        self._first_step: tuple[int, datetime] | None = None
        # The group's restarts as rank 0's pod last reported them, and when a read saw them change.
        self._group_restarts: int | None = None
        self.group_changed_at: datetime | None = None
        self.target_steps = 0
        # Pods in the group now, as rank 0's pod reports them (an elastic group may train on fewer than
        # ``pods``); None until reported.
        self.members: int | None = None

    @property
    def step_seconds(self) -> float | None:
        """Seconds per step over the steps this attempt's reads saw made (from the first read that
        showed a step to the read that showed the newest one); until two reads have seen steps made,
        rank 0's pod's own timing of its steps (a group that hangs within its first read intervals
        is watched too). A hang changes neither."""
        if self._first_step is None or self.step_changed_at is None or self.step <= self._first_step[0]:
            own = self.latest[0].step_seconds if 0 in self.latest and self.step > 0 else None
            return own if own is not None and own > 0 else None
        first_step, first_at = self._first_step
        return (self.step_changed_at - first_at).total_seconds() / (self.step - first_step)

    def record(self, now: datetime, answers: Mapping[int, PodScrape]) -> None:
        """One round of reads, by pod (pods that did not answer are absent); an empty round is no read."""
        if not answers:
            return
        read = _Round(now, dict(answers))
        self.latest.update(answers)
        step = int(read.step or 0)
        if self.step_changed_at is None or step > self.step:
            before = self._rounds[-1].at if self._rounds and self.step_changed_at is not None else None
            made = answers[0].last_sync if 0 in answers else None
            self.step, self.step_changed_at = max(step, self.step), stepped_at(made, now, before)
        if self._first_step is None and step > 0:
            self._first_step = (step, now)
        self.target_steps = max(self.target_steps, int(_max(p.target_steps for p in answers.values()) or 0))
        report = answers[0].restart if 0 in answers else None
        if report is not None and report.group_members:
            self.members = report.group_members
        if report is not None:
            if self._group_restarts is not None and report.restarts != self._group_restarts:
                self.group_changed_at = now
            self._group_restarts = report.restarts
        if 0 in answers:
            self.straggler = follow_straggler(
                self.straggler, answers[0], now, self.threshold, self.group_changed_at
            )
        self._rounds.append(read)
        while len(self._rounds) > 2 and (now - self._rounds[0].at).total_seconds() > self.rate_window_seconds:
            self._rounds.popleft()

    def keep(self, pod: int, scrape: PodScrape) -> None:
        """A pod's last answer outside a round (read as its training ended): for the summary only."""
        self.latest[pod] = scrape

    @property
    def finished(self) -> bool:
        """The furthest step reached the target steps the ranks export: training is over."""
        return self.target_steps > 0 and self.step >= self.target_steps

    def rank_steps(self) -> dict[int, int]:
        """Every rank's step, as the newest round's pods report them."""
        if not self._rounds:
            return {}
        return {rank: step for pod in self._rounds[-1].pods.values() for rank, step in pod.rank_steps.items()}

    def reset(self) -> None:
        """A new attempt: counters restart from zero in new processes."""
        self._rounds.clear()
        self.latest.clear()
        self.step, self.step_changed_at, self.straggler = 0, None, None
        self._first_step = None
        self._group_restarts, self.group_changed_at, self.target_steps = None, None, 0
        self.members = None

    def view(self) -> ProgressView:
        if not self._rounds:
            return ProgressView(pods_total=self.pods)
        newest, oldest = self._rounds[-1], self._rounds[0]
        seconds = (newest.at - oldest.at).total_seconds()
        pairs = (
            [(pod, oldest.pods[i]) for i, pod in newest.pods.items() if i in oldest.pods]
            if seconds > 0
            else []
        )
        pods = list(newest.pods.values())
        step = newest.step
        target = _max(p.target_steps for p in pods if p.target_steps)
        percent, remaining = self._completion(newest, step, target)
        samples = _increase(pairs, lambda p: p.samples)
        payload = _increase(pairs, lambda p: p.allreduce_bytes)
        service = _increase(pairs, lambda p: p.service_seconds)
        recent = histogram.add(
            histogram.subtract(new.allreduce_buckets, old.allreduce_buckets) for new, old in pairs
        )
        if max(recent.values(), default=0) <= 0:  # nothing reduced in the window: the whole attempt
            recent = histogram.add(p.allreduce_buckets for p in pods)
        last_sync = _max(p.last_sync for p in pods)
        return ProgressView(
            pods_total=self.pods,
            pods_reporting=len(pods),
            observed_at=newest.at,
            step=None if step is None else int(step),
            target_steps=None if target is None else int(target),
            percent_complete=percent,
            seconds_remaining=remaining,
            # The pods read are a sample of the group: their rate per pod times the pods training now.
            samples_per_second=None
            if samples is None
            else samples[0] / seconds * (self.members or self.pods) / samples[1],
            loss=_mean(p.loss for p in pods),
            overlap=_mean(p.overlap for p in pods),
            allreduce_p50=histogram.quantile(0.5, recent),
            bus_bandwidth=self._bus_bandwidth(payload, service),
            last_sync=datetime.fromtimestamp(last_sync, UTC) if last_sync and last_sync > 0 else None,
            straggler=self.straggler,
        )

    def _completion(
        self, newest: _Round, step: float | None, target: float | None
    ) -> tuple[int | None, int | None]:
        """Percent done, and seconds left at the step rate since the first read that saw a step."""
        if step is None or not target:
            return None, None
        stepped = next(r for r in self._rounds if r.step is not None)
        seconds = (newest.at - stepped.at).total_seconds()
        first = stepped.step or 0.0
        rate = (step - first) / seconds if seconds > 0 else 0.0
        remaining = max(0, round((target - step) / rate)) if rate > 0 else None
        return min(100, int(100 * step / target)), remaining

    def _bus_bandwidth(
        self, payload: tuple[float, int] | None, service: tuple[float, int] | None
    ) -> float | None:
        """Bytes per second of the ring allreduce's bus (NCCL's busbw): payload over service time."""
        if payload is None or service is None or not service[0] or self.world_size < 2:
            return None
        return payload[0] / service[0] * 2 * (self.world_size - 1) / self.world_size
