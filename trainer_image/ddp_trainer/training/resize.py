"""An elastic job's resize, the data part: where a resumed epoch goes on, and how many steps are left.

An elastic job (DDP_MIN_MEMBERS, docs/trainer.md "Elastic jobs") trains on as many pods as a round has,
so a checkpoint may come from another world size than the one resuming it. ``DistributedSampler``
shuffles an epoch's indices by the seed and the epoch alone, pads them to a multiple of the world
size, and deals them out round-robin: rank r takes positions r, r + w, r + 2w, ... So the first b
batches of every rank, together, are the first ``b x batch_size x w`` positions of the epoch's one
permutation, whatever w is. A resize keeps that prefix: batch b at world size w1 becomes batch
``floor(b x w1 / w2)`` at w2, which ends at or before the same position (a few samples are done
again, none is skipped).

Steps are counted as they were made: after a resize the job's step count no longer equals
epochs x batches per epoch, so the steps left are counted from where the data is.

Pure and torch-free.
"""

from __future__ import annotations

import math


def batches_per_epoch(samples: int, world_size: int, batch_size: int) -> int:
    """A rank's batches in one epoch: ``DistributedSampler`` (drop_last False) gives each rank
    ceil(samples / world_size) indices."""
    return math.ceil(math.ceil(samples / world_size) / batch_size)


def remap_batch(batch: int, saved_world_size: int, world_size: int, samples: int, batch_size: int) -> int:
    """The next batch of the epoch at ``world_size``, for a checkpoint whose next batch at
    ``saved_world_size`` was ``batch`` (see the module's docstring). An epoch whose every sample was
    consumed stays finished (its last batch may be padding)."""
    if saved_world_size == world_size:
        return batch
    last = batches_per_epoch(samples, world_size, batch_size)
    if batch * batch_size * saved_world_size >= samples:
        return last
    return min(batch * saved_world_size // world_size, last)


def total_steps(step: int, epoch: int, batch: int, per_epoch: int, epochs: int, max_steps: int) -> int:
    """The step the loop ends at: ``step`` (done) plus the batches left from ``batch`` of ``epoch``
    to the end of the last epoch, ``per_epoch`` each, capped by ``max_steps`` (0: no cap).

    Without a resize, ``step`` is ``epoch x per_epoch + batch`` and this is ``per_epoch x epochs``
    (capped), the count of an uninterrupted run."""
    # A place past the last epoch (the loop's own at its end, which the final checkpoint records as
    # (epochs, 0)) has nothing left, not a batch of one more epoch.
    left = (max(per_epoch - batch, 0) + per_epoch * (epochs - epoch - 1)) if epoch < epochs else 0
    total = step + left
    return min(total, max_steps) if max_steps else total
