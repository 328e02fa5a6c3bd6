"""The Helm chart: lint, render every documented toggle, install it into the real apiserver, and prove
its RBAC by running the operator with nothing but the chart's ServiceAccount token.

Rendering tests need only the helm binary (hack/build-k8s.sh builds it); install and RBAC tests use the
session's local control plane."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.integration.operator_harness import REPO, Kube, OperatorProcess, wait_for

from ddp_harness.binaries import default_bin_dir
from ddp_operator import builders, names

pytestmark = pytest.mark.integration

CHART = REPO / "charts" / "ddp-operator"
GEN_CRDS = REPO / "hack" / "gen-chart-crds.sh"
Docs = list[dict[str, Any]]

# The verbs the operator uses (kube_api.py and kopf's watches), per (apiGroup, resource): the chart must
# grant exactly these, no more. kopf's cluster-wide needs are separate (KOPF_CLUSTER_RULES).
OPERATOR_RULES: dict[tuple[str, str], set[str]] = {
    # get: a Kueue group's job is really gone before its Kueue Workload is deleted.
    ("ddp.dev", "ddpjobs"): {"list", "watch", "delete", "get"},
    ("ddp.dev", "ddpjobs/status"): {"patch"},
    # blockOwnerDeletion on the children's ownerReferences (OwnerReferencesPermissionEnforcement).
    ("ddp.dev", "ddpjobs/finalizers"): {"update"},
    # patch: Kueue's finalizer off an old pod Kueue would still count; a failed group's mark.
    ("", "pods"): {"create", "delete", "get", "list", "watch", "patch"},
    ("", "pods/resize"): {"patch"},
    ("", "services"): {"create", "get", "patch"},
    ("", "persistentvolumeclaims"): {"create", "get"},
    ("", "events"): {"create"},
    # The job's NetworkPolicy (builders.build_network_policy), followed like the Service.
    ("networking.k8s.io", "networkpolicies"): {"create", "get", "patch"},
    # The in-tree gang (gang.py): a Workload and a PodGroup per attempt, when the API is served.
    ("scheduling.k8s.io", "workloads"): {"create", "get", "list", "delete"},
    ("scheduling.k8s.io", "podgroups"): {"create", "get", "list", "delete"},
    # Kueue (kueue.py): why a queued job waits; a deleted or suspended job's group ended.
    ("kueue.x-k8s.io", "workloads"): {"get", "delete"},
    ("kueue.x-k8s.io", "localqueues"): {"get"},
}
KOPF_CLUSTER_RULES: dict[tuple[str, str], set[str]] = {
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    # The topology label of the nodes a job's ranks landed on (status.topology).
    ("", "nodes"): {"get"},
}
KOPF_NAMESPACE_RULES: dict[tuple[str, str], set[str]] = {("", "namespaces"): {"list", "watch"}}
# What the people who run jobs get through view/edit/admin (templates/rbac-users.yaml, docs/helm.md).
USER_VIEW_RULES: dict[tuple[str, str], set[str]] = {
    ("ddp.dev", "ddpjobs"): {"get", "list", "watch"},
    ("ddp.dev", "ddpjobs/status"): {"get", "list", "watch"},
}
USER_EDIT_RULES: dict[tuple[str, str], set[str]] = {
    ("ddp.dev", "ddpjobs"): {"create", "update", "patch", "delete", "deletecollection"},
}


def find_helm() -> Path | None:
    candidate = default_bin_dir() / "helm"
    if os.access(candidate, os.X_OK):
        return candidate
    found = shutil.which("helm")
    return Path(found) if found else None


@pytest.fixture(scope="module")
def helm() -> Path:
    binary = find_helm()
    if binary is None:
        pytest.skip(f"no helm binary in {default_bin_dir()} or on PATH (hack/build-k8s.sh builds it)")
    return binary


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def set_args(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def render(helm: Path, values: dict[str, str], api_versions: tuple[str, ...] = ()) -> Docs:
    extra = [arg for version in api_versions for arg in ("--api-versions", version)]
    result = run_helm(
        helm, "template", "rel", str(CHART), "--namespace", "ddp-system", *set_args(values), *extra
    )
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def kinds(docs: Docs) -> list[str]:
    return sorted(doc["kind"] for doc in docs)


def only(docs: Docs, kind: str) -> dict[str, Any]:
    matching = [doc for doc in docs if doc["kind"] == kind]
    assert len(matching) == 1, f"expected one {kind}, got {len(matching)}"
    return matching[0]


def rules_of(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role.get("rules") or []:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def operator_container(docs: Docs) -> dict[str, Any]:
    container: dict[str, Any] = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return container


# ---- lint and render ------------------------------------------------------------------------------

TOGGLES = [
    pytest.param({}, id="defaults"),
    pytest.param({"watchNamespaces": "{team-a,team-b}"}, id="watch-namespaces"),
    pytest.param({"leaderElection.enabled": "false"}, id="no-leader-election"),
    pytest.param({"replicaCount": "2"}, id="standby-replica"),
    pytest.param({"grafanaDashboard.enabled": "true"}, id="grafana-dashboard"),
    pytest.param({"metrics.service.enabled": "false"}, id="no-metrics-service"),
    pytest.param(
        {"rbac.create": "false", "serviceAccount.create": "false", "serviceAccount.name": "ops"},
        id="bring-your-own-sa",
    ),
    pytest.param(
        {"operator.verbose": "true", "operator.extraArgs": "{--status-interval=2}"}, id="operator-flags"
    ),
]


@pytest.mark.parametrize("values", TOGGLES)
def test_lint_strict_passes(helm: Path, values: dict[str, str]) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), *set_args(values), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_defaults_run_one_hardened_cluster_wide_operator(helm: Path) -> None:
    docs = render(helm, {})
    assert kinds(docs) == sorted(
        [
            "ClusterRole",
            "ClusterRole",
            # DDPJobs folded into the built-in view/edit/admin roles (templates/rbac-users.yaml).
            "ClusterRole",
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterRoleBinding",
            "Deployment",
            # The standby pods' class (templates/priorityclass.yaml; tests/integration/test_chart_standby.py).
            "PriorityClass",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
        ]
    )
    deployment = only(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(docs)
    assert container["image"] == "ddp-operator:0.1.0"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert "--all-namespaces" in container["args"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert f"--liveness=http://0.0.0.0:{ports['health']}/healthz" in container["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    service = only(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_rendered_args_are_flags_the_operator_accepts(helm: Path) -> None:
    """The chart and `ddpjob operator` agree on every flag (a renamed flag fails here, not in a pod)."""
    import argparse

    from ddp_operator.commands import operator as operator_command

    for values in (
        {},
        {
            "watchNamespaces": "{team-a,team-b}",
            "leaderElection.leaseDuration": "20",
            "operator.verbose": "true",
        },
    ):
        parser = argparse.ArgumentParser()
        operator_command.configure_parser(parser)
        args = parser.parse_args(operator_container(render(helm, values))["args"])
        assert args.liveness.endswith(":8080/healthz")
        assert args.metrics_port == 9410
        assert args.leader_election is True
        assert (args.leader_election_namespace, args.leader_election_name) == (
            "ddp-system",
            "rel-ddp-operator",
        )
        # The chart's default is the operator's own, plus the operator pods (they read progress).
        assert args.metrics_allow_from == (*builders.DEFAULT_METRICS_ALLOW_FROM, OPERATOR_PEER)
    assert args.namespace == ["team-a", "team-b"]
    assert args.lease_duration == 20


# The operator's own pods, always allowed to the rank metrics port: they read status.progress there.
OPERATOR_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ddp-system"}},
    "podSelector": {
        "matchLabels": {
            "app.kubernetes.io/component": "operator",
            "app.kubernetes.io/instance": "rel",
            "app.kubernetes.io/name": "ddp-operator",
        }
    },
}


@pytest.mark.parametrize(
    "allow_from",
    [
        pytest.param([], id="closed"),
        pytest.param(
            [
                {
                    "namespaceSelector": {},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                }
            ],
            id="prometheus-pods-anywhere",
        ),
    ],
)
def test_rank_metrics_allow_from_reaches_the_operator(helm: Path, allow_from: list[dict[str, Any]]) -> None:
    """rankMetrics.allowFrom becomes --metrics-allow-from, which the operator parses into the same peers."""
    import argparse

    from ddp_operator.commands import operator as operator_command

    result = run_helm(
        helm, "template", "rel", str(CHART), "--namespace", "ddp-system",
        "--set-json", f"rankMetrics.allowFrom={json.dumps(allow_from)}",
    )  # fmt: skip
    docs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    parser = argparse.ArgumentParser()
    operator_command.configure_parser(parser)
    args = parser.parse_args(operator_container(docs)["args"])
    assert args.metrics_allow_from == (*allow_from, OPERATOR_PEER)


@pytest.mark.parametrize(
    ("values", "namespaced_roles"),
    [
        pytest.param({}, [], id="cluster-wide"),
        pytest.param({"watchNamespaces": "{team-a,team-b}"}, ["team-a", "team-b"], id="namespaced"),
    ],
)
def test_rbac_grants_exactly_the_operators_verbs(
    helm: Path, values: dict[str, str], namespaced_roles: list[str]
) -> None:
    docs = render(helm, values)
    cluster_roles = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "ClusterRole"}
    kopf_expected = dict(KOPF_CLUSTER_RULES)
    if namespaced_roles:
        kopf_expected.update(KOPF_NAMESPACE_RULES)
    assert rules_of(cluster_roles.pop("rel-ddp-operator-kopf")) == kopf_expected
    # The roles for the people who run jobs, folded into view/edit/admin (none binds the operator).
    assert rules_of(cluster_roles.pop("rel-ddp-operator-view")) == USER_VIEW_RULES
    assert rules_of(cluster_roles.pop("rel-ddp-operator-edit")) == USER_EDIT_RULES
    roles = [
        doc
        for doc in docs
        if doc["kind"] == "Role" and not doc["metadata"]["name"].endswith("-leader-election")
    ]
    bindings = [doc for doc in docs if doc["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    if namespaced_roles:
        assert cluster_roles == {}
        assert sorted(role["metadata"]["namespace"] for role in roles) == namespaced_roles
        for role in roles:
            assert rules_of(role) == OPERATOR_RULES
    else:
        assert roles == []
        assert rules_of(cluster_roles["rel-ddp-operator"]) == OPERATOR_RULES
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "rel-ddp-operator", "namespace": "ddp-system"}
        ]
    args = operator_container(docs)["args"]
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={n}" for n in namespaced_roles]


@pytest.mark.parametrize(
    ("values", "replicas", "strategy"),
    [
        pytest.param({}, 1, "RollingUpdate", id="default"),
        pytest.param({"replicaCount": "2"}, 2, "RollingUpdate", id="standby"),
        pytest.param({"leaderElection.enabled": "false"}, 1, "Recreate", id="no-leader-election"),
    ],
)
def test_leader_election_makes_rollover_and_standbys_safe(
    helm: Path, values: dict[str, str], replicas: int, strategy: str
) -> None:
    docs = render(helm, values)
    deployment = only(docs, "Deployment")
    assert (deployment["spec"]["replicas"], deployment["spec"]["strategy"]["type"]) == (replicas, strategy)
    lease_roles = [
        doc for doc in docs if doc["kind"] == "Role" and doc["metadata"]["name"].endswith("-leader-election")
    ]
    args = operator_container(docs)["args"]
    if strategy == "Recreate":
        assert lease_roles == [] and "--no-leader-election" in args
        return
    (role,) = lease_roles
    assert role["metadata"]["namespace"] == "ddp-system"
    assert rules_of(role) == {("coordination.k8s.io", "leases"): {"get", "create", "update"}}


def test_two_acting_operators_are_refused(helm: Path) -> None:
    result = subprocess.run(
        [
            str(helm),
            "template",
            "rel",
            str(CHART),
            "-n",
            "ddp-system",
            "--set",
            "leaderElection.enabled=false",
            "--set",
            "replicaCount=2",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "needs leaderElection.enabled" in result.stderr


@pytest.mark.parametrize(
    ("api_versions", "values", "expected"),
    [
        pytest.param((), {}, [], id="no-prometheus-operator"),
        pytest.param(
            ("monitoring.coreos.com/v1",), {}, ["PodMonitor", "ServiceMonitor"], id="prometheus-operator"
        ),
        pytest.param(
            ("monitoring.coreos.com/v1",),
            {"metrics.serviceMonitor.enabled": "false", "metrics.podMonitor.enabled": "false"},
            [],
            id="monitors-off",
        ),
    ],
)
def test_monitors_only_where_the_prometheus_operator_api_exists(
    helm: Path, api_versions: tuple[str, ...], values: dict[str, str], expected: list[str]
) -> None:
    docs = render(helm, values, api_versions)
    assert sorted(d["kind"] for d in docs if d["kind"] in ("PodMonitor", "ServiceMonitor")) == expected
    if "PodMonitor" in expected:
        pod_monitor = only(docs, "PodMonitor")
        assert pod_monitor["spec"]["selector"]["matchLabels"] == {
            names.LABEL_MANAGED_BY: names.MANAGED_BY_VALUE
        }
        assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == names.METRICS_PORT_NAME
        assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}


def test_grafana_dashboard_charts_the_trainer_metrics(helm: Path) -> None:
    docs = render(helm, {"grafanaDashboard.enabled": "true"})
    config_map = only(docs, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["ddp-training.json"])
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    for metric in (
        "ddp_allreduce_duration_seconds_bucket",
        "ddp_allreduce_bytes_total",
        "ddp_allreduce_service_seconds_total",
        "ddp_comm_overlap_ratio",
        "ddp_step_duration_seconds_bucket",
        "ddp_rank_compute_seconds",
        "ddp_rank_wait_seconds",
        "ddp_step_phase_seconds",
        "ddp_straggler_slowdown",
        "ddp_straggler_rank",
        "ddp_straggler_phase",
    ):
        assert metric in exprs, metric
    assert all("rank" in panel["title"] for panel in dashboard["panels"])


BAD_VALUES = [
    pytest.param({"image.tag": "latest"}, "image.tag", id="latest-tag"),
    pytest.param({"watchNamespaces": "{Team_A}"}, "watchNamespaces", id="namespace-not-a-dns-label"),
    pytest.param({"operator.concurrency": "0"}, "operator.concurrency", id="zero-concurrency"),
    pytest.param({"replicas": "2"}, "replicas", id="unknown-key"),
    pytest.param({"podSecurityContext.runAsNonRoot": "false"}, "podSecurityContext.runAsNonRoot", id="root"),
    pytest.param({"metrics.podMonitor.interval": "soon"}, "metrics.podMonitor.interval", id="bad-duration"),
    pytest.param({"image.pullPolicy": "Sometimes"}, "image.pullPolicy", id="bad-pull-policy"),
    pytest.param(
        {"rankMetrics.allowFrom[0].podSelektor.matchLabels.app": "prom"},
        "rankMetrics.allowFrom.0",
        id="metrics-peer-typo",
    ),
]


@pytest.mark.parametrize(("values", "field"), BAD_VALUES)
def test_schema_refuses_bad_values_naming_them(helm: Path, values: dict[str, str], field: str) -> None:
    result = run_helm(helm, "template", "rel", str(CHART), *set_args(values), check=False)
    assert result.returncode != 0, f"{values} was accepted"
    # helm names the path with '/' or '.' separators depending on its version.
    message = result.stderr.replace("/", ".")
    assert "schema" in message.lower() and field in message, result.stderr


def test_chart_crds_are_generated_from_crds_dir() -> None:
    result = subprocess.run(
        [str(GEN_CRDS), "--check"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"chart CRDs are stale; run hack/gen-chart-crds.sh\n{result.stderr}"


# ---- install into the real apiserver --------------------------------------------------------------


def ddpjob(name: str, replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": names.API_GROUP_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "restartPolicy": "ExitCode",
            "runPolicy": {"backoffLimit": 3},
            "template": {"spec": {"containers": [{"name": "trainer", "image": "ddp-trainer:0.1.0"}]}},
        },
    }


@dataclass(frozen=True)
class TokenIdentity:
    """What `Kube` needs to run kubectl as someone else: a kubeconfig and the kubectl binary."""

    kubeconfig: Path
    kubectl: str


class Release:
    """One `helm install` of the chart into its own namespace, uninstalled by the fixture."""

    def __init__(self, cluster: Any, kube: Kube, values: dict[str, str]) -> None:
        self.cluster = cluster
        self.kube = kube
        self.name = f"ddp-{uuid.uuid4().hex[:6]}"
        self.namespace = f"{self.name}-system"
        self.values = values
        self.service_account = f"{self.name}-ddp-operator"

    def install(self) -> Release:
        self.cluster.helm_run(
            "install", self.name, str(CHART), "--namespace", self.namespace, "--create-namespace",
            "--wait=false", *set_args(self.values),
        )  # fmt: skip
        return self

    def uninstall(self) -> None:
        self.cluster.helm_run("uninstall", self.name, "--namespace", self.namespace, check=False)
        self.kube.delete_namespace(self.namespace)

    def token_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig holding nothing but a TokenRequest token for the chart's ServiceAccount."""
        token = self.kube.run(
            "create", "token", self.service_account, "-n", self.namespace, "--duration=1h"
        ).stdout.strip()
        assert token.count(".") == 2, "TokenRequest did not return a JWT"
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {
                        "server": self.cluster.apiserver,
                        "certificate-authority": str(self.cluster.ca_cert),
                    },
                }
            ],
            "users": [{"name": "operator", "user": {"token": token}}],
            "contexts": [{"name": "operator", "context": {"cluster": "local", "user": "operator"}}],
            "current-context": "operator",
        }
        path.write_text(yaml.safe_dump(config))
        return path


@pytest.fixture(scope="module")
def kube(local_cluster: Any, helm: Path) -> Kube:
    return Kube(local_cluster)


@pytest.fixture
def release_factory(local_cluster: Any, kube: Kube) -> Iterator[Callable[[dict[str, str]], Release]]:
    made: list[Release] = []

    def make(values: dict[str, str]) -> Release:
        release = Release(local_cluster, kube, values)
        made.append(release)
        return release.install()

    yield make
    for release in made:
        release.uninstall()


def test_install_creates_crd_rbac_and_deployment(
    kube: Kube, release_factory: Callable[[dict[str, str]], Release]
) -> None:
    release = release_factory({})
    kube.cluster.wait_established(names.CRD_NAME)
    for kind, name in (
        ("clusterrole", release.service_account),
        ("clusterrole", f"{release.service_account}-kopf"),
        ("clusterrolebinding", release.service_account),
        ("clusterrolebinding", f"{release.service_account}-kopf"),
    ):
        assert kube.run("get", kind, name, check=False).returncode == 0, f"{kind}/{name} missing"
    for kind in ("serviceaccount", "deployment", "service"):
        name = release.service_account if kind != "service" else f"{release.service_account}-metrics"
        assert kube.run("get", kind, name, "-n", release.namespace, check=False).returncode == 0, (
            f"{kind}/{name} missing"
        )
    deployment = kube.json("get", "deployment", release.service_account, "-n", release.namespace)
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate", "leader election makes rollover safe"
    assert (
        kube.run(
            "get", "role", f"{release.service_account}-leader-election", "-n", release.namespace, check=False
        ).returncode
        == 0
    )


# (verb, the built-in role bound to a user, whether it may) for DDPJobs in the bound namespace.
USER_ROLE_CASES = [
    ("list", "view", True),
    ("get", "view", True),
    ("create", "view", False),
    ("create", "edit", True),
    ("delete", "admin", True),
]


def test_ddpjobs_fold_into_the_built_in_user_roles(
    kube: Kube, release_factory: Callable[[dict[str, str]], Release]
) -> None:
    release_factory({})
    namespace = f"users-{uuid.uuid4().hex[:6]}"
    kube.run("create", "namespace", namespace)
    try:
        for role in sorted({role for _, role, _ in USER_ROLE_CASES}):
            kube.run(
                "create",
                "rolebinding",
                f"{role}-user",
                f"--clusterrole={role}",
                f"--user={role}-user",
                "-n",
                namespace,
            )

        def answers() -> list[tuple[str, str, bool]] | None:
            found = [
                (verb, role, kube.run(
                    "auth", "can-i", verb, f"{names.PLURAL}.{names.API_GROUP}", f"--as={role}-user", "-n", namespace,
                    check=False,
                ).stdout.strip() == "yes")
                for verb, role, _ in USER_ROLE_CASES
            ]  # fmt: skip
            return found if found == USER_ROLE_CASES else None

        # The aggregation controller folds the chart's roles in a moment after the install.
        wait_for("the chart's DDPJob roles aggregated into view, edit and admin", answers, timeout=60)
        proxy = kube.run(
            "auth",
            "can-i",
            "get",
            "pods",
            "--subresource=proxy",
            "--as=view-user",
            "-n",
            namespace,
            check=False,
        )
        assert proxy.stdout.strip() == "no", "view keeps pods/proxy out (docs/cli.md: `top` needs a grant)"
    finally:
        kube.delete_namespace(namespace)


def test_install_refuses_bad_values(local_cluster: Any, kube: Kube) -> None:
    name = f"bad-{uuid.uuid4().hex[:6]}"
    result = local_cluster.helm_run(
        "install", name, str(CHART), "--namespace", "default", "--set", "operator.concurrency=-1", check=False
    )
    assert result.returncode != 0 and "operator" in result.stderr and "concurrency" in result.stderr, (
        result.stderr
    )
    assert kube.run("get", "deployment", f"{name}-ddp-operator", "-n", "default", check=False).returncode != 0


def wait_pods(kube: Kube, namespace: str, job: str, attempt: int, count: int) -> list[dict[str, Any]]:
    def probe() -> list[dict[str, Any]] | None:
        pods = [
            p for p in kube.live_pods(namespace, job)
            if p["metadata"]["labels"].get(names.LABEL_ATTEMPT) == str(attempt)
            and p.get("status", {}).get("phase") == "Running"
        ]  # fmt: skip
        return pods if len(pods) == count else None

    return wait_for(f"{count} running pods of {job} attempt {attempt}", probe, timeout=90)


def wait_phase(kube: Kube, namespace: str, job: str, phase: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        status = kube.status(namespace, job)
        return status if status.get("phase") == phase else None

    return wait_for(f"{job} phase {phase} (status now: {kube.status(namespace, job)})", probe, timeout=90)


@pytest.mark.parametrize("mode", ["namespaced", "cluster-wide"])
def test_operator_runs_a_job_lifecycle_with_only_the_charts_rbac(
    kube: Kube, release_factory: Callable[[dict[str, str]], Release], tmp_path: Path, mode: str
) -> None:
    jobs_namespace = kube.create_namespace("rbac")
    other_namespace = kube.create_namespace("rbac-other")
    try:
        values = {"watchNamespaces": f"{{{jobs_namespace}}}"} if mode == "namespaced" else {}
        release = release_factory(values)
        kubeconfig = release.token_kubeconfig(tmp_path / "sa.kubeconfig")
        as_operator = Kube(TokenIdentity(kubeconfig=kubeconfig, kubectl=kube.kubectl))

        # What the operator does not need, it cannot do.
        denied = as_operator.run("get", "secrets", "-n", jobs_namespace, check=False)
        assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
        if mode == "namespaced":
            elsewhere = as_operator.run("get", "pods", "-n", other_namespace, check=False)
            assert elsewhere.returncode != 0 and "forbidden" in elsewhere.stderr.lower(), elsewhere.stderr

        namespaces = [jobs_namespace] if mode == "namespaced" else []
        # As the chart runs it: its Lease in the release namespace, the only place the chart lets it write one.
        lease = ["--leader-election-namespace", release.namespace]
        operator = OperatorProcess(kubeconfig, namespaces, tmp_path / "operator.log", extra=lease).start()
        try:
            kube.apply(ddpjob("lifecycle"), jobs_namespace)
            first = wait_pods(kube, jobs_namespace, "lifecycle", attempt=0, count=2)
            # The job's NetworkPolicy, created (and read back) under the chart's token.
            policy = kube.json("get", "networkpolicy", "lifecycle", "-n", jobs_namespace)
            assert policy["metadata"]["ownerReferences"][0]["name"] == "lifecycle"
            # A retryable failure of one rank restarts the whole gang as attempt 1.
            kube.end_pod(jobs_namespace, first[0]["metadata"]["name"], 143)
            second = wait_pods(kube, jobs_namespace, "lifecycle", attempt=1, count=2)
            wait_for("restarts = 1", lambda: kube.status(jobs_namespace, "lifecycle").get("restarts") == 1)
            for pod in second:
                kube.end_pod(jobs_namespace, pod["metadata"]["name"], 0)
            wait_phase(kube, jobs_namespace, "lifecycle", "Succeeded")
            kube.run("delete", "ddpjob", "lifecycle", "-n", jobs_namespace, "--wait=true", "--timeout=60s")
            wait_for(
                "the job's pods to be collected",
                lambda: not kube.pods(jobs_namespace, "lifecycle"),
                timeout=60,
            )
            log = operator.log_path.read_text(errors="replace")
            # A refusal as kopf, the apiserver or our client words it; "403" as a token only, since the
            # milliseconds of a log line's time (",403") or a UID ("-403a") hold it too.
            refused = re.compile(
                r"not enough permissions|forbidden|(?:^|[\s(=])403(?=$|[\s),:])", re.I | re.M
            )
            assert not refused.search(log), operator.log_tail(80)
        finally:
            operator.stop()
    finally:
        kube.delete_namespace(jobs_namespace)
        kube.delete_namespace(other_namespace)


def test_uninstall_leaves_no_ddpjob_or_namespace_stuck(
    kube: Kube, local_cluster: Any, release_factory: Callable[[dict[str, str]], Release]
) -> None:
    jobs_namespace = kube.create_namespace("uninstall")
    release = release_factory({"watchNamespaces": f"{{{jobs_namespace}}}"})
    kube.apply(ddpjob("orphan"), jobs_namespace)
    local_cluster.helm_run("uninstall", release.name, "--namespace", release.namespace)
    job = kube.job(jobs_namespace, "orphan")
    assert job is not None and not job["metadata"].get("finalizers"), job
    kube.run("delete", "namespace", jobs_namespace, "--wait=true", "--timeout=90s")
    kube.run("delete", "namespace", release.namespace, "--wait=true", "--timeout=90s")
    assert kube.run("get", "namespace", jobs_namespace, check=False).returncode != 0
