"""The children of a DDPJob: names, DNS, labels, ownership, the env contract and the pod defaults."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from tests.unit.kube_factories import JOB_UID, job_spec

from ddp_operator import builders, names

pytestmark = pytest.mark.unit

CHECKPOINT = {"volumeClaimTemplate": {"resources": {"requests": {"storage": "5Gi"}}}, "mountPath": "/ckpt"}

# A job without metrics recovers by recreating its gang (the operator counts in-place restarts from them).
RECREATE = {"runPolicy": {"restartMode": "Recreate"}}


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in trainer["env"]}


def trainer_of(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")


@pytest.mark.parametrize(
    ("rank", "attempt", "pod_name", "hostname"),
    [
        pytest.param(0, 0, "mnist-0-0", "mnist-0", id="rank0-attempt0"),
        pytest.param(1, 0, "mnist-1-0", "mnist-1", id="rank1-attempt0"),
        pytest.param(1, 3, "mnist-1-3", "mnist-1", id="hostname-stable-across-attempts"),
    ],
)
def test_rank_pod_names_and_dns(rank: int, attempt: int, pod_name: str, hostname: str) -> None:
    pod = builders.build_rank_pod(job_spec(), rank, attempt)
    assert pod["metadata"]["name"] == pod_name
    assert pod["metadata"]["namespace"] == "team-a"
    assert pod["spec"]["hostname"] == hostname
    assert pod["spec"]["subdomain"] == "mnist"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "ddp-operator",
        "ddp.dev/job-name": "mnist",
        "ddp.dev/rank": str(rank),
        "ddp.dev/attempt": str(attempt),
        "ddp.dev/job-uid": JOB_UID,
        "ddp.dev/spec-hash": builders.spec_hash(job_spec()),
    }


def test_every_child_has_a_controller_owner_reference() -> None:
    job = job_spec(checkpoint=CHECKPOINT)
    pvc = builders.build_checkpoint_pvc(job)
    assert pvc is not None
    for child in (builders.build_service(job, 0), builders.build_rank_pod(job, 0, 0), pvc):
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "ddp.dev/v1alpha1",
            "kind": "DDPJob",
            "name": "mnist",
            "uid": JOB_UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
        assert "finalizers" not in child["metadata"]


def test_service_is_headless_and_publishes_not_ready_addresses() -> None:
    service = builders.build_service(job_spec(), 3)
    assert service["metadata"]["name"] == "mnist"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    # The job object's UID, not its name: the rendezvous pod carries no ddp.dev/job-name.
    assert service["spec"]["selector"] == {
        "app.kubernetes.io/managed-by": "ddp-operator",
        "ddp.dev/job-uid": JOB_UID,
        "ddp.dev/attempt": "3",
    }
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"rendezvous": 29500, "metrics": 9400}


def test_the_service_selects_every_rank_pod_of_its_attempt_and_no_other() -> None:
    job = job_spec()
    selector = builders.build_service(job, 2)["spec"]["selector"]
    for rank in range(job.replicas):
        labels = builders.build_rank_pod(job, rank, 2)["metadata"]["labels"]
        assert selector.items() <= labels.items()
        older = builders.build_rank_pod(job, rank, 1)["metadata"]["labels"]
        assert not selector.items() <= older.items(), "a pod of an earlier attempt is not published"
    recreated = dataclasses.replace(job_spec(), uid="uid-of-a-recreated-job")
    labels = builders.build_rank_pod(recreated, 0, 2)["metadata"]["labels"]
    assert not selector.items() <= labels.items(), "a pod of another job of the same name is not published"


@pytest.mark.parametrize(
    ("spec", "rank", "expected"),
    [
        pytest.param(
            {"replicas": 2},
            1,
            {
                "MASTER_ADDR": "mnist-0.mnist.team-a.svc",
                "MASTER_PORT": "29500",
                "NNODES": "2",
                "NODE_RANK": "1",
                "NPROC_PER_NODE": "1",
                "WORLD_SIZE": "2",
                "RANK": "1",
                "LOCAL_RANK": "0",
                "PET_NNODES": "2",
                "PET_NODE_RANK": "1",
                "PET_NPROC_PER_NODE": "1",
                "PET_MASTER_ADDR": "mnist-0.mnist.team-a.svc",
                "PET_MASTER_PORT": "29500",
                "DDPJOB_NAME": "mnist",
                "DDPJOB_NAMESPACE": "team-a",
                "DDPJOB_ATTEMPT": "4",
                "DDP_BACKEND": "gloo",
                "DDP_METRICS_PORT": "9400",
                "DDP_RESTART_MODE": "InPlace",
                "DDP_RESTART_BUDGET": "3",
                "DDP_RUN_ID": "uid-1234-4",
                "PET_RDZV_BACKEND": "c10d",
                "DDP_RENDEZVOUS_ENDPOINT": "mnist-rdzv.mnist.team-a.svc:29500",
                "PET_RDZV_ENDPOINT": "mnist-rdzv.mnist.team-a.svc:29500",
                "PET_RDZV_ID": "uid-1234-4",
                "PET_MAX_RESTARTS": "3",
                "PET_RDZV_CONF": "is_host=0",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "POD_IP": {"fieldRef": {"fieldPath": "status.podIP"}},
                "PYTHONUNBUFFERED": "1",
            },
            id="cpu-one-process-per-pod-in-place",
        ),
        pytest.param(
            {
                "replicas": 2,
                "nprocPerNode": 8,
                "rendezvousPort": 23456,
                "runPolicy": {"restartMode": "Recreate"},
                "metrics": {"port": 9100},
                "checkpoint": CHECKPOINT,
                "template": {
                    "spec": {
                        "containers": [
                            {"name": "trainer", "image": "i", "resources": {"limits": {"nvidia.com/gpu": 8}}}
                        ]
                    }
                },
            },
            0,
            {
                "MASTER_ADDR": "mnist-0.mnist.team-a.svc",
                "MASTER_PORT": "23456",
                "NNODES": "2",
                "NODE_RANK": "0",
                "NPROC_PER_NODE": "8",
                "WORLD_SIZE": "16",
                "PET_NNODES": "2",
                "PET_NODE_RANK": "0",
                "PET_NPROC_PER_NODE": "8",
                "PET_MASTER_ADDR": "mnist-0.mnist.team-a.svc",
                "PET_MASTER_PORT": "23456",
                "DDPJOB_NAME": "mnist",
                "DDPJOB_NAMESPACE": "team-a",
                "DDPJOB_ATTEMPT": "4",
                "DDP_BACKEND": "nccl",
                "DDP_METRICS_PORT": "9100",
                "DDP_CHECKPOINT_DIR": "/ckpt",
                "DDP_RESTART_MODE": "Recreate",
                "POD_IP": {"fieldRef": {"fieldPath": "status.podIP"}},
                "PYTHONUNBUFFERED": "1",
            },
            id="gpu-eight-processes-no-rank-variables-recreate",
        ),
    ],
)
def test_env_contract(spec: dict[str, Any], rank: int, expected: dict[str, Any]) -> None:
    assert env_of(builders.build_rank_pod(job_spec(**spec), rank, 4)) == expected


@pytest.mark.parametrize(
    ("spec", "budget", "expected"),
    [
        pytest.param({}, None, "3", id="default-is-backoff-limit"),
        pytest.param({"runPolicy": {"backoffLimit": 5}}, 2, "2", id="what-is-left"),
        pytest.param({"runPolicy": {"backoffLimit": 5}}, -1, "0", id="never-negative"),
        pytest.param({"restartPolicy": "Never"}, None, "0", id="never-restarts"),
    ],
)
def test_restart_budget_env(spec: dict[str, Any], budget: int | None, expected: str) -> None:
    env = env_of(builders.build_rank_pod(job_spec(**spec), 1, 0, restart_budget=budget))
    assert env["DDP_RESTART_BUDGET"] == env["PET_MAX_RESTARTS"] == expected


def test_a_replacement_pod_has_a_new_name_and_the_ranks_hostname() -> None:
    first = builders.build_rank_pod(job_spec(), 2, 1)
    second = builders.build_rank_pod(job_spec(), 2, 1, replacement=2)
    assert first["metadata"]["name"] == "mnist-2-1"
    assert second["metadata"]["name"] == "mnist-2-1r2"
    assert second["metadata"]["labels"]["ddp.dev/replacement"] == "2"
    assert "ddp.dev/replacement" not in first["metadata"]["labels"]
    assert first["spec"]["hostname"] == second["spec"]["hostname"] == "mnist-2"
    assert env_of(first) == env_of(second)


def test_contract_env_replaces_the_templates_but_other_user_env_stays() -> None:
    template = {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "image": "i",
                    "env": [
                        {"name": "MASTER_ADDR", "value": "wrong"},
                        {"name": "PYTHONUNBUFFERED", "value": "0"},
                        {"name": "LR", "value": "0.1"},
                    ],
                }
            ]
        }
    }
    env = env_of(builders.build_rank_pod(job_spec(template=template), 0, 0))
    assert env["MASTER_ADDR"] == "mnist-0.mnist.team-a.svc"
    assert env["PYTHONUNBUFFERED"] == "0"
    assert env["LR"] == "0.1"
    names_in_order = [
        e["name"] for e in trainer_of(builders.build_rank_pod(job_spec(template=template), 0, 0))["env"]
    ]
    assert names_in_order.index("MASTER_ADDR") < names_in_order.index("LR"), (
        "user env may refer to $(MASTER_ADDR)"
    )


def test_pod_defaults() -> None:
    pod = builders.build_rank_pod(job_spec(), 0, 0)
    spec = pod["spec"]
    assert spec["enableServiceLinks"] is False
    assert spec["automountServiceAccountToken"] is False
    assert spec["terminationGracePeriodSeconds"] == builders.DEFAULT_TERMINATION_GRACE_SECONDS
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert trainer_of(pod)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert {(t["key"], t["effect"], t["tolerationSeconds"]) for t in spec["tolerations"]} == {
        ("node.kubernetes.io/not-ready", "NoExecute", 30),
        ("node.kubernetes.io/unreachable", "NoExecute", 30),
    }
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trainer_of(pod)["volumeMounts"]
    assert {(p["name"], p["containerPort"]) for p in trainer_of(pod)["ports"]} == {
        ("rendezvous", 29500),
        ("metrics", 9400),
    }


def test_template_overrides_win() -> None:
    template = {
        "metadata": {"labels": {"team": "vision", "ddp.dev/rank": "99"}, "annotations": {"a": "b"}},
        "spec": {
            "enableServiceLinks": True,
            "automountServiceAccountToken": True,
            "terminationGracePeriodSeconds": 600,
            "restartPolicy": "OnFailure",
            "hostname": "mine",
            "securityContext": {"runAsUser": 1000, "runAsNonRoot": False},
            "tolerations": [
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
            ],
            "volumes": [{"name": "shm", "hostPath": {"path": "/dev/shm"}}],
            "containers": [
                {
                    "name": "trainer",
                    "image": "i",
                    "securityContext": {"allowPrivilegeEscalation": True},
                    "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                    "ports": [{"name": "metrics", "containerPort": 8000}],
                }
            ],
        },
    }
    pod = builders.build_rank_pod(job_spec(template=template), 1, 0)
    spec = pod["spec"]
    assert spec["enableServiceLinks"] is True
    assert spec["automountServiceAccountToken"] is True
    assert spec["terminationGracePeriodSeconds"] == 600
    assert spec["securityContext"] == {
        "runAsUser": 1000,
        "runAsNonRoot": False,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    unreachable = [t for t in spec["tolerations"] if t["key"] == "node.kubernetes.io/unreachable"]
    assert unreachable == [
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
    ]
    assert [v["name"] for v in spec["volumes"]] == ["shm"], "a template /dev/shm mount replaces the default"
    trainer = trainer_of(pod)
    assert trainer["securityContext"]["allowPrivilegeEscalation"] is True
    assert [p["containerPort"] for p in trainer["ports"] if p["name"] == "metrics"] == [8000]
    # The operator's own fields are not overridable.
    assert spec["restartPolicy"] == "Never"
    assert spec["hostname"] == "mnist-1"
    assert pod["metadata"]["labels"]["ddp.dev/rank"] == "1"
    assert pod["metadata"]["labels"]["team"] == "vision"
    assert pod["metadata"]["annotations"] == {"a": "b"}


def test_every_container_gets_the_restricted_defaults() -> None:
    template = {
        "spec": {
            "initContainers": [{"name": "fetch", "image": "i"}],
            "containers": [{"name": "trainer", "image": "i"}, {"name": "sidecar", "image": "i"}],
        }
    }
    pod = builders.build_rank_pod(job_spec(template=template), 0, 0)
    for container in pod["spec"]["initContainers"] + pod["spec"]["containers"]:
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, container["name"]
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}, container["name"]
    sidecar = pod["spec"]["containers"][1]
    assert "env" not in sidecar, "only the trainer gets the env contract"


@pytest.mark.parametrize(
    ("rank", "mounted"),
    [pytest.param(0, True, id="rank0-mounts"), pytest.param(1, False, id="rank1-does-not")],
)
def test_checkpoint_volume_on_rank_zero_only(rank: int, mounted: bool) -> None:
    pod = builders.build_rank_pod(job_spec(checkpoint=CHECKPOINT), rank, 0)
    claims = [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    mounts = [m for m in trainer_of(pod)["volumeMounts"] if m["mountPath"] == "/ckpt"]
    assert bool(claims) is mounted
    assert bool(mounts) is mounted
    if mounted:
        assert claims[0]["persistentVolumeClaim"]["claimName"] == "mnist-checkpoint"
    assert env_of(pod)["DDP_CHECKPOINT_DIR"] == "/ckpt"


def test_checkpoint_pvc() -> None:
    pvc = builders.build_checkpoint_pvc(job_spec(checkpoint=CHECKPOINT))
    assert pvc is not None
    assert pvc["metadata"]["name"] == "mnist-checkpoint"
    assert pvc["spec"] == {"resources": {"requests": {"storage": "5Gi"}}, "accessModes": ["ReadWriteOnce"]}
    assert builders.build_checkpoint_pvc(job_spec()) is None


def test_metrics_disabled_declares_no_metrics_port() -> None:
    pod = builders.build_rank_pod(job_spec(metrics={"enabled": False}, **RECREATE), 0, 0)
    assert [p["name"] for p in trainer_of(pod)["ports"]] == ["rendezvous"]
    # 0 is "no endpoint" to the trainer, even where the disabled port equals the rendezvous port.
    assert env_of(pod)["DDP_METRICS_PORT"] == "0"


@pytest.mark.parametrize(
    ("security_context", "escalation"),
    [
        pytest.param({}, False, id="silent-template-gets-restricted"),
        pytest.param({"privileged": True}, None, id="privileged-keeps-escalation-unset"),
        pytest.param({"capabilities": {"add": ["SYS_ADMIN"]}}, None, id="sys-admin-keeps-escalation-unset"),
        pytest.param({"allowPrivilegeEscalation": True}, True, id="explicit-choice-kept"),
    ],
)
def test_privilege_escalation_default_never_makes_an_invalid_pod(
    security_context: dict[str, Any], escalation: bool | None
) -> None:
    template = {
        "spec": {"containers": [{"name": "trainer", "image": "i", "securityContext": security_context}]}
    }
    context = trainer_of(builders.build_rank_pod(job_spec(template=template), 0, 0))["securityContext"]
    assert context.get("allowPrivilegeEscalation") is escalation


def test_building_does_not_mutate_the_job_template() -> None:
    job = job_spec()
    before = repr(job.template)
    builders.build_rank_pod(job, 0, 0)
    builders.build_rank_pod(job, 1, 0)
    assert repr(job.template) == before


@pytest.mark.parametrize(
    ("job", "rank"),
    [pytest.param("a", 0, id="shortest"), pytest.param("j" * names.MAX_JOB_NAME_LENGTH, 4095, id="longest")],
)
def test_hostnames_are_dns_labels(job: str, rank: int) -> None:
    hostname = names.pod_hostname(job, rank)
    assert len(hostname) <= 63
    assert names.job_name_problem(job) is None


@pytest.mark.parametrize(
    ("change", "changes_the_hash"),
    [
        pytest.param({"replicas": 3}, True, id="replicas"),
        pytest.param({"nprocPerNode": 2}, True, id="processes-per-pod"),
        pytest.param({"rendezvousPort": 30000}, True, id="rendezvous-port"),
        pytest.param({"metrics": {"port": 9999}}, True, id="metrics-port"),
        pytest.param(
            {"template": {"spec": {"containers": [{"name": "trainer", "image": "ddp-trainer:2"}]}}},
            True,
            id="template",
        ),
        pytest.param({"scheduling": {"gang": "Workload"}}, True, id="gang-mode"),
        pytest.param({"scheduling": {"gang": "Auto"}}, False, id="gang-default-keeps-the-old-digest"),
        pytest.param({"runPolicy": {"backoffLimit": 9}}, False, id="run-policy-is-not-the-pods"),
        pytest.param({"restartPolicy": "Never"}, False, id="restart-policy-is-not-the-pods"),
        pytest.param({"networkPolicy": {"enabled": False}}, False, id="network-policy-is-not-the-pods"),
    ],
)
def test_spec_hash_follows_what_shapes_the_pods(change: dict[str, Any], changes_the_hash: bool) -> None:
    assert (builders.spec_hash(job_spec(**change)) != builders.spec_hash(job_spec())) is changes_the_hash


# ---- the NetworkPolicy --------------------------------------------------------------------------

PROMETHEUS = ({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},)
# Every pod of the job object, its rendezvous pod too (which carries no ddp.dev/job-name).
OWN_PODS = {
    "app.kubernetes.io/managed-by": "ddp-operator",
    "ddp.dev/job-uid": JOB_UID,
}


@pytest.mark.parametrize(
    ("spec", "allow_from", "ingress"),
    [
        pytest.param(
            {},
            PROMETHEUS,
            [
                {"from": [{"podSelector": {"matchLabels": OWN_PODS}}]},
                {"from": list(PROMETHEUS), "ports": [{"protocol": "TCP", "port": 9400}]},
            ],
            id="defaults",
        ),
        pytest.param(
            {"metrics": {"port": 9500}, "rendezvousPort": 23456},
            PROMETHEUS,
            [
                {"from": [{"podSelector": {"matchLabels": OWN_PODS}}]},
                {"from": list(PROMETHEUS), "ports": [{"protocol": "TCP", "port": 9500}]},
            ],
            id="metrics-port-follows-the-job",
        ),
        pytest.param(
            {"metrics": {"enabled": False}, **RECREATE},
            PROMETHEUS,
            [{"from": [{"podSelector": {"matchLabels": OWN_PODS}}]}],
            id="metrics-disabled-nothing-but-the-job",
        ),
        pytest.param({}, (), [{"from": [{"podSelector": {"matchLabels": OWN_PODS}}]}], id="no-prometheus"),
        pytest.param(
            {},
            ({"ipBlock": {"cidr": "10.9.0.0/16"}}, {"podSelector": {"matchLabels": {"app": "prom"}}}),
            [
                {"from": [{"podSelector": {"matchLabels": OWN_PODS}}]},
                {
                    "from": [
                        {"ipBlock": {"cidr": "10.9.0.0/16"}},
                        {"podSelector": {"matchLabels": {"app": "prom"}}},
                    ],
                    "ports": [{"protocol": "TCP", "port": 9400}],
                },
            ],
            id="several-peers",
        ),
    ],
)
def test_network_policy_admits_the_job_and_prometheus_only(
    spec: dict[str, Any], allow_from: tuple[dict[str, Any], ...], ingress: list[dict[str, Any]]
) -> None:
    policy = builders.build_network_policy(job_spec(**spec), allow_from)
    assert policy is not None
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["name"] == "mnist" and policy["metadata"]["namespace"] == "team-a"
    assert policy["metadata"]["labels"] == names.job_selector("mnist")
    (owner,) = policy["metadata"]["ownerReferences"]
    assert owner["uid"] == JOB_UID and owner["controller"] is True
    # Every rank pod of this job object, whatever the attempt: ingress only (egress is not restricted).
    assert policy["spec"]["podSelector"] == {"matchLabels": OWN_PODS}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == ingress


def test_network_policy_selects_every_rank_pod_of_the_job_object_and_no_other() -> None:
    job = job_spec()
    policy = builders.build_network_policy(job, PROMETHEUS)
    assert policy is not None
    selector = policy["spec"]["podSelector"]["matchLabels"]
    for rank, attempt in ((0, 0), (1, 0), (1, 5)):
        labels = builders.build_rank_pod(job, rank, attempt)["metadata"]["labels"]
        assert selector.items() <= labels.items()
    other = dataclasses.replace(job, uid="uid-of-a-later-job")
    assert not selector.items() <= builders.build_rank_pod(other, 0, 0)["metadata"]["labels"].items()


def test_network_policy_off_builds_nothing() -> None:
    assert builders.build_network_policy(job_spec(networkPolicy={"enabled": False}), PROMETHEUS) is None


def test_network_policy_does_not_share_the_callers_peers() -> None:
    peers = ({"podSelector": {"matchLabels": {"app": "prom"}}},)
    policy = builders.build_network_policy(job_spec(), peers)
    assert policy is not None
    policy["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"]["app"] = "changed"
    assert peers[0]["podSelector"]["matchLabels"]["app"] == "prom"


def test_default_metrics_allow_from_is_the_monitoring_namespace() -> None:
    assert builders.DEFAULT_METRICS_ALLOW_FROM == PROMETHEUS


@pytest.mark.parametrize(
    ("spec", "rank", "endpoint", "conf"),
    [
        pytest.param(
            {"replicas": 3}, 0, "mnist-rdzv.mnist.team-a.svc:29500", "is_host=0", id="rendezvous-pod"
        ),
        pytest.param(
            {"replicas": 1}, 0, "mnist-0.mnist.team-a.svc:29500", "is_host=1", id="one-pod-hosts-it"
        ),
    ],
)
def test_the_launchers_meet_at_the_rendezvous_pod(
    spec: dict[str, Any], rank: int, endpoint: str, conf: str
) -> None:
    """No launcher hosts the store where the job has a rendezvous pod; a job of one pod hosts its own."""
    job = job_spec(**spec)
    env = env_of(builders.build_rank_pod(job, rank, 0))
    assert (env["PET_RDZV_ENDPOINT"], env["PET_RDZV_CONF"]) == (endpoint, conf)
    assert env.get("DDP_RENDEZVOUS_ENDPOINT") == (endpoint if "rdzv" in endpoint else None)
    assert (builders.build_rendezvous_pod(job, 0) is not None) == ("rdzv" in endpoint)


def test_the_rendezvous_pod_runs_the_trainers_image_as_no_rank_under_the_templates_security() -> None:
    template = {
        "spec": {
            "securityContext": {"runAsUser": 1000},
            "nodeSelector": {"pool": "train"},
            "imagePullSecrets": [{"name": "registry"}],
            "affinity": {"podAntiAffinity": {}},
            "containers": [{"name": "trainer", "image": "team/trainer:1", "imagePullPolicy": "Never"}],
        }
    }
    job = job_spec(replicas=2, template=template)
    store = builders.build_rendezvous_pod(job, 3)
    assert store is not None
    meta, spec = store["metadata"], store["spec"]
    assert meta["name"] == "mnist-rdzv-3" and meta["labels"]["ddp.dev/role"] == "rendezvous"
    # No rank's pod: the operator's rank rules never count it, nor do the users' rules for rank pods (a
    # required anti-affinity on ddp.dev/job-name, one rank per node).
    assert "ddp.dev/rank" not in meta["labels"] and "ddp.dev/job-name" not in meta["labels"]
    assert meta["labels"]["ddp.dev/rendezvous-of"] == "mnist"
    # The Service (this attempt's pods) publishes it; the NetworkPolicy (the job's pods) admits its peers.
    assert builders.build_service(job, 3)["spec"]["selector"].items() <= meta["labels"].items()
    policy = builders.build_network_policy(job, ())
    assert (
        policy is not None and policy["spec"]["podSelector"]["matchLabels"].items() <= meta["labels"].items()
    )
    assert (spec["hostname"], spec["subdomain"]) == ("mnist-rdzv", "mnist")
    assert spec["securityContext"] == {
        "runAsUser": 1000,
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["nodeSelector"] == {"pool": "train"} and "affinity" not in spec, "placed as no rank is"
    assert spec["automountServiceAccountToken"] is False and spec["restartPolicy"] == "Never"
    [container] = spec["containers"]
    assert (container["image"], container["imagePullPolicy"]) == ("team/trainer:1", "Never")
    assert container["command"][:2] == ["python3", "-c"] and container["command"][-1] == "29500"
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
