"""An elastic job's resize, the data part (ddp_trainer.training.resize): where a resumed epoch goes on at
another world size, and the step the loop ends at."""

from __future__ import annotations

import math

import pytest

from ddp_trainer.training.resize import batches_per_epoch, remap_batch, total_steps

pytestmark = pytest.mark.unit

SAMPLES = 1437  # digits' training split (80% of 1797)
BATCH = 32


def epoch_order(samples: int, world_size: int, rank: int) -> list[int]:
    """DistributedSampler's share of one epoch for ``rank`` (drop_last False), over positions of the
    epoch's permutation: padded to a multiple of the world size, dealt round-robin."""
    per_rank = math.ceil(samples / world_size)
    padded = [position % samples for position in range(per_rank * world_size)]
    return padded[rank::world_size]


def consumed(batch: int, samples: int, world_size: int) -> set[int]:
    """The permutation positions every rank's first ``batch`` batches cover."""
    return {
        position
        for rank in range(world_size)
        for position in epoch_order(samples, world_size, rank)[: batch * BATCH]
    }


def uninterrupted(per_epoch: int, epochs: int, max_steps: int) -> int:
    """The loop's total steps before elastic jobs: every epoch's batches, capped by --max-steps."""
    total = per_epoch * epochs
    return min(total, max_steps) if max_steps else total


@pytest.mark.parametrize(
    ("batch", "saved", "world", "expected"),
    [
        pytest.param(7, 3, 3, 7, id="same-world-unchanged"),
        pytest.param(0, 3, 2, 0, id="epoch-start"),
        pytest.param(7, 3, 2, 10, id="3-to-2"),
        pytest.param(7, 2, 3, 4, id="2-to-3"),
        pytest.param(9, 2, 3, 6, id="2-to-3-exact"),
        pytest.param(7, 3, 1, 21, id="3-to-1"),
        pytest.param(14, 3, 2, 21, id="3-to-2-last-batch-of-w3"),
        pytest.param(15, 3, 2, batches_per_epoch(SAMPLES, 2, BATCH), id="epoch-done-stays-done-3-to-2"),
        pytest.param(23, 2, 3, batches_per_epoch(SAMPLES, 3, BATCH), id="epoch-done-stays-done-2-to-3"),
    ],
)
def test_the_place_in_the_epoch_follows_the_samples_consumed(
    batch: int, saved: int, world: int, expected: int
) -> None:
    remapped = remap_batch(batch, saved, world, SAMPLES, BATCH)
    assert remapped == expected
    # No sample is skipped: what the new division has done is within what the old one did.
    before = consumed(batch, SAMPLES, saved)
    after = consumed(remapped, SAMPLES, world)
    real = set(range(SAMPLES))
    assert after & real <= before & real or before & real == real


def test_a_remapped_place_redoes_less_than_one_new_batch_of_samples() -> None:
    for saved, world in [(3, 2), (2, 3), (4, 3), (1, 4)]:
        for batch in range(batches_per_epoch(SAMPLES, saved, BATCH)):
            remapped = remap_batch(batch, saved, world, SAMPLES, BATCH)
            redone = batch * BATCH * saved - remapped * BATCH * world
            assert 0 <= redone < BATCH * world, (saved, world, batch)


@pytest.mark.parametrize("world", [1, 2, 3, 4], ids=lambda w: f"world-{w}")
@pytest.mark.parametrize("epochs", [1, 10], ids=lambda e: f"{e}-epochs")
@pytest.mark.parametrize("max_steps", [0, 40, 120, 10_000], ids=lambda m: f"max-steps-{m}")
def test_without_a_resize_the_total_steps_are_an_uninterrupted_runs(
    world: int, epochs: int, max_steps: int
) -> None:
    per_epoch = batches_per_epoch(SAMPLES, world, BATCH)
    expected = uninterrupted(per_epoch, epochs, max_steps)
    # Every place an uninterrupted run (or a resume at its world size) can be at.
    # The end itself included: a resume from the final checkpoint (a gang restarted after it) is there.
    for step in sorted(
        {*range(0, min(expected, per_epoch * epochs) + 1, 7), min(expected, per_epoch * epochs)}
    ):
        epoch, batch = divmod(step, per_epoch)
        assert total_steps(step, epoch, batch, per_epoch, epochs, max_steps) == expected
        if batch == 0 and epoch > 0:  # a checkpoint at an epoch's end says (epoch - 1, all batches)
            assert total_steps(step, epoch - 1, per_epoch, per_epoch, epochs, max_steps) == expected


@pytest.mark.parametrize(
    ("step", "epoch", "batch", "per_epoch", "epochs", "max_steps", "expected"),
    [
        pytest.param(40, 2, 3, 24, 10, 0, 40 + 21 + 24 * 7, id="3-to-2-to-the-end"),
        pytest.param(40, 2, 3, 24, 10, 120, 120, id="3-to-2-capped-by-max-steps"),
        pytest.param(40, 1, 10, 12, 3, 0, 40 + 2 + 12, id="2-to-3-to-the-end"),
        pytest.param(40, 1, 10, 12, 3, 45, 45, id="2-to-3-capped"),
        pytest.param(30, 2, 12, 12, 3, 0, 30, id="last-epoch-done"),
        pytest.param(36, 3, 0, 12, 3, 0, 36, id="past-the-last-epoch"),
        pytest.param(30, 3, 0, 12, 3, 0, 30, id="past-the-last-epoch-after-a-resize"),
    ],
)
def test_total_steps_after_a_resize(
    step: int, epoch: int, batch: int, per_epoch: int, epochs: int, max_steps: int, expected: int
) -> None:
    assert total_steps(step, epoch, batch, per_epoch, epochs, max_steps) == expected


def test_batches_per_epoch_matches_the_sampler_share() -> None:
    for world in (1, 2, 3, 7):
        assert batches_per_epoch(SAMPLES, world, BATCH) == math.ceil(
            len(epoch_order(SAMPLES, world, 0)) / BATCH
        )
