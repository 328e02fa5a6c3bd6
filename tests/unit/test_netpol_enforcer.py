"""The e2e tier's NetworkPolicy enforcer (kube-router's firewall): what it needs of the kernel, how it is
run, when it has started, what it may read, and what is cleaned up after it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddp_harness import netpol_enforcer

pytestmark = pytest.mark.unit

COMPLETE = "\n".join(
    ["CONFIG_MODULES=y"] + [f"CONFIG_{name}=y" for name, _ in netpol_enforcer.KERNEL_OPTIONS]
)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        pytest.param(None, None, id="unknown-config-is-tried"),
        pytest.param(COMPLETE, None, id="built-in"),
        pytest.param(COMPLETE.replace("CONFIG_IP_SET=y", "CONFIG_IP_SET=m"), None, id="module"),
        pytest.param(
            COMPLETE.replace("CONFIG_NETFILTER_XT_SET=y", "# CONFIG_NETFILTER_XT_SET is not set"),
            "CONFIG_NETFILTER_XT_SET (the `-m set` match) is not built",
            id="no-xt-set",
        ),
        pytest.param(
            COMPLETE.replace("CONFIG_MODULES=y", "# CONFIG_MODULES is not set").replace(
                "CONFIG_IP_SET=y", "CONFIG_IP_SET=m"
            ),
            "CONFIG_IP_SET (ipsets of each policy's peers) is a module, and this kernel loads none",
            id="module-without-loading",
        ),
    ],
)
def test_kernel_problem_names_what_is_missing(config: str | None, named: str | None) -> None:
    problem = netpol_enforcer.kernel_problem(config)
    if named is None:
        assert problem is None
    else:
        assert problem is not None and named in problem


BINARY = Path("/cache/kube-router")
KUBECONFIG = Path("/state/kube-router.kubeconfig")


@pytest.mark.parametrize(
    ("netns", "prefix"),
    [
        pytest.param(None, [str(BINARY)], id="this-namespace"),
        pytest.param(
            Path("/proc/42/ns/net"), ["nsenter", "--net=/proc/42/ns/net", "--", str(BINARY)], id="kind-node"
        ),
    ],
)
def test_only_the_firewall_runs_with_no_port_open(netns: Path | None, prefix: list[str]) -> None:
    argv = netpol_enforcer.command(
        BINARY, kubeconfig=KUBECONFIG, node_name="node-a", service_cidr="10.96.0.0/16", netns=netns
    )
    assert argv[: len(prefix)] == prefix
    flags = set(argv[len(prefix) :])
    assert {"--run-firewall=true", "--run-router=false", "--run-service-proxy=false"} <= flags
    assert {"--health-port=0", "--metrics-port=0"} <= flags
    assert {
        f"--kubeconfig={KUBECONFIG}",
        "--hostname-override=node-a",
        "--service-cluster-ip-range=10.96.0.0/16",
    } <= flags


JUMPED = """*filter
:FORWARD DROP [0:0]
:KUBE-ROUTER-FORWARD - [0:0]
-A FORWARD -m comment --comment "kube-router netpol - TEMCG2JMHZYE7H7T" -j KUBE-ROUTER-FORWARD
-A FORWARD -j DOCKER-USER
COMMIT
"""


@pytest.mark.parametrize(
    ("table", "started"),
    [
        pytest.param(JUMPED, True, id="jump-from-forward"),
        pytest.param(JUMPED.replace("-A FORWARD -m comment", "-A OTHER -m comment"), False, id="chain-only"),
        pytest.param("*filter\n:FORWARD ACCEPT [0:0]\nCOMMIT\n", False, id="nothing"),
    ],
)
def test_enforcing_once_forward_jumps_to_its_chain(table: str, started: bool) -> None:
    assert netpol_enforcer.enforcing(table) is started


def test_only_its_own_new_sets_are_destroyed() -> None:
    listing = "KUBE-DST-ABC\nKUBE-SRC-DEF\ninet6:KUBE-SRC-GHI\nTMP-XYZ\nKUBE-SRC-OLD\nother-set\n\n"
    names = netpol_enforcer.ipset_names(listing)
    assert netpol_enforcer.sets_to_destroy(names, before=["KUBE-SRC-OLD"]) == [
        "KUBE-DST-ABC",
        "KUBE-SRC-DEF",
        "TMP-XYZ",
        "inet6:KUBE-SRC-GHI",
    ]


@pytest.mark.parametrize(
    "objects",
    [
        pytest.param(netpol_enforcer.rbac_objects(netpol_enforcer.user_subject()), id="real-node-user"),
        pytest.param(netpol_enforcer.service_account_objects(), id="kind-service-account"),
    ],
)
def test_it_may_only_read(objects: list[dict[str, Any]]) -> None:
    by_kind = {obj["kind"]: obj for obj in objects}
    role, binding = by_kind["ClusterRole"], by_kind["ClusterRoleBinding"]
    verbs = {verb for rule in role["rules"] for verb in rule["verbs"]}
    assert verbs == {"get", "list", "watch"}
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"pods", "namespaces", "networkpolicies", "nodes"} <= resources
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (subject,) = binding["subjects"]
    if "ServiceAccount" in by_kind:
        assert subject == {"kind": "ServiceAccount", "name": "kube-router", "namespace": "kube-system"}
    else:
        assert subject["name"] == netpol_enforcer.USER


def test_token_kubeconfig_points_at_the_server_with_its_ca() -> None:
    config = netpol_enforcer.token_kubeconfig("https://127.0.0.1:6443", "Q0E=", "t0ken")
    (cluster,) = config["clusters"]
    assert cluster["cluster"] == {"server": "https://127.0.0.1:6443", "certificate-authority-data": "Q0E="}
    (user,) = config["users"]
    assert user["user"] == {"token": "t0ken"}
    assert config["current-context"] == config["contexts"][0]["name"]
