"""What makes a resumed run step for step the run that was never interrupted (docs/restarts.md).

Two things in a DDP rank depend on how many times the process was started, not on the training state,
and both change the model's last bits after a recovery unless they are pinned:

- **The gradient buckets' layout.** DDP lays its buckets out twice: at construction, by parameter
  registration order, and again after the first synchronized backward, by the order the gradients
  became ready. gloo's ring allreduce sums each element in an order that depends on its offset in the
  bucket (the chunk it falls in decides which rank starts the sum), and float addition does not
  associate: the first step after any construction sums some gradients in another order than the same
  step of a run that built its DDP once. :func:`settle_buckets` makes the one synchronized backward
  that triggers the re-layout at construction, on a batch whose result is thrown away, so every real
  step of every run (fresh, resumed, restarted in place) uses the settled layout.
- **The random stream.** Dropout and any other draw use the rank's default generator, whose state
  depends on every draw since the process started. :func:`seed_step` reseeds it from the run's seed,
  the rank and the step before each step, so a rank's draws are a function of where training is, never
  of the process's history: a restarted, replaced or resumed rank needs no generator state from anyone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def step_seed(seed: int, rank: int, step: int) -> int:
    """The seed of ``rank``'s generator for the step that follows ``step`` completed steps."""
    digest = hashlib.blake2b(f"{seed}:{rank}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_step(seed: int, rank: int, step: int) -> None:
    """Reseed this process's default generators (CPU and, when present, CUDA) for the next step."""
    torch.manual_seed(step_seed(seed, rank, step))


def settle_buckets(ddp: DistributedDataParallel, loss: Callable[[], torch.Tensor]) -> None:
    """One synchronized backward that fixes DDP's bucket layout before the first real step.

    ``loss`` computes a loss through ``ddp`` on any valid batch. Nothing of it is kept: the gradients
    are dropped, the module's buffers (batch-norm statistics) and the random generators are restored.
    Every rank must call it (the backward allreduces). A comm hook may be registered after it.
    """
    module: nn.Module = ddp.module
    buffers = {name: tensor.detach().clone() for name, tensor in module.named_buffers()}
    devices = sorted({p.device.index for p in module.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=[d for d in devices if d is not None]):
        torch.autograd.backward([loss()])
    with torch.no_grad():
        for name, tensor in module.named_buffers():
            tensor.copy_(buffers[name])
    ddp.zero_grad(set_to_none=True)
