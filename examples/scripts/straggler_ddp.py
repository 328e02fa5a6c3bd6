"""A plain DDP script using ``ddp_trainer.instrument()``, with one rank made slow on purpose.

    torchrun --nproc-per-node 3 examples/scripts/straggler_ddp.py --slow-rank 2 --slow-ms 40

``--slow-rank R --slow-ms N`` makes rank R late by N ms per step, so every rank waits for it in the
gradient allreduce: all step times look alike, and only how long each rank waited there (the ranks
exchange it every ``--exchange-every`` steps) names rank R. ``--slow-in`` says where R loses the time:
``compute`` (its forward sleeps: a slower device, a noisy neighbour), ``data`` (it sleeps before the
forward: a slow data loader) or ``communication`` (it sleeps before each collective it starts: a slow
comm path on its host; the script wraps ``torch.distributed.all_reduce`` on that rank, a testing aid
only). With ``DDP_METRICS_PORT``
set, each worker serves /metrics on that port plus its LOCAL_RANK (``DDP_METRICS_HOST``: the address;
``--metrics-port`` overrides both for rank-per-process launches); rank 0's shows
``ddp_straggler_rank``. With ``DDP_STALL_TIMEOUT_SECONDS`` set, a rank that stops stepping for 3/4 of
it writes every thread's stack to stderr. ``--steps 0`` trains until SIGTERM.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddp_trainer


class Delay(nn.Module):
    """Sleeps in forward: this rank's compute takes longer, as on a slower device."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.seconds > 0:
            time.sleep(self.seconds)
        return inputs


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (0: until SIGTERM)")
    parser.add_argument("--slow-rank", type=int, default=-1, help="the rank to slow down (-1: none)")
    parser.add_argument("--slow-ms", type=float, default=0.0, help="milliseconds it is late per step")
    parser.add_argument(
        "--slow-in",
        choices=("compute", "data", "communication"),
        default="compute",
        help="where it loses them: its forward, before its forward, before each collective it starts",
    )
    parser.add_argument("--step-ms", type=float, default=0.0, help="milliseconds every rank sleeps per step")
    parser.add_argument("--exchange-every", type=int, default=5, help="steps between compute-time exchanges")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve /metrics here (0: nowhere)")
    parser.add_argument("--backend", default="gloo")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ddp_trainer.process_group_session():
        dist.init_process_group(args.backend)
        train(args, stop)
    return 0


def delay_collectives(seconds: float) -> None:
    """Every allreduce of this process starts ``seconds`` late (testing: a slow comm path)."""
    issue = dist.all_reduce

    def late(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return issue(*args, **kwargs)

    dist.all_reduce = late


def train(args: argparse.Namespace, stop: threading.Event) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    delay = args.slow_ms / 1000.0 if rank == args.slow_rank else 0.0
    if delay and args.slow_in == "communication":
        delay_collectives(delay)
    model = DistributedDataParallel(
        nn.Sequential(
            Delay(delay if args.slow_in == "compute" else 0.0),
            nn.Linear(64, 128),
            nn.ReLU(),
            nn.Linear(128, 4),
        )
    )
    metrics = ddp_trainer.instrument(
        model,
        port=args.metrics_port,
        total_steps=args.steps or None,
        # Until SIGTERM: the stop flag rides in the exchange's own allreduce (see below).
        exchange_every=args.exchange_every if args.steps else 0,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    batch, step = 16, 0
    while args.steps == 0 or step < args.steps:
        started = time.perf_counter()
        if delay and args.slow_in == "data":
            time.sleep(delay)  # a slow data loader
        inputs = torch.randn(batch, 64, generator=generator)
        targets = torch.randint(0, 4, (batch,), generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        step += 1
        metrics.step(samples=batch, seconds=time.perf_counter() - started, loss=loss.item())
        if args.step_ms:
            time.sleep(args.step_ms / 1000.0)
        if args.steps == 0 and step % args.exchange_every == 0:
            # Stop together: a SIGTERM on any rank ends every rank at the same step. One collective
            # carries both the compute times and the flag.
            (flag,) = metrics.exchange([1.0 if stop.is_set() else 0.0])
            if flag > 0:
                break
    if rank == 0 and metrics.straggler is not None:
        found = metrics.straggler
        times = " ".join(f"{t * 1000:.2f}" for t in metrics.rank_compute_seconds)
        sys.stdout.write(
            f"straggler rank={found.rank} slowdown={found.slowdown:.2f} phase={found.phase} compute_ms={times}\n"
        )
        sys.stdout.flush()
    dist.barrier()  # leave together


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
