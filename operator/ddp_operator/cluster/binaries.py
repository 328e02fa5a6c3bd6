"""Where the control plane's binaries live, which versions they must be, and how to build them.

The pinned versions are in hack/k8s-versions.env; hack/build-k8s.sh builds them from the Go module
proxy into ~/.cache/ddp-operator/k8s-<kubernetes version>/bin and stamps each with its version."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-k8s.sh"
VERSIONS_FILE = REPO_ROOT / "hack" / "k8s-versions.env"

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
    if not VERSIONS_FILE.is_file():
        raise BinariesError(f"{VERSIONS_FILE} is missing: run from a checkout of the repository")
    versions = parse_versions(VERSIONS_FILE.read_text())
    for key in set(BINARY_VERSION_KEYS.values()):
        if key in environ:
            versions[key] = environ[key]
    return versions


def default_bin_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """$DDP_K8S_BIN_DIR, else the build script's output directory for the pinned Kubernetes version."""
    if environ.get("DDP_K8S_BIN_DIR"):
        return Path(environ["DDP_K8S_BIN_DIR"])
    cache = Path(environ.get("DDP_CACHE") or Path.home() / ".cache" / "ddp-operator")
    return cache / f"k8s-{pinned_versions(environ)['KUBERNETES_VERSION']}" / "bin"


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
    versions = pinned_versions() if VERSIONS_FILE.is_file() else {}
    stale = stale_binaries(bin_dir, versions)
    if not stale:
        return
    if not build:
        raise BinariesError(f"missing or outdated in {bin_dir}: {', '.join(stale)}; run {BUILD_SCRIPT}")
    if not BUILD_SCRIPT.is_file():
        raise BinariesError(
            f"missing in {bin_dir}: {', '.join(stale)}, and no build script at {BUILD_SCRIPT}"
        )
    env = dict(os.environ)
    env.setdefault("DDP_K8S_PREFIX", str(bin_dir.parent))
    # The script prints its own progress; a cold build takes tens of minutes on 2 cores.
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, check=False)
    if result.returncode != 0:
        raise BinariesError(f"{BUILD_SCRIPT} failed (exit {result.returncode}); its output above says why")
    still_stale = stale_binaries(bin_dir, versions)
    if still_stale:
        raise BinariesError(f"{BUILD_SCRIPT} succeeded but {bin_dir} still lacks {', '.join(still_stale)}")
