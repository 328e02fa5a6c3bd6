"""Effective training time under chaos, on kind (a real kubelet, our images): the same job clean and with
a fault every ``--every`` seconds, and where the lost time goes.

The job is the digits example on 2 ranks (restartMode InPlace, a checkpoint volume, a checkpoint every
20 steps), a fixed amount of work (``--epochs``). A *clean* run measures its wall time from the apply to
``Succeeded`` on this machine's clock; a *faulty* run of the same manifest takes a fault every
``--every`` seconds once it trains, cycling through the classes of ``--faults``:

- ``worker-kill``: rank 1's training worker SIGKILLed (`kubectl exec`), its pod kept;
- ``pod-delete``: rank 1's pod deleted;
- ``rank-0-pod-delete``: rank 0's pod deleted;
- ``hard-kill``: rank 1's trainer container SIGKILLed from the node (its launcher, PID 1 of the
  container, and every worker die at once and leave no word: a node crash or an OOM kill of the launcher);
- ``rank-0-hard-kill``: the same to rank 0's container;
- ``freeze``: every process of rank 1's container SIGSTOPped from the node (a hang: nothing exits, no
  socket closes). A hang is found by the operator's stall limit (max(30 s, 10x the step time)), so it
  is not in the default cycle: ``--hang`` runs one faulty run with a single freeze and reports it apart.

``--faults`` takes the classes, or one of the mixes ``worker-kills`` (worker SIGKILLs only),
``pod-losses`` (every fault a lost pod: deleted, or hard-killed with no SIGTERM, rank 0's and rank 1's
in turn) and ``mix`` (all but the freeze). ``--standby-pods 1`` gives the job a standby pod;
``--node tight`` first fills the node with a pod of the ranks' priority that leaves room for the ranks
and the standbys only (a replacement then finds no room unless a standby yields: the case of issue 45),
``--node room`` leaves it as it is (``--waiting-cpu``: the operator's ``--standby-waiting-cpu``, which
a waiting standby requests). Every run must end with the clean run's parameters (rank 0's
``params`` line, the digest of its model's state).

A fault waits for its target to be Running and training again (a fault on a pod still starting is not
the fault measured). ETTR = clean wall time / faulty wall time. Clean runs of one manifest differ by a
few percent on a small machine (its pace drifts), as much as the faults cost, so each run is also read
against itself: rank 0's log, followed across its pods with the kubelet's timestamps (`ddpjob logs -f
--timestamps`), gives the time of every 50th step; the *lost time within the run* is the span from its
first to its last step less those steps at the run's own undisturbed pace (the intervals no fault's
first 15 s touch), and *ETTR within the run* = (wall - that) / wall. The same reading of the clean run,
at the faulty run's fault offsets, is the estimate's floor: what it says of a run that lost nothing.
``--clean-runs`` fewer than ``--runs`` leaves the later faulty runs with that reading only. Each fault's cost is split from the
operator's record of it (``status.lastRestart``, docs/restarts.md "Every restart measured"): *detection*
(the fault to ``failureTime``), *stop* (to ``stoppedSeconds``), *re-form* (to ``reformedSeconds``:
for a replaced pod this holds the new pod's start), *resume* (to ``resumedSeconds``: the state hand-off
and the first step) and *redone* (``stepsRedone``, in steps).

Needs a kind cluster with both images loaded and the chart installed (docs/benchmarks.md):

    python benchmarks/bench_chaos_kind.py --context kind-ddp-bench --cluster ddp-bench --runs 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from bench_recovery_kind import Kube, manifest, rank0_metrics, wait_for
from ddp_harness import kind_faults
from ddp_operator import builders, names

NAMESPACE = "bench-recovery"
FAULTS = ("worker-kill", "pod-delete", "rank-0-pod-delete", "hard-kill")
MIXES = {
    "worker-kills": ("worker-kill",),
    "pod-losses": ("pod-delete", "rank-0-hard-kill", "rank-0-pod-delete", "hard-kill"),
    "mix": ("worker-kill", "pod-delete", "rank-0-hard-kill", "worker-kill", "rank-0-pod-delete", "hard-kill"),
}
FILLER = "chaos-filler"


@dataclass
class Fault:
    kind: str
    at: float
    record: dict[str, Any] = field(default_factory=dict)

    def phases(self) -> dict[str, float | None]:
        """Seconds from the fault to each phase the operator recorded (None: not recorded)."""
        failure = self.record.get("failureTime")
        failed_at = (
            datetime.fromisoformat(str(failure).replace("Z", "+00:00")).timestamp() if failure else None
        )
        detection = None if failed_at is None else max(0.0, failed_at - self.at)

        def after(key: str) -> float | None:
            value = self.record.get(key)
            return None if value is None or detection is None else detection + float(value)

        return {
            "detection": detection,
            "stopped": after("stoppedSeconds"),
            "reformed": after("reformedSeconds"),
            "resumed": after("resumedSeconds"),
            "redone": float(self.record["stepsRedone"]) if "stepsRedone" in self.record else None,
        }


@dataclass
class Outcome:
    wall_s: float
    faults: list[Fault]
    status: dict[str, Any]
    digest: str | None = None
    # Rank 0's (time, step) at each `progress`/`resumed` line, on the node's clock, across its pods.
    steps: list[tuple[float, int]] = field(default_factory=list)


class StepLog:
    """Rank 0's log followed across its pods (`ddpjob logs -f --timestamps`, the product's follower),
    kept as the times of its steps: what the within-run estimate of the lost time reads."""

    def __init__(self, kube: Kube, job: str) -> None:
        command = [
            sys.executable, "-m", "ddp_operator", "logs", job, "-f", "--rank", "0", "--timestamps",
            "--context", kube.context, "-n", NAMESPACE,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.steps: list[tuple[float, int]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            stamp, _, text = line.partition(" ")
            if text.startswith(("progress step=", "resumed step=")):
                step = int(text.split("step=", 1)[1].split()[0])
                self.steps.append(
                    (datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00").timestamp(), step)
                )

    def finish(self, timeout: float = 60) -> list[tuple[float, int]]:
        """The steps, once the follower has read every pod's log to its end (it ends by itself after
        the job finished) or ``timeout`` passed."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.reader.join(timeout=10)
        return sorted(self.steps)


@dataclass(frozen=True)
class WithinRun:
    """The time a run lost to its faults, against its own undisturbed steps: ``lost_s`` = the span
    from rank 0's first to its last step, less those steps at the run's undisturbed rate (the
    ``step_s`` of every interval between two step lines that no fault's first ``settle`` seconds
    touch). Clean runs of one manifest differ by a few percent here (the machine's pace drifts), as
    much as the faults cost; this estimate compares a run with itself."""

    lost_s: float
    step_s: float
    quiet_steps: int


def within_run(
    steps: Sequence[tuple[float, int]], faults: Sequence[float], settle: float
) -> WithinRun | None:
    """``steps``: (time, step) in time order; ``faults``: their times on the same clock. None when
    there are too few undisturbed steps to say."""
    if len(steps) < 3:
        return None
    quiet_time, quiet_steps = 0.0, 0
    for (t0, s0), (t1, s1) in itertools.pairwise(steps):
        if s1 <= s0:
            continue  # a resume (its step line repeats or goes back): not a rate
        if all(f + settle <= t0 or f >= t1 for f in faults):
            quiet_time += t1 - t0
            quiet_steps += s1 - s0
    if quiet_steps < 100:
        return None
    step_s = quiet_time / quiet_steps
    first, last = steps[0], max(steps, key=lambda p: (p[1], p[0]))
    return WithinRun((last[0] - first[0]) - (last[1] - first[1]) * step_s, step_s, quiet_steps)


def _job_manifest(name: str, epochs: int, image: str, options: JobOptions) -> dict[str, Any]:
    job = manifest(name, "in-place", 40, image)
    trainer = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    trainer["command"] = [
        "python", "-m", "ddp_trainer", "--workload", "digits", "--epochs", str(epochs), "--throttle-ms", "30",
    ]  # fmt: skip
    if options.checkpoint:
        trainer["command"] += ["--checkpoint-every", "20"]
    else:
        del job["spec"]["checkpoint"]
    if options.standby_pods:
        job["spec"]["runPolicy"]["standbyPods"] = options.standby_pods
        # The standbys are more trainer pods beside two ranks on the 2-core kind node.
        trainer["resources"]["requests"]["cpu"] = "250m"
    return job


@dataclass(frozen=True)
class JobOptions:
    """What the job is given beside its work: standby pods, a checkpoint volume."""

    standby_pods: int = 0
    checkpoint: bool = True


def _status(kube: Kube, job: str) -> dict[str, Any]:
    status: dict[str, Any] = kube.json("get", "ddpjob", job, "-n", NAMESPACE).get("status") or {}
    return status


def _live_pod(kube: Kube, job: str, rank: int) -> str | None:
    selector = f"ddp.dev/job-name={job},ddp.dev/rank={rank}"
    for pod in kube.json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"]:
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in pod["status"].get("conditions", [])
        )
        if pod["status"].get("phase") == "Running" and ready and not pod["metadata"].get("deletionTimestamp"):
            return str(pod["metadata"]["name"])
    return None


def inject(kube: Kube, cluster: str, job: str, kind: str) -> float:
    """The fault, on its rank's live pod; returns when it was done, on this machine's clock (which the
    kind node and the operator share)."""
    rank = 0 if kind.startswith("rank-0-") else 1
    pod = wait_for(f"rank {rank}'s pod Ready", lambda: _live_pod(kube, job, rank), timeout=300)
    if kind == "worker-kill":
        logs = kube.run("logs", "-n", NAMESPACE, pod, "-c", "trainer")
        started = [x for x in logs.splitlines() if x.startswith("launcher ") and "event=started" in x]
        pid = int(started[-1].split("workers=")[1].split(",")[0].split(":")[1].split()[0])
        kill = f"import os, signal; os.kill({pid}, signal.SIGKILL)"
        kube.run("exec", "-n", NAMESPACE, pod, "-c", "trainer", "--", "python3", "-c", kill)
    elif kind in ("pod-delete", "rank-0-pod-delete"):
        kube.run("delete", "pod", pod, "-n", NAMESPACE, "--wait=false")
    elif kind in ("hard-kill", "rank-0-hard-kill"):
        kind_faults.kill_container(cluster, NAMESPACE, pod)
    elif kind == "freeze":
        kind_faults.freeze_pod(cluster, NAMESPACE, pod)
    else:
        raise ValueError(f"unknown fault {kind!r}")
    return time.time()


def _millicores(text: str) -> int:
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def fill_node(kube: Kube, image: str, room: int) -> int:
    """A pod of the ranks' priority that takes the node's free CPU but ``room`` millicores; returns its
    request (0: no filler needed)."""
    kube.run("delete", "pod", FILLER, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    # An earlier run's pods still hold their requests while they terminate.
    kube.run("delete", "ddpjob", "--all", "-n", NAMESPACE, "--wait=true")
    wait_for(
        "the namespace's pods gone",
        lambda: not kube.json("get", "pods", "-n", NAMESPACE)["items"] or None,
        timeout=300,
        interval=1,
    )
    node = kube.json("get", "nodes")["items"][0]
    free = _millicores(node["status"]["allocatable"]["cpu"])
    for pod in kube.json("get", "pods", "-A")["items"]:
        if pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        for container in pod["spec"]["containers"]:
            free -= _millicores(((container.get("resources") or {}).get("requests") or {}).get("cpu", "0"))
    request = free - room
    if request <= 0:
        return 0
    filler = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": FILLER, "namespace": NAMESPACE},
        "spec": {
            "containers": [
                {
                    "name": "filler",
                    "image": image,
                    "command": ["sleep", "infinity"],
                    "resources": {"requests": {"cpu": f"{request}m", "memory": "8Mi"}},
                }
            ],
            "terminationGracePeriodSeconds": 0,
        },
    }
    kube.run("apply", "-f", "-", stdin=json.dumps(filler))
    return request


def final_digest(kube: Kube, job: str) -> str | None:
    """The digest of rank 0's parameters at the end (its newest pod's ``params rank=0`` line)."""
    selector = f"ddp.dev/job-name={job},ddp.dev/rank=0"
    pods = kube.json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"]
    for pod in sorted(pods, key=lambda p: str(p["metadata"]["creationTimestamp"]), reverse=True):
        logs = kube.run("logs", "-n", NAMESPACE, pod["metadata"]["name"], "-c", "trainer", check=False)
        for line in reversed(logs.splitlines()):
            if line.startswith("params rank=0 "):
                return line.split("sha256=")[1].split()[0]
    return None


def _training_since(kube: Kube, job: str, since: float) -> bool | None:
    """Rank 0 trains on a group formed after ``since`` (its steps move after its latest resume)."""
    metrics = rank0_metrics(kube, job)
    resumed = metrics.get("ddp_resumed_timestamp_seconds", 0.0)
    if since and resumed <= since:
        return None
    return metrics.get("ddp_sync_steps_total", 0) > 0 or None


def run_job(
    kube: Kube,
    cluster: str,
    job: str,
    epochs: int,
    image: str,
    faults: Sequence[str],
    every: float,
    limit: int | None = None,
    options: JobOptions = JobOptions(),
) -> Outcome:
    kube.run("delete", "ddpjob", job, "-n", NAMESPACE, "--ignore-not-found", "--wait=true")
    applied = time.time()
    kube.run("apply", "-f", "-", stdin=json.dumps(_job_manifest(job, epochs, image, options)))
    log = StepLog(kube, job)
    done: list[Fault] = []
    last = 0.0
    if faults:
        wait_for("training steps", lambda: _training_since(kube, job, 0.0), timeout=600, interval=0.5)
        last = time.time()
    index = 0
    while True:
        status = _status(kube, job)
        if status.get("phase") in ("Succeeded", "Failed"):
            break
        if faults and time.time() - last >= every and (limit is None or len(done) < limit):
            previous = done[-1].at if done else 0.0
            if _training_since(kube, job, previous):
                kind = faults[index % len(faults)]
                index += 1
                try:
                    at = inject(kube, cluster, job, kind)
                except (RuntimeError, subprocess.CalledProcessError, TimeoutError) as error:
                    print(f"  {kind}: not injected ({error})", file=sys.stderr, flush=True)
                    last = time.time()
                    continue
                done.append(Fault(kind, at))
                print(f"  {kind} at +{at - applied:.1f} s", file=sys.stderr, flush=True)
                last = at
        _collect(status, done)
        time.sleep(0.5)
    wall = time.time() - applied
    _collect(status, done)
    return Outcome(wall, done, status, final_digest(kube, job), log.finish())


def _collect(status: dict[str, Any], faults: list[Fault]) -> None:
    """Give the operator's latest record, once its cost is in, to the fault it follows: the latest one
    injected before its failure time (2 s of slack: a deletion's failure time is when the operator saw
    it requested, which may precede the moment `kubectl delete` returned here)."""
    record = status.get("lastRestart") or {}
    failure = record.get("failureTime")
    if not failure or "resumedSeconds" not in record:
        return
    failed_at = datetime.fromisoformat(str(failure).replace("Z", "+00:00")).timestamp()
    before = [fault for fault in faults if fault.at - 2 <= failed_at]
    if before:
        before[-1].record = dict(record)


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


# A fault's disturbance, at most: its critical path, then a fresh standby's start beside the ranks.
SETTLE_S = 15.0


def _within(run: Outcome, faults: Sequence[float]) -> WithinRun | None:
    return within_run(run.steps, faults, SETTLE_S)


def _pair_row(index: int, clean_run: Outcome | None, run: Outcome) -> tuple[str, float | None, float | None]:
    """A faulty run's row, its ETTR against its clean run (None: none) and its within-run ETTR."""
    ettr = lost = None
    same = "unread"
    if clean_run is not None:
        ettr = clean_run.wall_s / run.wall_s
        lost = (run.wall_s - clean_run.wall_s) / len(run.faults) if run.faults else 0.0
        if run.digest is not None:
            same = "yes" if run.digest == clean_run.digest else "NO"
    faults = [f.at for f in run.faults]
    own = _within(run, faults)
    within_ettr = None if own is None else (run.wall_s - own.lost_s) / run.wall_s
    floor = None
    if clean_run is not None and clean_run.steps and run.steps:
        # The clean run read as if it had taken the faulty run's faults at the same offsets: what the
        # estimate says of a run that lost nothing (its floor).
        shift = clean_run.steps[0][0] - run.steps[0][0]
        floor = _within(clean_run, [at + shift for at in faults])
    per_fault = len(run.faults) or 1

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    row = (
        f"| {index + 1} | {fmt(clean_run.wall_s if clean_run else None, '.1f')} | {run.wall_s:.1f} | "
        f"{len(run.faults)} | {fmt(ettr, '.3f')} | {fmt(lost, '.1f')} | "
        f"{fmt(within_ettr, '.3f')} | {fmt(None if own is None else own.lost_s / per_fault, '.2f')} | "
        f"{fmt(None if floor is None else floor.lost_s / per_fault, '.2f')} | "
        f"{fmt(None if own is None else own.step_s * 1000, '.1f')} | "
        f"{run.status.get('goodput', '-')} | {same} |"
    )
    return row, ettr, within_ettr


def report(clean: list[Outcome], faulty: list[Outcome], every: float, hang: Outcome | None) -> str:
    lines = [
        "| run | clean wall s | faulty wall s | faults | ETTR | lost s per fault | ETTR within the run "
        "| lost s per fault, within | the same read on the clean run | undisturbed ms a step "
        "| status.goodput (faulty) | parameters as clean |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    ratios, withins = [], []
    for index, run in enumerate(faulty):
        row, ettr, within_ettr = _pair_row(index, clean[index] if index < len(clean) else None, run)
        lines.append(row)
        ratios += [ettr] if ettr is not None else []
        withins += [within_ettr] if within_ettr is not None else []
    medians = []
    if ratios:
        medians.append(f"median ETTR {statistics.median(ratios):.3f}")
    if withins:
        medians.append(f"within the run {statistics.median(withins):.3f}")
    lines.append(f"\n{', '.join(medians) or 'no ETTR'} at a fault every {every:.0f} s\n")
    lines += [
        "| fault | n | detection s | stopped s | re-formed s | resumed s | steps redone | modes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    by_kind: dict[str, list[Fault]] = {}
    for run in faulty + ([hang] if hang else []):
        for fault in run.faults:
            by_kind.setdefault(fault.kind, []).append(fault)
    for kind, items in by_kind.items():
        phases = [f.phases() for f in items]
        modes = sorted({str(f.record.get("mode", "unrecorded")) for f in items})
        lines.append(
            f"| {kind} | {len(items)} | "
            + " | ".join(
                _fmt(_median([p[k] for p in phases])) for k in ("detection", "stopped", "reformed", "resumed")
            )
            + f" | {_fmt(_median([p['redone'] for p in phases]))} | {', '.join(modes)} |"
        )
    if hang is not None and clean:
        median = statistics.median(c.wall_s for c in clean)
        lines.append(
            f"\nhang: one freeze, wall {hang.wall_s:.1f} s against a clean {median:.1f} s "
            f"(lost {hang.wall_s - median:.1f} s)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--context", default="kind-ddp", help="kubectl context of the kind cluster [kind-ddp]"
    )
    parser.add_argument("--cluster", default="ddp", help="kind cluster name, for the node's container [ddp]")
    parser.add_argument("--kubectl", default="kubectl")
    parser.add_argument("--image", default="ddp-trainer:0.1.0")
    parser.add_argument("--epochs", type=int, default=12, help="the job's work [12]")
    parser.add_argument("--every", type=float, default=40.0, help="seconds between faults [40]")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"the cycle, of {', '.join(FAULTS)}, rank-0-hard-kill, freeze; or a mix: {', '.join(MIXES)}",
    )
    parser.add_argument(
        "--node",
        choices=["room", "tight"],
        default="room",
        help="tight: fill the node but for the ranks and the standbys [room]",
    )
    parser.add_argument("--min-faults", type=int, default=0, help="fail a faulty run with fewer faults [0]")
    parser.add_argument("--runs", type=int, default=3, help="clean and faulty pairs [3]")
    parser.add_argument(
        "--clean-runs",
        type=int,
        default=None,
        help="clean runs, the first of each pair (fewer: the later faulty runs are read within the run "
        "only) [--runs]",
    )
    parser.add_argument("--hang", action="store_true", help="also one faulty run with a single freeze")
    parser.add_argument("--standby-pods", type=int, default=0, help="runPolicy.standbyPods of the job [0]")
    parser.add_argument(
        "--waiting-cpu",
        default=names.DEFAULT_STANDBY_WAITING_CPU,
        help="the operator's --standby-waiting-cpu, for the room --node tight leaves "
        f"('' : the ranks' request) [{names.DEFAULT_STANDBY_WAITING_CPU}]",
    )
    parser.add_argument(
        "--no-checkpoint", action="store_true", help="no checkpoint volume (a standby may then take rank 0)"
    )
    args = parser.parse_args(argv)
    options = JobOptions(standby_pods=args.standby_pods, checkpoint=not args.no_checkpoint)
    kube = Kube(args.context, args.kubectl)
    kube.run("create", "namespace", NAMESPACE, check=False)
    faults = list(MIXES.get(args.faults) or [f for f in args.faults.split(",") if f])
    filler = 0
    if args.node == "tight":
        request = _millicores("250m" if options.standby_pods else "500m")
        rendezvous = _millicores(builders.RENDEZVOUS_RESOURCES["requests"]["cpu"])
        # A standby waits with the operator's waiting CPU (--waiting-cpu: what the chart was given).
        standby = _millicores(args.waiting_cpu) if args.waiting_cpu else request
        filler = fill_node(kube, args.image, request * 2 + standby * options.standby_pods + rendezvous)
    print(f"faults {','.join(faults)}; node {args.node} (filler {filler}m)", file=sys.stderr, flush=True)
    clean: list[Outcome] = []
    faulty: list[Outcome] = []
    clean_runs = args.runs if args.clean_runs is None else min(args.clean_runs, args.runs)
    for index in range(args.runs):
        base = None
        if index < clean_runs:
            base = run_job(
                kube, args.cluster, "chaos-clean", args.epochs, args.image, [], args.every, options=options
            )
            print(
                f"clean run {index + 1}: {base.wall_s:.1f} s {base.status.get('phase')}, params {base.digest}",
                file=sys.stderr,
                flush=True,
            )
        # Each run starts the cycle one class later, so short runs still take every class.
        cycle = faults[index % len(faults) :] + faults[: index % len(faults)]
        run = run_job(
            kube, args.cluster, "chaos-faulty", args.epochs, args.image, cycle, args.every, options=options
        )
        print(
            f"faulty run {index + 1}: {run.wall_s:.1f} s {run.status.get('phase')}, {len(run.faults)} faults, "
            f"params {run.digest}",
            file=sys.stderr,
            flush=True,
        )
        if run.status.get("phase") != "Succeeded" or (base and base.status.get("phase") != "Succeeded"):
            print(
                json.dumps({"clean": base and base.status, "faulty": run.status}, indent=1), file=sys.stderr
            )
            return 1
        if base is not None:
            clean.append(base)
        faulty.append(run)
    hang = None
    if args.hang:
        hang = run_job(
            kube,
            args.cluster,
            "chaos-hang",
            args.epochs,
            args.image,
            ["freeze"],
            args.every,
            limit=1,
            options=options,
        )
    print(report(clean, faulty, args.every, hang))
    if filler:
        kube.run("delete", "pod", FILLER, "-n", NAMESPACE, "--ignore-not-found", "--wait=false")
    short = [index + 1 for index, run in enumerate(faulty) if len(run.faults) < args.min_faults]
    if short:
        print(
            f"faulty runs {short} took fewer than {args.min_faults} faults: raise --epochs", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
