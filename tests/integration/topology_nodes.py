"""Fake (kwok) nodes laid out in blocks and racks for the topology tests (docs/scheduling.md#topology).

A pool of its own per test: every node carries the pool label and a NoSchedule taint of the pool, so
the tests that share the control plane never land on it, and only a pod that selects and tolerates the
pool does. Kwok marks a node Ready a moment after its creation, as it does the harness's own nodes.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tests.integration.operator_harness import wait_for

from ddp_harness.manifests import NodeShape, fake_gpu_node

BLOCK_LABEL = "topology-test.ddp.dev/block"
RACK_LABEL = "topology-test.ddp.dev/rack"
HOST_LABEL = "kubernetes.io/hostname"
POOL_LABEL = "topology-test.ddp.dev/pool"
RANK_LABEL = "ddp.dev/rank"


@dataclass(frozen=True)
class Pool:
    """``blocks`` x ``racks_per_block`` x ``hosts_per_rack`` nodes of ``gpus`` nvidia.com/gpu each."""

    name: str
    nodes: dict[str, dict[str, str]]  # node name -> its labels

    def pod_spec(self) -> dict[str, Any]:
        """What a rank pod's template needs to land in the pool (and only there)."""
        return {
            "nodeSelector": {POOL_LABEL: self.name},
            "tolerations": [
                {"key": POOL_LABEL, "operator": "Equal", "value": self.name, "effect": "NoSchedule"}
            ],
        }

    def label_of(self, node: str, key: str) -> str:
        return self.nodes[node][key]

    def placed(self, pods: list[dict[str, Any]], key: str) -> dict[int, str]:
        """The ``key`` label's value on the node of each rank's newest bound pod (one being deleted is
        not counted)."""
        found: dict[int, str] = {}
        for pod in sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"]):
            node = pod["spec"].get("nodeName")
            if node and not pod["metadata"].get("deletionTimestamp"):
                found[int(pod["metadata"]["labels"][RANK_LABEL])] = self.label_of(node, key)
        return found


@contextlib.contextmanager
def node_pool(
    cluster: Any, *, blocks: int = 2, racks_per_block: int = 2, hosts_per_rack: int = 2, gpus: int = 2
) -> Iterator[Pool]:
    """Create the pool's nodes, wait until each is Ready, and delete them afterwards."""
    name = f"topo-{uuid.uuid4().hex[:6]}"
    nodes: dict[str, dict[str, str]] = {}
    manifests = []
    for block in range(blocks):
        for rack in range(racks_per_block):
            for host in range(hosts_per_rack):
                node = f"{name}-b{block}-r{rack}-h{host}"
                manifest = fake_gpu_node(node, NodeShape(gpus=gpus))
                labels = {
                    BLOCK_LABEL: f"b{block}",
                    RACK_LABEL: f"b{block}-r{rack}",
                    POOL_LABEL: name,
                }
                manifest["metadata"]["labels"].update(labels)
                manifest["spec"] = {"taints": [{"key": POOL_LABEL, "value": name, "effect": "NoSchedule"}]}
                nodes[node] = dict(manifest["metadata"]["labels"])
                manifests.append(manifest)
    cluster.kubectl_run("create", "-f", "-", input=_as_list(manifests))

    def all_ready() -> bool:
        items = cluster.get_json("nodes", "-l", f"{POOL_LABEL}={name}")["items"]
        ready = [
            n
            for n in items
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n.get("status", {}).get("conditions") or []
            )
        ]
        return len(ready) == len(nodes)

    try:
        wait_for(f"the {len(nodes)} nodes of pool {name} Ready", all_ready, timeout=60)
        yield Pool(name, nodes)
    finally:
        cluster.kubectl_run("delete", "nodes", "-l", f"{POOL_LABEL}={name}", "--wait=false", check=False)


def _as_list(items: list[dict[str, Any]]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


ORDER_ANNOTATION = "ddp.dev/rank-order"


def ranks_by_order(pods: list[dict[str, Any]], domain_of_node: dict[str, str]) -> list[str]:
    """The domain of each group rank of a job whose ranks follow the topology, from the order key the
    operator wrote on each bound pod (``ORDER_ANNOTATION``): torch's rendezvous ranks the pods by sorting
    their keys. Asserts what the order must give: every pod has a key, rank 0's pod ranks first, and each
    domain's pods hold consecutive ranks."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    keys = {
        p["metadata"]["name"]: (p["metadata"].get("annotations") or {}).get(ORDER_ANNOTATION) for p in live
    }
    assert all(keys.values()), f"a bound pod without its order key: {keys}"
    ordered = sorted(live, key=lambda p: keys[p["metadata"]["name"]])
    assert ordered[0]["metadata"]["labels"][RANK_LABEL] == "0", keys
    domains = [domain_of_node[p["spec"]["nodeName"]] for p in ordered]
    runs = [d for i, d in enumerate(domains) if i == 0 or domains[i - 1] != d]
    assert len(runs) == len(set(domains)), f"a domain's pods on ranks apart: {domains} (keys {keys})"
    return domains


def ranks_of(ranges: str) -> list[int]:
    """status.topology's "0-2,5" -> [0, 1, 2, 5]."""
    found: list[int] = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        found.extend(range(int(first), int(last or first) + 1))
    return found
