"""The rank order by topology (docs/scheduling.md, "Rank order"): the operator's order keys
(policies/topology.py) brought by each launcher to torch's rendezvous (ddp_trainer.supervisor.restarts.node_addr)
put rank 0's pod first and each domain's, and each node's, pods on consecutive ranks; the operator's
reading of the order (group_order, ranks.py) is the rendezvous's own; the launcher waits for its key."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tests.unit.kube_factories import job_object
from tests.unit.test_trainer_restarts import rendezvous_order

from ddp_operator import builders, names
from ddp_operator.policies import topology
from ddp_operator.spec import parse_job
from ddp_trainer.config import ConfigError, parse_env
from ddp_trainer.supervisor.rank_order import RankOrderMissingError, wait_for_key
from ddp_trainer.supervisor.restarts import NODE_RANK_DIGITS, node_addr, rank_mismatch

pytestmark = pytest.mark.unit


def random_placement(seed: int, pods: int, domains: int, nodes_per_domain: int) -> dict[int, topology.Bound]:
    """Pods scattered over racks and nodes as a scheduler might leave them, rank 0's anywhere."""
    rng = random.Random(seed)
    placement = {}
    for rank in range(pods):
        rack = rng.randrange(domains)
        placement[rank] = topology.Bound(f"node-{rack}-{rng.randrange(nodes_per_domain)}", f"rack-{rack}")
    return placement


def rendezvous_ranks(placement: dict[int, topology.Bound], seed: int) -> list[int]:
    """Pod ranks in the order torch's rendezvous ranks them, from the keys the operator writes."""
    keys = topology.keys_to_write(placement)
    by_addr = {node_addr(rank, key): rank for rank, key in keys.items()}
    return [by_addr[addr] for addr in rendezvous_order(list(by_addr), seed)]


def runs(values: list[str]) -> int:
    """How many runs of equal consecutive values."""
    return sum(1 for i, value in enumerate(values) if i == 0 or value != values[i - 1])


@pytest.mark.parametrize(
    ("pods", "domains", "nodes"),
    [
        pytest.param(2, 2, 1, id="2-pods-2-racks"),
        pytest.param(8, 3, 2, id="8-pods-3-racks"),
        pytest.param(64, 4, 4, id="64-pods-4-racks"),
        pytest.param(256, 8, 4, id="256-pods-8-racks"),
        pytest.param(12, 1, 6, id="one-rack-many-nodes"),
    ],
)
def test_the_rendezvous_puts_each_domain_and_node_on_consecutive_ranks(
    pods: int, domains: int, nodes: int
) -> None:
    for seed in range(5):
        placement = random_placement(seed, pods, domains, nodes)
        order = rendezvous_ranks(placement, seed)
        assert order[0] == 0, "rank 0's pod holds the checkpoint"
        assert sorted(order) == list(range(pods))
        racks = [placement[r].domain for r in order]
        hosts = [placement[r].node for r in order]
        # Each rack, and each node, is one run of consecutive ranks; the ring crosses each rack boundary
        # once (or not at all with one rack).
        assert runs(racks) == len(set(racks)) and runs(hosts) == len(set(hosts))
        crossings = topology.placement(dict(enumerate(racks))).ring_crossings
        assert crossings == (len(set(racks)) if len(set(racks)) > 1 else 0)
        # Rank 0's node, then the rest of its rack, come first.
        first = placement[0]
        assert hosts[: hosts.count(first.node)] == [first.node] * hosts.count(first.node)
        assert set(racks[: racks.count(first.domain)]) == {first.domain}
        # What the operator reads back (ranks.py, status.topology) is the rendezvous's order.
        keyed = {
            r: topology.Bound(b.node, b.domain, k)
            for (r, b), k in zip(placement.items(), topology.keys_to_write(placement).values(), strict=True)
        }
        assert topology.group_order({r: b.key or "" for r, b in keyed.items()}) == {
            r: i for i, r in enumerate(order)
        }
        assert topology.domains_by_group_rank(keyed) == dict(enumerate(racks))


def test_keys_wait_for_rank_0_and_are_never_rewritten() -> None:
    placed = {1: topology.Bound("n1", "rack-b"), 2: topology.Bound("n2", "rack-a")}
    assert topology.keys_to_write(placed) == {}, "every key is placed relative to rank 0's pod"
    placed[0] = topology.Bound("n0", "rack-a")
    written = topology.keys_to_write(placed)
    assert set(written) == {0, 1, 2}
    placed = {rank: topology.Bound(b.node, b.domain, written[rank]) for rank, b in placed.items()}
    # Rank 2's pod replaced onto another rack: only the new pod gets a key.
    placed[2] = topology.Bound("n9", "rack-c")
    assert list(topology.keys_to_write(placed)) == [2]
    assert topology.domains_by_group_rank({0: placed[0], 2: placed[2]}) == {0: "rack-a", 2: "rack-c"}


@pytest.mark.parametrize(
    ("restart_mode", "topology_field", "ordered"),
    [
        pytest.param("InPlace", {"preferred": "example.com/rack"}, True, id="in-place-preferred"),
        pytest.param("InPlace", {"required": "example.com/rack"}, True, id="in-place-required"),
        pytest.param("Recreate", {"preferred": "example.com/rack"}, False, id="recreate-static-rendezvous"),
        pytest.param("InPlace", None, False, id="no-topology"),
    ],
)
def test_the_pod_shows_its_key_to_the_launcher_through_a_downward_api_file(
    restart_mode: str, topology_field: dict[str, str] | None, ordered: bool
) -> None:
    scheduling = {"topology": topology_field} if topology_field else {}
    job = parse_job(job_object(scheduling=scheduling, runPolicy={"restartMode": restart_mode}, replicas=3))
    pod = builders.build_rank_pod(job, 1, 0)
    trainer = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert (names.PLACEMENT_VOLUME in volumes) == ordered
    assert ("DDP_RANK_ORDER_FILE" in env) == ordered
    if ordered:
        [item] = volumes[names.PLACEMENT_VOLUME]["downwardAPI"]["items"]
        assert item["fieldRef"]["fieldPath"] == f"metadata.annotations['{names.ANNOTATION_RANK_ORDER}']"
        [mount] = [m for m in trainer["volumeMounts"] if m["name"] == names.PLACEMENT_VOLUME]
        assert env["DDP_RANK_ORDER_FILE"] == f"{mount['mountPath']}/{item['path']}"
        assert "DDP_RANK_ORDER_FILE" in builders.CONTRACT_ENV


def test_the_launchers_key_width_is_the_operators() -> None:
    assert topology.RANK_DIGITS == NODE_RANK_DIGITS
    key = topology.order_key(7, "rack-a", "n1", "rack-b", "n0")
    assert node_addr(7, key).endswith(key)
    with pytest.raises(ValueError, match="not the key of NODE_RANK 3"):
        node_addr(3, key)


@pytest.mark.parametrize(
    ("pod_rank", "group_rank", "accepted"),
    [
        pytest.param(0, 0, True, id="pod0-rank0"),
        pytest.param(3, 1, True, id="ordered-before-lower-pods"),
        pytest.param(1, 3, True, id="ordered-after-higher-pods"),
        pytest.param(0, 2, False, id="pod0-not-first-refused"),
        pytest.param(2, 0, False, id="another-pod-first-refused"),
    ],
)
def test_an_ordered_round_may_rank_any_pod_anywhere_but_pod_0(
    pod_rank: int, group_rank: int, accepted: bool
) -> None:
    problem = rank_mismatch(pod_rank, group_rank, elastic=False, ordered=True)
    assert (problem is None) == accepted


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1


@pytest.mark.parametrize("arrives_after", [0, 1, 25], ids=lambda n: f"after-{n}-polls")
def test_the_launcher_waits_for_the_key_the_kubelet_writes_late(tmp_path: Path, arrives_after: int) -> None:
    path = tmp_path / "placement" / "rank-order"
    clock = FakeClock()
    waits: list[int] = []

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.sleeps == arrives_after:
            path.parent.mkdir(exist_ok=True)
            path.write_text("2/rack-a/n2/000002\n")

    if arrives_after == 0:
        path.parent.mkdir()
        path.write_text("2/rack-a/n2/000002\n")
    key = wait_for_key(path, 60, on_wait=lambda: waits.append(1), clock=clock.time, sleep=sleep)
    assert key == "2/rack-a/n2/000002"
    assert clock.sleeps == arrives_after and len(waits) == (1 if arrives_after else 0)


def test_a_key_that_never_comes_ends_the_wait_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rank-order"
    path.write_text("")  # the annotation is not there yet: the kubelet writes an empty file
    clock = FakeClock()
    with pytest.raises(RankOrderMissingError, match=r"DDP_RANK_ORDER_FILE.*ddp\.dev/rank-order"):
        wait_for_key(path, 5, clock=clock.time, sleep=clock.sleep)
    assert clock.now >= 5


def test_a_rank_order_file_needs_the_in_place_rendezvous() -> None:
    env = {
        "WORLD_SIZE": "2",
        "NNODES": "2",
        "NODE_RANK": "1",
        "NPROC_PER_NODE": "1",
        "MASTER_ADDR": "a",
        "MASTER_PORT": "29500",
        "DDP_RANK_ORDER_FILE": "/etc/ddp/placement/rank-order",
    }
    with pytest.raises(ConfigError, match="DDP_RANK_ORDER_FILE"):
        parse_env(env)
    assert parse_env({**env, "DDP_RESTART_MODE": "InPlace"}).rank_order_file == env["DDP_RANK_ORDER_FILE"]
