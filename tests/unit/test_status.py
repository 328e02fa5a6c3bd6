"""The status build (status.py): every field it can write is one it compares for a write."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from tests.unit.kube_factories import at
from tests.unit.test_crd_schema import root_schema
from tests.unit.test_elastic import elastic_job

from ddp_operator import status
from ddp_operator.spec import SchedulingSpec, TopologySpec

pytestmark = pytest.mark.unit

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def with_every_field() -> dict[str, Any]:
    """A status with every optional field the build writes set."""
    change = status.Transition(
        phase="Running",
        reason="Running",
        message="running",
        counts=status.Counts(replicas=3, ready=2, succeeded=1, failed=1),
        attempt=2,
        restarts=1,
        preemptions=1,
        start_time="2024-01-01T00:00:00Z",
        completion_time="2024-01-01T01:00:00Z",
        progress={"step": 10},
        straggler={"rank": 1},
        last_restart={
            "mode": "InPlace",
            "attempt": 2,
            "failureTime": "2024-01-01T00:30:00Z",
            "resumedSeconds": "2.50",
        },
        goodput=0.5,
        pod_replacements=1,
        straggler_replacements=1,
        avoided_nodes=("node-3",),
        group_replicas=2,
        resizes=1,
        ranks_created=2,
    )
    # The placement is the controller's observation, carried by the build (policies.topology), and the
    # rendezvous pod policies.rendezvous recorded, carried the same way.
    placed = {
        "topology": {"key": "rack", "path": "PodGroup", "domains": [], "ringCrossings": 0},
        "rendezvousPod": "job-rdzv-2r1",
    }
    job = dataclasses.replace(
        elastic_job(1, 3), scheduling=SchedulingSpec(topology=TopologySpec(key="rack", required=True))
    )
    return status.build_status(job, placed, change, at(5))


def test_the_build_with_every_field_set_writes_every_compared_key() -> None:
    assert set(with_every_field()) == set(status.STATUS_KEYS)


@pytest.mark.parametrize("key", sorted(with_every_field()))
def test_a_change_of_any_key_the_build_writes_alone_is_a_change(key: str) -> None:
    new = with_every_field()
    assert not status.status_changed(new, new)
    assert status.status_changed({**new, key: "something else"}, new)
    assert status.status_changed({k: v for k, v in new.items() if k != key}, new)


def test_a_field_the_build_does_not_write_is_left_out_of_the_comparison() -> None:
    new = with_every_field()
    assert not status.status_changed({**new, "someoneElses": 1}, new)


def test_every_key_the_build_writes_is_in_the_crds_status_schema() -> None:
    # The apiserver prunes a field its structural schema does not name: it would never be stored.
    documented = root_schema()["properties"]["status"]["properties"]
    assert set(status.STATUS_KEYS) <= set(documented)


def test_every_key_the_build_writes_is_in_the_status_table() -> None:
    text = API_DOC.read_text()
    table = text[text.index("## Status") :].split("\n\n", 2)[1]
    cells = re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
    documented = {name for cell in cells for name in re.findall(r"`(\w+)`", cell)}
    assert set(status.STATUS_KEYS) <= documented
