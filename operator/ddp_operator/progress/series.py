"""The trainer's series that progress reads (docs/metrics.md): the one list of their names.

Sample names as exported, so a counter carries its ``_total`` and a histogram's buckets their
``_bucket``. tests/unit/test_progress_series.py checks each against the trainer's registry: a series
renamed there fails that test instead of silently vanishing from status.progress and the live line.
"""

from __future__ import annotations

from typing import Final

STEPS: Final = "ddp_sync_steps_total"
SAMPLES: Final = "ddp_samples_total"
TARGET_STEPS: Final = "ddp_target_steps"
LOSS: Final = "ddp_loss"
OVERLAP: Final = "ddp_comm_overlap_ratio"
COMPUTE: Final = "ddp_compute_seconds"
ALLREDUCE_BYTES: Final = "ddp_allreduce_bytes_total"
ALLREDUCE_SERVICE_SECONDS: Final = "ddp_allreduce_service_seconds_total"
ALLREDUCE_DURATION_BUCKET: Final = "ddp_allreduce_duration_seconds_bucket"
LAST_SYNC: Final = "ddp_last_sync_timestamp_seconds"
# The steps' own durations as the rank timed them (a histogram's sum and count): the pace before two
# reads have seen steps made (ProgressTracker.step_seconds).
STEP_DURATION_SUM: Final = "ddp_step_duration_seconds_sum"
STEP_DURATION_COUNT: Final = "ddp_step_duration_seconds_count"
# Rank 0 only: the rank the others wait for, the job's step time with it over without it, and the
# phase it lost its time in (1 on that phase's sample, label ``phase``).
STRAGGLER_RANK: Final = "ddp_straggler_rank"
STRAGGLER_SLOWDOWN: Final = "ddp_straggler_slowdown"
STRAGGLER_PHASE: Final = "ddp_straggler_phase"
# Rank 0 only, once training is over: the held-out accuracy `ddpjob run` reports.
EVAL_ACCURACY: Final = "ddp_eval_accuracy"
# Rank 0 only: the seconds of the steps the current state keeps (goodput), and when its first step after
# resuming from a checkpoint ended.
KEPT_STEP_SECONDS: Final = "ddp_kept_step_seconds"
RESUMED: Final = "ddp_resumed_timestamp_seconds"
# Rank 0's pod's launcher (in place, docs/restarts.md): the group's restarts and the last one's story.
GROUP_RESTARTS: Final = "ddp_group_restarts_total"
RESTART_FAILURE: Final = "ddp_last_restart_failure_timestamp_seconds"
RESTART_STOPPED: Final = "ddp_last_restart_stopped_timestamp_seconds"
RESTART_REFORMED: Final = "ddp_last_restart_reformed_timestamp_seconds"
RESTART_RESUMED: Final = "ddp_last_restart_resumed_timestamp_seconds"
RESTART_STEPS_REDONE: Final = "ddp_last_restart_steps_redone"
RESTART_INFO: Final = "ddp_last_restart_info"
# Elastic jobs (docs/elastic.md): the group's members now, the rounds that grew it (not failures), the
# rounds that changed its size, and its members before and after the last restart (a resize when they differ).
GROUP_MEMBERS: Final = "ddp_group_members"
GROUP_GROWS: Final = "ddp_group_grows_total"
GROUP_RESIZES: Final = "ddp_group_resizes_total"
RESTART_MEMBERS_BEFORE: Final = "ddp_last_restart_members_before"
RESTART_MEMBERS_AFTER: Final = "ddp_last_restart_members_after"
# The deprecated name of a series (docs/metrics.md, "Deprecated names"): an older trainer image exports
# only that one, so it is read when the series itself is absent.
DEPRECATED: Final = {
    GROUP_MEMBERS: "ddp_group_nodes",
    RESTART_MEMBERS_BEFORE: "ddp_last_restart_nodes_before",
    RESTART_MEMBERS_AFTER: "ddp_last_restart_nodes_after",
}
# The gang health check (DDP_HEALTH_CHECK=on, docs/trainer.md): the rank whose links are far below the
# group's median in the last check (-1: none), and when that check ended (unix seconds, the rank's clock).
HEALTH_SLOW_RANK: Final = "ddp_health_slow_rank"
HEALTH_CHECKED_AT: Final = "ddp_health_check_timestamp_seconds"
# ... and what it measured: the all-reduce bus bandwidth, the slowest link when far below the median of
# links (its first rank, -1: none), and the seconds the check took (shown in status.progress.healthCheck).
HEALTH_BUS_BANDWIDTH: Final = "ddp_health_busbw_bytes_per_second"
HEALTH_SLOW_LINK: Final = "ddp_health_slow_link"
HEALTH_SECONDS: Final = "ddp_health_check_seconds"
# Exported by the in-place launcher, not by a worker's registry.
LAUNCHER: Final = frozenset(
    {
        GROUP_RESTARTS,
        RESTART_FAILURE,
        RESTART_STOPPED,
        RESTART_REFORMED,
        RESTART_RESUMED,
        RESTART_STEPS_REDONE,
        RESTART_INFO,
        GROUP_MEMBERS,
        GROUP_GROWS,
        GROUP_RESIZES,
        RESTART_MEMBERS_BEFORE,
        RESTART_MEMBERS_AFTER,
    }
)

READ: Final = frozenset(
    {
        STEP_DURATION_SUM,
        STEP_DURATION_COUNT,
        STEPS,
        SAMPLES,
        TARGET_STEPS,
        LOSS,
        OVERLAP,
        COMPUTE,
        ALLREDUCE_BYTES,
        ALLREDUCE_SERVICE_SECONDS,
        ALLREDUCE_DURATION_BUCKET,
        LAST_SYNC,
        STRAGGLER_RANK,
        STRAGGLER_SLOWDOWN,
        STRAGGLER_PHASE,
        EVAL_ACCURACY,
        KEPT_STEP_SECONDS,
        RESUMED,
        HEALTH_SLOW_RANK,
        HEALTH_CHECKED_AT,
        HEALTH_BUS_BANDWIDTH,
        HEALTH_SLOW_LINK,
        HEALTH_SECONDS,
    }
    | LAUNCHER
    | frozenset(DEPRECATED.values())
)
