"""The chart's PrometheusRule (templates/prometheusrule.yaml; docs/metrics.md, "Alerts").

The rules are tested as the chart renders them: `helm template` with the rule on, its groups written to
rules.yaml, then `promtool check rules` and `promtool test rules` with the unit tests in tests/promrules/
(synthetic series per alert: when it fires, with which labels and annotations, and when it does not).
The series the rules read are tied to the exporters' registries, and docs/metrics.md's table to the
rendered alerts. Needs helm and promtool (Debian's `prometheus` package), no cluster."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.integration.operator_harness import REPO
from tests.integration.test_chart import CHART, helm, render, run_helm, set_args

__all__ = ["helm"]  # the fixture, imported for pytest

pytestmark = pytest.mark.integration

PROMRULES = REPO / "tests" / "promrules"
METRICS_DOC = REPO / "docs" / "metrics.md"
PROMETHEUS_OPERATOR = ("monitoring.coreos.com/v1",)
ENABLED = {"metrics.prometheusRule.enabled": "true"}
# Where each group's series come from: the rank pods (PodMonitor) or the operator (ServiceMonitor).
JOB_ALERTS = {
    "DDPJobStalled",
    "DDPJobRestarting",
    "DDPJobStraggler",
    "DDPJobLowGoodput",
    "DDPJobBusBandwidthLow",
}
OPERATOR_ALERTS = {"DDPOperatorDown", "DDPOperatorNotLeading"}
# Series no exporter of ours exports: Prometheus's own, per scrape target.
PROMETHEUS_SERIES = {"up"}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("no promtool on PATH (Debian's `prometheus` package; hack/install-system-deps.sh)")
    return found


def prometheus_rule(helm: Path, values: dict[str, str] | None = None) -> dict[str, Any] | None:
    docs = render(helm, {**ENABLED, **(values or {})}, PROMETHEUS_OPERATOR)
    rules = [doc for doc in docs if doc["kind"] == "PrometheusRule"]
    assert len(rules) <= 1, rules
    return rules[0] if rules else None


@pytest.fixture(scope="module")
def groups(helm: Path) -> list[dict[str, Any]]:
    rule = prometheus_rule(helm)
    assert rule is not None
    found: list[dict[str, Any]] = rule["spec"]["groups"]
    return found


@pytest.fixture(scope="module")
def rules_dir(groups: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rendered rules as promtool reads them: {groups: [...]} in rules.yaml, the name every file in
    tests/promrules/ gives in its rule_files."""
    directory = tmp_path_factory.mktemp("promrules")
    (directory / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return directory


def alerts_of(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in groups for rule in group["rules"] if "alert" in rule}


def run_promtool(promtool: str, *args: str, cwd: Path) -> str:
    result = subprocess.run(
        [promtool, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"promtool {' '.join(args)} failed ({result.returncode}):\n{output}"
    return output


# ---- promtool -------------------------------------------------------------------------------------


def test_promtool_checks_the_rendered_rules(promtool: str, rules_dir: Path) -> None:
    output = run_promtool(promtool, "check", "rules", "rules.yaml", cwd=rules_dir)
    assert "SUCCESS" in output, output


PROMRULE_FILES = sorted(PROMRULES.glob("*.yaml"))


@pytest.mark.parametrize("test_file", PROMRULE_FILES, ids=[path.stem for path in PROMRULE_FILES])
def test_promtool_unit_tests_pass_on_the_rendered_rules(
    promtool: str, rules_dir: Path, test_file: Path
) -> None:
    shutil.copy(test_file, rules_dir / test_file.name)
    output = run_promtool(promtool, "test", "rules", test_file.name, cwd=rules_dir)
    assert "SUCCESS" in output, output


def test_every_alert_has_promtool_cases_that_fire_and_that_do_not(groups: list[dict[str, Any]]) -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in PROMRULE_FILES:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    alerts = set(alerts_of(groups))
    assert alerts == JOB_ALERTS | OPERATOR_ALERTS
    assert (alerts - firing, alerts - quiet) == (set(), set())


# ---- the series the rules read ---------------------------------------------------------------------

# Names in a PromQL expression: what is left once strings, label matchers, ranges, label lists and
# numbers are gone, less the keywords and the calls (functions and aggregations are followed by "(").
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_BRACES = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_NAME = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "Inf", "NaN"}


def series_names(expr: str) -> set[str]:
    bare = _BRACES.sub(" ", _LABEL_LISTS.sub(" ", _STRINGS.sub(" ", expr)))
    bare = re.sub(r"(?<![\w:])\d[\d.]*(?:[eE][+-]?\d+)?", " ", bare)
    return {name for name in _NAME.findall(bare) if name not in _KEYWORDS}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        pytest.param('rate(a_total{x="y"}[5m]) / b', {"a_total", "b"}, id="call-matchers-range"),
        pytest.param(
            'count_values by (ns, job) ("r", c >= 0) * 0 + on (ns) group_left () max by (ns) (d) > 1.5e9',
            {"c", "d"},
            id="aggregations-and-matching",
        ),
        pytest.param('label_replace(e, "dst", "$1", "src", "(.+)") and f', {"e", "f"}, id="strings"),
    ],
)
def test_series_names_parses_promql(expr: str, names: set[str]) -> None:
    assert series_names(expr) == names


def exported_series() -> set[str]:
    """Every sample name the trainer (rank 0, the richest: its straggler picture and its launcher's
    restart series) and the operator export."""
    from tests.unit.test_progress_series import rank_zero_registry

    from ddp_operator.metrics import OperatorMetrics

    operator = OperatorMetrics(lambda: {"Running": 1})
    operator.goodput.labels("team-a", "train").set(0.9)  # a labelled series has samples once set
    registries = (rank_zero_registry(), operator.registry)
    return {
        sample.name for registry in registries for family in registry.collect() for sample in family.samples
    }


def test_rules_read_only_series_the_exporters_export(groups: list[dict[str, Any]]) -> None:
    rules = [rule for group in groups for rule in group["rules"]]
    recorded = {rule["record"] for rule in rules if "record" in rule}
    read = set().union(*(series_names(rule["expr"]) for rule in rules))
    assert {"ddp_last_sync_timestamp_seconds", "ddpjob_goodput_ratio", "ddpjob_operator_leader"} <= read
    assert sorted(read - exported_series() - recorded - PROMETHEUS_SERIES) == []


# ---- docs ------------------------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_table_lists_exactly_the_rendered_alerts_with_their_runbooks(
    groups: list[dict[str, Any]],
) -> None:
    text = METRICS_DOC.read_text()
    section = text.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[(\w+)\]\(#([\w-]+)\) \|", section, flags=re.MULTILINE)
    anchors = {github_anchor(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}
    alerts = alerts_of(groups)
    assert sorted(name for name, _ in rows) == sorted(alerts)
    for name, anchor in rows:
        assert anchor in anchors, f"{name}'s link #{anchor} names no heading of docs/metrics.md"
        assert alerts[name]["annotations"]["runbook_url"].endswith(f"docs/metrics.md#{anchor}")


def test_every_alert_has_severity_summary_description_and_runbook(groups: list[dict[str, Any]]) -> None:
    for name, rule in alerts_of(groups).items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, name
        # The description names the alert's subject: the job's namespace and name, or the operator's.
        assert "$labels.namespace" in rule["annotations"]["description"], name
        if name in JOB_ALERTS:
            assert "$labels.ddpjob" in rule["annotations"]["description"], name


# ---- values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "api_versions", "expected"),
    [
        pytest.param({}, PROMETHEUS_OPERATOR, None, id="off-by-default"),
        pytest.param(ENABLED, (), None, id="no-prometheus-operator"),
        pytest.param(ENABLED, PROMETHEUS_OPERATOR, JOB_ALERTS | OPERATOR_ALERTS, id="on"),
        pytest.param(
            {**ENABLED, "metrics.serviceMonitor.enabled": "false"},
            PROMETHEUS_OPERATOR,
            JOB_ALERTS - {"DDPJobLowGoodput"},
            id="no-service-monitor",
        ),
        pytest.param(
            {**ENABLED, "metrics.podMonitor.enabled": "false"},
            PROMETHEUS_OPERATOR,
            OPERATOR_ALERTS,
            id="no-pod-monitor",
        ),
        pytest.param(
            {**ENABLED, "metrics.podMonitor.enabled": "false", "metrics.service.enabled": "false"},
            PROMETHEUS_OPERATOR,
            None,
            id="no-monitors",
        ),
        pytest.param(
            {**ENABLED, "metrics.prometheusRule.alerts.busBandwidthLow.enabled": "false"},
            PROMETHEUS_OPERATOR,
            JOB_ALERTS - {"DDPJobBusBandwidthLow"} | OPERATOR_ALERTS,
            id="one-alert-off",
        ),
    ],
)
def test_the_rule_renders_only_alerts_whose_series_are_scraped(
    helm: Path, values: dict[str, str], api_versions: tuple[str, ...], expected: set[str] | None
) -> None:
    docs = render(helm, values, api_versions)
    rules = [doc for doc in docs if doc["kind"] == "PrometheusRule"]
    if expected is None:
        assert rules == []
        return
    (rule,) = rules
    assert set(alerts_of(rule["spec"]["groups"])) == expected
    recorded = {r["record"] for group in rule["spec"]["groups"] for r in group["rules"] if "record" in r}
    assert bool(recorded) == ("DDPJobBusBandwidthLow" in expected)


def test_values_reach_the_rules(helm: Path) -> None:
    rule = prometheus_rule(
        helm,
        {
            "metrics.prometheusRule.labels.release": "kube-prometheus-stack",
            "metrics.prometheusRule.alertLabels.team": "ml-platform",
            "metrics.prometheusRule.interval": "30s",
            "metrics.prometheusRule.runbookUrl": "https://wiki.example.com/ddp",
            "metrics.prometheusRule.alerts.jobStalled.seconds": "1200",
            "metrics.prometheusRule.alerts.jobStalled.severity": "warning",
            "metrics.prometheusRule.alerts.straggler.for": "30m",
            "metrics.prometheusRule.alerts.jobRestarting.window": "6h",
        },
    )
    assert rule is not None
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert {group["interval"] for group in rule["spec"]["groups"]} == {"30s"}
    alerts = alerts_of(rule["spec"]["groups"])
    stalled = alerts["DDPJobStalled"]
    assert stalled["expr"].rstrip().endswith("> 1200")
    assert stalled["labels"] == {"severity": "warning", "team": "ml-platform"}
    assert stalled["annotations"]["runbook_url"] == "https://wiki.example.com/ddp#ddpjobstalled"
    assert alerts["DDPJobStraggler"]["for"] == "30m"
    assert "[6h]" in alerts["DDPJobRestarting"]["expr"] and "[1h]" not in alerts["DDPJobRestarting"]["expr"]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        pytest.param(
            {"metrics.prometheusRule.alerts.lowGoodput.ratio": "1.5"},
            "metrics.prometheusRule.alerts.lowGoodput.ratio",
            id="goodput-above-one",
        ),
        pytest.param(
            {"metrics.prometheusRule.alerts.straggler.slowdown": "1"},
            "metrics.prometheusRule.alerts.straggler.slowdown",
            id="slowdown-of-one",
        ),
        pytest.param(
            {"metrics.prometheusRule.alerts.jobRestarting.window": "an hour"},
            "metrics.prometheusRule.alerts.jobRestarting.window",
            id="bad-window",
        ),
        pytest.param(
            {"metrics.prometheusRule.alerts.jobStaled.enabled": "false"},
            "metrics.prometheusRule.alerts",
            id="misspelled-alert",
        ),
    ],
)
def test_schema_refuses_bad_alert_values(helm: Path, values: dict[str, str], field: str) -> None:
    result = run_helm(helm, "template", "rel", str(CHART), *set_args({**ENABLED, **values}), check=False)
    assert result.returncode != 0, f"{values} was accepted"
    message = result.stderr.replace("/", ".")
    assert "schema" in message.lower() and field in message, result.stderr


def test_lint_strict_passes_with_the_rule(helm: Path) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), *set_args(ENABLED), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
