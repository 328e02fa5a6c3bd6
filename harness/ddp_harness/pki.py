"""Certificates for the local control plane, made with the `openssl` command (no Python crypto needed).

One CA signs a serving certificate for the apiserver and one for kwok's kubelet-like server (pod logs,
kwok_logs.py), and one client certificate per component, so the audit log names who wrote what (the
admin is `ddp-admin`, kwok is `kwok-controller`, ...)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from ddp_harness.manifests import KWOK_SERVING_CERT, Layout
from ddp_harness.processes import LOCALHOST, StateLayout

_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_VALID_DAYS = "3650"
SYSTEM_MASTERS = "system:masters"


@dataclass(frozen=True)
class ClientIdentity:
    """A client certificate: `name` is the file stem, `user` the Kubernetes user, `group` its group."""

    name: str
    user: str
    group: str = SYSTEM_MASTERS


# The admin and every component: all in system:masters (the controller-manager runs without per-controller
# service-account credentials), each under its own user name.
CLIENT_IDENTITIES = (
    ClientIdentity("admin", "ddp-admin"),
    ClientIdentity("kube-controller-manager", "system:kube-controller-manager"),
    ClientIdentity("kube-scheduler", "system:kube-scheduler"),
    ClientIdentity("kwok", "kwok-controller"),
    ClientIdentity("apiserver-kubelet-client", "kube-apiserver-kubelet-client"),
    # Not a Kubernetes user: the apiserver's identity towards aggregated APIs (no group needed).
    ClientIdentity("front-proxy-client", "front-proxy-client", group=""),
)

APISERVER_SANS = (
    f"IP:{LOCALHOST}",
    "IP:10.96.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


class PkiError(RuntimeError):
    pass


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise PkiError("the `openssl` command is needed to make the cluster's certificates: install openssl")
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def sign_leaf(
    layout: StateLayout,
    ca: StateLayout,
    name: str,
    subject: str,
    usages: str,
    sans: Sequence[str] = (),
) -> None:
    """A key and a certificate, layout.key(name) and layout.cert(name), signed by ca's "ca" pair;
    usages is the extendedKeyUsage (serverAuth, clientAuth)."""
    extensions = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usages}",
    ]
    if sans:
        extensions.append("subjectAltName=" + ",".join(sans))
    addext = [arg for ext in extensions for arg in ("-addext", ext)]
    _openssl(
        "req", "-x509", *_EC_KEY,
        "-keyout", str(layout.key(name)), "-out", str(layout.cert(name)),
        "-subj", subject, "-days", _VALID_DAYS,
        "-CA", str(ca.cert("ca")), "-CAkey", str(ca.key("ca")),
        *addext,
    )  # fmt: skip
    layout.key(name).chmod(0o600)


def generate_pki(layout: Layout) -> None:
    """Write the CA, the apiserver's serving certificate, the client certificates and the
    service-account signing key pair under layout.pki_dir."""
    layout.pki_dir.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", *_EC_KEY,
        "-keyout", str(layout.key("ca")), "-out", str(layout.cert("ca")),
        "-subj", "/CN=ddp-local-ca", "-days", _VALID_DAYS,
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )  # fmt: skip
    sign_leaf(layout, layout, "apiserver", "/CN=kube-apiserver", "serverAuth", APISERVER_SANS)
    # kwok's kubelet-like server, which the apiserver dials at the fake nodes' InternalIP for pod logs.
    sign_leaf(layout, layout, KWOK_SERVING_CERT, "/CN=kwok", "serverAuth", (f"IP:{LOCALHOST}",))
    for identity in CLIENT_IDENTITIES:
        organization = f"/O={identity.group}" if identity.group else ""
        sign_leaf(layout, layout, identity.name, f"{organization}/CN={identity.user}", "clientAuth")
    _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(layout.key("sa"))
    )
    _openssl("pkey", "-in", str(layout.key("sa")), "-pubout", "-out", str(layout.sa_public_key))
    for key in layout.pki_dir.glob("*.key"):
        key.chmod(0o600)
