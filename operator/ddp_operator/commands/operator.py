"""`ddpjob operator`: run the DDPJob controller under kopf.

kopf is configured for scale and for a one-replica Deployment (docs/operator.md explains each choice):
- no finalizers: the operator registers no delete handler and no daemon, so kopf adds none, and a DDPJob
  stays deletable with the operator uninstalled (children go by garbage collection);
- no kopf Events: the controller posts exactly one Event per phase change itself, so kopf's posting
  is switched off and its level raised above anything it logs per handler;
- no persistence writes: only event handlers are registered, which keep no progress or diff-base
  annotations; the controller's state is the job's status;
- peering off unless `--peering`: the chart runs one replica with the Recreate strategy.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

DEFAULT_METRICS_PORT = 9410
DEFAULT_CONCURRENCY = 32


def configure_parser(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        metavar="NAME",
        help="watch DDPJobs and rank pods in this namespace only (repeatable)",
    )
    scope.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch DDPJobs in every namespace (the default when no --namespace is given)",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    parser.add_argument(
        "--liveness",
        metavar="URL",
        default=None,
        help="serve kopf's liveness probe here, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"serve the operator's Prometheus metrics on this port at /metrics (0: off; default {DEFAULT_METRICS_PORT})",
    )
    parser.add_argument("--metrics-address", default="0.0.0.0", help="address the metrics server binds")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"API requests in flight at once when creating or deleting children (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="join this kopf peering (needs kopf's peering CRDs); off by default: run one replica",
    )
    parser.add_argument(
        "--status-interval",
        type=float,
        default=1.0,
        help="counter-only status changes (readyReplicas...) are written once the counts stood still this many "
        "seconds, or after 10 times as long; at most 2 per phase (default 1)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_settings(peering: str | None) -> Any:
    import kopf

    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    settings.posting.level = logging.CRITICAL
    settings.peering.standalone = peering is None
    if peering is not None:
        settings.peering.name = peering
        settings.peering.mandatory = True
    # The controller answers every DDPJob event itself and re-reads nothing per event.
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 60
    return settings


def main(args: argparse.Namespace) -> int:
    import asyncio

    import kopf

    from ddp_operator.controller import Controller
    from ddp_operator.handlers import build_registry
    from ddp_operator.kube_api import KubeApi
    from ddp_operator.metrics import OperatorMetrics

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.kubeconfig:
        # kopf logs in through the kubernetes client, which reads $KUBECONFIG.
        os.environ["KUBECONFIG"] = os.path.abspath(args.kubeconfig)
    if args.concurrency < 1:
        print("ddpjob operator: --concurrency must be at least 1")
        return 2

    namespaces: list[str] = list(args.namespace)
    try:
        api = KubeApi.connect(args.kubeconfig, concurrency=args.concurrency)
    except Exception as error:  # the client's ConfigException and file errors alike
        print(f"ddpjob operator: cannot load cluster credentials: {error}")
        return 2
    controller = Controller(api, namespaces=namespaces or None, status_interval=args.status_interval)
    metrics = OperatorMetrics(controller.phase_counts)
    controller.metrics = metrics
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_address)

    registry = build_registry(controller)
    try:
        asyncio.run(
            kopf.operator(
                registry=registry,
                settings=build_settings(args.peering),
                clusterwide=not namespaces,
                namespaces=namespaces,
                standalone=args.peering is None,
                peering_name=args.peering,
                liveness_endpoint=args.liveness,
            )
        )
    finally:
        api.close()
    return 0
