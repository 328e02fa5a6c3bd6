"""What the job commands (`ddpjob get|describe|logs|top|wait`) share: the kubeconfig flags kubectl
users know, the connection, and one read of a job with its pods. Not a subcommand itself.

A job started by `ddpjob run` has no apiserver to ask: these commands read a cluster only (`ddpjob
run` prints its ranks' logs, prefixed, and the same per-rank table at its end)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddp_operator import names

if TYPE_CHECKING:
    from ddp_operator.kube_api import KubeApi
    from ddp_operator.observe import PodObservation

# Exit statuses the job commands share (docs/cli.md).
EXIT_OK = 0
EXIT_NOT_MET = 1  # `wait`: the job ended otherwise, or the timeout passed
EXIT_USAGE = 2  # a flag, the kubeconfig or the job itself is wrong: nothing to wait for


def add_connection_args(parser: argparse.ArgumentParser, all_namespaces: bool = False) -> None:
    parser.add_argument(
        "-n", "--namespace", help="the job's namespace (default: the context's, else default)"
    )
    parser.add_argument(
        "--kubeconfig", help="the kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)"
    )
    parser.add_argument("--context", help="the kubeconfig context (default: its current context)")
    if all_namespaces:
        parser.add_argument(
            "-A", "--all-namespaces", action="store_true", help="jobs of every namespace (`get` only)"
        )


def context_namespace(kubeconfig: str | None, context: str | None) -> str:
    """The namespace the kubeconfig's context names, as kubectl picks it; "default" when it names none
    (and inside a pod with no kubeconfig: the pod's own namespace)."""
    from kubernetes import config

    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError):
        service_account = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
        if kubeconfig is None and context is None and os.path.exists(service_account):
            with open(service_account, encoding="utf-8") as handle:
                return handle.read().strip() or "default"
        return "default"
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    namespace = ((chosen or {}).get("context") or {}).get("namespace")
    return str(namespace) if namespace else "default"


@dataclass
class Session:
    api: KubeApi
    namespace: str


def connect(args: argparse.Namespace) -> Session:
    """The API session the flags name; exits 2 with the client's own words when the kubeconfig or
    context cannot be used."""
    from kubernetes import config

    from ddp_operator.kube_api import KubeApi

    try:
        api = KubeApi.connect(args.kubeconfig, concurrency=4, context=args.context)
    except (config.ConfigException, OSError) as error:
        print(f"ddpjob: cannot use the kubeconfig: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    return Session(api, args.namespace or context_namespace(args.kubeconfig, args.context))


def job_selector(job: str) -> str:
    return f"{names.LABEL_JOB_NAME}={job}"


@dataclass(frozen=True)
class JobRead:
    """One read of a job: the DDPJob, its own pods observed, and each pod as the apiserver sent it."""

    job: Mapping[str, Any]
    pods: list[PodObservation]
    raw: Mapping[str, Mapping[str, Any]]


def read_job(session: Session, name: str) -> JobRead | None:
    """The DDPJob and its own pods, in one go; None when there is no such job."""
    from ddp_operator import jobview

    job = session.api.get_job_blocking(session.namespace, name)
    if job is None:
        return None
    pods, _ = session.api.list_pods_blocking(session.namespace, job_selector(name))
    own = jobview.own_pods(job, pods)
    kept = {p.name for p in own}
    raw = {str(pod["metadata"]["name"]): pod for pod in pods if pod["metadata"]["name"] in kept}
    return JobRead(job, own, raw)


def no_such_job(session: Session, name: str) -> int:
    print(
        f"ddpjob: no DDPJob {name!r} in namespace {session.namespace!r} (`ddpjob get` lists them; "
        "-n names another namespace)",
        file=sys.stderr,
    )
    return EXIT_USAGE


def api_failure(error: Exception) -> int:
    """An apiserver refusal or an unreachable server, in one line (a 403 names the verb to grant)."""
    print(f"ddpjob: the apiserver said: {error}", file=sys.stderr)
    return EXIT_USAGE
