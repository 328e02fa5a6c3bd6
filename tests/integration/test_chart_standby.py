"""The chart's PriorityClass for standby pods (templates/priorityclass.yaml, docs/restarts.md "Standby
pods"): rendered below the ranks and preempting nothing, named to the operator by its flag, left out or
replaced by values, refused when malformed, and installed into the real apiserver where the operator's
standby pods can use it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tests.integration.operator_harness import Kube
from tests.integration.test_chart import (
    CHART,
    Release,
    helm,
    kinds,
    kube,
    only,
    operator_container,
    release_factory,
    render,
    run_helm,
    set_args,
)

from ddp_operator import names
from ddp_operator.commands import operator as operator_command

pytestmark = pytest.mark.integration
__all__ = ["helm", "kube", "release_factory"]  # fixtures, imported for pytest


def standby_class_flag(docs: list[dict[str, Any]]) -> str:
    """The class the rendered Deployment tells the operator to give standby pods, as it parses it."""
    parser = argparse.ArgumentParser()
    operator_command.configure_parser(parser)
    args = parser.parse_args(operator_container(docs)["args"])
    return str(args.standby_priority_class)


def test_the_default_class_is_below_every_default_rank_and_preempts_nothing(helm: Path) -> None:
    docs = render(helm, {})
    priority_class = only(docs, "PriorityClass")
    assert priority_class["metadata"]["name"] == "rel-ddp-operator-standby"
    assert priority_class["value"] < 0, "below a rank pod that names no class (priority 0)"
    assert priority_class["preemptionPolicy"] == "Never"
    assert priority_class["globalDefault"] is False
    assert standby_class_flag(docs) == "rel-ddp-operator-standby"


def test_a_release_named_after_the_chart_installs_the_operators_default_class(helm: Path) -> None:
    result = run_helm(helm, "template", "ddp-operator", str(CHART), "--namespace", "ddp-system")
    assert f"name: {names.DEFAULT_STANDBY_PRIORITY_CLASS}\n" in result.stdout


@pytest.mark.parametrize(
    ("values", "installed", "flag"),
    [
        pytest.param({"standbyPriorityClass.value": "-50"}, True, "rel-ddp-operator-standby", id="other-value"),
        pytest.param({"standbyPriorityClass.name": "spares"}, True, "spares", id="own-name"),
        pytest.param(
            {"standbyPriorityClass.create": "false", "standbyPriorityClass.name": "cluster-spares"},
            False, "cluster-spares", id="an-existing-class",
        ),
        pytest.param({"standbyPriorityClass.create": "false"}, False, "", id="none-the-templates-class"),
    ],
)  # fmt: skip
def test_the_class_follows_the_values(helm: Path, values: dict[str, str], installed: bool, flag: str) -> None:
    docs = render(helm, values)
    assert ("PriorityClass" in kinds(docs)) == installed
    assert standby_class_flag(docs) == flag
    if installed:
        assert only(docs, "PriorityClass")["metadata"]["name"] == flag
    if "standbyPriorityClass.value" in values:
        assert only(docs, "PriorityClass")["value"] == -50


@pytest.mark.parametrize(
    ("values", "field"),
    [
        pytest.param({"standbyPriorityClass.value": "low"}, "standbyPriorityClass.value", id="not-a-number"),
        pytest.param({"standbyPriorityClass.name": "Spares_1"}, "standbyPriorityClass.name", id="not-a-dns-name"),
        pytest.param({"standbyPriorityClass.value": "2000000000"}, "standbyPriorityClass.value", id="above-user-range"),
    ],
)  # fmt: skip
def test_the_schema_refuses_a_bad_class(helm: Path, values: dict[str, str], field: str) -> None:
    result = run_helm(helm, "template", "rel", str(CHART), *set_args(values), check=False)
    assert result.returncode != 0, f"{values} was accepted"
    message = result.stderr.replace("/", ".")
    assert "schema" in message.lower() and field in message, result.stderr


def test_install_creates_the_class_and_uninstall_removes_it(
    kube: Kube, release_factory: Callable[[dict[str, str]], Release]
) -> None:
    release = release_factory({"standbyPriorityClass.value": "-3"})
    name = f"{release.service_account}-standby"
    stored = kube.json("get", "priorityclass", name)
    assert (stored["value"], stored["preemptionPolicy"], stored.get("globalDefault", False)) == (
        -3,
        "Never",
        False,
    )
    release.uninstall()
    assert kube.run("get", "priorityclass", name, check=False).returncode != 0
