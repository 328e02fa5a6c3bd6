"""Helpers for the operator's integration tests: an operator subprocess, kubectl JSON, bounded waits.

The operator runs as `python -m ddp_operator operator` with the local cluster's kubeconfig, watching only
the test's namespace, so tests never see each other's jobs and one can be SIGKILLed like a real pod.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ddp_harness import EXIT_CODE_ANNOTATION, FINISHED_AT_ANNOTATION, MESSAGE_ANNOTATION, REASON_ANNOTATION
from ddp_operator import names
from ddp_operator.local.ports import free_ports
from ddp_operator.observe import LAUNCHER_EXIT_MARKER

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def free_port() -> int:
    return free_ports(1)[0]


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.3) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except subprocess.CalledProcessError as error:
            last = f"{error}: {error.stderr}"
        if last:
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)


class Kube:
    """kubectl against the local cluster, returning parsed JSON."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.kubeconfig = Path(cluster.kubeconfig)
        self.kubectl = str(cluster.kubectl)

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.kubectl, "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
        )

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    def apply(self, obj: Any, namespace: str) -> None:
        text = obj if isinstance(obj, str) else yaml.safe_dump(obj)
        self.run("apply", "-n", namespace, "-f", "-", stdin=text)

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        result = self.run("get", "ddpjob", name, "-n", namespace, "-o", "json", check=False)
        if result.returncode != 0:
            return None
        job: dict[str, Any] = json.loads(result.stdout)
        return job

    def status(self, namespace: str, name: str) -> dict[str, Any]:
        job = self.job(namespace, name) or {}
        status: dict[str, Any] = job.get("status") or {}
        return status

    def pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        selector = names.label_selector(job)
        items: list[dict[str, Any]] = self.json("get", "pods", "-n", namespace, "-l", selector)["items"]
        return items

    def live_pods(self, namespace: str, job: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(namespace, job) if not p["metadata"].get("deletionTimestamp")]

    def end_pod(
        self,
        namespace: str,
        pod: str,
        exit_code: int,
        reason: str | None = None,
        finished_at: datetime | None = None,
        launcher_killed: bool = False,
    ) -> None:
        """The pod's process ends with this exit code, at ``finished_at`` (default: now); its node's kwok
        reports it after that node's latency. An earlier ``finished_at`` models a report that arrives late.
        The trainer's launcher leaves its last word in the termination message as it exits, unless
        ``launcher_killed``: the container was killed from outside, launcher and all."""
        args = [f"{EXIT_CODE_ANNOTATION}={exit_code}"]
        if not launcher_killed:
            args.append(f"{MESSAGE_ANNOTATION}={LAUNCHER_EXIT_MARKER} code={exit_code}")
        if reason:
            args.append(f"{REASON_ANNOTATION}={reason}")
        if finished_at is not None:
            args.append(
                f"{FINISHED_AT_ANNOTATION}={finished_at.astimezone(UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}"
            )
        self.run("annotate", "pod", pod, "-n", namespace, "--overwrite", *args)

    def write_pod_log(self, namespace: str, pod: str, text: str) -> None:
        """The pod's containers print ``text``: each line goes to the pod's log as stdout, a missing
        final newline implied, and `GET .../pods/<pod>/log` returns it from then on, follow streams
        already open included. The first write for a pod returns once kwok serves its log, which needs
        the pod bound to a fake node (LocalCluster.write_pod_log, ddp_harness/kwok_logs.py)."""
        self.cluster.write_pod_log(namespace, pod, text)

    def events_for(self, namespace: str, name: str) -> list[dict[str, Any]]:
        items = self.json("get", "events", "-n", namespace)["items"]
        return [
            e
            for e in items
            if e.get("involvedObject", {}).get("kind") == names.KIND
            and e["involvedObject"].get("name") == name
        ]

    def create_namespace(self, prefix: str, labels: dict[str, str] | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.run("create", "namespace", name)
        if labels:
            self.run("label", "namespace", name, *(f"{k}={v}" for k, v in labels.items()))
        # The ServiceAccount controller must have made `default` before pods can be admitted.
        wait_for(
            f"serviceaccount default in {name}",
            lambda: self.run("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        )
        return name

    def delete_namespace(self, name: str) -> None:
        self.run("delete", "namespace", name, "--wait=false", check=False)


# The operator's DEBUG line per decision (`-v`; ddp_operator.controller._log_decision).
DECISION_LINE = re.compile(
    r"job=(?P<namespace>[^/\s]+)/(?P<job>\S+) decided phase=(?P<phase>\S+) attempt=(?P<attempt>\S+) "
    r"restarts=(?P<restarts>\d+) failed=(?P<failed>\d+) judged_in=(?P<judged_in>\S+) .*"
    r"requeue_after=(?P<requeue_after>\S+)$"
)


@dataclass(frozen=True)
class Decided:
    """One decision of the operator for a job, as its debug line tells it."""

    phase: str
    attempt: int | None
    restarts: int
    failed: int  # status.failedReplicas: rank pods whose trainer failed
    judged_in: float | None  # seconds until the failures seen are judged; None: no failure waits
    requeue_after: float | None  # seconds until it decides again without an event; None: not before one


class OperatorProcess:
    """`ddpjob operator` as a child process, ready once kopf's liveness endpoint answers."""

    def __init__(
        self, kubeconfig: Path, namespaces: Sequence[str], log_path: Path, extra: Sequence[str] = ()
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespaces = list(namespaces)
        self.log_path = log_path
        self.extra = list(extra)
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        scope = [arg for ns in self.namespaces for arg in ("--namespace", ns)] or ["--all-namespaces"]
        command = [
            sys.executable,
            "-m",
            "ddp_operator",
            "operator",
            "--kubeconfig",
            str(self.kubeconfig),
            *scope,
            "--metrics-port",
            str(self.metrics_port),
            "--metrics-address",
            "127.0.0.1",
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            *self.extra,
        ]
        log = self.log_path.open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        wait_for("the operator's liveness endpoint", self._alive, timeout=timeout)
        return self

    def _alive(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"the operator exited with {self.process.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2
            ) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as answer:
            text: str = answer.read().decode()
            return text

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_offset(self) -> int:
        """Where the log ends now: ``decisions(since=...)`` from here are those made after this call."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def decisions(self, namespace: str, job: str, since: int = 0) -> list[Decided]:
        """The operator's decisions for a job from byte ``since`` of its log on, oldest first (its DEBUG
        lines: the operator must run with ``-v``)."""
        with self.log_path.open("rb") as log:
            log.seek(since)
            text = log.read().decode(errors="replace")
        found = []
        for line in text.splitlines(keepends=True):
            match = DECISION_LINE.search(line)
            if match is None or not line.endswith("\n"):  # a line still being written is read next time
                continue
            if (match["namespace"], match["job"]) != (namespace, job):
                continue
            found.append(
                Decided(
                    phase=match["phase"],
                    attempt=None if match["attempt"] == "-" else int(match["attempt"]),
                    restarts=int(match["restarts"]),
                    failed=int(match["failed"]),
                    judged_in=None if match["judged_in"] == "-" else float(match["judged_in"]),
                    requeue_after=None if match["requeue_after"] == "-" else float(match["requeue_after"]),
                )
            )
        return found

    def wait_decision(
        self,
        namespace: str,
        job: str,
        what: str,
        accept: Callable[[Decided], bool],
        since: int = 0,
        timeout: float = 60.0,
    ) -> Decided:
        """The first decision for ``job`` after byte ``since`` of the log that ``accept`` takes."""
        return wait_for(
            f"the operator's decision for {job}: {what}",
            lambda: next((d for d in self.decisions(namespace, job, since) if accept(d)), None),
            timeout=timeout,
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def checkpoint_volume(kube: Kube, namespace: str, job: str, claim: dict[str, Any]) -> str:
    """A PersistentVolume reserved (claimRef) for job's checkpoint claim, which the operator creates
    from ``claim`` (its volumeClaimTemplate). The local cluster has no dynamic provisioner, so the volume
    is provisioned statically; returns its name."""
    name = f"{namespace}-{job}"
    volume = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": claim["resources"]["requests"]["storage"]},
            "accessModes": claim.get("accessModes", ["ReadWriteOnce"]),
            "hostPath": {"path": f"/tmp/{name}"},
            "claimRef": {"namespace": namespace, "name": names.pvc_name(job)},
            "persistentVolumeReclaimPolicy": "Retain",
        },
    }
    kube.run("apply", "-f", "-", stdin=yaml.safe_dump(volume))
    return name


def ddpjob(
    name: str,
    replicas: int = 2,
    *,
    restart_policy: str | None = None,
    run_policy: dict[str, Any] | None = None,
    pod_spec: dict[str, Any] | None = None,
    gpus: int | None = None,
    namespace: str | None = None,
    labels: dict[str, str] | None = None,
    scheduling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A small DDPJob whose pods kwok runs (the image is never pulled): CPU requests, or ``gpus``
    nvidia.com/gpu per rank."""
    resources = (
        {"limits": {names.GPU_RESOURCE: str(gpus)}}
        if gpus is not None
        else {"requests": {"cpu": "100m", "memory": "128Mi"}}
    )
    spec: dict[str, Any] = {
        "replicas": replicas,
        "template": {
            "spec": {
                "containers": [{"name": "trainer", "image": "ddp-trainer:test", "resources": resources}],
                **(pod_spec or {}),
            }
        },
    }
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    if run_policy:
        spec["runPolicy"] = run_policy
    if scheduling:
        spec["scheduling"] = scheduling
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    if labels:
        metadata["labels"] = labels
    return {"apiVersion": names.API_GROUP_VERSION, "kind": names.KIND, "metadata": metadata, "spec": spec}


def pod_attempt(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["labels"][names.LABEL_ATTEMPT])


def pod_rank(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["labels"][names.LABEL_RANK])


def running_ranks(kube: Kube, namespace: str, job: str, replicas: int, attempt: int) -> list[dict[str, Any]]:
    """Wait until every rank of `attempt` has a Running pod; return those pods sorted by rank."""

    def probe() -> list[dict[str, Any]] | None:
        pods = [
            p
            for p in kube.live_pods(namespace, job)
            if pod_attempt(p) == attempt and p.get("status", {}).get("phase") == "Running"
        ]
        return sorted(pods, key=pod_rank) if len(pods) == replicas else None

    return wait_for(f"{replicas} Running pods of {job} attempt {attempt}", probe, timeout=90)


def pod_phase(kube: Kube, namespace: str, pod: str) -> str:
    return str(kube.json("get", "pod", pod, "-n", namespace).get("status", {}).get("phase", ""))


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for entry in status.get("conditions") or []:
        if entry.get("type") == kind:
            return entry  # type: ignore[no-any-return]
    return None
