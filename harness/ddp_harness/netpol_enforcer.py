"""The e2e tier's NetworkPolicy enforcer: kube-router's network-policy controller, and nothing else of it.

A plain CNI (the real node's bridge, kind's ptp) enforces nothing: a NetworkPolicy is only an object
until an enforcer runs. kube-router's firewall (`--run-firewall`; its BGP router and IPVS service proxy
stay off) watches pods, namespaces and NetworkPolicies and programs the filter table: a jump from
INPUT, FORWARD and OUTPUT to its own chains, one chain per local pod that some policy selects, one per
policy, with ipsets of the allowed peers, and a REJECT for what no policy admits. It runs as a process
on the host, in the node's network namespace: this host's on the real node, a kind node container's
on kind (`nsenter --net`), with the host's `iptables` (nf_tables backend, like kube-proxy's) and
`ipset`. Test-only: never in the chart or an image (docs/security.md).

hack/build-kube-router.sh builds the binary from the Go module proxy at the version pinned in
hack/k8s-versions.env. Health and metrics ports are off: v2.1.0 binds its health port on every
interface with no flag to narrow it, and whether it enforces is checked by a deny-all probe instead
(tests/e2e/test_real_node.py)."""

from __future__ import annotations

import gzip
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

from ddp_harness.binaries import pinned_versions
from ddp_harness.hack import HackDirError, hack_file
from ddp_harness.processes import ClusterError, ComponentState, cache_dir, spawn, stop_components, wait_for

NAME: Final = "kube-router"
BUILD_SCRIPT: Final = "build-kube-router.sh"
# The real node's client certificate names this user; on kind it runs as a ServiceAccount.
USER: Final = "ddp:kube-router"
SERVICE_ACCOUNT_NAMESPACE: Final = "kube-system"
HOST_COMMANDS: Final = ("iptables", "iptables-save", "iptables-restore", "ipset", "nsenter")
# The chain its jump from FORWARD leads to; present once it has started enforcing.
FORWARD_CHAIN: Final = "KUBE-ROUTER-FORWARD"
# What its rules use of the kernel, and what for (pkg/controllers/netpol in v2.1.0).
KERNEL_OPTIONS: Final = (
    ("IP_SET", "ipsets of each policy's peers"),
    ("IP_SET_HASH_IP", "hash:ip sets (pod addresses)"),
    ("IP_SET_HASH_NET", "hash:net sets (ipBlock peers)"),
    ("NETFILTER_XT_SET", "the `-m set` match"),
    ("NETFILTER_XT_MATCH_PHYSDEV", "`-m physdev` (traffic bridged between pods of one node)"),
    ("NETFILTER_XT_MATCH_ADDRTYPE", "`-m addrtype` (the node's own traffic)"),
    ("NETFILTER_XT_MATCH_CONNTRACK", "`-m conntrack` (established connections)"),
    ("NETFILTER_XT_MATCH_COMMENT", "`-m comment`"),
    ("NETFILTER_XT_MATCH_MARK", "`-m mark`"),
    ("NETFILTER_XT_TARGET_MARK", "`-j MARK`"),
    ("NETFILTER_XT_TARGET_NFLOG", "`-j NFLOG` (dropped packets)"),
    ("IP_NF_TARGET_REJECT", "`-j REJECT`"),
)


class EnforcerError(ClusterError):
    pass


def version() -> str:
    return pinned_versions()["KUBE_ROUTER_VERSION"]


def binary_path() -> Path:
    return cache_dir() / f"kube-router-{version()}" / "bin" / "kube-router"


def ensure_binary(*, build: bool) -> Path:
    """The binary at the pinned version, built by the hack script when missing and `build` allows it."""
    binary = binary_path()
    stamp = binary.parent / ".version"
    if os.access(binary, os.X_OK) and stamp.is_file() and stamp.read_text().strip() == version():
        return binary
    try:
        script = hack_file(BUILD_SCRIPT)
    except HackDirError as exc:
        raise EnforcerError(f"{binary} is missing and hack/{BUILD_SCRIPT} cannot be found: {exc}") from None
    if not build:
        raise EnforcerError(f"{binary} is missing: run {script}")
    if subprocess.run(["bash", str(script)], check=False).returncode != 0 or not binary.is_file():
        raise EnforcerError(f"{script} failed; its output above says why")
    return binary


# ---- what the host must have ------------------------------------------------------------------------


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
    """What kube-router's rules need that a kernel built with `config` lacks; None when nothing is
    missing. An unknown configuration is not a problem: the deny-all probe then finds out."""
    if config is None:
        return None
    modules = _option(config, "MODULES") == "y"
    missing = []
    for name, what in KERNEL_OPTIONS:
        value = _option(config, name)
        if value == "y" or (value == "m" and modules):
            continue
        state = "a module, and this kernel loads none" if value == "m" else "not built"
        missing.append(f"CONFIG_{name} ({what}) is {state}")
    if not missing:
        return None
    return f"the running kernel {platform.release()} lacks what kube-router's rules use: " + "; ".join(
        missing
    )


def missing_prerequisites() -> list[str]:
    """What this host lacks to run the enforcer, each with how to get it."""
    problems = [
        f"`{command}` on PATH: hack/{BUILD_SCRIPT} installs Debian's iptables and ipset"
        for command in HOST_COMMANDS
        if shutil.which(command) is None
    ]
    kernel = kernel_problem(read_kernel_config())
    if kernel:
        problems.append(kernel)
    return problems


# ---- what it runs as --------------------------------------------------------------------------------


def rbac_objects(subject: dict[str, str]) -> list[dict[str, Any]]:
    """Read-only access to what its informers list and watch (v2.1.0 starts informers for services,
    endpoints and EndpointSlices too, even with only the firewall on) and the node it runs for."""
    meta = {"name": USER, "labels": {"app.kubernetes.io/name": NAME}}
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": meta,
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods", "namespaces", "nodes", "services", "endpoints"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                },
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
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": USER},
            "subjects": [subject],
        },
    ]


def user_subject() -> dict[str, str]:
    return {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}


def service_account_objects() -> list[dict[str, Any]]:
    """A ServiceAccount and its RBAC, for a cluster whose client certificates we cannot sign (kind)."""
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": NAME, "namespace": SERVICE_ACCOUNT_NAMESPACE},
    }
    subject = {"kind": "ServiceAccount", "name": NAME, "namespace": SERVICE_ACCOUNT_NAMESPACE}
    return [account, *rbac_objects(subject)]


def token_kubeconfig(server: str, ca_data: str, token: str) -> dict[str, Any]:
    """A kubeconfig with a bearer token; ca_data is base64 PEM, as kubeconfigs carry it."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "cluster", "cluster": {"server": server, "certificate-authority-data": ca_data}}
        ],
        "users": [{"name": NAME, "user": {"token": token}}],
        "contexts": [{"name": NAME, "context": {"cluster": "cluster", "user": NAME}}],
        "current-context": NAME,
    }


def in_netns(netns: Path | None, command: Sequence[str]) -> list[str]:
    """`command` run in the network namespace at `netns` (/proc/<pid>/ns/net); as is when None."""
    return list(command) if netns is None else ["nsenter", f"--net={netns}", "--", *command]


def command(
    binary: Path, *, kubeconfig: Path, node_name: str, service_cidr: str, netns: Path | None = None
) -> list[str]:
    """The firewall alone, for `node_name`'s pods, in `netns` (None: this host's namespace).

    `--service-cluster-ip-range` is required even so: it exempts Service VIPs from egress policies.
    Health and metrics ports are off (module docstring)."""
    return in_netns(
        netns,
        [
            str(binary),
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            "--run-loadbalancer=false",
            f"--kubeconfig={kubeconfig}",
            f"--hostname-override={node_name}",
            f"--service-cluster-ip-range={service_cidr}",
            "--enable-ipv4=true",
            "--enable-ipv6=false",
            "--health-port=0",
            "--metrics-port=0",
            "--v=1",
        ],
    )


def iptables_save_command(netns: Path | None) -> list[str]:
    return in_netns(netns, ["iptables-save", "-t", "filter"])


def enforcing(filter_table: str) -> bool:
    """Whether `iptables-save -t filter` shows FORWARD jumping to kube-router's chain: it programs that
    jump when its controller starts, before the first sync of the policies."""
    return any(
        line.startswith("-A FORWARD ") and line.rstrip().endswith(f"-j {FORWARD_CHAIN}")
        for line in filter_table.splitlines()
    )


def ipset_names(listing: str) -> list[str]:
    """The set names of `ipset list -n`."""
    return [line.strip() for line in listing.splitlines() if line.strip()]


def sets_to_destroy(names: Iterable[str], before: Iterable[str]) -> list[str]:
    """The sets kube-router made (its KUBE-SRC-/KUBE-DST- policy sets, `inet6:` for IPv6, TMP- while
    restoring) that did not exist before the node started; destroyed after the rules that use them."""
    existed = set(before)
    return sorted(
        n for n in names if n not in existed and n.removeprefix("inet6:").startswith(("KUBE-", "TMP-"))
    )


def start(
    binary: Path,
    *,
    kubeconfig: Path,
    node_name: str,
    service_cidr: str,
    netns: Path | None,
    log: Path,
    timeout_s: float = 60.0,
) -> ComponentState:
    """Spawn it (its output appended to `log`) and return once its chains are in the filter table of
    `netns`; stop it and raise EnforcerError, with its log's tail, when it exits or times out first.
    The real node starts it through its own record instead (real_node.py), so `down` stops it."""
    component = spawn(
        NAME,
        command(binary, kubeconfig=kubeconfig, node_name=node_name, service_cidr=service_cidr, netns=netns),
        log,
        {},
    )

    def chains() -> bool:
        saved = subprocess.run(iptables_save_command(netns), capture_output=True, text=True, check=False)
        return saved.returncode == 0 and enforcing(saved.stdout)

    try:
        wait_for(
            f"kube-router's chains in the filter table (log: {log})",
            chains,
            time.monotonic() + timeout_s,
            [component],
            error=EnforcerError,
        )
    except BaseException:
        stop_components([component])
        raise
    return component
