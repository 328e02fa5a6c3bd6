"""A NetworkPolicy enforcer for the real node: sigs.k8s.io/kube-network-policies, the one kind ships.

The local control plane's real node (real_node.py) has a plain CNI bridge, which enforces nothing: a
NetworkPolicy is only an object there until an enforcer runs. kube-network-policies is a DaemonSet pod
(host network, privileged) that adds an nftables table whose postrouting chain sends the first packet
of each connection to or from a pod selected by some policy to an nfqueue, and judges it in user space
against the policies it watches. hack/build-kube-network-policies.sh builds it from the Go module proxy;
`ensure_image` wraps the static binary in an image of its own (no registry), which the real node loads
like any other image.

What it needs of the kernel: nf_tables with its `queue` expression (CONFIG_NFT_QUEUE) and nfnetlink
queue. `kernel_problem` says when the running kernel lacks them, which `enforcement_unavailable` turns
into the reason a test cannot prove enforcement here (docs/security.md shows what happens on such a
kernel: the binary starts, its rules are refused, and it enforces nothing)."""

from __future__ import annotations

import gzip
import io
import os
import platform
import subprocess
import tarfile
from pathlib import Path
from typing import Any, Final

from ddp_harness.hack import HackDirError, hack_file
from ddp_harness.processes import ClusterError, cache_dir

VERSION: Final = "v0.8.0"
BUILD_SCRIPT: Final = "build-kube-network-policies.sh"
IMAGE: Final = f"ddp-kube-network-policies:{VERSION}"
NAME: Final = "kube-network-policies"
NAMESPACE: Final = "kube-system"
# The nfqueue it judges packets on (upstream's install.yaml uses 98 too).
QUEUE_ID: Final = 98
LABELS: Final = {"app": NAME}


class EnforcerError(ClusterError):
    pass


def binary_path() -> Path:
    return cache_dir() / f"kube-network-policies-{VERSION}" / "bin" / "kube-network-policies"


def ensure_binary(*, build: bool) -> Path:
    """The enforcer's binary, built by the hack script when missing and `build` allows it."""
    binary = binary_path()
    if os.access(binary, os.X_OK):
        return binary
    try:
        script = hack_file(BUILD_SCRIPT)
    except HackDirError as exc:
        raise EnforcerError(f"{binary} is missing and hack/{BUILD_SCRIPT} cannot be found: {exc}") from None
    if not build:
        raise EnforcerError(f"{binary} is missing: run {script}")
    env = {**os.environ, "KUBE_NETWORK_POLICIES_VERSION": VERSION}
    if subprocess.run(["bash", str(script)], env=env, check=False).returncode != 0 or not binary.is_file():
        raise EnforcerError(f"{script} failed; its output above says why")
    return binary


# ---- the kernel -------------------------------------------------------------------------------------


def read_kernel_config() -> str | None:
    """The running kernel's build configuration (/proc/config.gz, else /boot/config-<release>)."""
    proc = Path("/proc/config.gz")
    if proc.is_file():
        try:
            return gzip.decompress(proc.read_bytes()).decode(errors="replace")
        except OSError:
            pass
    boot = Path("/boot") / f"config-{platform.release()}"
    return boot.read_text(errors="replace") if boot.is_file() else None


def _option(config: str, name: str) -> str | None:
    """'y', 'm', or None (not set) for CONFIG_<name>."""
    for line in config.splitlines():
        if line.startswith(f"CONFIG_{name}="):
            return line.split("=", 1)[1].strip()
    return None


def kernel_problem(config: str | None) -> str | None:
    """Why kube-network-policies cannot enforce on a kernel built with `config`; None when it can.

    An unknown configuration is not a problem: the test then finds out for itself.
    """
    if config is None:
        return None
    modules = _option(config, "MODULES") == "y"
    missing = []
    for name, what in (
        ("NF_TABLES", "nf_tables"),
        ("NF_TABLES_INET", "nf_tables' inet family"),
        ("NFT_QUEUE", "nf_tables' `queue` expression (nft_queue)"),
        ("NETFILTER_NETLINK_QUEUE", "nfnetlink_queue"),
        ("NFT_CT", "nf_tables' `ct` expression"),
    ):
        value = _option(config, name)
        if value == "y" or (value == "m" and modules):
            continue
        state = "a module, and this kernel loads none" if value == "m" else "not built"
        missing.append(f"CONFIG_{name} ({what}) is {state}")
    if not missing:
        return None
    return (
        f"kube-network-policies {VERSION} needs "
        + "; ".join(missing)
        + f" in the running kernel {platform.release()}: its nftables rules would be refused and no "
        "packet would ever reach its queue, so nothing would be enforced (docs/security.md)"
    )


def enforcement_unavailable() -> str | None:
    """Why a NetworkPolicy cannot be enforced on this machine's real node, or None."""
    return kernel_problem(read_kernel_config())


# ---- the image and the objects ----------------------------------------------------------------------


def ensure_image(binary: Path) -> None:
    """The enforcer's image in Docker: its static binary as the only file (like the pause image)."""
    if (
        subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, check=False).returncode
        == 0
    ):
        return
    payload = io.BytesIO()
    with tarfile.open(fileobj=payload, mode="w") as tar:
        tar.add(str(binary), arcname="kube-network-policies")
    result = subprocess.run(
        ["docker", "import", "--change", 'ENTRYPOINT ["/kube-network-policies"]', "-", IMAGE],
        input=payload.getvalue(),
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        raise EnforcerError(f"docker import of {IMAGE} failed: {result.stderr.decode(errors='replace')}")


def api_objects(image: str = IMAGE) -> list[dict[str, Any]]:
    """The ServiceAccount, its read-only RBAC and the DaemonSet, as upstream's install.yaml has them.

    NRI (the runtime telling it pod IPs before the apiserver knows them) is left out: our containerd
    does not serve it, and the enforcer falls back to the apiserver's pod IPs.
    """
    meta = {"name": NAME, "namespace": NAMESPACE, "labels": dict(LABELS)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME, "labels": dict(LABELS)},
            "rules": [
                {"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]},
                {
                    "apiGroups": ["networking.k8s.io"],
                    "resources": ["networkpolicies"],
                    "verbs": ["list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME, "labels": dict(LABELS)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NAME},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": meta,
            "spec": {
                "selector": {"matchLabels": dict(LABELS)},
                "template": {
                    "metadata": {"labels": dict(LABELS)},
                    "spec": {
                        "hostNetwork": True,
                        "serviceAccountName": NAME,
                        "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
                        "containers": [
                            {
                                "name": NAME,
                                "image": image,
                                "imagePullPolicy": "Never",
                                "args": [
                                    "--hostname-override=$(NODE_NAME)",
                                    f"--nfqueue-id={QUEUE_ID}",
                                    "--v=2",
                                ],
                                "env": [
                                    {
                                        "name": "NODE_NAME",
                                        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                                    }
                                ],
                                "securityContext": {
                                    "privileged": True,
                                    "capabilities": {"add": ["NET_ADMIN"]},
                                },
                                "resources": {"requests": {"cpu": "50m", "memory": "50Mi"}},
                            }
                        ],
                    },
                },
            },
        },
    ]
