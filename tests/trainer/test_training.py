"""Real gloo process groups: training results, identical parameters, and the metrics over HTTP."""

from __future__ import annotations

import shutil

import pytest
from trainer_gang import LINGERING, Gangs, describe, promtool_check, samples, wait_all

from ddp_trainer.library.teardown import THREADS_OUTLIVED_GROUP

pytestmark = pytest.mark.trainer

LINGER = ["--metrics-linger", "120"]  # the test ends the linger with SIGTERM once it has scraped


def scrape_after_final(process_with_metrics: object) -> str:
    from trainer_gang import TrainerProcess

    assert isinstance(process_with_metrics, TrainerProcess)
    process_with_metrics.wait_for_stdout(LINGERING)
    return process_with_metrics.scrape()


def assert_sync_invariants(
    text: str, rank: str, world_size: int, gradient_bytes_per_step: int, ratio: float
) -> None:
    steps = samples(text, "ddp_sync_steps_total")[rank]
    calls = samples(text, "ddp_allreduce_calls_total")[rank]
    buckets = samples(text, "ddp_buckets")[rank]
    gradient = samples(text, "ddp_gradient_bytes_total")[rank]
    payload = samples(text, "ddp_allreduce_bytes_total")[rank]
    assert steps > 0
    assert gradient == gradient_bytes_per_step * steps
    assert payload == gradient * ratio
    assert calls == buckets * steps
    assert samples(text, "ddp_world_size")[rank] == world_size
    assert 0.0 <= samples(text, "ddp_comm_overlap_ratio")[rank] <= 1.0
    assert samples(text, "ddp_backward_comm_seconds")[rank] > 0
    assert samples(text, "ddp_last_sync_timestamp_seconds")[rank] > 0


def test_digits_default_config_trains_identically_and_exports_metrics(gangs: Gangs) -> None:
    gang = gangs.ranks(2, [*LINGER, "--progress-every", "20"], metrics_ranks=(0, 1))
    texts = {str(rank): scrape_after_final(process) for rank, process in enumerate(gang)}
    for process in gang:
        process.signal(15)
    assert wait_all(gang) == [0, 0], describe(gang)
    # Each rank ended its group (and joined gloo's threads) before the interpreter's teardown.
    assert not any(THREADS_OUTLIVED_GROUP in process.stderr for process in gang), describe(gang)
    final = gang[0].final()
    assert final is not None and final.accuracy >= 0.90, describe(gang)
    progress = gang[0].progress()
    assert len(progress) >= 2 and progress[-1].loss < progress[0].loss
    digests = {**gang[0].digests(), **gang[1].digests()}
    assert set(digests) == {0, 1} and digests[0] == digests[1]
    # Flatten + Linear(64, 10): 650 fp32 parameters in one bucket.
    for rank, text in texts.items():
        assert_sync_invariants(text, rank, world_size=2, gradient_bytes_per_step=650 * 4, ratio=1.0)
        # Every step counted, the buckets of one step in --stop-check-every (5) timed: the 1st, 6th, ...
        steps = samples(text, "ddp_sync_steps_total")[rank]
        timed = samples(text, "ddp_sync_timed_steps_total")[rank]
        assert timed == -(-steps // 5), (steps, timed)
        buckets = samples(text, "ddp_buckets")[rank]
        assert samples(text, "ddp_allreduce_duration_seconds_count")[rank] == buckets * timed
        assert (
            samples(text, "ddp_step_duration_seconds_count")[rank]
            == samples(text, "ddp_sync_steps_total")[rank]
        )
        assert samples(text, "ddp_allreduce_service_seconds_total")[rank] > 0
        assert samples(text, "ddp_samples_total")[rank] > 0
        assert samples(text, "ddp_build_info")[rank] == 1
        assert 'comm_hook="allreduce"' in text and 'backend="gloo"' in text


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package 'prometheus') is not installed"
)
def test_metrics_pass_promtool_mid_training(gangs: Gangs) -> None:
    gang = gangs.ranks(
        2,
        [
            "--workload",
            "synthetic",
            "--synthetic-width",
            "32",
            "--synthetic-depth",
            "2",
            "--max-steps",
            "400",
            "--throttle-ms",
            "20",
            "--progress-every",
            "5",
        ],
        metrics_ranks=(0,),
    )
    gang[0].wait_for_stdout(r"^progress step=10 ")
    text = gang[0].scrape()
    checked = promtool_check(text)
    assert checked.returncode == 0, checked.stdout + checked.stderr + text
    assert "ddp_allreduce_duration_seconds_bucket" in text


def test_every_mid_training_scrape_counts_whole_steps_over_several_buckets(gangs: Gangs) -> None:
    """A scrape may land while buckets are in flight: counters still show whole steps, so bytes per
    sync step is exact at any moment (what a dashboard or the e2e test reads at a pod IP)."""
    width, depth = 64, 3
    gang = gangs.ranks(
        2,
        [
            "--workload",
            "synthetic",
            "--synthetic-width",
            str(width),
            "--synthetic-depth",
            str(depth),
            "--bucket-cap-mb",
            "0.01",
            "--max-steps",
            "400",
            "--throttle-ms",
            "5",
            "--progress-every",
            "5",
        ],
        metrics_ranks=(0,),
    )
    gang[0].wait_for_stdout(r"^progress step=5 ")
    # DDP rebuilds its buckets after the first step, so calls are compared step to step, not from 0.
    seen: list[tuple[float, float]] = []
    for _ in range(40):
        text = gang[0].scrape()
        steps = samples(text, "ddp_sync_steps_total")["0"]
        buckets = samples(text, "ddp_buckets")["0"]
        assert buckets > 1, "the bucket cap must split the gradients into several buckets"
        assert (
            samples(text, "ddp_gradient_bytes_total")["0"] == synthetic_gradient_bytes(width, depth) * steps
        )
        calls = samples(text, "ddp_allreduce_calls_total")["0"]
        if seen:
            previous_steps, previous_calls = seen[-1]
            assert calls - previous_calls == buckets * (steps - previous_steps)
        seen.append((steps, calls))
    seen_steps = {steps for steps, _ in seen}
    assert len(seen_steps) > 1, "the scrapes should have seen training progress"


def synthetic_gradient_bytes(width: int, depth: int) -> int:
    hidden = (depth - 1) * (width * width + width)
    return (hidden + width * 10 + 10) * 4


@pytest.mark.parametrize(
    ("comm_hook", "ratio"),
    [
        pytest.param("fp16", 0.5, id="fp16-halves-payload"),
        pytest.param("bf16", 0.5, id="bf16-halves-payload"),
    ],
)
def test_three_ranks_compressed_payload(gangs: Gangs, comm_hook: str, ratio: float) -> None:
    width, depth = 48, 3
    args = [
        "--workload",
        "synthetic",
        "--synthetic-width",
        str(width),
        "--synthetic-depth",
        str(depth),
        "--synthetic-samples",
        "960",
        "--max-steps",
        "12",
        "--comm-hook",
        comm_hook,
        *LINGER,
    ]
    gang = gangs.ranks(3, args, metrics_ranks=(2,))
    text = scrape_after_final(gang[2])
    gang[2].signal(15)
    assert wait_all(gang) == [0, 0, 0], describe(gang)
    assert_sync_invariants(
        text, "2", world_size=3, gradient_bytes_per_step=synthetic_gradient_bytes(width, depth), ratio=ratio
    )
    assert samples(text, "ddp_sync_steps_total")["2"] == 12
    assert (
        len(
            set(gang[0].digests().values())
            | set(gang[1].digests().values())
            | set(gang[2].digests().values())
        )
        == 1
    )


def test_light_mode_derives_bytes_without_a_hook(gangs: Gangs) -> None:
    gang = gangs.ranks(2, ["--sync-metrics", "light", "--max-steps", "15", *LINGER], metrics_ranks=(1,))
    text = scrape_after_final(gang[1])
    gang[1].signal(15)
    assert wait_all(gang) == [0, 0], describe(gang)
    assert_sync_invariants(text, "1", world_size=2, gradient_bytes_per_step=650 * 4, ratio=1.0)
    assert samples(text, "ddp_sync_steps_total")["1"] == 15
    assert "ddp_allreduce_duration_seconds" not in text
    assert "ddp_allreduce_service_seconds_total" not in text
    assert "ddp_sync_timed_steps_total" not in text


def test_powersgd_sends_less_than_the_gradients(gangs: Gangs) -> None:
    args = [
        "--workload",
        "synthetic",
        "--synthetic-width",
        "64",
        "--synthetic-depth",
        "3",
        "--synthetic-samples",
        "640",
        "--max-steps",
        "10",
        "--comm-hook",
        "powersgd",
        *LINGER,
    ]
    gang = gangs.ranks(2, args, metrics_ranks=(0,))
    text = scrape_after_final(gang[0])
    gang[0].signal(15)
    assert wait_all(gang) == [0, 0], describe(gang)
    gradient = samples(text, "ddp_gradient_bytes_total")["0"]
    payload = samples(text, "ddp_allreduce_bytes_total")["0"]
    assert gradient == synthetic_gradient_bytes(64, 3) * 10
    assert 0 < payload < gradient / 2
