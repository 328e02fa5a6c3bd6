"""Every public name kept under a deprecated alias is documented as deprecated, with that alias, in the
one table of its kind (docs/metrics.md, docs/api.md, docs/trainer.md, each under "Deprecated names"),
and nothing else is: the tables mirror the code's lists of aliases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kube_factories import job_object

from ddp_operator import builders
from ddp_operator.progress import series
from ddp_operator.spec import parse_job
from ddp_trainer.config import DEPRECATED_MIN_MEMBERS_ENV, MIN_MEMBERS_ENV
from ddp_trainer.metrics import DEPRECATED_ALIASES
from ddp_trainer.progress import DEPRECATED_LAUNCHER_FIELDS

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parents[2] / "docs"


def deprecated_table(doc: str) -> dict[str, str]:
    """The "Deprecated names" table of ``doc``: each name and its deprecated alias."""
    text = (DOCS / doc).read_text()
    section = text[text.index("### Deprecated names") :]
    table = section[section.index("\n|") :].split("\n\n", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| `(\w+)` \|$", table, re.MULTILINE))


def test_the_metrics_deprecated_names_are_the_trainers_and_the_operators() -> None:
    assert deprecated_table("metrics.md") == dict(DEPRECATED_ALIASES) == series.DEPRECATED


def test_the_launchers_deprecated_fields_are_documented() -> None:
    assert deprecated_table("trainer.md") == dict(DEPRECATED_LAUNCHER_FIELDS)


def test_the_env_contracts_deprecated_variables_are_documented_and_set_alike() -> None:
    assert deprecated_table("api.md") == {MIN_MEMBERS_ENV: DEPRECATED_MIN_MEMBERS_ENV}
    body = job_object()
    del body["spec"]["replicas"]
    body["spec"]["elastic"] = {"minReplicas": 2, "maxReplicas": 3}
    env = {e["name"]: e.get("value") for e in builders.contract_env(parse_job(body), 1, 0, 3)}
    assert env[MIN_MEMBERS_ENV] == env[DEPRECATED_MIN_MEMBERS_ENV] == "2"
