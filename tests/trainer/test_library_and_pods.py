"""The library API example, pods with several local workers, and the mnist workload on IDX files."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from trainer_gang import LINGERING, Gangs, describe, run_torchrun, samples, wait_all

from ddp_trainer.training.idx import write_idx

pytestmark = pytest.mark.trainer

REPO = Path(__file__).resolve().parents[2]


def test_instrument_example_counts_every_bucket_allreduce() -> None:
    script = REPO / "examples" / "scripts" / "instrument_ddp.py"
    # No DDP_METRICS_PORT: the script reads its series with render(); a fixed port + LOCAL_RANK could
    # collide with other tests on a shared machine.
    result = run_torchrun(script)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in ("0", "1"):
        steps = samples(result.stdout, "ddp_sync_steps_total")[rank]
        calls = samples(result.stdout, "ddp_allreduce_calls_total")[rank]
        buckets = samples(result.stdout, "ddp_buckets")[rank]
        assert steps == 20 and calls == buckets * steps


def test_two_pods_of_two_workers_serve_one_endpoint_per_pod(gangs: Gangs) -> None:
    pods = gangs.pods(2, 2, ["--max-steps", "20", "--progress-every", "10", "--metrics-linger", "120"])
    texts = []
    for pod in pods:
        pod.wait_for_stdout(LINGERING)
        texts.append(pod.scrape())
    for pod in pods:
        pod.signal(15)
    # A second SIGTERM while the pod winds down (a user's, or a kubelet's after a delete) must not turn
    # its exit 0 into torch's "SignalException" and exit 1. The gap lets it land after the linger ends.
    time.sleep(0.2)
    for pod in pods:
        pod.signal(15)
    assert wait_all(pods) == [0, 0], describe(pods)
    for node, text in enumerate(texts):
        local_ranks = {str(2 * node), str(2 * node + 1)}
        assert set(samples(text, "ddp_sync_steps_total")) == local_ranks
        assert set(samples(text, "ddp_world_size").values()) == {4.0}
        for rank in local_ranks:
            assert samples(text, "ddp_sync_steps_total")[rank] == 20
    digests = {**pods[0].digests(), **pods[1].digests()}
    assert set(digests) == {0, 1, 2, 3} and len(set(digests.values())) == 1


def write_mnist_fixture(directory: Path, train: int, test: int) -> None:
    """A tiny MNIST in the real file layout: class k images have a bright row k."""
    rng = np.random.default_rng(0)
    for prefix, count in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, size=count).astype(np.uint8)
        images = rng.integers(0, 40, size=(count, 28, 28)).astype(np.uint8)
        for index, label in enumerate(labels):
            images[index, 2 * label + 4, :] = 255
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels)


def test_mnist_workload_trains_from_idx_files_without_network(gangs: Gangs, tmp_path: Path) -> None:
    data = tmp_path / "mnist"
    data.mkdir()
    write_mnist_fixture(data, train=640, test=200)
    # An unroutable URL: the run must not need it.
    args = [
        "--workload",
        "mnist",
        "--data-dir",
        str(data),
        "--mnist-url",
        "http://127.0.0.1:9/none",
        "--epochs",
        "3",
        "--batch-size",
        "32",
    ]
    gang = gangs.ranks(2, args)
    assert wait_all(gang) == [0, 0], describe(gang)
    final = gang[0].final()
    assert final is not None and final.accuracy >= 0.9, describe(gang)
