"""From a rank's failure to training again, on kind (a real kubelet, our images), by recovery mode.

Three modes (docs/restarts.md), each on a digits job of 2 ranks with a checkpoint every 20 steps:

- ``in-place``: rank 1's training worker is SIGKILLed (`kubectl exec` into its pod); every pod's
  launcher restarts its workers on a new rendezvous round, no pod is created or deleted;
- ``pod-replaced``: rank 1's pod is deleted; the operator creates one new pod for rank 1, rank 0
  restarts in place and waits for it;
- ``rank-0-replaced``: rank 0's pod is deleted; the store is the attempt's rendezvous pod, so rank 0's
  pod is replaced alone like any other (before the rendezvous pod, this was the whole gang's path);
- ``whole-gang``: the same deletion under ``runPolicy.restartMode: Recreate``: every pod is recreated;
- ``elastic-rank-0-replaced``: rank 0's pod deleted in an elastic job of 1..2 pods: replaced alone, and
  the survivor waits for the new pod 0 instead of training without it (docs/elastic.md);
- ``standby-pod-replaced``: rank 1's pod deleted in a job with ``runPolicy.standbyPods: 1``: a running
  standby pod takes rank 1 instead of a new pod (docs/restarts.md, "Standby pods");
- ``standby-rank-0-replaced``: the same for rank 0's pod, whose checkpoint volume (ReadWriteOnce) the
  standby mounts too, on rank 0's node (docs/restarts.md, "Standby pods");
- ``hard-kill``, ``standby-hard-kill``: rank 1's trainer container SIGKILLed from the node (its launcher
  and workers die at once, no word: a node crash, an OOM kill of the launcher), without and with a
  standby;
- ``freeze``: every process of rank 1's container SIGSTOPped from the node, no standby: found by the
  operator's stall limit, then replaced by a new pod;
- ``rendezvous-lost``: the rendezvous pod deleted mid-training, then, once every pod's supervisor goes on
  with its replacement, rank 1's worker SIGKILLed as in ``in-place``: the figure is that restart's, met
  in the new store; ``relinked`` is from the deletion to the last supervisor on the new store, and the
  run checks that the ranks kept training meanwhile and that no rank pod was recreated;
- ``standby-freeze``: every process of rank 1's container SIGSTOPped from the node (a hang), with a
  standby: found by the operator's stall limit (no ``stallTimeoutSeconds``), then taken by the standby.
  Its figure includes the detection (``--cluster`` names the kind cluster, for the node's container).

In the standby modes each failure waits first for a standby whose launcher waits, ready.

Each mode's job takes ``--runs`` failures one after the other (backoffLimit leaves room for all), each
once the job has trained and checkpointed again since the last. Measured from the failure (the time the
kill or the delete returned, on this machine's clock, which kind's node shares): until rank 0's first
training step after the resume (the trainer's ``ddp_resumed_timestamp_seconds``, read through the
apiserver's pod proxy), and the phases the operator recorded in ``status.lastRestart`` (survivors stopped,
group re-formed). Prints the medians per mode and their ratio to the whole gang's, as a table.

Needs a kind cluster with both images loaded and the chart installed (``make kind-up``, then
``helm install ddp-operator charts/ddp-operator -n ddp-system --create-namespace --wait``):

    python benchmarks/bench_recovery_kind.py --context kind-ddp --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import yaml

from ddp_harness import kind_faults

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "digits-cpu.yaml"
NAMESPACE = "bench-recovery"
METRICS_PORT = 9400
MODES = (
    "in-place",
    "pod-replaced",
    "rank-0-replaced",
    "whole-gang",
    "elastic-rank-0-replaced",
    "standby-pod-replaced",
    "standby-rank-0-replaced",
    "hard-kill",
    "standby-hard-kill",
    "standby-freeze",
    "freeze",
    "rendezvous-lost",
)
# The modes that fail rank 0's pod (the others fail rank 1).
RANK_0_MODES = frozenset({"rank-0-replaced", "elastic-rank-0-replaced", "standby-rank-0-replaced"})
T = TypeVar("T")


@dataclass
class Run:
    mode: str
    resumed_s: float
    stopped_s: float | None = None
    reformed_s: float | None = None
    operator_resumed_s: float | None = None
    steps_redone: int | None = None
    # Whether the survivor's workers kept their processes (the same PIDs in its next round's
    # `launcher event=started` line); None where the survivor's pod is not the same after the failure.
    survivors_kept: bool | None = None
    # rendezvous-lost: from the rendezvous pod's deletion to the last supervisor on its replacement.
    relinked_s: float | None = None


@dataclass
class Kube:
    context: str
    kubectl: str = "kubectl"
    calls: list[str] = field(default_factory=list)

    def run(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [self.kubectl, "--context", self.context, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json"))


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 600, interval: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


def manifest(name: str, mode: str, runs: int, image: str) -> dict[str, Any]:
    job: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"] = {"name": name, "namespace": NAMESPACE}
    job["spec"]["runPolicy"] = {
        "backoffLimit": runs + 2,
        "restartMode": "Recreate" if mode == "whole-gang" else "InPlace",
    }
    job["spec"]["checkpoint"] = {
        "volumeClaimTemplate": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        }
    }
    if mode.startswith("standby"):
        job["spec"]["runPolicy"]["standbyPods"] = 1
    if mode.startswith("elastic"):
        del job["spec"]["replicas"]
        job["spec"]["elastic"] = {"minReplicas": 1, "maxReplicas": 2}
    trainer = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    trainer["image"] = image
    if mode.startswith("standby"):
        # A third trainer pod (the standby) beside two ranks on the 2-core kind node.
        trainer["resources"]["requests"]["cpu"] = "250m"
    trainer["command"] = [
        "python", "-m", "ddp_trainer", "--workload", "digits", "--epochs", "400",
        "--throttle-ms", "30", "--checkpoint-every", "20",
    ]  # fmt: skip
    return job


def rank0_metrics(kube: Kube, job: str) -> dict[str, float]:
    pods = kube.json("get", "pods", "-n", NAMESPACE, "-l", f"ddp.dev/job-name={job},ddp.dev/rank=0")["items"]
    live = [
        p
        for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]
    if not live:
        return {}
    name = live[0]["metadata"]["name"]
    path = f"/api/v1/namespaces/{NAMESPACE}/pods/{name}:{METRICS_PORT}/proxy/metrics"
    text = kube.run("get", "--raw", path, "--request-timeout=5s", check=False)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        series = key.split("{", 1)[0]
        try:
            values[series] = max(values.get(series, float("-inf")), float(value))
        except ValueError:
            continue
    return values


def fail(kube: Kube, job: str, mode: str, cluster: str) -> float:
    """Fail rank 1 (rank 0 for RANK_0_MODES) the mode's way; when it was done, on this machine's
    clock."""
    rank = 0 if mode in RANK_0_MODES else 1
    selector = f"ddp.dev/job-name={job},ddp.dev/rank={rank}"
    pods = kube.json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"]
    victim = next(
        p["metadata"]["name"]
        for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    )
    if mode in ("in-place", "rendezvous-lost"):
        # The worker its launcher started last (`launcher event=started workers=RANK:PID`).
        logs = kube.run("logs", "-n", NAMESPACE, victim, "-c", "trainer")
        started = [
            line for line in logs.splitlines() if line.startswith("launcher ") and "event=started" in line
        ]
        pid = int(started[-1].split("workers=")[1].split(",")[0].split(":")[1].split()[0])
        kill = f"import os, signal; os.kill({pid}, signal.SIGKILL)"
        kube.run("exec", "-n", NAMESPACE, victim, "-c", "trainer", "--", "python3", "-c", kill)
    elif mode.endswith("hard-kill"):
        kind_faults.kill_container(cluster, NAMESPACE, victim)
    elif mode.endswith("freeze"):
        kind_faults.freeze_pod(cluster, NAMESPACE, victim)
    else:
        kube.run("delete", "pod", victim, "-n", NAMESPACE, "--wait=false")
    return time.time()


def started_workers(kube: Kube, job: str, rank: int) -> tuple[str, list[set[int]]] | None:
    """The live pod of ``rank`` and its workers' PIDs in each round it started (its supervisor's
    `launcher event=started workers=RANK:PID,...` lines)."""
    pods = kube.json("get", "pods", "-n", NAMESPACE, "-l", f"ddp.dev/job-name={job},ddp.dev/rank={rank}")
    for pod in pods["items"]:
        if pod["status"].get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
            continue
        name = pod["metadata"]["name"]
        logs = kube.run("logs", "-n", NAMESPACE, name, "-c", "trainer", check=False)
        rounds = []
        for line in logs.splitlines():
            if line.startswith("launcher ") and "event=started" in line:
                workers = line.split("workers=")[1].split()[0]
                rounds.append({int(item.split(":")[1]) for item in workers.split(",")})
        return name, rounds
    return None


def standby_ready(kube: Kube, job: str) -> bool | None:
    """A standby pod of ``job`` whose launcher logged that it waits (torch imported, forkserver up)."""
    pods = kube.json("get", "pods", "-n", NAMESPACE, "-l", f"ddp.dev/job-name={job},ddp.dev/role=standby")
    for pod in pods["items"]:
        if pod["status"].get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
            continue
        logs = kube.run("logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "trainer", check=False)
        if "launcher event=standby " in logs:
            return True
    return None


def rank_pod_uids(kube: Kube, job: str) -> set[str]:
    pods = kube.json("get", "pods", "-n", NAMESPACE, "-l", f"ddp.dev/job-name={job},ddp.dev/rank")["items"]
    return {p["metadata"]["uid"] for p in pods if not p["metadata"].get("deletionTimestamp")}


def lose_the_rendezvous_pod(kube: Kube, job: str) -> float:
    """Delete the job's serving rendezvous pod; return once every rank's supervisor logged that it goes on
    with the replacement (`launcher event=store-relinked`), the seconds that took. The ranks must have
    trained meanwhile and no rank pod may have been recreated."""
    uid = kube.json("get", "ddpjob", job, "-n", NAMESPACE)["metadata"]["uid"]
    selector = f"ddp.dev/job-uid={uid},ddp.dev/role=rendezvous"
    stores = [
        p["metadata"]["name"]
        for p in kube.json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"]
        if not p["metadata"].get("deletionTimestamp")
    ]
    pods, steps = rank_pod_uids(kube, job), rank0_metrics(kube, job).get("ddp_sync_steps_total", 0)
    relinks_before = {rank: relinks(kube, job, rank) for rank in (0, 1)}
    kube.run("delete", "pod", stores[0], "-n", NAMESPACE, "--wait=false")
    deleted = time.time()
    for rank in (0, 1):
        wait_for(
            f"rank {rank} on the new store",
            lambda rank=rank: relinks(kube, job, rank) > relinks_before[rank] or None,
        )
    relinked = time.time() - deleted
    if rank0_metrics(kube, job).get("ddp_sync_steps_total", 0) <= steps:
        raise AssertionError("the ranks stopped training while the rendezvous pod was replaced")
    if rank_pod_uids(kube, job) != pods:
        raise AssertionError("a rank pod was recreated for the rendezvous pod's loss")
    return relinked


def relinks(kube: Kube, job: str, rank: int) -> int:
    pods = kube.json("get", "pods", "-n", NAMESPACE, "-l", f"ddp.dev/job-name={job},ddp.dev/rank={rank}")
    live = [p for p in pods["items"] if not p["metadata"].get("deletionTimestamp")]
    if not live:
        return 0
    logs = kube.run("logs", "-n", NAMESPACE, live[0]["metadata"]["name"], "-c", "trainer", check=False)
    return sum(1 for line in logs.splitlines() if line.startswith("launcher event=store-relinked "))


def one_failure(kube: Kube, job: str, mode: str, restarts_before: int, cluster: str) -> Run:
    # Trained and checkpointed since the last resume: a few seconds of steps.
    def training() -> bool | None:
        return rank0_metrics(kube, job).get("ddp_sync_steps_total", 0) > 0 or None

    wait_for("training steps", training)
    time.sleep(4.0)
    if mode.startswith("standby"):
        wait_for("a standby waiting, ready", lambda: standby_ready(kube, job))
    survivor_rank = 1 if mode in RANK_0_MODES else 0
    relinked = lose_the_rendezvous_pod(kube, job) if mode == "rendezvous-lost" else None
    before = started_workers(kube, job, survivor_rank)
    failed_at = fail(kube, job, mode, cluster)

    def resumed() -> float | None:
        at = rank0_metrics(kube, job).get("ddp_resumed_timestamp_seconds")
        return at if at is not None and at > failed_at else None

    resumed_at = wait_for("rank 0's first step after the resume", resumed, timeout=600)
    after = started_workers(kube, job, survivor_rank)
    kept = None
    if before is not None and after is not None and before[0] == after[0] and len(after[1]) > len(before[1]):
        kept = before[1][-1] <= after[1][-1]

    def recorded() -> dict[str, Any] | None:
        """The operator's record of this failure (not the previous one's), once its cost is in."""
        status: dict[str, Any] = kube.json("get", "ddpjob", job, "-n", NAMESPACE).get("status") or {}
        record = status.get("lastRestart") or {}
        failure = datetime.fromisoformat(
            str(record.get("failureTime", "1970-01-01T00:00:00Z")).replace("Z", "+00:00")
        )
        this_one = failure.timestamp() >= failed_at - 10
        counted = status.get("restarts", 0) > restarts_before
        return status if counted and this_one and "resumedSeconds" in record else None

    status = wait_for("the restart recorded", recorded, timeout=120)
    record = status["lastRestart"]

    def number(key: str) -> float | None:
        return float(record[key]) if key in record else None

    return Run(
        mode=mode,
        resumed_s=resumed_at - failed_at,
        stopped_s=number("stoppedSeconds"),
        reformed_s=number("reformedSeconds"),
        operator_resumed_s=number("resumedSeconds"),
        steps_redone=int(record["stepsRedone"]) if "stepsRedone" in record else None,
        survivors_kept=kept,
        relinked_s=relinked,
    )


def bench_mode(kube: Kube, mode: str, runs: int, image: str, cluster: str) -> list[Run]:
    job = f"bench-{mode}"
    kube.run("delete", "ddpjob", job, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    kube.run("apply", "-f", "-", stdin=json.dumps(manifest(job, mode, runs, image)))

    def running() -> bool | None:
        status = kube.json("get", "ddpjob", job, "-n", NAMESPACE).get("status") or {}
        return status.get("phase") == "Running" or None

    wait_for(f"{job} Running", running)
    results = []
    for index in range(runs):
        restarts = int(
            (kube.json("get", "ddpjob", job, "-n", NAMESPACE).get("status") or {}).get("restarts", 0)
        )
        run = one_failure(kube, job, mode, restarts, cluster)
        print(f"{mode} run {index + 1}: {run}", file=sys.stderr, flush=True)
        results.append(run)
    kube.run("delete", "ddpjob", job, "-n", NAMESPACE, "--wait=true")
    return results


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def table(results: dict[str, list[Run]]) -> str:
    whole = _median([r.resumed_s for r in results.get("whole-gang", [])])
    lines = [
        "| mode | runs | failure to training again (median s) | vs whole gang | survivors stopped | group re-formed | operator's resumedSeconds | steps redone | survivor's workers kept their PIDs | rendezvous pod replaced, supervisors relinked (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, runs in results.items():
        resumed = _median([r.resumed_s for r in runs])

        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        ratio = "-" if resumed is None or not whole else f"{resumed / whole:.2f}"
        lines.append(
            f"| {mode} | {len(runs)} | {fmt(resumed)} | {ratio} | {fmt(_median([r.stopped_s for r in runs]))} | "
            f"{fmt(_median([r.reformed_s for r in runs]))} | {fmt(_median([r.operator_resumed_s for r in runs]))} | "
            f"{fmt(_median([float(r.steps_redone) if r.steps_redone is not None else None for r in runs]))} | "
            f"{sum(1 for r in runs if r.survivors_kept)}/{sum(1 for r in runs if r.survivors_kept is not None)} | "
            f"{fmt(_median([r.relinked_s for r in runs]))} |"
        )
    return "\n".join(lines)


def kind_parser(description: str | None) -> argparse.ArgumentParser:
    """The arguments every kind benchmark takes: the cluster's context, kubectl, the trainer image."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--context", default="kind-ddp", help="kubectl context of the kind cluster [kind-ddp]"
    )
    parser.add_argument("--kubectl", default="kubectl")
    parser.add_argument("--image", default="ddp-trainer:0.1.0")
    return parser


def kind_cluster(args: argparse.Namespace) -> Kube:
    """kubectl on the benchmark's cluster, with the benchmarks' namespace there."""
    kube = Kube(args.context, args.kubectl)
    kube.run("create", "namespace", NAMESPACE, check=False)
    return kube


def main(argv: Sequence[str] | None = None) -> int:
    parser = kind_parser(__doc__)
    parser.add_argument("--runs", type=int, default=5, help="failures per mode [5]")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--cluster", default="ddp", help="kind cluster name, for the node's container [ddp]")
    args = parser.parse_args(argv)
    kube = kind_cluster(args)
    results = {
        mode: bench_mode(kube, mode, args.runs, args.image, args.cluster) for mode in args.modes.split(",")
    }
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
