"""In-place restarts, the pure parts: rank order, the restart decision, the record, the bookkeeping."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ddp_trainer.metrics import DEPRECATED_ALIASES, RestartCollector
from ddp_trainer.supervisor.restarts import (
    Failure,
    LedgerState,
    RestartLedger,
    RestartRecord,
    ResumeNote,
    build_record,
    decide,
    first_failure,
    healthy_restart,
    is_grow,
    node_addr,
    rank_mismatch,
    restart_cause,
    restarts_spent,
)
from ddp_trainer.supervisor.resume import (
    KEPT_SECONDS_FIELD,
    PROGRESS_DIR_ENV,
    StepBook,
    read_resume_note,
    read_step_marker,
    resume_note_path,
    step_marker_path,
    write_restarts,
)

pytestmark = pytest.mark.unit


def rendezvous_order(addresses: list[str], seed: int) -> list[str]:
    """The order the launchers' rendezvous gives a round's pods (ddp_trainer.supervisor.rendezvous.ranked): by
    sort key, whatever order they joined in (tickets and pids are anyone's)."""
    rng = random.Random(seed)
    descriptors = [(addr, rng.randrange(1, 4_000_000), 0) for addr in addresses]
    rng.shuffle(descriptors)
    return [addr for addr, _, _ in sorted(descriptors)]


@pytest.mark.parametrize("pods", [3, 11, 101, 4096], ids=lambda n: f"{n}-pods")
def test_the_rendezvous_ranks_pods_by_pod_rank(pods: int) -> None:
    addresses = [node_addr(rank) for rank in range(pods)]
    for seed in range(3):
        assert rendezvous_order(addresses, seed) == addresses


def test_host_names_alone_would_rank_pod_10_before_pod_2() -> None:
    # Why node_addr exists: torch's default address is the FQDN, and pod names sort as text.
    names = [f"job-{rank}.job.ns.svc.cluster.local" for rank in range(11)]
    order = rendezvous_order(names, seed=0)
    assert order[0] == names[0] and order[2] == names[10]


def test_node_addr_refuses_ranks_it_cannot_order() -> None:
    with pytest.raises(ValueError):
        node_addr(-1)
    with pytest.raises(ValueError):
        node_addr(10**6)


@pytest.mark.parametrize(
    ("pod_rank", "group_rank", "elastic", "accepted"),
    [
        pytest.param(2, 2, False, True, id="fixed-own-rank"),
        pytest.param(2, 1, False, False, id="fixed-shifted-down-refused"),
        pytest.param(1, 2, False, False, id="fixed-shifted-up-refused"),
        pytest.param(0, 0, True, True, id="elastic-pod0-is-rank0"),
        pytest.param(2, 2, True, True, id="elastic-all-present"),
        pytest.param(2, 1, True, True, id="elastic-after-a-missing-pod"),
        pytest.param(5, 0, True, True, id="elastic-only-missing-pods-before"),
        pytest.param(0, 1, True, False, id="elastic-pod0-not-rank0-refused"),
        pytest.param(1, 2, True, False, id="elastic-ranked-after-itself-refused"),
    ],
)
def test_the_rank_a_round_may_give_a_pod(
    pod_rank: int, group_rank: int, elastic: bool, accepted: bool
) -> None:
    problem = rank_mismatch(pod_rank, group_rank, elastic)
    assert (problem is None) == accepted
    if problem is not None:
        assert f"NODE_RANK {pod_rank}" in problem and f"group rank {group_rank}" in problem


@pytest.mark.parametrize(
    ("before", "after", "failures", "grow"),
    [
        pytest.param(2, 3, [], True, id="pod-joined-healthy-group"),
        pytest.param(1, 3, [], True, id="two-pods-joined"),
        pytest.param(2, 3, ["failure"], False, id="a-failure-is-no-grow"),
        pytest.param(3, 3, [], False, id="replacement-same-size"),
        pytest.param(3, 2, ["failure"], False, id="shrink"),
        pytest.param(3, 2, [], False, id="shrink-without-report"),
    ],
)
def test_grow_detection(before: int, after: int, failures: list[str], grow: bool) -> None:
    reported = [failure(1, 137, 10.0) for _ in failures]
    assert is_grow(before, after, reported) is grow
    record = build_record(1, reported, [], 50.0, None, members_before=before, members_after=after)
    assert (record.grow, record.members_before, record.members_after) == (grow, before, after)


@pytest.mark.parametrize(
    ("restarts", "grows", "budget", "code", "expected"),
    [
        pytest.param(3, 0, 3, 137, "budget-spent", id="no-grows-spent"),
        pytest.param(3, 1, 3, 137, "restart", id="a-grow-is-not-budgeted"),
        pytest.param(5, 2, 3, 170, "budget-spent", id="three-failures-two-grows-spent"),
        pytest.param(2, 2, 0, 137, "budget-spent", id="only-grows-budget-zero"),
        pytest.param(4, 4, 1, 137, "restart", id="only-grows-budget-one"),
    ],
)
def test_the_budget_counts_restarts_but_grows(
    restarts: int, grows: int, budget: int, code: int, expected: str
) -> None:
    assert decide(code, restarts_spent(restarts, grows), budget) == expected


@pytest.mark.parametrize(
    ("elastic", "members", "pods", "spent", "budget", "expected"),
    [
        pytest.param(True, 2, 3, 0, 3, "grow", id="elastic-smaller-round-grows"),
        pytest.param(True, 2, 3, 3, 3, "grow", id="grow-allowed-with-budget-spent"),
        pytest.param(True, 3, 3, 1, 3, "restart", id="elastic-full-round-restarts"),
        pytest.param(True, 3, 3, 3, 3, "budget-spent", id="elastic-full-round-spent"),
        pytest.param(False, 3, 3, 2, 3, "restart", id="fixed-replacement-restarts"),
        pytest.param(False, 3, 3, 3, 3, "budget-spent", id="fixed-replacement-spent"),
    ],
)
def test_a_healthy_group_restarts_for_a_waiting_pod(
    elastic: bool, members: int, pods: int, spent: int, budget: int, expected: str
) -> None:
    assert healthy_restart(elastic, members, pods, spent, budget) == expected


@pytest.mark.parametrize(
    ("code", "restarts_done", "budget", "expected"),
    [
        pytest.param(137, 0, 3, "restart", id="killed-restarts"),
        pytest.param(170, 2, 3, "restart", id="peer-lost-last-restart"),
        pytest.param(143, 0, 3, "restart", id="stopped-restarts"),
        pytest.param(128, 0, 1, "restart", id="lowest-retried-code"),
        pytest.param(137, 3, 3, "budget-spent", id="budget-spent"),
        pytest.param(137, 0, 0, "budget-spent", id="budget-zero"),
        pytest.param(1, 0, 3, "permanent", id="own-error"),
        pytest.param(2, 0, 3, "permanent", id="bad-config"),
        pytest.param(127, 0, 3, "permanent", id="highest-permanent"),
        pytest.param(3, 5, 3, "permanent", id="permanent-wins-over-budget"),
    ],
)
def test_decide(code: int, restarts_done: int, budget: int, expected: str) -> None:
    assert decide(code, restarts_done, budget) == expected


def failure(rank: int, code: int, time: float) -> Failure:
    return Failure(pod_rank=rank, global_rank=rank, exit_code=code, time=time)


@pytest.mark.parametrize(
    ("failures", "expected", "cause"),
    [
        pytest.param([], None, "MemberJoined", id="nobody-failed"),
        pytest.param([failure(1, 137, 10.0)], 1, "ExitCode", id="one-killed"),
        pytest.param(
            [failure(0, 170, 10.1), failure(2, 170, 10.2), failure(1, 137, 10.3)],
            1,
            "ExitCode",
            id="own-failure-over-earlier-collateral",
        ),
        pytest.param([failure(2, 170, 10.2), failure(0, 170, 10.1)], 0, "PeerLost", id="only-collateral"),
        pytest.param([failure(2, 137, 10.0), failure(1, 139, 10.0)], 1, "ExitCode", id="tie-lowest-rank"),
        pytest.param([failure(0, 143, 9.0), failure(1, 170, 8.0)], 1, "PeerLost", id="stop-is-collateral"),
    ],
)
def test_the_first_failure_and_the_cause(failures: list[Failure], expected: int | None, cause: str) -> None:
    found = first_failure(failures)
    assert (None if found is None else found.global_rank) == expected
    assert restart_cause(found) == cause


def test_a_failure_survives_the_store() -> None:
    record = Failure(pod_rank=3, global_rank=7, exit_code=137, time=1796140000.123456)
    assert Failure.decode(record.encode()) == record


def test_the_record_of_a_restart() -> None:
    record = build_record(
        restarts=2,
        failures=[failure(0, 170, 100.5), failure(1, 137, 100.0)],
        stopped_times=[100.2, 101.0, 100.1],
        reformed=102.0,
        steps_before=47,
    )
    assert (record.cause, record.failed_rank, record.exit_code, record.failure) == ("ExitCode", 1, 137, 100.0)
    assert (record.stopped, record.reformed, record.steps_redone) == (101.0, 102.0, None)
    resumed = record.with_resume(104.5, 40)
    assert (resumed.resumed, resumed.steps_redone, resumed.restarts) == (104.5, 7, 2)


def test_a_replacement_without_any_failure_is_a_member_joining() -> None:
    record = build_record(restarts=1, failures=[], stopped_times=[], reformed=50.0, steps_before=None)
    assert (record.cause, record.failure, record.stopped, record.steps_redone) == (
        "MemberJoined",
        None,
        50.0,
        None,
    )


@pytest.mark.parametrize(
    "text",
    ['{"restarts": 1}', "not json", '{"restarts": 1, "time": "nan", "resumed_step": 3}', "[]"],
    ids=["missing-fields", "not-json", "nan-time", "a-list"],
)
def test_a_torn_resume_note_reads_as_none(text: str) -> None:
    assert ResumeNote.decode(text) is None


def book(tmp_path: Path, rank: int, restarts: int) -> StepBook:
    write_restarts(tmp_path, restarts)  # as the launcher does before it starts the round's workers
    return StepBook(rank, {PROGRESS_DIR_ENV: str(tmp_path)})


def test_the_step_book_counts_kept_seconds_and_marks_the_step(tmp_path: Path) -> None:
    steps = book(tmp_path, rank=0, restarts=0)
    steps.resumed(20, {KEPT_SECONDS_FIELD: 12.5})
    assert steps.kept_seconds == 12.5
    assert read_step_marker(step_marker_path(tmp_path, 0)) == 20
    steps.loop_started()
    steps.step_done(21)
    steps.step_done(22)
    assert steps.kept_seconds > 12.5
    assert read_step_marker(step_marker_path(tmp_path, 0)) == 22
    assert steps.checkpoint_fields() == {KEPT_SECONDS_FIELD: steps.kept_seconds}
    # No restart before this round: nothing to note.
    assert read_resume_note(resume_note_path(tmp_path, 0)) is None


@pytest.mark.parametrize(
    ("rank", "restarts", "noted"),
    [
        pytest.param(0, 2, True, id="rank0-after-a-restart"),
        pytest.param(1, 2, False, id="other-ranks-never"),
        pytest.param(0, 0, False, id="first-round-never"),
    ],
)
def test_rank0_notes_its_first_step_after_an_in_place_restart(
    tmp_path: Path, rank: int, restarts: int, noted: bool
) -> None:
    steps = book(tmp_path, rank=rank, restarts=restarts)
    steps.resumed(40, None)
    steps.step_done(41)
    note = read_resume_note(resume_note_path(tmp_path, rank))
    assert (note is not None) == noted
    if note is not None:
        assert (note.restarts, note.resumed_step) == (restarts, 40)
        first = note.time
        steps.step_done(42)
        again = read_resume_note(resume_note_path(tmp_path, rank))
        assert again is not None and again.time == first  # the first step only


def test_without_the_launcher_the_book_only_counts(tmp_path: Path) -> None:
    steps = StepBook(0, {})
    steps.resumed(0, {KEPT_SECONDS_FIELD: "garbage"})
    steps.step_done(1)
    assert steps.kept_seconds >= 0 and not list(tmp_path.iterdir())


def test_a_missing_restarts_file_reads_as_the_first_round(tmp_path: Path) -> None:
    steps = StepBook(0, {PROGRESS_DIR_ENV: str(tmp_path)})
    steps.resumed(0, None)
    steps.step_done(1)
    assert read_resume_note(resume_note_path(tmp_path, 0)) is None


def exposition(ledger: RestartLedger, rank: int, resume: RestartRecord | None = None) -> str:
    registry = CollectorRegistry()
    registry.register(RestartCollector(ledger, rank, (lambda record: resume) if resume is not None else None))
    return generate_latest(registry).decode()


def test_the_restart_series_are_absent_until_a_restart() -> None:
    text = exposition(RestartLedger(), rank=0)
    assert 'ddp_group_restarts_total{rank="0"} 0.0' in text
    assert "ddp_last_restart" not in text


def test_the_last_restart_series() -> None:
    ledger = RestartLedger()
    ledger.round_formed(
        1, 0, 2, build_record(1, [failure(1, 137, 100.0)], [100.5, 100.25], 101.0, steps_before=47)
    )
    text = exposition(ledger, rank=0)
    assert 'ddp_group_restarts_total{rank="0"} 1.0' in text
    assert 'ddp_last_restart_failure_timestamp_seconds{rank="0"} 100.0' in text
    assert 'ddp_last_restart_stopped_timestamp_seconds{rank="0"} 100.5' in text
    assert 'ddp_last_restart_reformed_timestamp_seconds{rank="0"} 101.0' in text
    assert 'ddp_last_restart_info{cause="ExitCode",exit_code="137",failed_rank="1",rank="0"} 1.0' in text
    # Rank 0 has not stepped since the resume: no resume time and no steps redone yet.
    assert "resumed_timestamp" not in text and "steps_redone" not in text
    record = ledger.state.record
    assert record is not None
    text = exposition(ledger, rank=0, resume=record.with_resume(103.0, 40))
    assert 'ddp_last_restart_resumed_timestamp_seconds{rank="0"} 103.0' in text
    assert 'ddp_last_restart_steps_redone{rank="0"} 7.0' in text


def test_the_group_series_on_every_pod_and_the_resize_on_rank0() -> None:
    ledger = RestartLedger()
    assert 'ddp_group_members{rank="2"} 0.0' in exposition(ledger, rank=2)  # no round yet
    ledger.round_formed(
        2, 1, 3, build_record(2, [], [], 50.0, steps_before=30, members_before=2, members_after=3), resizes=2
    )
    text = exposition(ledger, rank=0)
    assert 'ddp_group_grows_total{rank="0"} 1.0' in text
    assert 'ddp_group_resizes_total{rank="0"} 2.0' in text
    assert 'ddp_group_members{rank="0"} 3.0' in text
    assert 'ddp_last_restart_members_before{rank="0"} 2.0' in text
    assert 'ddp_last_restart_members_after{rank="0"} 3.0' in text
    assert 'ddp_last_restart_info{cause="MemberJoined",exit_code="",failed_rank="",rank="0"} 1.0' in text
    # A record without member counts (none known) exports none, under either name.
    ledger.round_formed(1, 0, 3, build_record(1, [failure(1, 137, 10.0)], [], 50.0, steps_before=None))
    text = exposition(ledger, rank=0)
    assert "members_before" not in text and "nodes_before" not in text


def test_each_deprecated_alias_is_exported_with_the_value_of_its_series() -> None:
    ledger = RestartLedger()
    ledger.round_formed(
        2, 1, 3, build_record(2, [], [], 50.0, steps_before=30, members_before=2, members_after=3)
    )
    values = {s.name: s.value for family in RestartCollector(ledger, 0).collect() for s in family.samples}
    assert {name: values[name] for name in DEPRECATED_ALIASES} == {
        "ddp_group_members": 3.0,
        "ddp_last_restart_members_before": 2.0,
        "ddp_last_restart_members_after": 3.0,
    }
    assert {alias: values[alias] for alias in DEPRECATED_ALIASES.values()} == {
        alias: values[name] for name, alias in DEPRECATED_ALIASES.items()
    }


def test_a_round_without_a_record_keeps_the_last_one() -> None:
    ledger = RestartLedger()
    record = build_record(1, [failure(1, 137, 10.0)], [], 50.0, steps_before=None)
    ledger.round_formed(1, 0, 2, record)
    ledger.round_formed(1, 0, 2, None)  # a pod other than rank 0's, or the first round: no new record
    assert ledger.state == LedgerState(restarts=1, grows=0, members=2, record=record)


def test_a_scrape_renders_one_state_of_the_ledger() -> None:
    # An elastic group of 2 after one failure; then a pod joins: the grow is restart 2 and grow 1.
    ledger = RestartLedger()
    ledger.round_formed(1, 0, 2, build_record(1, [failure(1, 137, 10.0)], [], 50.0, steps_before=None))
    scrape = RestartCollector(ledger, 0).collect()
    families = [next(scrape)]
    # The agent's thread forms the grow's round while the endpoint's is between two series.
    ledger.round_formed(
        2, 1, 3, build_record(2, [], [], 60.0, steps_before=None, members_before=2, members_after=3)
    )
    families += list(scrape)
    values = {
        (sample.name, sample.labels.get("cause")): sample.value
        for family in families
        for sample in family.samples
    }
    # All of the round the scrape began in: a mix would pair one round's counts with the next round's
    # record (or its restarts with the last round's grows, charging the grow to the restart budget).
    assert values == {
        ("ddp_group_restarts_total", None): 1.0,
        ("ddp_group_grows_total", None): 0.0,
        ("ddp_group_resizes_total", None): 0.0,
        ("ddp_group_members", None): 2.0,
        ("ddp_group_nodes", None): 2.0,
        ("ddp_last_restart_failure_timestamp_seconds", None): 10.0,
        ("ddp_last_restart_stopped_timestamp_seconds", None): 50.0,
        ("ddp_last_restart_reformed_timestamp_seconds", None): 50.0,
        ("ddp_last_restart_info", "ExitCode"): 1.0,
    }
    # The next scrape renders the new round.
    assert 'ddp_group_restarts_total{rank="0"} 2.0' in exposition(ledger, rank=0)


def test_a_member_joining_has_no_failed_rank() -> None:
    ledger = RestartLedger()
    ledger.round_formed(2, 0, 2, build_record(2, [], [], 50.0, steps_before=None))
    text = exposition(ledger, rank=0)
    assert 'ddp_last_restart_info{cause="MemberJoined",exit_code="",failed_rank="",rank="0"} 1.0' in text
    assert "failure_timestamp" not in text
