"""The NetworkPolicy enforcer of the real node: when the kernel can run it, and what is deployed."""

from __future__ import annotations

import pytest

from ddp_harness import netpol_enforcer

pytestmark = pytest.mark.unit

COMPLETE = "\n".join(
    [
        "CONFIG_MODULES=y",
        "CONFIG_NF_TABLES=y",
        "CONFIG_NF_TABLES_INET=y",
        "CONFIG_NFT_QUEUE=m",
        "CONFIG_NETFILTER_NETLINK_QUEUE=y",
        "CONFIG_NFT_CT=y",
    ]
)
# This machine's Firecracker kernel: no modules, no nft queue expression (the xt NFQUEUE target exists).
NO_NFT_QUEUE = "\n".join(
    [
        "# CONFIG_MODULES is not set",
        "CONFIG_NF_TABLES=y",
        "CONFIG_NF_TABLES_INET=y",
        "# CONFIG_NFT_QUEUE is not set",
        "CONFIG_NETFILTER_XT_TARGET_NFQUEUE=y",
        "CONFIG_NETFILTER_NETLINK_QUEUE=y",
        "CONFIG_NFT_CT=y",
    ]
)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        pytest.param(None, None, id="unknown-config-is-tried"),
        pytest.param(COMPLETE, None, id="modules"),
        pytest.param(COMPLETE.replace("CONFIG_NFT_QUEUE=m", "CONFIG_NFT_QUEUE=y"), None, id="built-in"),
        pytest.param(
            NO_NFT_QUEUE,
            "CONFIG_NFT_QUEUE (nf_tables' `queue` expression (nft_queue)) is not built",
            id="no-nft-queue",
        ),
        pytest.param(
            COMPLETE.replace("CONFIG_MODULES=y", "# CONFIG_MODULES is not set"),
            "CONFIG_NFT_QUEUE (nf_tables' `queue` expression (nft_queue)) is a module, and this kernel loads none",
            id="module-without-loading",
        ),
    ],
)
def test_kernel_problem_names_what_is_missing(config: str | None, named: str | None) -> None:
    problem = netpol_enforcer.kernel_problem(config)
    if named is None:
        assert problem is None
    else:
        assert problem is not None and named in problem and "nothing would be enforced" in problem


def test_the_enforcer_runs_on_the_host_network_with_read_only_rbac() -> None:
    objects = {obj["kind"]: obj for obj in netpol_enforcer.api_objects("img:1")}
    assert set(objects) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"}
    verbs = {verb for rule in objects["ClusterRole"]["rules"] for verb in rule["verbs"]}
    assert verbs == {"list", "watch"}
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["serviceAccountName"] == netpol_enforcer.NAME
    (container,) = pod["containers"]
    assert container["image"] == "img:1" and container["imagePullPolicy"] == "Never"
    assert f"--nfqueue-id={netpol_enforcer.QUEUE_ID}" in container["args"]
    assert container["securityContext"]["privileged"] is True
