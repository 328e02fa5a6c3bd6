"""The real node's pure builders: image names, the network, iptables and mount cleanup, configs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from ddp_harness import node_manifests as nm
from ddp_harness import tcp_relay

pytestmark = pytest.mark.unit

LAYOUT = nm.NodeLayout(Path("/state"), Path("/cache/images"), Path("/run/ddp-test"))
PORTS = nm.NodePorts(
    kubelet=10250,
    kubelet_healthz=10248,
    kube_proxy_healthz=10256,
    kube_proxy_metrics=10249,
    coredns=1053,
    coredns_health=8080,
    coredns_ready=8181,
)


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        pytest.param("ddp-trainer:0.1.0", "docker.io/library/ddp-trainer:0.1.0", id="bare-name"),
        pytest.param("team/trainer:1", "docker.io/team/trainer:1", id="docker-hub-user"),
        pytest.param("registry.local/ddp/op:2", "registry.local/ddp/op:2", id="registry-with-dot"),
        pytest.param("localhost:5000/op:3", "localhost:5000/op:3", id="registry-with-port"),
        pytest.param("localhost/op:3", "localhost/op:3", id="localhost-registry"),
        pytest.param("ddp-trainer", "docker.io/library/ddp-trainer:latest", id="untagged"),
    ],
)
def test_normalized_image_ref(ref: str, expected: str) -> None:
    assert nm.normalized_image_ref(ref) == expected


# `ctr images ls` as the node's containerd printed it: the CRI plugin's `sha256:<image id>` alias of
# each managed image points at the same manifest digest as the image's name.
_CTR_LISTING = """REF TYPE DIGEST SIZE PLATFORMS LABELS
docker.io/library/ddp-trainer:0.1.0 application/vnd.docker.distribution.manifest.v2+json sha256:e37f 4.5 GiB linux/amd64 io.cri-containerd.image=managed
docker.io/library/ddp-trainer:keep application/vnd.docker.distribution.manifest.v2+json sha256:e37f 4.5 GiB linux/amd64 io.cri-containerd.image=managed
docker.io/library/ddp-pause:ddp-1 application/vnd.docker.distribution.manifest.v2+json sha256:556f 1.4 MiB linux/amd64 io.cri-containerd.image=managed
sha256:5681 application/vnd.docker.distribution.manifest.v2+json sha256:e37f 4.5 GiB linux/amd64 io.cri-containerd.image=managed
sha256:a15f application/vnd.docker.distribution.manifest.v2+json sha256:556f 1.4 MiB linux/amd64 io.cri-containerd.image=managed
"""


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param(
            "docker.io/library/ddp-trainer:0.1.0",
            ["docker.io/library/ddp-trainer:0.1.0", "sha256:5681"],
            id="name-and-its-cri-alias-not-another-tag",
        ),
        pytest.param(
            "docker.io/library/ddp-pause:ddp-1",
            ["docker.io/library/ddp-pause:ddp-1", "sha256:a15f"],
            id="pause",
        ),
        pytest.param("docker.io/library/absent:1", [], id="not-stored"),
    ],
)
def test_image_refs_to_remove(name: str, expected: list[str]) -> None:
    assert nm.image_refs_to_remove(_CTR_LISTING, name) == expected


@pytest.mark.parametrize(
    ("cidr", "gateway", "gateway_cidr"),
    [
        pytest.param("10.85.0.0/24", "10.85.0.1", "10.85.0.1/24", id="default"),
        pytest.param("192.168.77.0/26", "192.168.77.1", "192.168.77.1/26", id="small-private"),
    ],
)
def test_network_gateway(cidr: str, gateway: str, gateway_cidr: str) -> None:
    network = nm.NodeNetwork(pod_cidr=cidr)
    assert (network.gateway, network.gateway_cidr) == (gateway, gateway_cidr)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"pod_cidr": "8.8.8.0/24"}, "private", id="public-cidr"),
        pytest.param({"pod_cidr": "10.85.0.0/30"}, "too small", id="tiny-cidr"),
        pytest.param({"pod_cidr": "10.85.0.1/24"}, "host bits", id="host-bits-set"),
        pytest.param({"bridge": "a-very-long-bridge-name"}, "interface name", id="long-bridge"),
    ],
)
def test_network_refuses(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        nm.NodeNetwork(**kwargs)


def test_containerd_config_names_our_socket_pause_image_and_cni() -> None:
    text = nm.containerd_config(LAYOUT, nm.NodeNetwork(), Path("/usr/lib/cni"))
    assert 'address = "/run/ddp-test/containerd.sock"' in text
    assert 'sandbox_image = "docker.io/library/ddp-pause:ddp-1"' in text
    assert "restrict_oom_score_adj = true" in text
    assert "SystemdCgroup = false" in text
    assert 'conf_dir = "/state/node/cni/net.d"' in text
    assert 'root = "/cache/images"' in text


def test_cni_bridge_uses_the_pod_cidr_and_gateway() -> None:
    network = nm.NodeNetwork(bridge="br-test", pod_cidr="10.86.0.0/24")
    bridge = nm.cni_conflist(network, LAYOUT)["plugins"][0]
    assert bridge["bridge"] == "br-test"
    assert bridge["ipam"]["ranges"] == [[{"subnet": "10.86.0.0/24", "gateway": "10.86.0.1"}]]
    assert bridge["ipam"]["dataDir"] == "/state/node/cni/ipam"


def test_kubelet_config_binds_the_bridge_and_tolerates_this_machine() -> None:
    config = nm.kubelet_config(LAYOUT, nm.NodeNetwork(), PORTS, Path("/pki/ca.crt"))
    assert config["address"] == "10.85.0.1"
    assert config["healthzBindAddress"] == "127.0.0.1"
    assert (config["cgroupDriver"], config["failCgroupV1"], config["failSwapOn"]) == (
        "cgroupfs",
        False,
        False,
    )
    assert config["authentication"]["x509"]["clientCAFile"] == "/pki/ca.crt"
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["containerRuntimeEndpoint"] == "unix:///run/ddp-test/containerd.sock"
    assert config["clusterDNS"] == ["10.96.0.10"]


def test_kube_proxy_never_opens_node_ports_outside_the_bridge() -> None:
    config = nm.kube_proxy_config(LAYOUT, nm.NodeNetwork(), PORTS, "node-a")
    assert config["mode"] == "iptables"
    assert config["nodePortAddresses"] == ["10.85.0.1/32"]
    assert config["iptables"]["localhostNodePorts"] is False
    assert config["hostnameOverride"] == "node-a"


@pytest.mark.parametrize(
    ("resolv", "expected"),
    [
        pytest.param("nameserver 10.0.0.2\nsearch corp.example\n", ["10.0.0.2"], id="keeps-servers"),
        pytest.param("nameserver 127.0.0.53\nnameserver 1.1.1.1\n", ["1.1.1.1"], id="drops-loopback"),
        pytest.param("# nothing\nnameserver not-an-ip\n", [], id="ignores-junk"),
    ],
)
def test_upstream_nameservers(resolv: str, expected: list[str]) -> None:
    assert nm.upstream_nameservers(resolv) == expected


def test_corefile_serves_the_cluster_domain_on_the_bridge() -> None:
    text = nm.corefile(nm.NodeNetwork(), PORTS, Path("/state/node/coredns.kubeconfig"), ["10.0.0.2"])
    assert text.startswith(".:1053 {")
    assert "bind 10.85.0.1" in text
    assert "kubernetes cluster.local in-addr.arpa ip6.arpa {" in text
    assert "kubeconfig /state/node/coredns.kubeconfig" in text
    assert "forward . 10.0.0.2" in text
    assert "forward" not in nm.corefile(nm.NodeNetwork(), PORTS, Path("/k"), [])


def test_api_objects_point_services_at_the_bridge() -> None:
    objects = nm.api_objects(nm.NodeNetwork(), 6443, 1053, [Path("/v/pv-0"), Path("/v/pv-1")])
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in objects:
        by_kind.setdefault(str(obj["kind"]), []).append(obj)
    slices = {s["metadata"]["name"]: s for s in by_kind["EndpointSlice"]}
    kubernetes = slices["kubernetes-real-node"]
    assert kubernetes["metadata"]["labels"]["kubernetes.io/service-name"] == "kubernetes"
    assert kubernetes["endpoints"] == [{"addresses": ["10.85.0.1"], "conditions": {"ready": True}}]
    assert kubernetes["ports"] == [{"name": "https", "port": 6443, "protocol": "TCP"}]
    dns_service = by_kind["Service"][0]
    assert dns_service["spec"]["clusterIP"] == "10.96.0.10"
    assert [p["port"] for p in slices["kube-dns-real-node"]["ports"]] == [1053, 1053]
    volumes = by_kind["PersistentVolume"]
    assert [v["spec"]["hostPath"]["path"] for v in volumes] == ["/v/pv-0", "/v/pv-1"]
    assert all(v["spec"]["storageClassName"] == nm.STORAGE_CLASS for v in volumes)


SAVE_BEFORE = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:DOCKER-USER - [0:0]
:KUBE-OLD - [0:0]
-A FORWARD -j DOCKER-USER
-A DOCKER-USER -j RETURN
COMMIT
"""

SAVE_AFTER = """*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:DOCKER-USER - [0:0]
:KUBE-OLD - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -j DOCKER-USER
-A FORWARD -j KUBE-OLD
-A DOCKER-USER -d 10.85.0.0/24 -m comment --comment ddp-real-node -j ACCEPT
-A DOCKER-USER -j RETURN
-A KUBE-FORWARD -m mark --mark 0x4000/0x4000 -j ACCEPT
COMMIT
"""


def test_iptables_cleanup_removes_only_what_the_node_added() -> None:
    before = nm.iptables_chains(SAVE_BEFORE)
    commands = nm.iptables_cleanup("filter", SAVE_AFTER, before)
    assert commands == [
        [
            "-t", "filter", "-D", "INPUT", "-m", "conntrack", "--ctstate", "NEW", "-m", "comment",
            "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES",
        ],
        ["-t", "filter", "-D", "FORWARD", "-m", "comment", "--comment", "kubernetes forwarding rules",
         "-j", "KUBE-FORWARD"],
        ["-t", "filter", "-D", "DOCKER-USER", "-d", "10.85.0.0/24", "-m", "comment", "--comment",
         "ddp-real-node", "-j", "ACCEPT"],
        ["-t", "filter", "-F", "KUBE-FORWARD"],
        ["-t", "filter", "-F", "KUBE-SERVICES"],
        ["-t", "filter", "-X", "KUBE-FORWARD"],
        ["-t", "filter", "-X", "KUBE-SERVICES"],
    ]  # fmt: skip


def test_iptables_cleanup_with_nothing_added_is_empty() -> None:
    assert nm.iptables_cleanup("filter", SAVE_BEFORE, nm.iptables_chains(SAVE_BEFORE)) == []


MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
90 22 0:50 / /state/node/kubelet/pods/a/volumes/kubernetes.io~empty-dir/dshm rw - tmpfs tmpfs rw
91 22 0:51 / /state/node/kubelet/pods/a/volumes/kubernetes.io~projected/kube-api-access rw - tmpfs tmpfs rw
92 22 0:52 / /run/ddp-test/state/io.containerd.runtime.v2.task/k8s.io/abc/rootfs rw - overlay overlay rw
93 22 0:53 / /state/node-other rw - tmpfs tmpfs rw
94 22 0:54 / /run/ddp-test rw - tmpfs tmpfs rw
"""


def test_mounts_under_lists_deepest_first_and_only_ours() -> None:
    assert nm.mounts_under(MOUNTINFO, LAYOUT.owned_dirs) == [
        "/state/node/kubelet/pods/a/volumes/kubernetes.io~empty-dir/dshm",
        "/state/node/kubelet/pods/a/volumes/kubernetes.io~projected/kube-api-access",
        "/run/ddp-test/state/io.containerd.runtime.v2.task/k8s.io/abc/rootfs",
        "/run/ddp-test",
    ]


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        pytest.param("10.85.0.1:6443", True, id="ipv4"),
        pytest.param("localhost:1", True, id="name"),
        pytest.param("10.85.0.1", False, id="no-port"),
        pytest.param(":6443", False, id="no-host"),
        pytest.param("h:70000", False, id="port-out-of-range"),
    ],
)
def test_relay_parse_address(text: str, ok: bool) -> None:
    if ok:
        host, port = tcp_relay.parse_address(text)
        assert f"{host}:{port}" == text
    else:
        with pytest.raises(ValueError, match="HOST:PORT"):
            tcp_relay.parse_address(text)


def test_relay_copies_bytes_both_ways() -> None:
    async def scenario() -> bytes:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            data = await reader.read(-1)
            writer.write(b"echo:" + data)
            await writer.drain()
            writer.close()

        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        target = upstream.sockets[0].getsockname()[:2]
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        listen = probe.sockets[0].getsockname()[:2]
        probe.close()
        await probe.wait_closed()
        ready = asyncio.Event()
        relay = asyncio.create_task(tcp_relay.serve(listen, target, ready))
        await ready.wait()
        reader, writer = await asyncio.open_connection(*listen)
        writer.write(b"x" * 100_000)
        writer.write_eof()
        answer = await reader.read(-1)
        writer.close()
        relay.cancel()
        upstream.close()
        return answer

    answer = asyncio.run(scenario())
    assert answer == b"echo:" + b"x" * 100_000


def test_api_objects_are_json_serializable() -> None:
    json.dumps(nm.api_objects(nm.NodeNetwork(), 1, 2, []))


def test_node_state_survives_its_json_record() -> None:
    from ddp_harness.processes import ComponentState
    from ddp_harness.real_node import NodeState

    state = NodeState(
        name="ddp-node",
        bin_dir="/bin",
        image_store="/images",
        run_dir="/run/ddp-test",
        bridge="ddpbr0",
        pod_cidr="10.85.0.0/24",
        components=[ComponentState("kubelet", 42, 7, {"https": 10250}, "/logs/kubelet.log", ["kubelet"])],
        bridge_created=True,
        iptables_rules=[["-t", "filter", "DOCKER-USER", "-s", "10.85.0.0/24", "-j", "ACCEPT"]],
        chains_before={"filter": ["DOCKER-USER"]},
        netns_before=["cni-old"],
        sysctls_changed={"/proc/sys/net/ipv4/ip_forward": "0"},
    )
    assert NodeState.from_json(state.to_json()) == state
