"""Kueue (built from the Go module proxy by hack/build-kueue.sh) as a local process beside the local
control plane, with its `pod` integration on: what docs/scheduling.md calls "real Kueue" in tests.

How it reaches the apiserver and back (found in Kueue v0.17.0's source, cmd/kueue/main.go and
pkg/util/cert/cert.go):
- Kueue reads its Configuration (config.kueue.x-k8s.io/v1beta2) from `--config` and its credentials
  from KUBECONFIG; every listener is bound to 127.0.0.1 (webhook, health) or off (metrics).
- Its webhooks must be reachable from the apiserver, which runs on 127.0.0.1: the webhook
  configurations use `clientConfig.url: https://127.0.0.1:<port>/<path>` (the paths and rules come
  from Kueue's own config/components/webhook/manifests.yaml, copied at build time), and so do the
  conversion webhooks of the five CRDs that serve two versions (v1beta1, v1beta2).
- internalCertManagement stays on: with it off, Kueue insists on metrics certificates at the fixed
  path /etc/kueue/metrics/certs. Its rotator (open-policy-agent/cert-controller) keeps certificates
  it finds valid in the Secret `kueue-webhook-server-cert` (CA with the name `kueue-ca`, serving
  certificate valid for `kueue-webhook-service.kueue-system.svc`), so the harness makes them first,
  adding the SAN IP:127.0.0.1 the apiserver checks; it writes the same files into `webhook.certDir`
  (in a cluster that is the mounted Secret) and the rotator injects the CA into the two webhook
  configurations and the five CRDs by name, as in a real install.
- The pod webhooks and `managedJobsNamespaceSelector` are scoped to namespaces labelled
  MANAGED_NAMESPACE_LABEL, so other tests sharing the control plane never meet Kueue.

Pure functions render the Configuration, the webhook configurations and the CRD patch; start_kueue()
and KueueProcess do the impure rest. Kueue's objects hold finalizers: delete them (and namespaces
holding Kueue workloads) while Kueue still runs."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ddp_operator.local.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
LOCALHOST = "127.0.0.1"
NAMESPACE = "kueue-system"
WEBHOOK_SERVICE = "kueue-webhook-service"
WEBHOOK_SECRET = "kueue-webhook-server-cert"
CA_NAME = "kueue-ca"  # the rotator checks the CA certificate is valid for this name
MUTATING_WEBHOOKS = "kueue-mutating-webhook-configuration"
VALIDATING_WEBHOOKS = "kueue-validating-webhook-configuration"
# The CRDs whose conversion webhook Kueue's kustomization enables (and whose CA the rotator injects).
CONVERSION_CRDS = (
    "localqueues.kueue.x-k8s.io",
    "clusterqueues.kueue.x-k8s.io",
    "workloads.kueue.x-k8s.io",
    "cohorts.kueue.x-k8s.io",
    "multikueueclusters.kueue.x-k8s.io",
)
MANAGED_NAMESPACE_LABEL = "kueue-test.ddp.dev/managed"
# Webhooks for what the `pod` integration and Kueue's own API serve; the others (Jobs, JobSets, Ray, ...)
# are not registered by a kueue running only the pod integration, and a webhook whose path is not
# served fails every request it matches.
SERVED_API_GROUPS = frozenset({"", "kueue.x-k8s.io"})


def kueue_version() -> str:
    env = os.environ.get("KUEUE_VERSION")
    if env:
        return env
    for line in (REPO / "hack" / "k8s-versions.env").read_text().splitlines():
        if line.startswith("KUEUE_VERSION="):
            return line.split("=", 1)[1].strip()
    raise RuntimeError("hack/k8s-versions.env has no KUEUE_VERSION")


def kueue_prefix() -> Path:
    """Where hack/build-kueue.sh puts bin/kueue, crds/ and webhooks.yaml."""
    env = os.environ.get("DDP_KUEUE_PREFIX")
    if env:
        return Path(env)
    cache = Path(os.environ.get("DDP_CACHE") or Path.home() / ".cache" / "ddp-operator")
    return cache / f"kueue-{kueue_version()}"


def is_built(prefix: Path) -> bool:
    binary = prefix / "bin" / "kueue"
    stamp = prefix / "bin" / ".kueue.version"
    return (
        os.access(binary, os.X_OK)
        and stamp.is_file()
        and stamp.read_text().strip() == kueue_version()
        and (prefix / "webhooks.yaml").is_file()
        and any((prefix / "crds").glob("*.yaml"))
    )


# ---- pure: what Kueue and the apiserver are given --------------------------------------------------------


@dataclass(frozen=True)
class KueuePorts:
    webhook: int
    health: int


def managed_namespace_selector() -> dict[str, Any]:
    return {"matchLabels": {MANAGED_NAMESPACE_LABEL: "true"}}


def render_configuration(ports: KueuePorts, cert_dir: Path) -> dict[str, Any]:
    """Kueue's Configuration for a local process: only the pod integration, scoped to labelled
    namespaces, every listener on 127.0.0.1, no leader election, the visibility API server off."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"{LOCALHOST}:{ports.health}"},
        "metrics": {"bindAddress": "0"},  # "0" turns controller-runtime's metrics server off
        "webhook": {"host": LOCALHOST, "port": ports.webhook, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": WEBHOOK_SECRET,
        },
        "clientConnection": {"qps": 100, "burst": 200},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": managed_namespace_selector(),
        "integrations": {"frameworks": ["pod"]},
        # An aggregated API server of its own that binds 0.0.0.0:8082; nothing here uses it.
        "featureGates": {"VisibilityOnDemand": False},
    }


def _serves(webhook: Mapping[str, Any]) -> bool:
    return all(
        group in SERVED_API_GROUPS
        for rule in webhook.get("rules") or ()
        for group in rule.get("apiGroups") or ()
    )


def _is_pod_webhook(webhook: Mapping[str, Any]) -> bool:
    return any("pods" in (rule.get("resources") or ()) for rule in webhook.get("rules") or ())


def render_webhook_configurations(
    kueue_manifests: Iterable[Mapping[str, Any]], base_url: str, ca_pem: bytes
) -> list[dict[str, Any]]:
    """Kueue's Mutating/ValidatingWebhookConfigurations (its manifests.yaml, as kustomize would name
    them), reaching ``base_url`` instead of the in-cluster Service, for the API groups the pod
    integration serves; pod webhooks only in managed namespaces."""
    ca_bundle = base64.b64encode(ca_pem).decode()
    names = {
        "MutatingWebhookConfiguration": MUTATING_WEBHOOKS,
        "ValidatingWebhookConfiguration": VALIDATING_WEBHOOKS,
    }
    rendered = []
    for manifest in kueue_manifests:
        kind = manifest.get("kind")
        if kind not in names:
            continue
        webhooks = []
        for source in manifest.get("webhooks") or ():
            if not _serves(source):
                continue
            webhook = json.loads(json.dumps(source))
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"{base_url}{path}", "caBundle": ca_bundle}
            if _is_pod_webhook(webhook):
                webhook["namespaceSelector"] = managed_namespace_selector()
            webhooks.append(webhook)
        rendered.append(
            {
                "apiVersion": manifest["apiVersion"],
                "kind": kind,
                "metadata": {"name": names[kind]},
                "webhooks": webhooks,
            }
        )
    return rendered


def with_conversion_webhook(crd: Mapping[str, Any], base_url: str, ca_pem: bytes) -> dict[str, Any]:
    """A copy of one of Kueue's CRDs; those in CONVERSION_CRDS convert through Kueue's /convert."""
    patched: dict[str, Any] = json.loads(json.dumps(crd))
    if patched["metadata"]["name"] in CONVERSION_CRDS:
        patched["spec"]["conversion"] = {
            "strategy": "Webhook",
            "webhook": {
                "clientConfig": {"url": f"{base_url}/convert", "caBundle": base64.b64encode(ca_pem).decode()},
                "conversionReviewVersions": ["v1"],
            },
        }
    return patched


def kueue_command(binary: Path, config: Path) -> list[str]:
    return [str(binary), f"--config={config}", "--zap-log-level=2"]


# ---- impure: certificates, objects, the process ----------------------------------------------------------


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {result.stderr.strip()}")


_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "3650"]
_RSA = ["-newkey", "rsa:2048", "-nodes", "-days", "3650"]


def make_certificates(pki: Path, cluster_ca: tuple[Path, Path]) -> None:
    """Kueue's webhook CA and serving certificate, and a client certificate (CN kueue, system:masters)
    signed by the cluster's CA, under ``pki``."""
    pki.mkdir(parents=True, exist_ok=True)
    # The rotator parses the CA key from the Secret as PKCS#1 RSA ("RSA PRIVATE KEY") and nothing else.
    _openssl(
        "req", "-x509", *_RSA, "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
        "-subj", f"/O=kueue/CN={CA_NAME}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-addext", f"subjectAltName=DNS:{CA_NAME}",
    )  # fmt: skip
    _openssl("rsa", "-in", str(pki / "ca.key"), "-out", str(pki / "ca.key"), "-traditional")
    _openssl(
        "req", "-x509", *_EC, "-keyout", str(pki / "tls.key"), "-out", str(pki / "tls.crt"),
        "-subj", f"/CN={WEBHOOK_SERVICE}.{NAMESPACE}.svc",
        "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
        "-addext", "basicConstraints=critical,CA:FALSE",
        "-addext", "keyUsage=critical,digitalSignature,keyEncipherment",
        "-addext", "extendedKeyUsage=serverAuth",
        "-addext", f"subjectAltName=DNS:{WEBHOOK_SERVICE}.{NAMESPACE}.svc,IP:{LOCALHOST}",
    )  # fmt: skip
    _openssl(
        "req", "-x509", *_EC, "-keyout", str(pki / "client.key"), "-out", str(pki / "client.crt"),
        "-subj", "/O=system:masters/CN=kueue",
        "-CA", str(cluster_ca[0]), "-CAkey", str(cluster_ca[1]),
        "-addext", "basicConstraints=critical,CA:FALSE",
        "-addext", "keyUsage=critical,digitalSignature,keyEncipherment",
        "-addext", "extendedKeyUsage=clientAuth",
    )  # fmt: skip
    for key in pki.glob("*.key"):
        key.chmod(0o600)


def _kubeconfig(server: str, cluster_ca: Path, pki: Path) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(cluster_ca)}}
        ],
        "users": [
            {
                "name": "kueue",
                "user": {
                    "client-certificate": str(pki / "client.crt"),
                    "client-key": str(pki / "client.key"),
                },
            }
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "kueue"}}],
        "current-context": "local",
    }


def _free_port() -> int:
    return free_ports(1)[0]


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class KueueProcess:
    """A running kueue manager and the cluster-scoped objects installed for it."""

    def __init__(self, cluster: Any, proc: subprocess.Popen[bytes], log: Path, ports: KueuePorts) -> None:
        self.cluster = cluster
        self.proc = proc
        self.log = log
        self.ports = ports

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        result: subprocess.CompletedProcess[str] = self.cluster.kubectl_run(*args, input=stdin, check=check)
        return result

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log, lines)

    def stop(self, grace_s: float = 15.0) -> None:
        """Remove the webhook configurations (the rest of the cluster must not depend on a stopped
        Kueue), then end the process group."""
        for kind, name in (
            ("mutatingwebhookconfiguration", MUTATING_WEBHOOKS),
            ("validatingwebhookconfiguration", VALIDATING_WEBHOOKS),
        ):
            self.kubectl("delete", kind, name, "--ignore-not-found", check=False)
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(grace_s)


def _wait(
    what: str, check: Any, proc: subprocess.Popen[bytes] | None, log: Path | None, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"kueue exited ({proc.returncode}) while waiting for {what}:\n{_tail(log or Path())}"
            )
        if time.monotonic() > deadline:
            tail = f":\n{_tail(log)}" if log else ""
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}{tail}")
        time.sleep(0.3)


def _readyz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOCALHOST}:{port}/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _webhook_serves(port: int, ca: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection((LOCALHOST, port), timeout=2) as raw,
            context.wrap_socket(raw, server_hostname=LOCALHOST),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


def ensure_built() -> Path:
    """Kueue's build for the pinned version: built with hack/build-kueue.sh when missing (10+ minutes
    cold), or the test is skipped when no Go toolchain can build it."""
    import pytest

    prefix = kueue_prefix()
    if not is_built(prefix):
        if shutil.which("go") is None:
            pytest.skip(f"no Go toolchain to build Kueue, and {prefix} holds no build")
        print("[kueue] building with hack/build-kueue.sh (10+ min when cold)", file=sys.stderr, flush=True)
        subprocess.run([str(REPO / "hack" / "build-kueue.sh")], check=True, timeout=3600)
    return prefix


def start_kueue(
    cluster: Any, state_dir: Path, prefix: Path | None = None, timeout_s: float = 180.0
) -> KueueProcess:
    """Install Kueue's CRDs, certificates and webhooks on ``cluster`` (a LocalCluster) and start the
    manager; returns once its webhooks answer the apiserver."""
    prefix = prefix or kueue_prefix()
    state_dir.mkdir(parents=True, exist_ok=True)
    pki = state_dir / "pki"
    cert_dir = state_dir / "serving-certs"
    make_certificates(pki, (cluster.ca_cert, cluster.ca_key))
    cert_dir.mkdir(exist_ok=True)
    for name in ("tls.crt", "tls.key"):
        shutil.copy(pki / name, cert_dir / name)
    ca_pem = (pki / "ca.crt").read_bytes()
    ports = KueuePorts(webhook=_free_port(), health=_free_port())
    base_url = f"https://{LOCALHOST}:{ports.webhook}"

    def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        result: subprocess.CompletedProcess[str] = cluster.kubectl_run(*args, input=stdin, timeout=120)
        return result

    kubectl("create", "namespace", NAMESPACE)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE},
        "type": "Opaque",
        "data": {
            name: base64.b64encode((pki / name).read_bytes()).decode()
            for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")
        },
    }
    kubectl("apply", "-f", "-", stdin=json.dumps(secret))
    crds = [yaml.safe_load(path.read_text()) for path in sorted((prefix / "crds").glob("*.yaml"))]
    patched = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [with_conversion_webhook(c, base_url, ca_pem) for c in crds],
    }
    # Too large for client-side apply's last-applied annotation.
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=ddp-kueue-harness", "-f", "-",
            stdin=json.dumps(patched))  # fmt: skip
    cluster.wait_established(*(c["metadata"]["name"] for c in crds))
    manifests = list(yaml.safe_load_all((prefix / "webhooks.yaml").read_text()))
    webhooks = {
        "apiVersion": "v1",
        "kind": "List",
        "items": render_webhook_configurations(manifests, base_url, ca_pem),
    }
    kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=ddp-kueue-harness", "-f", "-",
            stdin=json.dumps(webhooks))  # fmt: skip

    config = state_dir / "config.yaml"
    config.write_text(yaml.safe_dump(render_configuration(ports, cert_dir)))
    kubeconfig = state_dir / "kubeconfig"
    kubeconfig.write_text(json.dumps(_kubeconfig(cluster.apiserver, cluster.ca_cert, pki)))
    kubeconfig.chmod(0o600)
    log = state_dir / "kueue.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            kueue_command(prefix / "bin" / "kueue", config),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=state_dir,
            env=env,
            start_new_session=True,
        )
    process = KueueProcess(cluster, proc, log, ports)
    try:
        _wait("kueue /readyz", lambda: _readyz(ports.health), proc, log, timeout_s)
        _wait(
            "kueue's webhook server",
            lambda: _webhook_serves(ports.webhook, pki / "ca.crt"),
            proc,
            log,
            timeout_s,
        )

        # The apiserver reaches the webhooks: a dry-run create goes through Kueue's ResourceFlavor webhooks.
        probe = {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ResourceFlavor",
            "metadata": {"name": "probe"},
        }

        def admitted() -> bool:
            result = cluster.kubectl_run(
                "create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False, timeout=30
            )
            return bool(result.returncode == 0)

        _wait("the apiserver to reach kueue's webhooks", admitted, proc, log, timeout_s)
    except BaseException:
        process.stop()
        raise
    return process
