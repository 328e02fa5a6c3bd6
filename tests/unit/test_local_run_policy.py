"""Every runPolicy field of the CRD, and whether `ddpjob run` honours it: a field it cannot honour
is named in a warning at start (docs/local-run.md). A field added to the CRD fails here until it is
placed in the table, so `ddpjob run` and the operator cannot drift apart unnoticed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ddp_operator import cli
from ddp_operator.local.run_policy import RUN_POLICY, warnings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# field -> (honoured by `ddpjob run`, a value to set, the test that shows it acting locally).
FIELDS: dict[str, tuple[bool, Any, str]] = {
    "backoffLimit": (
        True,
        1,
        "tests/trainer/test_local_run.py::test_sigkilled_rank_restarts_the_gang_from_the_checkpoint",
    ),
    "activeDeadlineSeconds": (
        True,
        60,
        "tests/trainer/test_local_run.py::test_active_deadline_stops_every_rank",
    ),
    "stallTimeoutSeconds": (
        True,
        10,
        "tests/trainer/test_local_run.py::test_a_stalled_gang_restarts_and_succeeds",
    ),
    "suspend": (True, True, "tests/unit/test_local_run_cli.py::test_suspended_job_runs_nothing"),
    "restartMode": (
        True,
        "InPlace",
        "tests/trainer/test_local_run.py::test_a_failed_worker_restarts_in_place_and_is_counted",
    ),
    "startupDeadlineSeconds": (False, 60, ""),
    "ttlSecondsAfterFinished": (False, 60, ""),
    "cleanPodPolicy": (False, "All", ""),
    "stragglerPolicy": (False, {"action": "Replace"}, ""),
    "standbyPods": (False, 1, ""),
}


def crd_run_policy_fields() -> set[str]:
    crd = yaml.safe_load((REPO / "crds" / "ddp.dev_ddpjobs.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return set(spec["properties"]["runPolicy"]["properties"])


def test_the_table_covers_every_run_policy_field_of_the_crd() -> None:
    assert set(FIELDS) == crd_run_policy_fields() == set(RUN_POLICY)


@pytest.mark.parametrize("field", FIELDS, ids=list(FIELDS))
def test_ddpjob_run_honours_the_field_or_warns_naming_it(field: str) -> None:
    honoured, value, shown_by = FIELDS[field]
    assert RUN_POLICY[field].honoured is honoured
    said = warnings({"spec": {"runPolicy": {field: value}}})
    if honoured:
        assert said == []
        path, name = shown_by.split("::")
        assert f"def {name}(" in (REPO / path).read_text(), f"{shown_by} does not exist"
    else:
        assert len(said) == 1 and f"spec.runPolicy.{field} is not honoured" in said[0]


def test_no_warning_for_a_field_left_unset() -> None:
    assert warnings({"spec": {"runPolicy": {"backoffLimit": 2}}}) == warnings({"spec": {}}) == []


def test_the_warning_is_printed_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(
        "apiVersion: ddp.dev/v1alpha1\nkind: DDPJob\nmetadata: {name: demo}\n"
        "spec:\n  replicas: 1\n  runPolicy: {suspend: true, ttlSecondsAfterFinished: 60, cleanPodPolicy: All}\n"
        "  template:\n    spec:\n      containers: [{name: trainer, image: unused}]\n"
    )
    assert (
        cli.main(["run", str(manifest), "--workdir", str(tmp_path / "work")]) == 0
    )  # suspended: runs nothing
    err = capsys.readouterr().err
    assert "warning: spec.runPolicy.ttlSecondsAfterFinished is not honoured" in err
    assert "warning: spec.runPolicy.cleanPodPolicy is not honoured" in err


@pytest.mark.parametrize(
    ("scheduling", "warned"),
    [
        pytest.param({"topology": {"required": "topology.kubernetes.io/rack"}}, True, id="topology"),
        pytest.param({"gang": "Workload"}, False, id="gang-is-moot-locally"),
    ],
)
def test_a_placement_field_without_local_meaning_is_named(scheduling: dict[str, Any], warned: bool) -> None:
    said = warnings({"spec": {"scheduling": scheduling}})
    assert (
        (len(said) == 1 and "spec.scheduling.topology is not honoured" in said[0]) if warned else said == []
    )
