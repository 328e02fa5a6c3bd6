"""What the job commands show (jobview.py): the rank's pod, the tables, describe, wait's verdict, and
the log lines' order across reconnects."""

from __future__ import annotations

from typing import Any

import pytest
from kube_factories import at, job_object, observe, pod, standby_pod

from ddp_operator import jobview
from ddp_operator.observe import format_time
from ddp_operator.progress.exposition import PodScrape
from ddp_operator.progress.render import RankResult


def job_with(status: dict[str, Any], name: str = "mnist", **spec: Any) -> dict[str, Any]:
    job = job_object(name, **spec)
    job["metadata"]["creationTimestamp"] = format_time(at(0))
    job["status"] = status
    return job


def condition(kind: str, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": format_time(at(5)),
    }


# ---- the rank's pod --------------------------------------------------------------------------------

RANK_POD_CASES = [
    pytest.param({"attempt": 0}, [pod(0), pod(1)], {0: "mnist-0-0", 1: "mnist-1-0"}, id="first-attempt"),
    pytest.param(
        {"attempt": 0},
        [pod(0), pod(1, deleting_at=3), pod(1, replacement=1)],
        {0: "mnist-0-0", 1: "mnist-1-0r1"},
        id="a-replacement-supersedes-the-lost-pod",
    ),
    pytest.param(
        {"attempt": 1},
        [pod(0, deleting_at=3), pod(0, attempt=1)],
        {0: "mnist-0-1"},
        id="status-attempt-picks-the-new-gang-while-the-old-one-goes",
    ),
    pytest.param({}, [pod(0), pod(0, attempt=2)], {0: "mnist-0-2"}, id="no-status-yet-the-newest-attempt"),
    pytest.param(
        {"attempt": 0},
        [pod(0), pod(1, owner_uid="another-job")],
        {0: "mnist-0-0"},
        id="a-recreated-jobs-leftover-is-not-its-own",
    ),
]


@pytest.mark.parametrize(("status", "pods", "expected"), RANK_POD_CASES)
def test_rank_pods(status: dict[str, Any], pods: list[dict[str, Any]], expected: dict[int, str]) -> None:
    job = job_with(status)
    current = jobview.rank_pods(job, jobview.own_pods(job, pods))
    assert {rank: p.name for rank, p in current.items()} == expected


# ---- wait --------------------------------------------------------------------------------------------

WAIT_CASES = [
    pytest.param({"phase": "Running"}, "Succeeded", (False, False), id="running-may-still-succeed"),
    pytest.param({"phase": "Succeeded"}, "Succeeded", (True, True), id="succeeded-met"),
    pytest.param(
        {"phase": "Failed", "conditions": [condition("Failed", "BackoffLimitExceeded", "3 restarts")]},
        "Succeeded",
        (True, False),
        id="failed-never-succeeds",
    ),
    pytest.param({"phase": "Running"}, "Running", (True, True), id="waiting-for-running"),
    pytest.param({"phase": "Succeeded"}, "Running", (True, False), id="finished-before-running-was-seen"),
    pytest.param({}, "Succeeded", (False, False), id="no-status-yet"),
    pytest.param({"phase": "Suspended"}, "Succeeded", (False, False), id="suspended-may-resume"),
]


@pytest.mark.parametrize(("status", "wanted", "expected"), WAIT_CASES)
def test_wait_verdict(status: dict[str, Any], wanted: str, expected: tuple[bool, bool]) -> None:
    verdict = jobview.wait_verdict(job_with(status), wanted)
    assert (verdict.done, verdict.met) == expected


def test_wait_verdict_names_the_reason_of_a_failure() -> None:
    status = {"phase": "Failed", "conditions": [condition("Failed", "BackoffLimitExceeded", "3 restarts")]}
    message = jobview.wait_verdict(job_with(status), "Succeeded").message
    assert "BackoffLimitExceeded" in message and "3 restarts" in message


def test_wait_verdict_of_a_deleted_job() -> None:
    verdict = jobview.wait_verdict(None, "Succeeded")
    assert (verdict.done, verdict.met) == (True, False) and "does not exist" in verdict.message


# ---- get and describe ---------------------------------------------------------------------------------


def test_get_table_shows_progress_and_straggler() -> None:
    running = job_with(
        {
            "phase": "Running",
            "ready": "2/2",
            "attempt": 1,
            "restarts": 1,
            "progress": {"step": 120, "percentComplete": 40, "samplesPerSecond": "1234"},
            "straggler": {"rank": 1, "slowdown": "2.31"},
        },
        name="b-job",
    )
    fresh = job_with({}, name="a-job")
    lines = jobview.get_table([running, fresh], at(90)).splitlines()
    assert lines[0].split() == [c for col in jobview.GET_COLUMNS for c in col.split()]
    assert lines[1].split()[0] == "a-job" and lines[1].split()[1] == "-"
    assert lines[2].split() == [
        "b-job",
        "Running",
        "2/2",
        "1",
        "1",
        "120",
        "40%",
        "1234",
        "rank",
        "1",
        "(2.31x)",
        "1m30s",
    ]


def test_get_table_with_namespaces() -> None:
    lines = jobview.get_table([job_with({"phase": "Pending"})], at(5), with_namespace=True).splitlines()
    assert lines[0].startswith("NAMESPACE") and lines[1].split()[:2] == ["team-a", "mnist"]


def test_describe_shows_every_part_in_one_screen() -> None:
    job = job_with(
        {
            "phase": "Running",
            "attempt": 0,
            "restarts": 1,
            "podReplacements": 1,
            "goodput": "0.974",
            "lostSeconds": {
                "stopping": "0.40",
                "reforming": "11.20",
                "resuming": "1.10",
                "recreating": "0.00",
                "total": "12.70",
                "restarts": 1,
            },
            "startTime": format_time(at(0)),
            "straggler": {"rank": 1, "pod": "mnist-1-0r1", "node": "node-1", "slowdown": "2.10"},
            "lastRestart": {
                "cause": "PodDeleted",
                "mode": "PodReplaced",
                "rank": 1,
                "stepsRedone": 0,
                "note": "n",
            },
            "conditions": [condition("Running", "Training", "2 of 2 ranks running")],
        }
    )
    pods = jobview.own_pods(job, [pod(0), pod(1, deleting_at=3), pod(1, replacement=1, created=4)])
    events = [
        {
            "type": "Normal",
            "reason": "PodReplaced",
            "message": "rank 1 replaced",
            "lastTimestamp": format_time(at(6)),
        },
        {
            "type": "Warning",
            "reason": "Straggler",
            "message": "rank 1 slow",
            "count": 3,
            "lastTimestamp": format_time(at(8)),
        },
    ]
    text = jobview.describe(job, pods, events, at(10))
    for expected in (
        "team-a/mnist",
        "Running (Training)",
        "2 of 2 ranks running",
        "Goodput:     0.974",
        "Lost:        12.70s to 1 restart(s): stopping 0.40s, reforming 11.20s, resuming 1.10s",
        "mode=PodReplaced",
        "stepsRedone=0",
        "note: n",
        "slowdown=2.10",
        "mnist-1-0r1",
        "node-1",
    ):
        assert expected in text, (expected, text)
    assert "mnist-1-0 " not in text.split("Ranks:")[1].split("Events:")[0], (
        "the superseded pod is not a rank's"
    )
    event_lines = text.split("Events:")[1].splitlines()[2:]
    assert [line.split()[2] for line in event_lines] == ["PodReplaced", "Straggler"], "oldest first"


def test_describe_without_events_or_status() -> None:
    text = jobview.describe(job_with({}), [], [], at(1))
    assert "Events:      <none>" in text and "Phase:       -" in text


# ---- top ---------------------------------------------------------------------------------------------


def test_top_screen_is_the_run_summarys_table() -> None:
    job = job_with({"phase": "Running", "attempt": 0, "progress": {"step": 7}})
    results = [
        RankResult(0, 0, "mnist-0-0", None, PodScrape(steps=7, samples=448, loss=0.5)),
        RankResult(0, 1, "mnist-1-0", None, None),
    ]
    text = jobview.top_screen(job, results, at(3))
    assert text.splitlines()[2].split()[:5] == ["attempt", "rank", "pod", "exit", "steps"]
    assert text.splitlines()[4].split()[:5] == ["0", "0", "mnist-0-0", "-", "7"]
    assert "no metrics from rank(s) 1" in text


def test_metrics_port_is_the_trainers_named_port() -> None:
    ported = pod(0)
    ported["spec"]["containers"] = [
        {"name": "sidecar", "ports": [{"name": "metrics", "containerPort": 1}]},
        {
            "name": "trainer",
            "ports": [
                {"name": "rendezvous", "containerPort": 29500},
                {"name": "metrics", "containerPort": 9400},
            ],
        },
    ]
    assert jobview.metrics_port(ported) == 9400
    assert jobview.metrics_port(pod(0)) is None


# ---- logs ----------------------------------------------------------------------------------------------

LOG_LINE_CASES = [
    pytest.param(
        "2026-12-02T11:31:19.123456789Z step 3",
        (("2026-12-02T11:31:19", 123456789), "step 3"),
        id="nanoseconds",
    ),
    pytest.param(
        "2026-12-02T11:31:19.5Z x", (("2026-12-02T11:31:19", 500000000), "x"), id="trimmed-zeros-pad"
    ),
    pytest.param("2026-12-02T11:31:19Z x", (("2026-12-02T11:31:19", 0), "x"), id="whole-second"),
    pytest.param("plain line", (None, "plain line"), id="no-timestamp"),
    pytest.param(
        "2026-12-02T11:31:19+01:00 x", (None, "2026-12-02T11:31:19+01:00 x"), id="not-utc-kept-whole"
    ),
]


@pytest.mark.parametrize(("line", "expected"), LOG_LINE_CASES)
def test_split_log_line(line: str, expected: tuple[object, str]) -> None:
    assert jobview.split_log_line(line) == expected


def test_log_keys_order_lines_within_a_second() -> None:
    early = jobview.split_log_line("2026-12-02T11:31:19.5Z a")[0]
    late = jobview.split_log_line("2026-12-02T11:31:19.123456789Z b")[0]
    assert early is not None and late is not None and late < early
    assert jobview.since_time(early) == "2026-12-02T11:31:19Z"


def test_switch_note_says_why() -> None:
    first, replaced, next_attempt = observe(pod(0), pod(0, replacement=1), pod(0, attempt=1))
    assert "replacement" in jobview.switch_note(0, first, replaced)
    assert "new attempt" in jobview.switch_note(0, replaced, next_attempt)
    assert jobview.switch_note(0, None, first) == "rank 0: pod mnist-0-0 (attempt 0)"


def test_describe_lists_the_standby_pods_apart_from_the_ranks() -> None:
    job = job_with({"phase": "Running", "attempt": 0})
    pods = jobview.own_pods(job, [pod(0), pod(1), standby_pod(1), standby_pod(2, deleting_at=3)])
    text = jobview.describe(job, pods, [], at(10))
    ranks, standbys = text.split("Ranks:")[1].split("Standby pods")
    assert "mnist-standby1-0" not in ranks and "mnist-standby1-0" in standbys
    assert "mnist-standby2-0" not in text, "a standby being deleted is not listed"
