"""Pod logs on kwok's fake nodes, the pure parts: kwok's flags, the Logs objects, the CRI log records."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from ddp_harness import kwok_logs, manifests
from ddp_harness.manifests import KWOK_SERVING_CERT, Layout, Ports

pytestmark = pytest.mark.unit

PORTS = Ports(
    etcd_client=2379, etcd_peer=2380, apiserver=6443, controller_manager=10257, scheduler=10259, kwok=10247
)
LAYOUT = Layout(Path("/state"))


def test_kwok_serves_tls_on_the_port_the_nodes_advertise_and_watches_logs_objects() -> None:
    argv = manifests.kwok_command(Path("/bin-dir"), LAYOUT, PORTS)
    assert f"--server-address={manifests.LOCALHOST}:{PORTS.kwok}" in argv
    assert f"--node-port={PORTS.kwok}" in argv  # the node's daemonEndpoints, which the apiserver dials
    assert f"--node-ip={manifests.LOCALHOST}" in argv  # its InternalIP, the serving certificate's SAN
    assert f"--tls-cert-file={LAYOUT.cert(KWOK_SERVING_CERT)}" in argv
    assert f"--tls-private-key-file={LAYOUT.key(KWOK_SERVING_CERT)}" in argv
    assert f"--enable-crds={kwok_logs.LOGS_KIND}" in argv


def test_the_apiserver_verifies_kubelets_against_the_cluster_ca() -> None:
    argv = manifests.apiserver_command(Path("/bin-dir"), LAYOUT, PORTS)
    assert f"--kubelet-certificate-authority={LAYOUT.cert('ca')}" in argv
    assert "--kubelet-preferred-address-types=InternalIP,Hostname" in argv


def test_the_logs_crd_serves_kwoks_kind_and_fields() -> None:
    crd = kwok_logs.logs_crd()
    assert crd["metadata"]["name"] == f"{crd['spec']['names']['plural']}.{crd['spec']['group']}"
    [version] = crd["spec"]["versions"]
    assert f"{crd['spec']['group']}/{version['name']}" == "kwok.x-k8s.io/v1alpha1"
    assert crd["spec"]["names"]["kind"] == "Logs" and crd["spec"]["scope"] == "Namespaced"
    entry = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["logs"]["items"]
    assert set(entry["properties"]) == {"containers", "logsFile", "previousLogsFile", "follow"}
    json.dumps(crd)


def test_a_pods_logs_object_is_named_after_it_owned_by_it_and_names_its_file() -> None:
    log_file = kwok_logs.pod_log_file(LAYOUT.pod_logs_dir, "ns", "rank-0", "uid-1")
    assert log_file.is_relative_to(LAYOUT.pod_logs_dir) and "uid-1" in str(log_file)
    assert kwok_logs.pod_log_file(LAYOUT.pod_logs_dir, "ns", "rank-0", "uid-2") != log_file
    logs = kwok_logs.pod_logs("ns", "rank-0", "uid-1", log_file)
    assert (logs["metadata"]["namespace"], logs["metadata"]["name"]) == ("ns", "rank-0")
    [owner] = logs["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", "rank-0", "uid-1")
    [entry] = logs["spec"]["logs"]
    assert "containers" not in entry  # the default entry: every container of the pod
    assert kwok_logs.logs_target(logs) == ("uid-1", str(log_file))
    assert kwok_logs.logs_target({}) == (None, None)
    assert kwok_logs.logs_path("ns", "rank-0") == "/apis/kwok.x-k8s.io/v1alpha1/namespaces/ns/logs/rank-0"


@pytest.mark.parametrize(
    ("text", "read_back"),
    [
        pytest.param("a\nb\n", "a\nb\n", id="lines"),
        pytest.param("a\nb", "a\nb\n", id="final-newline-implied"),
        pytest.param("\n", "\n", id="one-empty-line"),
        pytest.param("", "", id="nothing"),
        pytest.param("x y  z\tw\r", "x y  z\tw\r\n", id="spaces-kept"),
    ],
)
def test_cri_records_read_back_as_the_text_printed(text: str, read_back: str) -> None:
    now = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    records = kwok_logs.cri_records(text, now)
    for record in records.splitlines():
        assert record.startswith("2026-01-02T03:04:05.678901Z stdout F ")
    assert kwok_logs.log_text(records) == read_back
    assert kwok_logs.log_text(records + kwok_logs.cri_records("more", now)) == read_back + "more\n"
