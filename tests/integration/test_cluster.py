"""The local control plane is real: each test exercises one component the way the operator will."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ddp_harness import (
    EXIT_CODE_ANNOTATION,
    GPU_RESOURCE,
    REASON_ANNOTATION,
    LocalCluster,
)
from ddp_harness.binaries import pinned_versions
from ddp_harness.manifests import NodeShape

pytestmark = pytest.mark.integration

T = TypeVar("T")
WAIT_S = 60.0


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = WAIT_S) -> T:
    """Poll probe until it returns something other than None/False; fail naming what never happened."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last is not None and last is not False:
            return last
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
def namespace(local_cluster: LocalCluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    local_cluster.create_namespace(name)
    yield name
    local_cluster.kubectl_run("delete", "namespace", name, "--wait=false", check=False)


def pod(name: str, gpus: int = 0, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "registry.invalid/never-pulled:1"}
    if gpus:
        container["resources"] = {"limits": {GPU_RESOURCE: str(gpus)}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {"containers": [container], "restartPolicy": "Never"},
    }


def get_pod(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any]:
    result: dict[str, Any] = cluster.get_json("pod", name, "-n", ns)
    return result


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return None


def running_and_ready(cluster: LocalCluster, ns: str, name: str) -> dict[str, Any] | None:
    p = get_pod(cluster, ns, name)
    ready = condition(p, "Ready")
    if p["status"].get("phase") == "Running" and ready and ready["status"] == "True":
        return p
    return None


def test_nodes_are_ready_gpu_nodes_with_capacity(local_cluster: LocalCluster) -> None:
    shape = NodeShape()
    nodes = {n["metadata"]["name"]: n for n in local_cluster.get_json("nodes")["items"]}
    assert set(local_cluster.node_names) <= set(nodes), nodes.keys()
    for name in local_cluster.node_names:
        node = nodes[name]
        assert (condition(node, "Ready") or {}).get("status") == "True", node["status"]
        for field in ("capacity", "allocatable"):
            assert node["status"][field][GPU_RESOURCE] == str(shape.gpus)
            assert node["status"][field]["pods"] == str(shape.pods)
            assert node["status"][field]["cpu"] == str(shape.cpus)
    table = local_cluster.kubectl_run("get", "nodes", "--no-headers").stdout
    assert table.count(" Ready ") >= len(local_cluster.node_names), table


def test_plain_pod_is_scheduled_onto_a_fake_node_and_runs(
    local_cluster: LocalCluster, namespace: str
) -> None:
    local_cluster.apply_json(pod("plain"), "-n", namespace)
    running = wait_for(
        "pod plain Running and Ready", lambda: running_and_ready(local_cluster, namespace, "plain")
    )
    assert running["spec"]["nodeName"] in local_cluster.node_names
    assert running["status"]["podIP"]
    assert (condition(running, "PodScheduled") or {}).get("status") == "True"


@pytest.mark.parametrize(
    ("exit_code", "reason", "phase", "expected_reason"),
    [
        pytest.param("0", None, "Succeeded", "Completed", id="exit-0-succeeds"),
        pytest.param("3", None, "Failed", "Error", id="exit-3-fails-with-error"),
        pytest.param("137", "OOMKilled", "Failed", "OOMKilled", id="exit-137-oomkilled"),
        pytest.param("170", "Error", "Failed", "Error", id="exit-170-peer-lost"),
    ],
)
def test_annotated_pod_ends_with_that_exit_code(
    local_cluster: LocalCluster,
    namespace: str,
    exit_code: str,
    reason: str | None,
    phase: str,
    expected_reason: str,
) -> None:
    local_cluster.apply_json(pod("ends"), "-n", namespace)
    wait_for("pod ends Running", lambda: running_and_ready(local_cluster, namespace, "ends"))
    annotations = [f"{EXIT_CODE_ANNOTATION}={exit_code}"]
    if reason:
        annotations.append(f"{REASON_ANNOTATION}={reason}")
    local_cluster.kubectl_run("annotate", "pod", "ends", "-n", namespace, *annotations)

    def finished() -> dict[str, Any] | None:
        p = get_pod(local_cluster, namespace, "ends")
        return p if p["status"].get("phase") in ("Succeeded", "Failed") else None

    done = wait_for(f"pod ends {phase}", finished)
    assert done["status"]["phase"] == phase
    statuses = done["status"]["containerStatuses"]
    assert [s["name"] for s in statuses] == ["main"]
    terminated = statuses[0]["state"]["terminated"]
    assert terminated["exitCode"] == int(exit_code)
    assert terminated["reason"] == expected_reason
    assert terminated["finishedAt"]
    assert (condition(done, "Ready") or {}).get("status") == "False"


def test_pod_asking_more_gpus_than_any_node_stays_pending_unschedulable(
    local_cluster: LocalCluster, namespace: str
) -> None:
    local_cluster.apply_json(pod("greedy", gpus=NodeShape().gpus + 1), "-n", namespace)

    def unschedulable() -> dict[str, Any] | None:
        scheduled = condition(get_pod(local_cluster, namespace, "greedy"), "PodScheduled")
        return scheduled if scheduled and scheduled["status"] == "False" else None

    scheduled = wait_for("PodScheduled=False", unschedulable)
    assert scheduled["reason"] == "Unschedulable"
    assert f"Insufficient {GPU_RESOURCE}" in scheduled["message"]
    current = get_pod(local_cluster, namespace, "greedy")
    assert current["status"]["phase"] == "Pending"
    assert "nodeName" not in current["spec"]


def test_deployment_yields_replicaset_and_running_pods(local_cluster: LocalCluster, namespace: str) -> None:
    labels = {"app": "web"}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "web", "image": "registry.invalid/web:1"}]},
            },
        },
    }
    local_cluster.apply_json(deployment, "-n", namespace)

    def available() -> dict[str, Any] | None:
        d: dict[str, Any] = local_cluster.get_json("deployment", "web", "-n", namespace)
        return d if d.get("status", {}).get("readyReplicas") == 3 else None

    deployed = wait_for("deployment web to have 3 ready replicas", available)
    replicasets = local_cluster.get_json("replicasets", "-n", namespace, "-l", "app=web")["items"]
    assert len(replicasets) == 1
    owner = replicasets[0]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("Deployment", deployed["metadata"]["uid"])
    pods = local_cluster.get_json("pods", "-n", namespace, "-l", "app=web")["items"]
    assert len(pods) == 3
    for p in pods:
        assert p["metadata"]["ownerReferences"][0]["uid"] == replicasets[0]["metadata"]["uid"]
        assert p["status"]["phase"] == "Running"


def test_deleting_an_owner_deletes_its_dependents(local_cluster: LocalCluster, namespace: str) -> None:
    local_cluster.kubectl_run("create", "configmap", "owner", "-n", namespace)
    owner_uid = local_cluster.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    owner_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
    dependents = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "dependent", "ownerReferences": [owner_ref]},
        },
        {**pod("dependent-pod"), "metadata": {"name": "dependent-pod", "ownerReferences": [owner_ref]}},
    ]
    local_cluster.apply_json({"apiVersion": "v1", "kind": "List", "items": dependents}, "-n", namespace)
    wait_for("dependent-pod Running", lambda: running_and_ready(local_cluster, namespace, "dependent-pod"))
    local_cluster.kubectl_run("delete", "configmap", "owner", "-n", namespace)

    def gone(kind: str, name: str) -> bool:
        result = local_cluster.kubectl_run("get", kind, name, "-n", namespace, check=False)
        return result.returncode != 0 and "NotFound" in result.stderr

    wait_for("the garbage collector to delete configmap dependent", lambda: gone("configmap", "dependent"))
    wait_for("the garbage collector to delete pod dependent-pod", lambda: gone("pod", "dependent-pod"))


def test_namespace_deletion_completes(local_cluster: LocalCluster) -> None:
    name = f"t-doomed-{uuid.uuid4().hex[:6]}"
    local_cluster.create_namespace(name)
    local_cluster.kubectl_run("create", "configmap", "data", "-n", name)
    local_cluster.apply_json(pod("resident"), "-n", name)
    wait_for("pod resident Running", lambda: running_and_ready(local_cluster, name, "resident"))
    local_cluster.kubectl_run("delete", "namespace", name, "--wait=false")

    def deleted() -> bool:
        result = local_cluster.kubectl_run("get", "namespace", name, check=False)
        return result.returncode != 0 and "NotFound" in result.stderr

    wait_for(f"namespace {name} to be deleted", deleted)


def test_volume_binder_binds_a_claim_and_protection_lets_its_namespace_go(
    local_cluster: LocalCluster,
) -> None:
    namespace = f"t-claim-{uuid.uuid4().hex[:6]}"
    volume = f"{namespace}-data"
    local_cluster.create_namespace(namespace)
    local_cluster.apply_json(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "hostPath": {"path": f"/tmp/{volume}"},
                "claimRef": {"namespace": namespace, "name": "data"},
                "persistentVolumeReclaimPolicy": "Retain",
            },
        }
    )
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    local_cluster.apply_json(claim, "-n", namespace)

    def claim_bound() -> dict[str, Any] | None:
        pvc: dict[str, Any] = local_cluster.get_json("pvc", "data", "-n", namespace)
        return pvc if pvc.get("status", {}).get("phase") == "Bound" else None

    pvc = wait_for("the volume binder to bind claim data", claim_bound)
    assert pvc["spec"]["volumeName"] == volume
    # StorageObjectInUseProtection adds these; only the protection controllers take them off again.
    assert "kubernetes.io/pvc-protection" in pvc["metadata"]["finalizers"]
    assert "kubernetes.io/pv-protection" in local_cluster.get_json("pv", volume)["metadata"]["finalizers"]

    user = pod("user")
    user["spec"]["volumes"] = [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]
    local_cluster.apply_json(user, "-n", namespace)
    wait_for("pod user Running", lambda: running_and_ready(local_cluster, namespace, "user"))
    local_cluster.kubectl_run("delete", "namespace", namespace, "--wait=false")

    def gone(*what: str) -> bool:
        result = local_cluster.kubectl_run("get", *what, check=False)
        return result.returncode != 0 and "NotFound" in result.stderr

    wait_for(
        f"namespace {namespace} (with a bound claim in use) to be deleted", lambda: gone("ns", namespace)
    )
    local_cluster.kubectl_run("delete", "pv", volume, "--wait=false")
    wait_for(f"volume {volume}, released by its claim, to be deleted", lambda: gone("pv", volume))


def test_block_owner_deletion_needs_update_on_the_owners_finalizers(
    local_cluster: LocalCluster, namespace: str
) -> None:
    """OwnerReferencesPermissionEnforcement is on, as on OpenShift: the chart's RBAC is checked against it."""
    local_cluster.kubectl_run("create", "configmap", "owner", "-n", namespace)
    owner_uid = local_cluster.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    user = f"creator-{uuid.uuid4().hex[:6]}"
    local_cluster.kubectl_run(
        "create", "role", user, "-n", namespace, "--verb=create,get", "--resource=configmaps"
    )
    local_cluster.kubectl_run(
        "create", "rolebinding", user, "-n", namespace, f"--role={user}", f"--user={user}"
    )

    def child(name: str, block: bool) -> str:
        reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "ownerReferences": [{**reference, "blockOwnerDeletion": block}]},
            }
        )

    def create_as_user(manifest: str) -> subprocess.CompletedProcess[str]:
        return local_cluster.kubectl_run(
            "create", "-n", namespace, f"--as={user}", "-f", "-", input=manifest, check=False
        )

    plain = create_as_user(child("plain", block=False))
    assert plain.returncode == 0, plain.stderr
    blocking = create_as_user(child("blocking", block=True))
    assert blocking.returncode != 0 and "blockOwnerDeletion" in blocking.stderr, blocking.stderr
    local_cluster.kubectl_run(
        "create", "role", f"{user}-finalizers", "-n", namespace, "--verb=update",
        "--resource=configmaps/finalizers",
    )  # fmt: skip
    local_cluster.kubectl_run(
        "create", "rolebinding", f"{user}-finalizers", "-n", namespace, f"--role={user}-finalizers",
        f"--user={user}",
    )  # fmt: skip

    def created_once_allowed() -> bool:
        return create_as_user(child("blocking", block=True)).returncode == 0

    wait_for(
        "a blocking ownerReference to be allowed with update on configmaps/finalizers", created_once_allowed
    )


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        pytest.param(
            {**pod("x"), "spec": {"containers": [{"name": "Bad_Name", "image": "i:1"}]}},
            ['Pod "x" is invalid', 'spec.containers[0].name: Invalid value: "Bad_Name"'],
            id="pod-container-name-not-a-dns-label",
        ),
        pytest.param(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "UPPER"},
            },
            ['ConfigMap "UPPER" is invalid', 'metadata.name: Invalid value: "UPPER"'],
            id="configmap-name-not-lowercase",
        ),
        pytest.param(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": "neg"},
                "spec": {
                    "parallelism": -1,
                    "template": {
                        "spec": {"restartPolicy": "Never", "containers": [{"name": "a", "image": "i:1"}]}
                    },
                },
            },
            [
                'Job "neg" is invalid',
                "spec.parallelism: Invalid value: -1: must be greater than or equal to 0",
            ],
            id="job-negative-parallelism",
        ),
    ],
)
def test_apiserver_rejects_invalid_objects_with_its_own_error(
    local_cluster: LocalCluster, namespace: str, manifest: dict[str, Any], expected: list[str]
) -> None:
    result = local_cluster.kubectl_run(
        "create", "-n", namespace, "-f", "-", input=json.dumps(manifest), check=False
    )
    assert result.returncode != 0
    for fragment in expected:
        assert fragment in result.stderr, result.stderr


def test_audit_log_names_the_user_of_every_write(local_cluster: LocalCluster, namespace: str) -> None:
    marker = f"audited-{uuid.uuid4().hex[:6]}"
    local_cluster.kubectl_run("create", "configmap", marker, "-n", namespace)

    def creation_event() -> dict[str, Any] | None:
        for line in local_cluster.audit_log.read_text().splitlines():
            event = json.loads(line)
            ref = event.get("objectRef", {})
            if (
                ref.get("name") == marker
                and event.get("verb") == "create"
                and event.get("stage") == "ResponseComplete"
            ):
                return dict(event)
        return None

    event = wait_for("the audit event of the configmap's creation", creation_event)
    assert event["user"]["username"] == "ddp-admin"
    assert "system:masters" in event["user"]["groups"]
    assert event["objectRef"]["namespace"] == namespace
    assert event["responseStatus"]["code"] == 201
    assert event["level"] == "Metadata"
    reads = [json.loads(line).get("verb") for line in local_cluster.audit_log.read_text().splitlines()]
    assert "get" not in reads and "list" not in reads and "watch" not in reads


def test_binaries_report_the_pinned_versions(local_cluster: LocalCluster) -> None:
    pins = pinned_versions()
    versions = json.loads(local_cluster.kubectl_run("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"] == pins["KUBERNETES_VERSION"]
    assert versions["serverVersion"]["gitVersion"] == pins["KUBERNETES_VERSION"]
    helm = local_cluster.helm_run("version", "--template", "{{.Version}}").stdout.strip()
    assert helm == pins["HELM_VERSION"]
    etcd = subprocess.run(
        [str(local_cluster.bin_dir / "etcd"), "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert f"etcd Version: {pins['ETCD_VERSION'].lstrip('v')}" in etcd


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_cli_up_status_down_leaves_no_process_behind(local_cluster: LocalCluster, tmp_path: Path) -> None:
    """A second, one-node cluster through `ddp-harness cluster`, in its own state directory."""
    state_dir = tmp_path / "cli-cluster"
    harness = [sys.executable, "-m", "ddp_harness", "cluster"]
    where = ["--state-dir", str(state_dir)]
    up = subprocess.run(
        [
            *harness,
            "up",
            *where,
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            f"--bin-dir={local_cluster.bin_dir}",
            "--no-build",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    try:
        assert up.returncode == 0, up.stderr
        assert f"kubeconfig: {state_dir / 'kubeconfig'}" in up.stdout
        status = subprocess.run(
            [*harness, "status", *where, "--json"], capture_output=True, text=True, check=False
        )
        assert status.returncode == 0, status.stdout + status.stderr
        components = json.loads(status.stdout)["components"]
        assert {c["name"] for c in components} == {
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kwok",
        }
        assert all(c["running"] and c["rss_bytes"] > 0 and Path(c["log"]).is_file() for c in components)
        pids = [c["pid"] for c in components]
        nodes = subprocess.run(
            [
                str(local_cluster.kubectl),
                f"--kubeconfig={state_dir / 'kubeconfig'}",
                "get",
                "nodes",
                "-o",
                "json",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        [node] = json.loads(nodes.stdout)["items"]
        assert node["status"]["capacity"][GPU_RESOURCE] == "2"
    finally:
        down = subprocess.run(
            [*harness, "down", *where], capture_output=True, text=True, timeout=60, check=False
        )
    assert down.returncode == 0, down.stderr
    assert [pid for pid in pids if _pid_alive(pid)] == []
    assert not state_dir.exists()
    again = subprocess.run([*harness, "status", *where], capture_output=True, text=True, check=False)
    assert again.returncode == 1 and "no cluster" in again.stdout


def test_pod_created_with_an_exit_code_ends_without_running(
    local_cluster: LocalCluster, namespace: str
) -> None:
    local_cluster.apply_json(pod("stillborn", annotations={EXIT_CODE_ANNOTATION: "2"}), "-n", namespace)

    def failed() -> dict[str, Any] | None:
        p = get_pod(local_cluster, namespace, "stillborn")
        return p if p["status"].get("phase") == "Failed" else None

    done = wait_for("pod stillborn Failed", failed)
    terminated = done["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (2, "Error")
    assert done["spec"]["nodeName"] in local_cluster.node_names


def test_a_lost_node_is_tainted_its_pods_stay_terminating_then_it_recovers(
    local_cluster: LocalCluster, namespace: str
) -> None:
    node = local_cluster.node_names[-1]
    victim = pod("victim")
    victim["spec"]["nodeName"] = node
    victim["spec"]["tolerations"] = [
        {
            "key": "node.kubernetes.io/unreachable",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 2,
        }
    ]
    local_cluster.apply_json(victim, "-n", namespace)
    wait_for("pod victim Running", lambda: running_and_ready(local_cluster, namespace, "victim"))
    local_cluster.lose_node(node)
    try:

        def tainted() -> list[dict[str, Any]] | None:
            taints = local_cluster.get_json("node", node)["spec"].get("taints") or []
            unreachable = [t for t in taints if t["key"] == "node.kubernetes.io/unreachable"]
            # NoSchedule comes first, the taint that evicts (NoExecute) a moment later.
            return unreachable if len(unreachable) == 2 else None

        taints = wait_for(f"node {node} tainted unreachable (NoSchedule and NoExecute)", tainted)
        assert {t["effect"] for t in taints} == {"NoSchedule", "NoExecute"}
        ready = condition(local_cluster.get_json("node", node), "Ready") or {}
        assert ready.get("status") == "Unknown"

        def evicted() -> dict[str, Any] | None:
            pod_now = local_cluster.get_json("pod", "victim", "-n", namespace)
            return pod_now if pod_now["metadata"].get("deletionTimestamp") else None

        # Evicted by the taint-eviction controller, but its silent kubelet never confirms: Terminating.
        stuck = wait_for("pod victim evicted by the taint-eviction controller", evicted)
        disruption = condition(stuck, "DisruptionTarget") or {}
        assert disruption.get("reason") == "DeletionByTaintManager", stuck["status"]
    finally:
        local_cluster.restore_node(node)

    def gone() -> bool:
        result = local_cluster.kubectl_run("get", "pod", "victim", "-n", namespace, check=False)
        return result.returncode != 0 and "NotFound" in result.stderr

    wait_for("the node, back, to confirm the deletion", gone)

    def recovered() -> bool:
        back = local_cluster.get_json("node", node)
        ready = (condition(back, "Ready") or {}).get("status") == "True"
        return ready and not back["spec"].get("taints")

    wait_for(f"node {node} Ready and untainted again", recovered)
