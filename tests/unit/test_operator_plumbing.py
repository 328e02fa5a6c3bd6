"""The operator's pure plumbing: ownership checks, status merge patches, the pod cache, metrics text."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import threading
from typing import Any, cast

import pytest

from ddp_operator import names
from ddp_operator.kube_api import merge_patch_for
from ddp_operator.metrics import PHASES, OperatorMetrics
from ddp_operator.ownership import is_ours
from ddp_operator.podcache import PodCache

pytestmark = pytest.mark.unit

JOB_UID = "uid-1"


def _pod(
    name: str,
    *,
    owner: str | None = JOB_UID,
    attempt: str = "0",
    rv: str = "10",
    phase: str = "Pending",
    uid: str = "pod-uid-1",
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": uid,
        "resourceVersion": rv,
        "labels": {**names.rank_labels("job", 0, int(attempt))},
    }
    if owner is not None:
        meta["ownerReferences"] = [{"uid": owner, "controller": True, "kind": "DDPJob", "name": "job"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": {"phase": phase}}


def _hashed(pod: dict[str, Any], spec_hash: str) -> dict[str, Any]:
    pod["metadata"]["labels"][names.LABEL_SPEC_HASH] = spec_hash
    return pod


@pytest.mark.parametrize(
    ("existing", "wanted", "expected"),
    [
        pytest.param(_pod("job-0-0"), _pod("job-0-0"), True, id="same-owner-same-attempt"),
        pytest.param(_pod("job-0-0", owner="other"), _pod("job-0-0"), False, id="other-owner"),
        pytest.param(_pod("job-0-0", owner=None), _pod("job-0-0"), False, id="no-owner"),
        pytest.param(_pod("job-0-0", attempt="1"), _pod("job-0-0"), False, id="other-attempt"),
        pytest.param(
            _hashed(_pod("job-0-0"), "old"), _hashed(_pod("job-0-0"), "new"), False, id="other-spec-version"
        ),
        pytest.param(_hashed(_pod("job-0-0"), "new"), _hashed(_pod("job-0-0"), "new"), True, id="same-spec"),
        pytest.param(_pod("job-0-0"), _hashed(_pod("job-0-0"), "new"), True, id="pod-of-an-older-operator"),
        pytest.param(
            {"kind": "Service", "metadata": {"ownerReferences": [{"uid": JOB_UID, "controller": True}]}},
            {"kind": "Service", "metadata": {"labels": {names.LABEL_ATTEMPT: "3"}}},
            True,
            id="service-ignores-attempt",
        ),
        pytest.param(
            {"kind": "Service", "metadata": {"ownerReferences": [{"uid": JOB_UID, "controller": False}]}},
            {"kind": "Service", "metadata": {}},
            False,
            id="non-controller-reference",
        ),
    ],
)
def test_is_ours(existing: dict[str, Any], wanted: dict[str, Any], expected: bool) -> None:
    assert is_ours(wanted, existing, JOB_UID) is expected


@pytest.mark.parametrize(
    ("old", "new", "patch"),
    [
        pytest.param({}, {"phase": "Pending"}, {"phase": "Pending"}, id="first-status"),
        pytest.param(
            {"phase": "Running", "readyReplicas": 2},
            {"phase": "Running", "readyReplicas": 2},
            {},
            id="no-change",
        ),
        pytest.param(
            {"phase": "Succeeded", "completionTime": "t"},
            {"phase": "Pending"},
            {"phase": "Pending", "completionTime": None},
            id="removed-key-nulled",
        ),
        pytest.param(
            {"conditions": [{"type": "Running"}]},
            {"conditions": [{"type": "Running"}, {"type": "Failed"}]},
            {"conditions": [{"type": "Running"}, {"type": "Failed"}]},
            id="lists-replaced-whole",
        ),
        pytest.param(
            {"progress": {"step": 5, "healthCheck": {"time": "t1", "slowRank": 2}}},
            {"progress": {"step": 9, "healthCheck": {"time": "t2"}}},
            {"progress": {"step": 9, "healthCheck": {"time": "t2", "slowRank": None}}},
            id="nested-key-gone-nulled",
        ),
        pytest.param(
            {"lastRestart": {"cause": "ExitCode", "exitCode": 137}},
            {"lastRestart": {"cause": "StragglerReplaced"}},
            {"lastRestart": {"cause": "StragglerReplaced", "exitCode": None}},
            id="a-new-record-keeps-no-old-field",
        ),
        pytest.param(
            {"straggler": {"rank": 1}},
            {"straggler": {"rank": 1}, "progress": {"step": 1}},
            {"progress": {"step": 1}},
            id="nested-unchanged-not-sent",
        ),
    ],
)
def test_merge_patch_for(old: dict[str, Any], new: dict[str, Any], patch: dict[str, Any]) -> None:
    got = merge_patch_for(old, new)
    assert got == patch
    assert _apply_merge_patch(old, got) == new, "the server's merge of the patch is the new status"


def _apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386's MergePatch, as the apiserver applies a merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _apply_merge_patch(result.get(key), value)
    return result


def _cache(changed: list[tuple[str, str]]) -> PodCache:
    return PodCache(api=None, namespaces=["ns"], on_change=changed.append)  # type: ignore[arg-type]


# (where the copy comes from: a watch event type, or "answer" for the operator's own write's answer, pod)
Copy = tuple[str, dict[str, Any]]


@pytest.mark.parametrize(
    ("copies", "expected_phases"),
    [
        pytest.param([("ADDED", _pod("job-0-0", rv="5"))], {"job-0-0": "Pending"}, id="added"),
        pytest.param(
            [("ADDED", _pod("job-0-0", rv="5")), ("MODIFIED", _pod("job-0-0", rv="7", phase="Running"))],
            {"job-0-0": "Running"},
            id="the-watch-is-in-order",
        ),
        pytest.param(
            [
                ("answer", _pod("job-0-0", rv="7", phase="Running")),
                ("ADDED", _pod("job-0-0", rv="6")),
                ("MODIFIED", _pod("job-0-0", rv="7", phase="Running")),
            ],
            {"job-0-0": "Running"},
            id="events-in-flight-before-the-answer-are-older",
        ),
        pytest.param(
            [
                ("answer", _pod("job-0-0", rv="7")),
                ("MODIFIED", _pod("job-0-0", rv="7")),
                ("MODIFIED", _pod("job-0-0", rv="8", phase="Running")),
            ],
            {"job-0-0": "Running"},
            id="events-after-the-answer-are-newer",
        ),
        pytest.param(
            [
                ("ADDED", _pod("job-0-0", rv="5")),
                ("MODIFIED", _pod("job-0-0", rv="7", phase="Running")),
                ("answer", _pod("job-0-0", rv="5")),
            ],
            {"job-0-0": "Running"},
            id="an-answer-the-watch-delivered-first-is-older",
        ),
        pytest.param(
            [
                ("ADDED", _pod("job-0-0", rv="5")),
                ("DELETED", _pod("job-0-0", rv="9")),
                ("answer", _pod("job-0-0", rv="8")),
            ],
            {},
            id="late-answer-does-not-resurrect",
        ),
        pytest.param(
            [
                ("ADDED", _pod("job-0-0", rv="5")),
                ("DELETED", _pod("job-0-0", rv="9")),
                ("answer", _pod("job-0-0", rv="12", uid="pod-uid-2")),
            ],
            {"job-0-0": "Pending"},
            id="a-new-pod-of-the-same-name-is-taken",
        ),
        pytest.param(
            [("ADDED", _pod("job-0-0", rv="b")), ("MODIFIED", _pod("job-0-0", rv="a", phase="Running"))],
            {"job-0-0": "Running"},
            id="versions-are-opaque-not-ordered",
        ),
    ],
)
def test_pod_cache_keeps_the_newest_copy(copies: list[Copy], expected_phases: dict[str, str]) -> None:
    changed: list[tuple[str, str]] = []
    cache = _cache(changed)
    for source, pod in copies:
        if source == "answer":
            cache.remember(pod)
        else:
            cache._apply(source, pod)
    assert {p.name: p.phase for p in cache.pods_of(("ns", "job"))} == expected_phases
    assert changed and set(changed) == {("ns", "job")}


def test_pod_cache_relist_replaces_scope_and_marks_synced() -> None:
    async def scenario() -> tuple[bool, bool, list[str]]:
        cache = _cache([])
        cache._apply("ADDED", _pod("job-0-0"))
        before = cache.synced.is_set()
        cache._replace_scope("ns", [_pod("job-1-0")])
        return before, cache.synced.is_set(), [p.name for p in cache.pods_of(("ns", "job"))]

    before, after, pods = asyncio.run(scenario())
    assert (before, after, pods) == (False, True, ["job-1-0"])


def test_metrics_pass_promtool_and_report_every_phase() -> None:
    metrics = OperatorMetrics(lambda: {"Running": 2, "Failed": 1})
    metrics.reconcile_duration.observe(0.01)
    metrics.pods_created.inc(3)
    metrics.gang_restarts.inc()
    metrics.time_to_running.observe(12)
    text = metrics.exposition().decode()
    for phase in PHASES:
        assert f'ddpjob_jobs{{phase="{phase}"}}' in text
    assert 'ddpjob_jobs{phase="Running"} 2.0' in text
    assert "ddpjob_pods_created_total 3.0" in text
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed here; the exposition text was checked without it")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _leader_sample(metrics: OperatorMetrics) -> str:
    (line,) = [
        line
        for line in metrics.exposition().decode().splitlines()
        if line.startswith("ddpjob_operator_leader ")
    ]
    return line


def test_leader_gauge_follows_the_electors_event() -> None:
    """ddpjob_operator_leader (the chart's DDPOperatorNotLeading alert) is read from the event the
    elector sets and clears, through the controller that owns both."""
    from ddp_operator.controller import Controller
    from ddp_operator.kube_api import KubeApi

    leading = threading.Event()
    controller = Controller(cast(KubeApi, object()), leadership=leading, metrics=OperatorMetrics)
    assert controller.metrics is not None
    assert _leader_sample(controller.metrics) == "ddpjob_operator_leader 0.0"
    leading.set()
    assert _leader_sample(controller.metrics) == "ddpjob_operator_leader 1.0"
    leading.clear()  # the elector's stop(): the Lease released
    assert _leader_sample(controller.metrics) == "ddpjob_operator_leader 0.0"
    # Without leader election the one process acts from the start.
    unelected = Controller(cast(KubeApi, object()), metrics=OperatorMetrics)
    assert unelected.metrics is not None
    assert _leader_sample(unelected.metrics) == "ddpjob_operator_leader 1.0"


def _policy(port: int, peers: list[dict[str, Any]]) -> dict[str, Any]:
    own = {"podSelector": {"matchLabels": {"ddp.dev/job-name": "j"}}}
    return {
        "kind": "NetworkPolicy",
        "spec": {
            "podSelector": {"matchLabels": {"ddp.dev/job-name": "j"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [own]}, {"from": peers, "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }


MONITORING_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


@pytest.mark.parametrize(
    ("existing", "wanted", "patched"),
    [
        pytest.param(_policy(9400, [MONITORING_PEER]), _policy(9400, [MONITORING_PEER]), False, id="same"),
        pytest.param(
            _policy(9400, [MONITORING_PEER]), _policy(9500, [MONITORING_PEER]), True, id="metrics-port"
        ),
        pytest.param(_policy(9400, [MONITORING_PEER]), _policy(9400, []), True, id="allow-from"),
    ],
)
def test_network_policy_patch(existing: dict[str, Any], wanted: dict[str, Any], patched: bool) -> None:
    from ddp_operator.ownership import network_policy_patch

    patch = network_policy_patch(wanted, existing)
    assert (patch is not None) is patched
    if patch is not None:
        assert patch == {"spec": {"ingress": wanted["spec"]["ingress"]}}


def operator_parser() -> argparse.ArgumentParser:
    """`ddpjob operator`'s flags, as its command line parses them."""
    from ddp_operator.commands import operator as operator_command

    parser = argparse.ArgumentParser()
    operator_command.configure_parser(parser)
    return parser


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        pytest.param([], None, id="default"),
        pytest.param(["--metrics-allow-from=[]"], (), id="closed"),
        pytest.param(
            ['--metrics-allow-from=[{"podSelector": {"matchLabels": {"app": "prom"}}}]'],
            ({"podSelector": {"matchLabels": {"app": "prom"}}},),
            id="pods",
        ),
    ],
)
def test_metrics_allow_from_flag(argv: list[str], expected: Any) -> None:
    parser = operator_parser()
    assert parser.parse_args(argv).metrics_allow_from == expected


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        pytest.param("--metrics-allow-from={not json", "not JSON", id="allow-from-not-json"),
        pytest.param(
            '--metrics-allow-from=[{"podSelektor": {}}]',
            "--metrics-allow-from[0].podSelektor",
            id="allow-from-typo",
        ),
        pytest.param("--progress-interval=0", "counts in-place restarts", id="progress-interval-zero"),
        pytest.param("--progress-interval=-5", "must be more than 0", id="progress-interval-negative"),
        pytest.param(
            "--progress-interval=soon", "not a number of seconds", id="progress-interval-not-a-number"
        ),
    ],
)
def test_flags_refuse_mistakes_at_start(flag: str, named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        operator_parser().parse_args([flag])
    assert named in capsys.readouterr().err


def test_progress_interval_flag_takes_fractions_of_a_second() -> None:
    assert operator_parser().parse_args(["--progress-interval", "2.5"]).progress_interval == 2.5
