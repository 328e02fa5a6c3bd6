"""`ddp-harness`: the test harness from the command line.

    ddp-harness cluster up [--real-node [--network-policy]] | down | status

The product's own command, `ddpjob`, has no harness subcommands: the harness is not in its wheel."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from ddp_harness.binaries import BinariesError
from ddp_harness.cluster import ClusterOptions, down, status, up
from ddp_harness.hack import HackDirError
from ddp_harness.manifests import NodeShape
from ddp_harness.node_manifests import RealNodeOptions
from ddp_harness.pki import PkiError
from ddp_harness.processes import ClusterError, default_state_dir


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddp-harness",
        description="The test harness of ddp-operator: a local Kubernetes cluster for tests and demos.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    cluster = commands.add_parser(
        "cluster",
        help="a local Kubernetes control plane (and optionally one real node) as processes on this machine",
    )
    _configure_cluster(cluster)
    return parser


def _configure_cluster(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="cluster_action", metavar="ACTION", required=True)
    shape = NodeShape()

    def add_state_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--state-dir",
            type=Path,
            default=None,
            help=f"where certificates, logs, etcd data and the kubeconfig live [{default_state_dir()}; "
            "env DDP_CLUSTER_STATE_DIR]",
        )

    p_up = actions.add_parser(
        "up", help="start etcd, apiserver, controller-manager, scheduler, kwok and fake GPU nodes"
    )
    add_state_dir(p_up)
    p_up.add_argument("--nodes", type=_int_at_least(0), default=4, help="fake GPU nodes [4]")
    # The capacity of every fake node: (NodeShape field, flag, what it is, the smallest value).
    for field_name, flag, what, minimum in (
        ("gpus", "--gpus-per-node", "nvidia.com/gpu per node", 0),
        ("pods", "--pods-per-node", "pod capacity per node", 1),
        ("cpus", "--cpus-per-node", "cpu per node", 1),
        ("memory_gi", "--memory-per-node-gi", "memory per node, GiB", 1),
    ):
        default = getattr(shape, field_name)
        p_up.add_argument(flag, type=_int_at_least(minimum), default=default, help=f"{what} [{default}]")
    p_up.add_argument(
        "--bin-dir",
        type=Path,
        default=None,
        help="the binaries [the build script's output; env DDP_K8S_BIN_DIR]",
    )
    p_up.add_argument("--no-build", action="store_true", help="fail instead of building missing binaries")
    p_up.add_argument(
        "--real-node",
        action="store_true",
        help="also start one real node (containerd, kubelet, CNI bridge, kube-proxy, CoreDNS; needs root; "
        "docs/real-node.md); use --nodes 0 so pods cannot land on fake nodes",
    )
    p_up.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="IMAGE",
        help="with --real-node: a Docker image to load into the node (repeatable)",
    )
    p_up.add_argument(
        "--network-policy",
        action="store_true",
        help="with --real-node: enforce NetworkPolicies with kube-router's firewall (hack/build-kube-router.sh; "
        "docs/security.md)",
    )
    p_up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness [120]")

    p_down = actions.add_parser("down", help="stop every process `up` started and remove the state directory")
    add_state_dir(p_down)
    p_down.add_argument("--keep-state", action="store_true", help="keep logs, certificates and etcd data")

    p_status = actions.add_parser("status", help="the components, their pids, ports, memory and log files")
    add_state_dir(p_status)
    p_status.add_argument("--json", action="store_true", help="machine-readable output")


def _progress(message: str) -> None:
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


def _up(args: argparse.Namespace) -> int:
    options = ClusterOptions(
        state_dir=args.state_dir or default_state_dir(),
        bin_dir=args.bin_dir,
        nodes=args.nodes,
        node_shape=NodeShape(
            gpus=args.gpus_per_node,
            cpus=args.cpus_per_node,
            memory_gi=args.memory_per_node_gi,
            pods=args.pods_per_node,
        ),
        build=not args.no_build,
        timeout_s=args.timeout,
        real_node=(
            RealNodeOptions(images=tuple(args.image), network_policy=args.network_policy)
            if args.real_node
            else None
        ),
    )
    cluster = up(options, progress=_progress)
    print(f"kubeconfig: {cluster.kubeconfig}")
    print(f"kubectl:    {cluster.kubectl}")
    print(f"audit log:  {cluster.audit_log}")
    print(f"try:        {cluster.kubectl} --kubeconfig {cluster.kubeconfig} get nodes")
    return 0


def _status(args: argparse.Namespace) -> int:
    result = status(args.state_dir)
    if result is None:
        print(f"no cluster in {args.state_dir or default_state_dir()}")
        return 1
    state, rows = result
    if args.json:
        print(json.dumps({"cluster": asdict(state), "components": [asdict(r) for r in rows]}, indent=2))
    else:
        print(f"state dir:  {state.state_dir}\nkubeconfig: {state.kubeconfig}\napiserver:  {state.apiserver}")
        print(f"audit log:  {state.audit_log}\nbinaries:   {state.bin_dir}\n")
        print(f"{'COMPONENT':<24} {'PID':>8} {'STATE':<8} {'RSS MiB':>8}  {'PORTS':<28} LOG")
        for r in rows:
            ports = ",".join(f"{k}={v}" for k, v in r.ports.items())
            state_word = "running" if r.running else "stopped"
            print(f"{r.name:<24} {r.pid:>8} {state_word:<8} {r.rss_bytes / 2**20:>8.0f}  {ports:<28} {r.log}")
        total = sum(r.rss_bytes for r in rows)
        print(f"\ntotal RSS: {total / 2**20:.0f} MiB")
    return 0 if all(r.running for r in rows) else 3


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cluster_action == "up":
            return _up(args)
        if args.cluster_action == "down":
            if not down(args.state_dir, keep_state=args.keep_state, progress=_progress):
                print(f"no cluster in {args.state_dir or default_state_dir()}", file=sys.stderr)
            return 0
        return _status(args)
    except (ClusterError, BinariesError, PkiError, HackDirError) as exc:
        print(f"ddp-harness cluster {args.cluster_action}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
