"""One torchrun worker for tests/trainer/test_teardown.py: train a few DDP steps, end the group the
way CASE says, and print whether its gloo threads are gone before the interpreter exits.

Most cases take the protocol apart (``leave_process_group`` by hand) to show what each step is for;
``session`` is the protocol as the trainer and library users run it, one context manager."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddp_trainer
from ddp_trainer.library.teardown import (
    collective_threads,
    exit_without_finalizing,
    import_group_defaults_early,
)


def main() -> None:
    case = os.environ["CASE"]
    if case == "session":
        running = None
        with ddp_trainer.process_group_session() as session:
            dist.init_process_group("gloo")
            rank = dist.get_rank()
            running = train_instrumented()  # never closed by hand: the session closes it
        print(f"rank {rank}: before={running} left={session.left} after={collective_threads()}", flush=True)
        if not session.left:
            exit_without_finalizing(0)
        return
    if case == "defaults-imported-early":
        import_group_defaults_early()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    metrics = ddp_trainer.instrument(model, port=0) if case.startswith("instrumented") else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model(torch.randn(8, 16)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.barrier()
    running = collective_threads()
    held = []
    if metrics is not None and case != "instrumented-not-closed":
        metrics.close()
    if case == "model-still-held":
        held.append(model)
    del model, optimizer, loss
    left = ddp_trainer.leave_process_group()
    print(f"rank {rank}: before={running} left={left} after={collective_threads()}", flush=True)
    if not left:
        exit_without_finalizing(0)  # the threads are still there: interpreter teardown could abort


def train_instrumented() -> int | None:
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    ddp_trainer.instrument(model, port=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model(torch.randn(8, 16)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.barrier()
    return collective_threads()


if __name__ == "__main__":
    main()
