"""Where the control plane's binaries live, which versions they must be, and how to build them.

The pinned versions are in hack/k8s-versions.env; hack/build-k8s.sh builds them from the Go module
proxy into ~/.cache/ddp-operator/k8s-<kubernetes version>/bin and stamps each with its version (hack.py
says how hack/ is found)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from ddp_harness.hack import HackDirError, hack_file
from ddp_harness.processes import cache_dir

BUILD_SCRIPT = "build-k8s.sh"
VERSIONS_FILE = "k8s-versions.env"

# binary -> the key of its version in k8s-versions.env
BINARY_VERSION_KEYS: dict[str, str] = {
    "etcd": "ETCD_VERSION",
    "kube-apiserver": "KUBERNETES_VERSION",
    "kube-controller-manager": "KUBERNETES_VERSION",
    "kube-scheduler": "KUBERNETES_VERSION",
    "kubectl": "KUBERNETES_VERSION",
    "kwok": "KWOK_VERSION",
    "helm": "HELM_VERSION",
}


class BinariesError(RuntimeError):
    pass


def parse_versions(text: str) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments are skipped."""
    versions: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        versions[key.strip()] = value.strip().strip("\"'")
    return versions


def pinned_versions(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The pinned versions, with the same environment overrides the build script honours."""
    try:
        versions_file = hack_file(VERSIONS_FILE, environ)
    except HackDirError as exc:
        raise BinariesError(str(exc)) from None
    versions = parse_versions(versions_file.read_text())
    for key in set(BINARY_VERSION_KEYS.values()):
        if key in environ:
            versions[key] = environ[key]
    return versions


def default_bin_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$DDP_K8S_BIN_DIR, else the build script's output directory for the pinned Kubernetes version."""
    if environ.get("DDP_K8S_BIN_DIR"):
        return Path(environ["DDP_K8S_BIN_DIR"])
    return cache_dir(environ) / f"k8s-{pinned_versions(environ)['KUBERNETES_VERSION']}" / "bin"


def stale_binaries(bin_dir: Path, versions: Mapping[str, str]) -> list[str]:
    """Binaries that are missing from bin_dir or were built at another version than pinned."""
    stale = []
    for name, key in BINARY_VERSION_KEYS.items():
        stamp = bin_dir / f".{name}.version"
        wanted = versions.get(key)
        built = stamp.read_text().strip() if stamp.is_file() else None
        if not os.access(bin_dir / name, os.X_OK) or (wanted is not None and built != wanted):
            stale.append(name)
    return stale


def ensure_binaries(bin_dir: Path, *, build: bool) -> None:
    """Make sure every binary is in bin_dir at its pinned version, building the missing ones when allowed."""
    try:
        build_script: Path | None = hack_file(BUILD_SCRIPT)
    except HackDirError:
        build_script = None  # binaries built elsewhere ($DDP_K8S_BIN_DIR) are taken as they are
    versions = pinned_versions() if build_script is not None else {}
    stale = stale_binaries(bin_dir, versions)
    if not stale:
        return
    if build_script is None or not build_script.is_file():
        raise BinariesError(
            f"missing in {bin_dir}: {', '.join(stale)}, and no hack/{BUILD_SCRIPT} to build them: "
            "run from a checkout or set $DDP_HACK_DIR"
        )
    if not build:
        raise BinariesError(f"missing or outdated in {bin_dir}: {', '.join(stale)}; run {build_script}")
    env = dict(os.environ)
    env.setdefault("DDP_K8S_PREFIX", str(bin_dir.parent))
    # The script prints its own progress; a cold build takes tens of minutes on 2 cores.
    result = subprocess.run(["bash", str(build_script)], env=env, check=False)
    if result.returncode != 0:
        raise BinariesError(f"{build_script} failed (exit {result.returncode}); its output above says why")
    still_stale = stale_binaries(bin_dir, versions)
    if still_stale:
        raise BinariesError(f"{build_script} succeeded but {bin_dir} still lacks {', '.join(still_stale)}")
