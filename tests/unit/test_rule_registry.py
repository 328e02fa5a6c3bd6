"""The rules registry (policies/registry.py): a new policy is one module whose ``RULES`` decide() walks
in order, and whose next look sets the requeue, with no edit anywhere else. This is the walk-through of
docs/architecture.md ("Adding a restart policy, as a newcomer"), done with a dummy rule."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from tests.unit.kube_factories import at, job_spec, observe, pod

from ddp_operator import names
from ddp_operator.decision import Decision
from ddp_operator.observe import format_time
from ddp_operator.policies import registry
from ddp_operator.policies.rule import LIVE, Attempt, Finish, Outcome, Rule
from ddp_operator.reconcile import decide

pytestmark = pytest.mark.unit

RUNNING = {
    "phase": "Running",
    "attempt": 0,
    "restarts": 0,
    "replicas": 2,
    "startTime": format_time(at(0)),
    "conditions": [],
}


@dataclass(frozen=True)
class Pace:
    """The dummy rule's facts: how many rank pods run."""

    running: int


def pace(live: Attempt) -> Pace:
    return Pace(running=len(live.running))


def give_up_alone(live: Attempt, facts: Pace) -> Outcome | None:
    """Fail a job left with one running rank (the dummy rule's decision)."""
    if facts.running != 1:
        return None
    return Finish(names.PHASE_FAILED, "DummyAlone", "one rank left alone")


def look_in_seven(live: Attempt, facts: Pace) -> float | None:
    return 7.0


DUMMY = Rule("dummy_alone", 65, pace, give_up_alone, look_in_seven)


@pytest.fixture
def dummy() -> Iterator[Rule[Pace]]:
    registry.register(DUMMY)
    try:
        yield DUMMY
    finally:
        registry.unregister(DUMMY)


def run(pods: list[dict[str, object]]) -> Decision:
    return decide(job_spec(), RUNNING, observe(*pods), at(100))


@pytest.mark.parametrize(
    ("pods", "phase", "requeue"),
    [
        pytest.param([pod(0), pod(1)], "Running", 7.0, id="not-its-call-its-next-look-is-the-requeue"),
        pytest.param([pod(0), pod(1, phase="Pending")], "Failed", None, id="it-decides"),
    ],
)
def test_decide_walks_a_registered_rule_and_uses_its_deadline(
    dummy: Rule[Pace], pods: list[dict[str, object]], phase: str, requeue: float | None
) -> None:
    decision = run(pods)
    assert decision.phase == phase
    if phase == "Failed":
        assert decision.report.event is not None and decision.report.event.reason == "DummyAlone"
    else:
        assert decision.requeue_after == requeue


def test_without_the_rule_nothing_of_it_is_left() -> None:
    decision = run([pod(0), pod(1)])
    assert decision.phase == "Running" and decision.requeue_after is None


def test_its_place_is_its_order() -> None:
    registry.register(DUMMY)
    try:
        names_in_order = [r.name for r in registry.rules(LIVE)]
    finally:
        registry.unregister(DUMMY)
    assert names_in_order.index("dummy_alone") == names_in_order.index("root_image_refused") + 1


@pytest.mark.parametrize(
    "clash",
    [
        pytest.param(Rule("judged", 66, pace, give_up_alone, look_in_seven), id="same-name"),
        pytest.param(Rule("another", 20, pace, give_up_alone, look_in_seven), id="same-place"),
    ],
)
def test_two_rules_share_neither_a_name_nor_a_place(clash: Rule[Pace]) -> None:
    with pytest.raises(ValueError, match="clashes"):
        registry.register(clash)


def test_a_rules_facts_are_computed_once_per_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def counted(live: Attempt) -> Pace:
        calls.append(1)
        return pace(live)

    rule = Rule("counted", 66, counted, give_up_alone, look_in_seven)
    registry.register(rule)
    try:
        run([pod(0), pod(1)])
    finally:
        registry.unregister(rule)
    assert len(calls) == 1, "asked for its outcome and its next look, computed once"
