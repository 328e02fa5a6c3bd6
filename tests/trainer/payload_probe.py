"""One torchrun worker for tests/trainer/test_payload_and_checkpoints.py: fp64 gradients reduced with
each compressing comm hook in each mode, printing the bytes the metrics counted per step."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import ddp_trainer

STEPS = 4
CASES = [(mode, hook) for mode in ("detailed", "light") for hook in ("fp16", "bf16")]


def measure(mode: str, hook: str) -> str:
    model = DistributedDataParallel(nn.Linear(16, 8).to(torch.float64))
    metrics = ddp_trainer.instrument(model, comm_hook=hook, mode=mode, port=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        optimizer.zero_grad()
        model(torch.randn(4, 16, dtype=torch.float64)).sum().backward()
        optimizer.step()
        metrics.step(samples=4)
    metrics.flush()
    registry = metrics.endpoint.registry
    assert registry is not None
    labels = {"rank": str(dist.get_rank())}
    values = {
        name: registry.get_sample_value(f"ddp_{name}_total", labels)
        for name in ("sync_steps", "gradient_bytes", "allreduce_bytes")
    }
    elements = sum(p.numel() for p in model.parameters())
    fields = " ".join(f"{name}={value:.0f}" for name, value in values.items())
    return f"case mode={mode} hook={hook} rank={labels['rank']} elements={elements} {fields}\n"


def main() -> None:
    with ddp_trainer.process_group_session():
        dist.init_process_group("gloo")
        lines = [measure(mode, hook) for mode, hook in CASES]
        dist.barrier()
    sys.stdout.write("".join(lines))  # one write per rank: the workers share stdout
    sys.stdout.flush()


if __name__ == "__main__":
    main()
