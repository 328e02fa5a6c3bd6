"""The gcn workload in real gloo process groups: the example as `ddpjob run` runs it, its sync metrics,
and a broken dataset refused in one line."""

from __future__ import annotations

import gzip
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_gang import LINGERING, PYTHON, Gangs, base_env, describe, free_port, samples, wait_all

pytestmark = pytest.mark.trainer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gcn-products.yaml"
# What docs/trainer.md states for the example on the generated graph (measured: about 0.93).
EXAMPLE_ACCURACY = 0.85
# Bounds how long a broken run can hang; nothing asserts on elapsed time.
RUN_TIMEOUT = 600.0


def run_ddpjob(manifest: Path, workdir: Path) -> tuple[int, str]:
    """`ddpjob run` to the end, in its own session so that a hung run can be ended whole."""
    log = workdir.parent / f"{workdir.name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "ddp_operator", "run", str(manifest), "--workdir", str(workdir)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
    return code, log.read_text(errors="replace")


def test_the_example_trains_to_the_documented_accuracy_with_identical_ranks(tmp_path: Path) -> None:
    code, output = run_ddpjob(EXAMPLE, tmp_path / "work")
    assert code == 0, output
    final = re.search(r"^\[rank 0\] final accuracy=([0-9.]+) .* steps=(\d+)", output, re.MULTILINE)
    assert final, output
    assert float(final.group(1)) >= EXAMPLE_ACCURACY, output
    # 1,600 training nodes, 800 per rank, --batch-size 800: one synchronized step per epoch.
    assert int(final.group(2)) == 80, output
    digests = dict(re.findall(r"^\[rank \d\] params rank=(\d) sha256=(\w+)", output, re.MULTILINE))
    assert set(digests) == {"0", "1"} and digests["0"] == digests["1"], output
    assert f"held-out accuracy: {final.group(1)}" in output
    assert "outcome: Succeeded" in output


def gcn_args(*extra: str) -> list[str]:
    return ["--workload", "gcn", "--graph-nodes", "3000", "--batch-size", "120", "--epochs", "3", *extra]


# Generated graph of 3,000 nodes: 100 features, 16 classes; 240 training nodes, 120 per rank.
HIDDEN = 32
GCN_PARAMETERS = (100 * HIDDEN + HIDDEN) + (HIDDEN * 16 + 16)


@pytest.mark.parametrize(
    ("bucket_cap_mb", "buckets"),
    [
        # Far above the model's 15 KiB of gradients: one bucket, reduced after the whole backward.
        pytest.param("25", 1, id="default-cap-one-bucket"),
        # 2,097 bytes: the output layer's gradients (2,112 bytes), ready first, close a bucket of their
        # own, whose allreduce can run while the first layer's backward (the sparse product over the
        # whole graph) still does; the first layer's 12,928 bytes are the second bucket.
        pytest.param("0.002", 2, id="small-cap-bucket-per-layer"),
    ],
)
def test_gcn_sync_metrics_count_its_gradients(gangs: Gangs, bucket_cap_mb: str, buckets: int) -> None:
    gang = gangs.ranks(
        2,
        gcn_args("--gcn-hidden", str(HIDDEN), "--bucket-cap-mb", bucket_cap_mb, "--metrics-linger", "120"),
        metrics_ranks=(0, 1),
    )
    texts = {}
    for index, process in enumerate(gang):
        process.wait_for_stdout(LINGERING)
        texts[str(index)] = process.scrape()
        process.signal(signal.SIGTERM)
    assert wait_all(gang) == [0, 0], describe(gang)
    digests = {**gang[0].digests(), **gang[1].digests()}
    assert set(digests) == {0, 1} and digests[0] == digests[1], describe(gang)
    for rank, text in texts.items():
        steps = samples(text, "ddp_sync_steps_total")[rank]
        assert steps == 3
        assert samples(text, "ddp_samples_total")[rank] == 3 * 120
        assert samples(text, "ddp_gradient_bytes_total")[rank] == GCN_PARAMETERS * 4 * steps
        assert samples(text, "ddp_buckets")[rank] == buckets
        # DDP lays its buckets out again, in the order the gradients became ready, after its first
        # backward; the trainer makes that backward before the first step (ddp_trainer.training.determinism), so
        # every counted step reduces the rebuilt buckets.
        assert samples(text, "ddp_allreduce_calls_total")[rank] == buckets * steps


GCN_ON_OGB = ("--workload", "gcn", "--graph-data", "ogbn-products")


@pytest.mark.parametrize(
    ("plain_text_features", "file", "problem"),
    [
        pytest.param(None, "raw", "no such directory", id="empty-data-dir"),
        pytest.param(False, "raw/node-feat.csv.gz", "missing", id="partial-download"),
        pytest.param(True, "raw/node-feat.csv.gz", "not a readable gzip file", id="features-not-gzipped"),
    ],
)
def test_a_broken_dataset_exits_2_with_one_line_naming_the_file(
    tmp_path: Path, plain_text_features: bool | None, file: str, problem: str
) -> None:
    if plain_text_features is not None:
        raw = tmp_path / "raw"
        raw.mkdir()
        for name, text in {"num-node-list.csv.gz": "3\n", "num-edge-list.csv.gz": "1\n"}.items():
            with gzip.open(raw / name, "wt") as out:
                out.write(text)
        if plain_text_features:
            (raw / "node-feat.csv.gz").write_text("0.5,1.0\n0.0,2.0\n1.0,0.0\n")
    env = {**base_env(), "WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": str(free_port())}
    done = subprocess.run(
        [PYTHON, "-m", "ddp_trainer", *GCN_ON_OGB, "--data-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"ddp_trainer: bad configuration: {tmp_path / file}: {problem}"), done.stderr
