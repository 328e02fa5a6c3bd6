"""The rendezvous pod (policies.rendezvous, docs/restarts.md "No rank is special"): which one the attempt
has, a lost one replaced alone under a new name, and which ones go; decide() with it."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.kube_factories import at, job_spec, observe, pod, with_run_policy
from tests.unit.test_reconcile import live_status

from ddp_operator import names
from ddp_operator.decision import REASON_RENDEZVOUS_REPLACED
from ddp_operator.policies import rendezvous
from ddp_operator.policies.rendezvous import RendezvousPlan
from ddp_operator.reconcile import decide

pytestmark = pytest.mark.unit


def store_pod(attempt: int = 0, replacement: int = 0, **state: Any) -> dict[str, Any]:
    """A rendezvous pod as the apiserver returns it: no rank, the rendezvous role."""
    made = pod(0, attempt, **state)
    made["metadata"]["name"] = names.rendezvous_pod_name("mnist", attempt, replacement)
    made["metadata"]["labels"] = names.rendezvous_labels(
        "mnist", made["metadata"]["ownerReferences"][0]["uid"], attempt
    )
    made["status"]["containerStatuses"][0]["name"] = names.RENDEZVOUS_CONTAINER
    return made


@pytest.mark.parametrize(
    ("phase", "attempt", "stores", "recorded", "expected"),
    [
        pytest.param(
            "Running",
            0,
            [store_pod()],
            "mnist-rdzv-0",
            RendezvousPlan(),
            id="serving-and-recorded-nothing-to-do",
        ),
        pytest.param(
            "Running",
            0,
            [store_pod()],
            None,
            RendezvousPlan(record="mnist-rdzv-0"),
            id="seen-the-first-time-recorded",
        ),
        pytest.param(
            "Pending",
            0,
            [],
            None,
            RendezvousPlan(create="mnist-rdzv-0"),
            id="never-seen-created-by-name-a-409-if-it-exists",
        ),
        pytest.param(
            "Running",
            0,
            [store_pod(deleting_at=10)],
            "mnist-rdzv-0",
            RendezvousPlan(create="mnist-rdzv-0r1"),
            id="deleted-replaced-alone-under-a-new-name",
        ),
        pytest.param(
            "Running",
            0,
            [],
            "mnist-rdzv-0",
            RendezvousPlan(create="mnist-rdzv-0r1"),
            id="gone-from-the-cluster-replaced-too-never-its-own-name-again",
        ),
        pytest.param(
            "Running",
            0,
            [store_pod(exit_code=0)],
            "mnist-rdzv-0",
            RendezvousPlan(create="mnist-rdzv-0r1", delete=("mnist-rdzv-0",)),
            id="its-store-ended-replaced-and-the-ended-pod-deleted",
        ),
        pytest.param(
            "Running",
            0,
            [store_pod(deleting_at=10), store_pod(replacement=1)],
            "mnist-rdzv-0",
            RendezvousPlan(
                record="mnist-rdzv-0r1", replaced=("mnist-rdzv-0", "mnist-rdzv-0r1", "it was deleted")
            ),
            id="the-replacement-seen-recorded-and-the-event",
        ),
        pytest.param(
            "Running",
            0,
            [store_pod(replacement=1)],
            "mnist-rdzv-0",
            RendezvousPlan(
                record="mnist-rdzv-0r1", replaced=("mnist-rdzv-0", "mnist-rdzv-0r1", "it was deleted")
            ),
            id="the-replacement-seen-after-the-lost-one-left-the-cache",
        ),
        pytest.param(
            "Running",
            0,
            [store_pod(replacement=1, deleting_at=40)],
            "mnist-rdzv-0r1",
            RendezvousPlan(create="mnist-rdzv-0r2"),
            id="the-replacement-lost-too-the-next-number",
        ),
        pytest.param(
            "Running",
            1,
            [store_pod(0), store_pod(1)],
            "mnist-rdzv-0r1",
            RendezvousPlan(record="mnist-rdzv-1", delete=("mnist-rdzv-0",)),
            id="a-new-attempt-its-own-first-and-the-old-one-goes",
        ),
        pytest.param(
            "Restarting",
            0,
            [store_pod()],
            None,
            RendezvousPlan(delete=("mnist-rdzv-0",)),
            id="the-gang-restarts-its-store-goes",
        ),
        pytest.param(
            "Succeeded",
            0,
            [store_pod(), store_pod(replacement=1, deleting_at=5)],
            "mnist-rdzv-0",
            RendezvousPlan(delete=("mnist-rdzv-0",)),
            id="finished-every-store-goes-none-deleted-twice",
        ),
    ],
)
def test_the_plan(
    phase: str, attempt: int, stores: list[dict[str, Any]], recorded: str | None, expected: RendezvousPlan
) -> None:
    assert rendezvous.plan(job_spec(), phase, attempt, observe(*stores), recorded) == expected


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({"replicas": 1}, id="one-pod-hosts-its-own-store"),
        pytest.param(with_run_policy(restartMode="Recreate"), id="recreate-meets-at-rank-0"),
    ],
)
def test_a_job_without_a_rendezvous_pod_never_gets_one(spec: dict[str, Any]) -> None:
    assert rendezvous.plan(job_spec(**spec), "Running", 0, [], None) == RendezvousPlan()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param("mnist-rdzv-0", 0, id="first"),
        pytest.param("mnist-rdzv-0r3", 3, id="third-replacement"),
        pytest.param("mnist-rdzv-1r1", None, id="another-attempt"),
        pytest.param("mnist-rdzv-0r", None, id="no-number"),
        pytest.param("mnist-rdzv-0r01", None, id="not-a-name-we-make"),
    ],
)
def test_replacement_numbers(name: str, expected: int | None) -> None:
    assert rendezvous.replacement_number("mnist", 0, name) == expected


def test_decide_replaces_a_deleted_rendezvous_pod_alone() -> None:
    """The ranks train on: no rank pod is created or deleted, no restart counted; once the replacement
    is seen, the status records it and the Event says what happened."""
    recorded = live_status(rendezvousPod="mnist-rdzv-0")
    decision = decide(job_spec(), recorded, observe(pod(0), pod(1), store_pod(deleting_at=10)), at(30))
    assert decision.create.rendezvous == "mnist-rdzv-0r1"
    assert (decision.create.ranks, decision.create.replacements, decision.delete.pods) == ((), (), ())
    assert (decision.phase, decision.report.status["restarts"], decision.events) == ("Running", 0, ())
    seen = decide(job_spec(), recorded, observe(pod(0), pod(1), store_pod(replacement=1)), at(31))
    assert seen.create.rendezvous is None
    assert seen.report.status["rendezvousPod"] == "mnist-rdzv-0r1" and seen.report.changed
    [event] = seen.events
    assert (event.type, event.reason) == ("Warning", REASON_RENDEZVOUS_REPLACED)
    assert "mnist-rdzv-0 was lost (it was deleted); mnist-rdzv-0r1 replaces it" in event.message


def test_decide_leaves_a_serving_rendezvous_pod_and_its_status_alone() -> None:
    recorded = live_status(rendezvousPod="mnist-rdzv-0")
    decision = decide(job_spec(), recorded, observe(pod(0), pod(1), store_pod()), at(30))
    assert decision.create.rendezvous is None and decision.events == ()
    assert decision.report.status["rendezvousPod"] == "mnist-rdzv-0" and decision.delete.pods == ()
