"""Whether a quiet run trips runPolicy.stragglerPolicy: false positives per 1,000 exchange windows.

Three gloo ranks on this machine train the small MLP of bench_straggler.py (``instrument()``, its
exchange every 10 steps, every rank sleeping --step-ms per step as a data loader waits) for
--minutes, with no slowdown injected anywhere: no rank is a straggler, so every rank the product
would name is a false sighting, and every pod it would replace a false positive.

After every exchange each rank renders its /metrics text (rank 0's is what the operator scrapes; the
others render theirs too, so that no rank does more work than the others), and rank 0 keeps the
lines of the series the operator reads (``exposition.read_lines``) with the time on its clock. Those
reads then go through the operator's own path, as its scraper takes them: ``ExpositionReader`` into a
``PodScrape``, ``ProgressTracker.record`` (the naming threshold, ``STRAGGLER_THRESHOLD``, and the
sighting followed across reads), ``ranks.pod_of_rank`` for the straggler's pod among the job's three
Running pods (one rank each), and ``policies.straggler.verdict`` under the default
``StragglerPolicy`` with action Replace. A replacement the verdict orders is applied as the operator
would apply it (the rank's next pod starts then, ``stragglerReplacements`` counts it), so a
persistent false sighting is counted once per replacement, not once per read.

The reads are fed twice: every exchange (the strictest picture: any exchange could be the one the
operator reads) and at the operator's cadence (a read every 15 s, ``pull.DEFAULT_INTERVAL_SECONDS``,
the newest exchange before it; pooled over 15 starting offsets 1 s apart). Counted per feed:
windows (reads), sightings at or above the naming threshold (a straggler would be named in that
read), sightings that had lasted the operator's 30 s window (``status.straggler`` and its Event),
and the verdicts that would replace a pod (false positives) or would be held (rank 0's pod, the
bound).

    python benchmarks/bench_straggler_quiet.py [--minutes 30 --step-ms 10]
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import os
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from prometheus_client import generate_latest
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_operator import ranks
from ddp_operator.observe import PodObservation
from ddp_operator.policies import straggler
from ddp_operator.progress.exposition import ExpositionReader, read_lines
from ddp_operator.progress.pull import DEFAULT_INTERVAL_SECONDS
from ddp_operator.progress.tracker import (
    STRAGGLER_THRESHOLD,
    STRAGGLER_WINDOW_SECONDS,
    ProgressTracker,
    persistence_left,
)
from ddp_operator.spec import STRAGGLER_REPLACE, StragglerPolicy
from ddp_trainer import instrument, process_group_session
from ddp_trainer.library.instrumentation import DEFAULT_EXCHANGE_EVERY

WORLD = 3
POLICY = StragglerPolicy(action=STRAGGLER_REPLACE)  # the defaults otherwise: 200%, 120 s, 2
CADENCE_OFFSETS = 15  # starting offsets of the 15 s reads, 1 s apart


def worker(rank: int, world: int, port: int, args: argparse.Namespace, record: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    with process_group_session():
        dist.init_process_group("gloo", rank=rank, world_size=world)
        train(rank, args, record)


def train(rank: int, args: argparse.Namespace, record: str) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))
    # The exchange rides with the stop flag (as the built-in trainer's does): instrument()'s own every
    # DEFAULT_EXCHANGE_EVERY steps, at the same point of the step, without a second collective.
    metrics = instrument(model, port=0, exchange_every=0)
    registry = metrics.endpoint.registry
    assert registry is not None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(32, 64), torch.randint(0, 4, (32,))
    dist.barrier()
    began = time.time()
    deadline = began + args.minutes * 60.0
    next_note, highest, exchanges = began + 60.0, 0.0, 0
    out = open(record, "w", encoding="utf-8") if rank == 0 else None  # noqa: SIM115
    step = 0
    while True:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
        step += 1
        metrics.step(len(targets))
        if step % DEFAULT_EXCHANGE_EVERY == 0:
            (stop,) = metrics.exchange([1.0 if time.time() >= deadline else 0.0])
            # What /metrics serves (prometheus_client's server renders the registry the same way).
            text = generate_latest(registry).decode()
            if out is not None:
                now = time.time()
                out.write(json.dumps({"t": now, "step": step, "text": "\n".join(read_lines(text))}) + "\n")
                exchanges += 1
                found = metrics.straggler
                if found is not None and math.isfinite(found.slowdown):
                    highest = max(highest, found.slowdown)
                if now >= next_note:
                    next_note += 60.0
                    print(
                        f"minute {(now - began) / 60:.1f}: step {step}, {exchanges} exchanges, "
                        f"highest slowdown so far {highest:.2f}, load {os.getloadavg()[0]:.2f}",
                        flush=True,
                    )
            if stop:
                break
        time.sleep(args.step_ms / 1000.0)
    if out is not None:
        out.close()


@dataclasses.dataclass
class Tally:
    """What one feed of reads made of the run."""

    windows: int = 0
    named: int = 0  # sightings at or above the naming threshold
    reported: int = 0  # ... that had lasted the straggler window (status.straggler)
    replaced: int = 0  # verdicts that would replace a pod: false positives
    held: int = 0  # verdicts due but held (rank 0's pod, maxReplacements)
    ranks_named: dict[int, int] = dataclasses.field(default_factory=dict)
    acts: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.windows += other.windows
        self.named += other.named
        self.reported += other.reported
        self.replaced += other.replaced
        self.held += other.held
        for rank, count in other.ranks_named.items():
            self.ranks_named[rank] = self.ranks_named.get(rank, 0) + count
        self.acts += other.acts


def job_pods(started: datetime) -> list[PodObservation]:
    """The job's pods as the operator observes them: one rank each, Running since ``started``."""
    return [
        PodObservation(
            name=f"quiet-{rank}-0",
            rank=rank,
            attempt=0,
            phase="Running",
            node=f"node-{rank}",
            created_at=started,
            started_at=started,
            scheduled=True,
            ready=True,
        )
        for rank in range(WORLD)
    ]


def feed(reads: Sequence[tuple[float, str]], started: datetime) -> Tally:
    """The reads through the operator's path, in order: scrape, tracker, pod of the rank, verdict."""
    reader = ExpositionReader()
    tracker = ProgressTracker(WORLD, WORLD)  # threshold: STRAGGLER_THRESHOLD, as the operator's default
    pods = job_pods(started)
    replaced = 0  # status.stragglerReplacements
    tally = Tally()
    for at, text in reads:
        now = datetime.fromtimestamp(at, UTC)
        tracker.record(now, {0: reader.reduce(text)})
        sighting = tracker.straggler
        tally.windows += 1
        if sighting is None:
            continue
        tally.named += 1
        tally.ranks_named[sighting.rank] = tally.ranks_named.get(sighting.rank, 0) + 1
        if persistence_left(sighting, STRAGGLER_WINDOW_SECONDS, now) == 0:
            tally.reported += 1
        pod = ranks.pod_of_rank(sighting.rank, {}, pods, nproc_per_node=1, elastic=False)
        verdict = straggler.verdict(POLICY, sighting, pod, now, replaced)
        if verdict.held is not None:
            tally.held += 1
            tally.acts.append(f"held at {now:%H:%M:%S}: {verdict.held}")
        if verdict.replace is not None:
            old = verdict.replace
            replaced += 1
            tally.replaced += 1
            tally.acts.append(
                f"REPLACE at {now:%H:%M:%S}: {straggler.replacement_text(POLICY, sighting, old)} "
                f"(named since {sighting.since:%H:%M:%S})"
            )
            # The operator deletes it and starts the rank's next pod: the verdict restarts from there.
            new = dataclasses.replace(old, name=f"{old.name}r{replaced}", created_at=now, started_at=now)
            pods = [new if p.rank == old.rank else p for p in pods]
    return tally


def at_cadence(reads: Sequence[tuple[float, str]], offset: float) -> list[tuple[float, str]]:
    """What a scraper reading every DEFAULT_INTERVAL_SECONDS from ``offset`` s after the first exchange
    gets: the newest exchange at each tick (stamped with the tick, its clock)."""
    times = [at for at, _ in reads]
    picked = []
    tick = times[0] + offset
    while tick <= times[-1]:
        newest = bisect.bisect_right(times, tick) - 1
        picked.append((tick, reads[newest][1]))
        tick += DEFAULT_INTERVAL_SECONDS
    return picked


def per_thousand(count: int, windows: int) -> str:
    return f"{1000.0 * count / windows:.2f}" if windows else "-"


def slowdowns(reads: Sequence[tuple[float, str]]) -> list[float]:
    """Every read's slowdown as the scrape reduces it (NaN, no straggler estimated, left out)."""
    reader = ExpositionReader()
    values = (reader.reduce(text).straggler_slowdown for _, text in reads)
    return [v for v in values if v is not None and math.isfinite(v)]


def cpu_model() -> str:
    found = subprocess.run(
        ["grep", "-m1", "model name", "/proc/cpuinfo"], capture_output=True, text=True, check=False
    ).stdout
    return found.split(":", 1)[1].strip() if ":" in found else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the ranks train")
    parser.add_argument("--step-ms", type=float, default=10.0, help="every rank sleeps this long per step")
    parser.add_argument("--record", help="keep rank 0's reads here (JSON lines; default: a temporary file)")
    args = parser.parse_args()
    record = args.record or tempfile.mkstemp(prefix="bench-straggler-quiet-", suffix=".jsonl")[1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    load_start = os.getloadavg()
    started = datetime.now(UTC)  # the pods' start: before the group forms
    mp.spawn(worker, args=(WORLD, port, args, record), nprocs=WORLD)
    load_end = os.getloadavg()
    with open(record, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    if not args.record:
        Path(record).unlink()
    reads = [(row["t"], row["text"]) for row in rows]
    steps = rows[-1]["step"] if rows else 0
    minutes = (reads[-1][0] - reads[0][0]) / 60.0 if len(reads) > 1 else 0.0
    every = feed(reads, started)
    cadence = Tally()
    for offset in range(CADENCE_OFFSETS):
        cadence.add(feed(at_cadence(reads, float(offset)), started))
    seen = slowdowns(reads)
    p50 = statistics.median(seen) if seen else float("nan")
    p99 = statistics.quantiles(seen, n=100)[98] if len(seen) >= 100 else float("nan")
    high = max(seen, default=float("nan"))
    cpu = cpu_model()
    print(
        f"torch {torch.__version__}, gloo, {WORLD} ranks, no slowdown injected, every rank sleeping "
        f"{args.step_ms:g} ms per step; exchange every {DEFAULT_EXCHANGE_EVERY} steps; naming threshold "
        f"{STRAGGLER_THRESHOLD:g}, straggler window {STRAGGLER_WINDOW_SECONDS:g} s; stragglerPolicy "
        f"{POLICY.action}, slowdownPercent {POLICY.slowdown_percent}, sustainedSeconds "
        f"{POLICY.sustained_seconds}, maxReplacements {POLICY.max_replacements}; "
        f"{os.cpu_count()} CPUs ({cpu})"
    )
    print()
    print(
        "| reads fed | minutes | steps | windows | named (>= 1.5) | per 1,000 | named 30 s | "
        "replace verdicts | per 1,000 | held | slowdown p50 / p99 / max | load start / end | CPU |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, tally in (
        ("every exchange", every),
        (f"every {DEFAULT_INTERVAL_SECONDS:g} s ({CADENCE_OFFSETS} offsets)", cadence),
    ):
        print(
            f"| {name} | {minutes:.1f} | {steps} | {tally.windows} | {tally.named} | "
            f"{per_thousand(tally.named, tally.windows)} | {tally.reported} | {tally.replaced} | "
            f"{per_thousand(tally.replaced, tally.windows)} | {tally.held} | "
            f"{p50:.2f} / {p99:.2f} / {high:.2f} | {load_start[0]:.2f} / {load_end[0]:.2f} | {cpu} |"
        )
    print()
    print(f"ranks named (every exchange): {dict(sorted(every.ranks_named.items())) or 'none'}")
    for name, tally in (("every exchange", every), (f"every {DEFAULT_INTERVAL_SECONDS:g} s", cadence)):
        for act in tally.acts:
            print(f"- {name}: {act}")
    if seen:
        above = {bound: sum(v >= bound for v in seen) for bound in (1.1, 1.2, 1.3, STRAGGLER_THRESHOLD, 2.0)}
        print(
            "exchanges with a slowdown at or above "
            + ", ".join(f"{bound:g}: {count}" for bound, count in above.items())
            + f" (of {len(seen)} estimated)"
        )


if __name__ == "__main__":
    main()
