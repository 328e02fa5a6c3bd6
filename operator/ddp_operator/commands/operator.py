"""`ddpjob operator`: run the DDPJob controller under kopf.

kopf is configured for scale and for a one-replica Deployment (docs/operator.md explains each choice):
- no finalizers: the operator registers no delete handler and no daemon, so kopf adds none, and a DDPJob
  stays deletable with the operator uninstalled (children go by garbage collection);
- no kopf Events: the controller posts exactly one Event per phase change itself, so kopf's posting
  is switched off and its level raised above anything it logs per handler;
- no persistence writes: only event handlers are registered, which keep no progress or diff-base
  annotations; the controller's state is the job's status;
- no kopf peering: at most one operator acts because the controller starts only in the process that
  holds the leader Lease (leader.py); the others keep kopf running (their probes answer) and wait.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from ddp_operator import names
from ddp_operator.builders import DEFAULT_METRICS_ALLOW_FROM
from ddp_operator.decision import DEFAULT_TIMING, TimingRules
from ddp_operator.progress.pull import DEFAULT_CONCURRENCY as DEFAULT_SCRAPE_CONCURRENCY
from ddp_operator.progress.pull import DEFAULT_INTERVAL_SECONDS, ProgressScraper
from ddp_operator.progress.tracker import STRAGGLER_THRESHOLD

if TYPE_CHECKING:
    from ddp_operator.controller import Controller
    from ddp_operator.kube_api import KubeApi

DEFAULT_METRICS_PORT = 9410
DEFAULT_CONCURRENCY = 32


def _positive_seconds(text: str) -> float:
    """A flag's seconds, which must be more than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"must be more than 0, got {text}: the operator counts in-place restarts from this read"
        )
    return value


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
        "--leader-election",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="act only while holding a coordination.k8s.io Lease, so replicas never act together (default on)",
    )
    parser.add_argument(
        "--leader-election-namespace",
        metavar="NAME",
        default=None,
        help="namespace of the Lease (default: $POD_NAMESPACE, the service account's, else the first "
        "--namespace, else default)",
    )
    parser.add_argument(
        "--leader-election-name",
        metavar="NAME",
        default=None,
        help="name of the Lease (default: ddp-operator, with a digest of the --namespace list when given)",
    )
    parser.add_argument("--lease-duration", type=float, default=15.0, help="seconds (default 15)")
    parser.add_argument("--renew-deadline", type=float, default=10.0, help="seconds (default 10)")
    parser.add_argument("--retry-period", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument(
        "--decision-window",
        type=float,
        default=DEFAULT_TIMING.decision_window_seconds,
        help="after an attempt's first failure, wait up to this many seconds for every rank's report before "
        f"judging it (default {DEFAULT_TIMING.decision_window_seconds:g}; docs/restarts.md)",
    )
    parser.add_argument(
        "--progress-interval",
        type=_positive_seconds,
        default=DEFAULT_INTERVAL_SECONDS,
        help="read each Running job's progress from its rank 0 metrics endpoint this often, in seconds (> 0: "
        "the same read counts in-place restarts against backoffLimit and detects stalls) "
        f"(default {DEFAULT_INTERVAL_SECONDS:g})",
    )
    parser.add_argument(
        "--progress-concurrency",
        type=int,
        default=DEFAULT_SCRAPE_CONCURRENCY,
        help=f"progress reads in flight at once, across all jobs (default {DEFAULT_SCRAPE_CONCURRENCY})",
    )
    parser.add_argument(
        "--straggler-threshold",
        type=float,
        default=STRAGGLER_THRESHOLD,
        help="the rank the others wait for is slow when the job's step takes this many times as long "
        f"with it as without it (default {STRAGGLER_THRESHOLD:g})",
    )
    parser.add_argument(
        "--straggler-window",
        type=float,
        default=DEFAULT_TIMING.straggler_window_seconds,
        help="seconds a rank must stay slow before status.straggler names it and an Event is posted "
        f"(default {DEFAULT_TIMING.straggler_window_seconds:g})",
    )
    parser.add_argument(
        "--unconfirmed-deletion",
        type=float,
        default=DEFAULT_TIMING.unconfirmed_deletion_seconds,
        help="a deleted pod still Terminating this many seconds after its grace period is on a lost node and no "
        f"longer holds the next attempt back (default {DEFAULT_TIMING.unconfirmed_deletion_seconds:g})",
    )
    parser.add_argument(
        "--status-interval",
        type=float,
        default=1.0,
        help="counter-only status changes (readyReplicas...) are written once the counts stood still this many "
        "seconds, or after 10 times as long; at most 2 per phase (default 1)",
    )
    parser.add_argument(
        "--metrics-allow-from",
        type=metrics_allow_from,
        default=None,
        metavar="JSON",
        help="who may reach the rank pods' metrics port through each job's NetworkPolicy: a JSON list of "
        "NetworkPolicyPeer objects (namespaceSelector, podSelector, ipBlock); [] closes it to all but the "
        "job's own pods (default: the namespace 'monitoring', "
        f"{json.dumps(list(DEFAULT_METRICS_ALLOW_FROM), separators=(',', ':'))})",
    )
    parser.add_argument(
        "--standby-priority-class",
        metavar="NAME",
        default=names.DEFAULT_STANDBY_PRIORITY_CLASS,
        help="the PriorityClass of standby pods (runPolicy.standbyPods), below the ranks' priority so the "
        "scheduler preempts a standby for a rank pod; the chart installs it. '' keeps the template's class "
        f"(default {names.DEFAULT_STANDBY_PRIORITY_CLASS}; docs/restarts.md)",
    )
    parser.add_argument(
        "--standby-waiting-cpu",
        type=waiting_cpu,
        metavar="QUANTITY",
        default=names.DEFAULT_STANDBY_WAITING_CPU,
        help="the CPU request a standby pod waits with, so that its start takes little of a busy node's "
        "CPU from the ranks; it gets its rank's request back, resized in place, when it takes a rank. "
        f"'' keeps the rank's request (default {names.DEFAULT_STANDBY_WAITING_CPU}; docs/restarts.md)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def waiting_cpu(text: str) -> str:
    """--standby-waiting-cpu: a CPU quantity, or '' for the ranks' own request."""
    from ddp_operator.quantity import parse_quantity

    if text.strip():
        try:
            if parse_quantity(text) <= 0:
                raise ValueError(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a positive CPU quantity: {text!r} (for instance 10m; '' for the ranks' own request)"
            ) from None
    return text.strip()


def metrics_allow_from(text: str) -> tuple[dict[str, Any], ...]:
    """--metrics-allow-from: a JSON list of NetworkPolicyPeers, checked now rather than at each job's create."""
    from ddp_operator.spec import SpecError, parse_network_peers

    try:
        return parse_network_peers(json.loads(text), "--metrics-allow-from")
    except ValueError as error:  # json's JSONDecodeError and SpecError alike
        message = str(error) if isinstance(error, SpecError) else f"--metrics-allow-from: not JSON: {error}"
        raise argparse.ArgumentTypeError(message) from None


def lease_namespace(namespaces: list[str]) -> str:
    """Where the Lease lives: the operator's own namespace in a pod, else where it works."""
    from ddp_operator import leader

    if os.environ.get("POD_NAMESPACE") or os.path.exists(leader.SERVICE_ACCOUNT_NAMESPACE_FILE):
        return leader.default_namespace()
    return namespaces[0] if namespaces else "default"


def lease_name(namespaces: list[str]) -> str:
    """One Lease per scope: operators watching different namespaces are different deployments."""
    from ddp_operator import leader

    if not namespaces:
        return leader.DEFAULT_LEASE_NAME
    digest = hashlib.sha256(",".join(sorted(set(namespaces))).encode()).hexdigest()[:10]
    return f"{leader.DEFAULT_LEASE_NAME}-{digest}"


def build_settings() -> Any:
    import kopf

    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    settings.posting.level = logging.CRITICAL
    settings.peering.standalone = True
    # The controller answers every DDPJob event itself and re-reads nothing per event.
    settings.watching.reconnect_backoff = 1.0
    settings.networking.request_timeout = 60
    return settings


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # Every liveness probe is an aiohttp access line: noise below the one line per job decision.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def build_controller(
    args: argparse.Namespace, api: KubeApi, leadership: threading.Event | None
) -> Controller:
    """The controller the command line asks for, with its collaborators."""
    from ddp_operator.controller import Controller
    from ddp_operator.metrics import OperatorMetrics

    rules = TimingRules(args.decision_window, args.unconfirmed_deletion, args.straggler_window)
    allow_from = DEFAULT_METRICS_ALLOW_FROM if args.metrics_allow_from is None else args.metrics_allow_from
    scraper = functools.partial(
        ProgressScraper,
        interval=args.progress_interval,
        concurrency=max(1, args.progress_concurrency),
        straggler_threshold=args.straggler_threshold,
    )
    return Controller(
        api,
        namespaces=list(args.namespace) or None,
        status_interval=args.status_interval,
        rules=rules,
        metrics_allow_from=allow_from,
        leadership=leadership,
        metrics=OperatorMetrics,
        scraper=scraper,
        standby_priority_class=args.standby_priority_class,
        standby_waiting_cpu=args.standby_waiting_cpu,
    )


def main(args: argparse.Namespace) -> int:
    import asyncio

    import kopf

    from ddp_operator import leader
    from ddp_operator.handlers import build_registry
    from ddp_operator.kube_api import KubeApi

    _configure_logging(args.verbose)
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
    timing = leader.Timing(args.lease_duration, args.renew_deadline, args.retry_period)
    if args.leader_election and timing.problem():
        print(f"ddpjob operator: {timing.problem()}")
        return 2
    elector: leader.LeaderElector | None = None
    if args.leader_election:
        elector = leader.LeaderElector(
            api,
            args.leader_election_namespace or lease_namespace(namespaces),
            args.leader_election_name or lease_name(namespaces),
            timing,
        )
    controller = build_controller(args, api, elector.leading if elector is not None else None)
    if elector is not None:
        elector.start()
    if args.metrics_port and controller.metrics is not None:
        controller.metrics.serve(args.metrics_port, args.metrics_address)

    registry = build_registry(controller)
    try:
        asyncio.run(
            kopf.operator(
                registry=registry,
                settings=build_settings(),
                clusterwide=not namespaces,
                namespaces=namespaces,
                standalone=True,
                liveness_endpoint=args.liveness,
            )
        )
    finally:
        if elector is not None:
            elector.stop()
        api.close()
    return 0
