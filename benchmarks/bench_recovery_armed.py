"""What armed recovery costs a step: a DDP step with the supervisor's channel looked at, against plain.

Under the pod's supervisor a worker's per-step work for recovery is what the trainer does with its
``ddp_trainer.supervisor.membership.Membership``: ``step_done()`` after every step (for the control
thread, which watches for a blocked leave and runs beside the steps), and a look at its pipe for a
"leave" (``leave_requested``) at each stop check; nothing of the state is copied (docs/restarts.md).
Armed here is all of that, with the control thread running, the look every ``--look-every`` steps (5:
the trainer's default ``--stop-check-every``; 1: the worst case), on one gloo rank, for the digits model
and an 8 x 1024 MLP (57 MB of parameters and momentum), in interleaved rounds with and without it;
medians of the mean step of each round.

    python benchmarks/bench_recovery_armed.py [--rounds 9 --steps 40 --look-every 5]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_trainer import process_group_session
from ddp_trainer.supervisor.membership import Membership
from ddp_trainer.training.workloads import mlp

MODELS = {
    "digits (linear 64x10), batch 32": (lambda: nn.Linear(64, 10), 64, 32),
    "mlp (8 x 1024), batch 64": (lambda: mlp(1024, 8), 1024, 64),
}


def steps(
    ddp: DistributedDataParallel,
    width: int,
    batch: int,
    count: int,
    armed: Membership | None,
    look_every: int,
) -> float:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    inputs, targets = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(count):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()
        if armed is not None:
            armed.step_done()
            if len(times) % look_every == 0 and armed.leave_requested():
                raise RuntimeError("nobody asked this worker to leave")
        times.append(time.perf_counter() - started)
    return statistics.fmean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--look-every", type=int, default=5, help="steps between two looks at the pipe [5]")
    parser.add_argument(
        "--same", action="store_true", help="both kinds of round plain: what the interleaving alone shows"
    )
    parser.add_argument(
        "--no-control-thread",
        action="store_true",
        help="armed without the control thread (to tell the costs apart)",
    )
    options = parser.parse_args()
    torch.set_num_threads(1)
    _supervisor, worker = multiprocessing.Pipe()
    armed = Membership(worker)
    if not options.no_control_thread:
        armed.watch(lambda waited: True)  # the control thread runs, as in a supervised worker
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="bench-armed-"), "store"), 1)
    with process_group_session():
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        print(
            f"torch {torch.__version__}, {options.rounds} rounds x {options.steps} steps, a look every "
            f"{options.look_every} step(s), medians of the rounds' mean steps"
        )
        print("| model | plain step | armed step | armed's share |")
        print("|---|---|---|---|")
        for name, (build, width, batch) in MODELS.items():
            torch.manual_seed(0)
            ddp = DistributedDataParallel(build())
            timed: dict[str, list[float]] = {"plain": [], "armed": []}
            for index in range(options.rounds):
                order = ["plain", "armed"] if index % 2 == 0 else ["armed", "plain"]
                for mode in order:
                    channel = armed if mode == "armed" and not options.same else None
                    timed[mode].append(steps(ddp, width, batch, options.steps, channel, options.look_every))
            plain, with_look = statistics.median(timed["plain"]), statistics.median(timed["armed"])
            print(
                f"| {name} | {plain * 1e3:.3f} ms | {with_look * 1e3:.3f} ms | "
                f"{(with_look - plain) / plain:+.1%} |"
            )
            del ddp
        calls = 100_000
        started = time.perf_counter()
        for _ in range(calls):
            armed.leave_requested()
        look = (time.perf_counter() - started) / calls
        started = time.perf_counter()
        for _ in range(calls):
            armed.step_done()
        step_done = (time.perf_counter() - started) / calls
        print(f"\none look at the pipe (leave_requested), {calls:,} calls: {look * 1e6:.2f} us")
        print(f"step_done, {calls:,} calls: {step_done * 1e6:.2f} us")
        print(f"a step's own work for recovery: {(step_done + look / options.look_every) * 1e6:.2f} us")


if __name__ == "__main__":
    main()
