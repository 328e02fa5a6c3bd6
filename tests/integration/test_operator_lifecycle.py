"""The operator on the real control plane: a job's children, its phases, restarts, deadlines, TTL, GC.

Pods are fake (kwok): they become Running once scheduled, and a test ends one by annotating it with the
exit code kwok should report. Waits are bounded polls; nothing asserts on how long anything took.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from tests.integration.operator_fixtures import kube, namespace, operator, verbose_operator, wait_phase
from tests.integration.operator_harness import (
    Decided,
    Kube,
    OperatorProcess,
    condition,
    ddpjob,
    pod_attempt,
    pod_rank,
    running_ranks,
    wait_for,
)

from ddp_operator.decision import REASON_SUCCEEDED

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace", "operator", "verbose_operator"]  # fixtures, imported for pytest


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in trainer.get("env", [])}


def test_job_gets_headless_service_and_rank_pods_with_the_env_contract(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("envjob", replicas=3), namespace)
    pods = running_ranks(kube, namespace, "envjob", 3, attempt=0)

    service = kube.json("get", "service", "envjob", "-n", namespace)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert [p["metadata"]["name"] for p in pods] == ["envjob-0-0", "envjob-1-0", "envjob-2-0"]
    master = f"envjob-0.envjob.{namespace}.svc"
    for rank, pod in enumerate(pods):
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("DDPJob", "envjob", True)
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (f"envjob-{rank}", "envjob")
        assert pod["spec"]["restartPolicy"] == "Never"
        assert not pod["metadata"].get("finalizers")
        env = _env(pod)
        expected = {
            "MASTER_ADDR": master,
            "PET_MASTER_ADDR": master,
            "MASTER_PORT": "29500",
            "PET_MASTER_PORT": "29500",
            "NNODES": "3",
            "PET_NNODES": "3",
            "NODE_RANK": str(rank),
            "PET_NODE_RANK": str(rank),
            "NPROC_PER_NODE": "1",
            "PET_NPROC_PER_NODE": "1",
            "WORLD_SIZE": "3",
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "DDPJOB_NAME": "envjob",
            "DDPJOB_NAMESPACE": namespace,
            "DDPJOB_ATTEMPT": "0",
            "DDP_BACKEND": "gloo",
            "DDP_METRICS_PORT": "9400",
            "PYTHONUNBUFFERED": "1",
        }
        assert {k: env.get(k) for k in expected} == expected
        assert env["POD_IP"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}} or env[
            "POD_IP"
        ] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert "DDP_CHECKPOINT_DIR" not in env
    job = kube.job(namespace, "envjob")
    assert job is not None and not job["metadata"].get("finalizers")


def test_all_ranks_succeeding_makes_the_job_succeeded_with_conditions_and_one_event_per_phase(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("ok", replicas=2), namespace)
    pods = running_ranks(kube, namespace, "ok", 2, attempt=0)
    wait_phase(kube, namespace, "ok", "Running")
    for pod in pods:
        kube.end_pod(namespace, pod["metadata"]["name"], 0)
    status = wait_phase(kube, namespace, "ok", "Succeeded")

    assert status["succeededReplicas"] == 2
    assert status["observedGeneration"] == 1
    assert status.get("completionTime") and status.get("startTime")
    succeeded = condition(status, "Succeeded")
    assert succeeded is not None and succeeded["status"] == "True"
    running = condition(status, "Running")
    assert running is not None and running["status"] == "False"

    def all_events() -> list[dict[str, Any]] | None:
        events = kube.events_for(namespace, "ok")
        return events if any(e["reason"] == REASON_SUCCEEDED for e in events) else None

    events = wait_for("the Event of the Succeeded phase", all_events)
    # firstTimestamp has one-second resolution: the apiserver's write order (resourceVersion) is exact.
    reasons = [e["reason"] for e in sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"]))]
    # One Event per phase change (Pending, maybe Starting, Running, Succeeded), none from kopf.
    assert all(e["source"].get("component") == "ddp-operator" for e in events), reasons
    assert reasons[0] == "Created" and reasons[-1] == REASON_SUCCEEDED, reasons
    assert len(reasons) == len(set(reasons)) <= 4, reasons
    assert all(e.get("count", 1) == 1 for e in events)
    assert "ddpjob_pods_created_total 2.0" in operator.metrics()


def test_exit_137_on_one_rank_restarts_the_gang_with_new_pod_names(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("gang", replicas=2), namespace)
    first = running_ranks(kube, namespace, "gang", 2, attempt=0)
    kube.end_pod(namespace, first[1]["metadata"]["name"], 137)

    second = running_ranks(kube, namespace, "gang", 2, attempt=1)
    assert [p["metadata"]["name"] for p in second] == ["gang-0-1", "gang-1-1"]
    status = wait_phase(kube, namespace, "gang", "Running")
    assert (status["attempt"], status["restarts"]) == (1, 1)
    assert {pod_attempt(p) for p in kube.pods(namespace, "gang")} == {1}
    assert "ddpjob_gang_restarts_total 1.0" in operator.metrics()


def _holds_failures(failed: int) -> Callable[[Decided], bool]:
    """A decision that saw ``failed`` failed ranks and, the job still Running, holds them for the
    decision window."""
    return lambda d: (
        d.phase == "Running" and d.failed >= failed and d.judged_in is not None and d.judged_in > 0
    )


def test_a_permanent_crash_reported_after_its_collateral_still_fails_the_job(
    kube: Kube, namespace: str, verbose_operator: OperatorProcess
) -> None:
    """Rank 1 crashes with exit 1; its peers' lost-peer 170s a second later reach the apiserver first
    (their kubelets are quicker). The operator, running all along, must still judge by what happened."""
    kube.apply(ddpjob("late", replicas=3, restart_policy="ExitCode"), namespace)
    pods = [p["metadata"]["name"] for p in running_ranks(kube, namespace, "late", 3, attempt=0)]
    crashed_at = datetime.now(UTC)
    collateral = [pods[0], pods[2]]
    for pod in collateral:
        kube.end_pod(namespace, pod, 170, finished_at=crashed_at + timedelta(seconds=1))
    # Rank 1's kubelet is slower still: its report arrives once the operator has seen both 170s and
    # holds them for the decision window.
    verbose_operator.wait_decision(namespace, "late", "the 170s seen and held", _holds_failures(2))
    kube.end_pod(namespace, pods[1], 1, finished_at=crashed_at)

    status = wait_phase(kube, namespace, "late", "Failed")
    failed = condition(status, "Failed")
    assert failed is not None and failed["reason"] == "ExitCode", status
    assert "rank 1 exited with code 1" in failed["message"], failed["message"]
    assert status.get("restarts", 0) == 0, "the permanent crash was retried as a lost peer"


def test_a_retryable_first_failure_restarts_even_when_a_later_exit_1_is_reported_first(
    kube: Kube, namespace: str, verbose_operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("coll", replicas=2, restart_policy="ExitCode"), namespace)
    pods = [p["metadata"]["name"] for p in running_ranks(kube, namespace, "coll", 2, attempt=0)]
    killed_at = datetime.now(UTC)
    kube.end_pod(namespace, pods[1], 1, finished_at=killed_at + timedelta(seconds=2))
    # Rank 0's 137 is reported once the operator has seen rank 1's exit 1 and holds it.
    verbose_operator.wait_decision(namespace, "coll", "rank 1's exit 1 seen and held", _holds_failures(1))
    kube.end_pod(namespace, pods[0], 137, finished_at=killed_at)

    running_ranks(kube, namespace, "coll", 2, attempt=1)
    status = wait_phase(kube, namespace, "coll", "Running")
    assert status["restarts"] == 1
    restarts = [e["message"] for e in kube.events_for(namespace, "coll") if e["reason"] == "ExitCode"]
    assert restarts and "rank 0 exited with code 137" in restarts[0], restarts


def test_spent_backoff_limit_fails_the_job(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    kube.apply(ddpjob("spent", replicas=2, run_policy={"backoffLimit": 1}), namespace)
    for attempt in (0, 1):
        pods = running_ranks(kube, namespace, "spent", 2, attempt=attempt)
        kube.end_pod(namespace, pods[0]["metadata"]["name"], 137)
    status = wait_phase(kube, namespace, "spent", "Failed")
    failed = condition(status, "Failed")
    assert failed is not None and failed["reason"] == "BackoffLimitExceeded", failed
    assert status["restarts"] == 1


def test_oom_killed_rank_is_reported_as_such(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    kube.apply(ddpjob("oom", replicas=2, run_policy={"backoffLimit": 0}), namespace)
    pods = running_ranks(kube, namespace, "oom", 2, attempt=0)
    kube.end_pod(namespace, pods[0]["metadata"]["name"], 137, reason="OOMKilled")
    status = wait_phase(kube, namespace, "oom", "Failed")
    failed = condition(status, "Failed")
    assert failed is not None and failed["reason"] == "OOMKilled", failed


def patch_job(kube: Kube, namespace: str, name: str, patch: dict[str, Any]) -> None:
    """`kubectl patch --type=merge` of a DDPJob's spec, as a user suspends, resumes or edits it."""
    kube.run("patch", "ddpjob", name, "-n", namespace, "--type=merge", "-p", json.dumps(patch))


def test_suspend_deletes_the_pods_and_resume_starts_a_new_attempt(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("pause", replicas=2), namespace)
    running_ranks(kube, namespace, "pause", 2, attempt=0)

    patch_job(kube, namespace, "pause", {"spec": {"runPolicy": {"suspend": True}}})
    wait_phase(kube, namespace, "pause", "Suspended")
    wait_for("the suspended job's pods to go", lambda: not kube.pods(namespace, "pause"))

    patch_job(kube, namespace, "pause", {"spec": {"runPolicy": {"suspend": False}}})
    pods = running_ranks(kube, namespace, "pause", 2, attempt=1)
    assert [p["metadata"]["name"] for p in pods] == ["pause-0-1", "pause-1-1"]
    wait_phase(kube, namespace, "pause", "Running")


def test_active_deadline_fails_a_running_job(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    kube.apply(ddpjob("late", replicas=2, run_policy={"activeDeadlineSeconds": 3}), namespace)
    running_ranks(kube, namespace, "late", 2, attempt=0)
    status = wait_phase(kube, namespace, "late", "Failed")
    failed = condition(status, "Failed")
    assert failed is not None and failed["reason"] == "DeadlineExceeded", failed
    # cleanPodPolicy Running (the default): the running ranks are deleted.
    wait_for("the late job's pods to go", lambda: not kube.live_pods(namespace, "late"))


def test_startup_deadline_classifies_an_unschedulable_rank(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    job = ddpjob(
        "nowhere",
        replicas=2,
        run_policy={"startupDeadlineSeconds": 3},
        pod_spec={"nodeSelector": {"ddp.dev/no-such-node": "true"}},
    )
    kube.apply(job, namespace)
    status = wait_phase(kube, namespace, "nowhere", "Failed")
    failed = condition(status, "Failed")
    assert failed is not None and failed["reason"] == "Unschedulable", failed


def test_ttl_deletes_a_finished_job_and_garbage_collection_its_children(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("brief", replicas=2, run_policy={"ttlSecondsAfterFinished": 2}), namespace)
    for pod in running_ranks(kube, namespace, "brief", 2, attempt=0):
        kube.end_pod(namespace, pod["metadata"]["name"], 0)
    wait_phase(kube, namespace, "brief", "Succeeded")
    wait_for("the TTL to delete the job", lambda: kube.job(namespace, "brief") is None)


def test_deleting_a_job_removes_its_children(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    kube.apply(ddpjob("gone", replicas=2), namespace)
    running_ranks(kube, namespace, "gone", 2, attempt=0)
    kube.run("delete", "ddpjob", "gone", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for("garbage collection of the pods", lambda: not kube.pods(namespace, "gone"))
    wait_for(
        "garbage collection of the Service",
        lambda: kube.run("get", "service", "gone", "-n", namespace, check=False).returncode != 0,
    )


def test_forbidden_pod_create_fails_the_job_with_the_apiservers_message(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-pods"},
        "spec": {"hard": {"pods": "0"}},
    }
    kube.apply(quota, namespace)
    wait_for(
        "the quota to be counted",
        lambda: kube.json("get", "resourcequota", "no-pods", "-n", namespace).get("status", {}).get("hard"),
    )
    kube.apply(ddpjob("denied", replicas=2), namespace)
    status = wait_phase(kube, namespace, "denied", "Failed")
    failed = condition(status, "Failed")
    assert failed is not None and failed["reason"] == "PodCreateForbidden", failed
    assert "exceeded quota" in failed["message"], failed["message"]
    assert not kube.pods(namespace, "denied")
    # Failed for good: no retry loop keeps knocking on the quota.
    assert operator.process is not None and operator.process.poll() is None


def test_rank_pods_keep_their_ranks_across_attempts(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("ranks", replicas=3, restart_policy="OnFailure"), namespace)
    pods = running_ranks(kube, namespace, "ranks", 3, attempt=0)
    kube.end_pod(namespace, pods[2]["metadata"]["name"], 1)
    again = running_ranks(kube, namespace, "ranks", 3, attempt=1)
    assert [pod_rank(p) for p in again] == [0, 1, 2]
    assert [p["spec"]["hostname"] for p in again] == ["ranks-0", "ranks-1", "ranks-2"]


def test_a_pod_the_apiserver_rejects_as_invalid_fails_the_job_naming_the_field(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    job = ddpjob("badlabel", replicas=2)
    # The CRD keeps template labels free-form; the apiserver checks them on the pod.
    job["spec"]["template"]["metadata"] = {"labels": {"team": "a b"}}
    kube.apply(job, namespace)
    status = wait_phase(kube, namespace, "badlabel", "Failed")
    failed = condition(status, "Failed")
    assert failed is not None and failed["reason"] == "InvalidSpec", failed
    assert "metadata.labels" in failed["message"] and "pod" in failed["message"], failed["message"]
    wait_for("the attempt's pods to go", lambda: not kube.pods(namespace, "badlabel"))
    assert operator.process is not None and operator.process.poll() is None


def test_a_privileged_template_keeps_privilege_escalation_unset(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    trainer = {"name": "trainer", "image": "ddp-trainer:test", "securityContext": {"privileged": True}}
    kube.apply(ddpjob("privileged", replicas=2, pod_spec={"containers": [trainer]}), namespace)
    pods = running_ranks(kube, namespace, "privileged", 2, attempt=0)
    for pod in pods:
        context = pod["spec"]["containers"][0]["securityContext"]
        assert context["privileged"] is True and "allowPrivilegeEscalation" not in context, context


def test_ports_changed_while_suspended_reach_the_service(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("ports", replicas=2), namespace)
    running_ranks(kube, namespace, "ports", 2, attempt=0)
    patch_job(kube, namespace, "ports", {"spec": {"runPolicy": {"suspend": True}}})
    wait_phase(kube, namespace, "ports", "Suspended")
    resume = {"rendezvousPort": 30000, "metrics": {"port": 9999}, "runPolicy": {"suspend": False}}
    patch_job(kube, namespace, "ports", {"spec": resume})
    running_ranks(kube, namespace, "ports", 2, attempt=1)

    def service_ports() -> dict[str, int]:
        service = kube.json("get", "service", "ports", "-n", namespace)
        return {port["name"]: port["port"] for port in service["spec"]["ports"]}

    wait_for(
        "the Service to carry the new ports",
        lambda: service_ports() == {"rendezvous": 30000, "metrics": 9999},
    )


def test_a_checkpoint_added_while_suspended_gets_its_pvc_and_mount(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(ddpjob("later-ckpt", replicas=2), namespace)
    running_ranks(kube, namespace, "later-ckpt", 2, attempt=0)
    patch_job(kube, namespace, "later-ckpt", {"spec": {"runPolicy": {"suspend": True}}})
    wait_phase(kube, namespace, "later-ckpt", "Suspended")
    checkpoint = {"volumeClaimTemplate": {"resources": {"requests": {"storage": "1Gi"}}}}
    patch_job(
        kube, namespace, "later-ckpt", {"spec": {"checkpoint": checkpoint, "runPolicy": {"suspend": False}}}
    )

    wait_for(
        "the checkpoint PVC",
        lambda: kube.run("get", "pvc", "later-ckpt-checkpoint", "-n", namespace, check=False).returncode == 0,
    )
    pods = wait_for(
        "attempt 1's pods", lambda: [p for p in kube.pods(namespace, "later-ckpt") if pod_attempt(p) == 1]
    )
    rank0 = next(p for p in pods if pod_rank(p) == 0)
    claims = [v.get("persistentVolumeClaim", {}).get("claimName") for v in rank0["spec"]["volumes"]]
    assert "later-ckpt-checkpoint" in claims
