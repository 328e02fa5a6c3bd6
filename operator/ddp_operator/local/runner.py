"""The attempt loop of `ddpjob run`: start a gang, watch it, restart it like the operator would.

The decisions are the operator's own (``policies.attempt``): the first failure of an attempt decides,
a retryable one restarts the whole gang as a new attempt (new rendezvous port, DDPJOB_ATTEMPT + 1)
that resumes from the newest checkpoint, until backoffLimit is spent. A stall is the operator's too
(``policies.stall``, measured by the shared progress tracker): no new synchronized step for
runPolicy.stallTimeoutSeconds stops every rank and counts as the attempt's failure, reason Stalled.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

from ddp_operator import builders
from ddp_operator.decision import REASON_DEADLINE
from ddp_operator.local.console import Console
from ddp_operator.local.plan import Host, LocalAddresses, PlanError, ProcessSpec, find_trainer, plan_process
from ddp_operator.local.ports import free_ports
from ddp_operator.local.scrape import Scraper
from ddp_operator.local.supervisor import Exit, Gang
from ddp_operator.policies import failure, stall, success
from ddp_operator.policies.accounting import account, lost_seconds
from ddp_operator.policies.attempt import AttemptVerdict, judge_attempt
from ddp_operator.policies.budget import launcher_budget
from ddp_operator.policies.restart_events import describe_lost, restart_notice
from ddp_operator.progress.render import (
    RankResult,
    accuracy_note,
    render_line,
    render_summary,
    straggler_note,
)
from ddp_operator.progress.tracker import STRAGGLER_THRESHOLD, STRAGGLER_WINDOW_SECONDS, ProgressTracker
from ddp_operator.spec import JobSpec

# Exit codes of `ddpjob run` (documented in docs/local-run.md).
EXIT_SUCCEEDED: Final = 0
EXIT_FAILED: Final = 1
EXIT_INVALID: Final = 2
# Interrupted by signal N: 128 + N, like a shell reports a program it stopped (130 for Ctrl-C).

OUTCOME_SUCCEEDED: Final = "Succeeded"
OUTCOME_FAILED: Final = "Failed"
OUTCOME_INTERRUPTED: Final = "Interrupted"

# Status lines the trainer prints once its training loop is over (see ddp_trainer.progress).
_TRAINING_ENDED = re.compile(r"(params|stopped|final) ")
# Printed by a trainer that keeps /metrics up after training (--metrics-linger).
_LINGERING = "ddp_trainer: serving /metrics for"


@dataclass(frozen=True)
class RunOptions:
    workdir: Path
    resume: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    grace_seconds: float | None = None
    progress: bool = True
    live_progress: bool = False
    progress_interval: float = 10.0
    scrape_interval: float = 1.0


@dataclass
class RunResult:
    outcome: str
    exit_code: int
    reason: str = ""
    message: str = ""
    attempts: int = 0
    results: list[RankResult] = field(default_factory=list)


def this_host() -> Host:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return Host(
        node_name=socket.gethostname(),
        cpus=os.cpu_count() or 1,
        memory_bytes=memory,
        python=sys.executable,
        loopback_interface={"linux": "lo", "darwin": "lo0"}.get(sys.platform),
    )


def grace_seconds_of(job: JobSpec, pod: Mapping[str, object]) -> float:
    spec = pod.get("spec")
    value = spec.get("terminationGracePeriodSeconds") if isinstance(spec, Mapping) else None
    if isinstance(value, int):
        return float(value)
    return float(builders.DEFAULT_TERMINATION_GRACE_SECONDS)


def prepare_checkpoint_dir(workdir: Path, resume: bool) -> Path:
    """A fresh run starts from nothing, like a new DDPJob gets a new PVC; --resume keeps it."""
    checkpoint_dir = workdir / "checkpoints"
    if checkpoint_dir.exists() and not resume:
        shutil.rmtree(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    return checkpoint_dir.resolve()


class StopRequest:
    """Set from signal handlers: the first signal stops gracefully, a second one hurries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0

    def handle(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum
        self.count += 1

    @property
    def requested(self) -> bool:
        return self.count > 0

    @property
    def hurry(self) -> bool:
        return self.count > 1


class LocalJobRunner:
    def __init__(self, job: JobSpec, options: RunOptions, console: Console, stop: StopRequest) -> None:
        # Every local rank runs on this machine (run_policy.SCHEDULING warns): no topology to place or
        # order the ranks by, so the pods are planned without one and the ranks follow NODE_RANK.
        self.job = replace(job, scheduling=replace(job.scheduling, topology=None))
        self.options = options
        self.console = console
        self.stop = stop
        self.host = this_host()
        self.attempt = 0
        self.tracker = ProgressTracker(job.replicas, job.world_size)
        self.scraper = Scraper(self.tracker, self._show_progress, interval=options.scrape_interval)
        self._gang: Gang | None = None
        # The failure of a stalled attempt and what to say about it (policies.stall), once one stalls.
        self._stall: tuple[failure.RankFailure, str] | None = None
        # Ranks still running success.FINISH_GRACE_SECONDS after rank 0 exited 0: hung after training.
        self._hung: frozenset[int] = frozenset()
        # Gang restarts spent: whole attempts, and those the launchers made in place (policies.recovery,
        # counted from rank 0's metrics as the operator counts them), with the last one's record.
        self.restarts = 0
        self._last_restart: Mapping[str, object] | None = None
        # status.lostSeconds as the operator sums it: the in-place restarts' phases (a whole attempt's
        # restart is not measured here: there is no rank 0 across attempts to say when it trained again).
        self.lost: dict[str, object] | None = None

    def _show_progress(self, tracker: ProgressTracker) -> None:
        self._follow_restarts(tracker)
        if self.options.progress and tracker.latest:
            self.console.status(render_line(tracker.view(), self.attempt, STRAGGLER_WINDOW_SECONDS))

    def _follow_restarts(self, tracker: ProgressTracker) -> None:
        """In-place restarts rank 0's pod reports: counted and printed, as the operator's Events say them."""
        rank_zero = tracker.latest.get(0)
        report = rank_zero.restart if rank_zero is not None else None
        accounting = account(self._last_restart, self.attempt, report)
        if accounting.record is None:
            return
        self.lost = lost_seconds(self.lost, self._last_restart, accounting.record)
        self._last_restart = accounting.record
        self.restarts += accounting.added
        limit = self.job.run_policy.backoff_limit
        notice = restart_notice(accounting, self.restarts, limit, resized=False)
        if notice is not None:
            self.console.note(
                f"{'restarted in place' if notice.kind == 'in-place' else 'recovered'}: {notice.text}"
            )

    def _on_line(self, rank: int, text: str) -> None:
        self.console.rank_line(rank, text)
        if _TRAINING_ENDED.match(text):
            # The trainer's last words before it exits: read its final numbers while it still serves them.
            self.scraper.scrape_rank(rank)
        elif text.startswith(_LINGERING):
            # Training is over and the endpoint waits to be scraped: take the final numbers, then let
            # it go (SIGTERM ends the trainer's linger with exit 0).
            self.scraper.scrape_rank(rank)
            gang = self._gang
            if gang is not None:
                gang.signal_rank(rank, signal.SIGTERM)

    def plan(self, attempt: int, checkpoint_dir: Path) -> list[ProcessSpec]:
        master_port, *metrics_ports = free_ports(1 + self.job.replicas)
        specs = []
        for rank in range(self.job.replicas):
            budget = launcher_budget(self.job, self.restarts)
            pod = builders.build_rank_pod(self.job, rank, attempt, restart_budget=budget)
            addresses = LocalAddresses(master_port, metrics_ports[rank], str(checkpoint_dir))
            specs.append(
                plan_process(
                    pod,
                    rank,
                    addresses,
                    self.host,
                    os.environ,
                    overrides=self.options.env,
                    template=self.job.template,
                )
            )
        return specs

    def check(self) -> None:
        """Plan every rank once before anything starts: raises PlanError for a manifest that cannot run here."""
        specs = self.plan(0, self.options.workdir / "checkpoints")
        index, _ = find_trainer(self.job.template)
        for spec in specs:
            program = spec.argv[0]
            if shutil.which(program, path=spec.env.get("PATH")) is None:
                raise PlanError(
                    f"spec.template.spec.containers[{index}].command",
                    f"{program!r} is not a program on this machine's PATH (the image is not used here); "
                    "fix: install it, or use a command this environment has",
                )

    def _announce(self, attempt: int, specs: Sequence[ProcessSpec], checkpoint_dir: Path) -> None:
        job = self.job
        if attempt == 0:
            self.console.note(
                f"job {job.name}: {job.replicas} pod(s) x {job.nproc_per_node} process(es) = world size "
                f"{job.world_size}, backend {job.backend}, restartPolicy {job.restart_policy}, "
                f"backoffLimit {job.run_policy.backoff_limit}"
            )
            self.console.note("the container image is not used: each rank runs in this Python environment")
            self.console.note(f"checkpoints: {checkpoint_dir}")
            for note in specs[0].notes:
                self.console.note(note)
            self.console.note(f"command (rank 0): {' '.join(specs[0].argv)}")
        master_port = specs[0].env.get("MASTER_PORT", "?")
        self.console.note(
            f"attempt {attempt}: rendezvous 127.0.0.1:{master_port}; metrics "
            + ", ".join(f"rank {s.rank} http://127.0.0.1:{s.metrics_port}/metrics" for s in specs)
        )

    def _deadline(self, started: float) -> float | None:
        limit = self.job.run_policy.active_deadline_seconds
        return None if limit is None else started + limit

    def run(self) -> RunResult:
        job = self.job
        result = RunResult(outcome=OUTCOME_FAILED, exit_code=EXIT_FAILED)
        checkpoint_dir = prepare_checkpoint_dir(self.options.workdir, self.options.resume)
        started = time.monotonic()
        deadline = self._deadline(started)
        grace = self.options.grace_seconds
        self.scraper.start()
        try:
            while True:
                specs = self.plan(self.attempt, checkpoint_dir)
                if grace is None:
                    grace = grace_seconds_of(job, builders.build_rank_pod(job, 0, self.attempt))
                self._announce(self.attempt, specs, checkpoint_dir)
                self._stall = None
                gang = Gang(specs, cwd=None, on_line=self._on_line)
                self._gang = gang
                if job.metrics.enabled:
                    self.scraper.set_targets({s.rank: s.metrics_port for s in specs})
                exits, ending = self._watch(gang, grace, deadline)
                self.console.clear_status()
                metrics = self.scraper.snapshot()
                self.scraper.set_targets({})
                result.attempts = self.attempt + 1
                result.results.extend(
                    RankResult(
                        attempt=self.attempt,
                        rank=s.rank,
                        pod_name=s.pod_name,
                        exit_code=exits[s.rank].exit_code if s.rank in exits else None,
                        metrics=metrics.get(s.rank),
                    )
                    for s in specs
                )
                if ending == "interrupted":
                    self._interrupted(result, checkpoint_dir)
                    break
                if ending == "deadline":
                    result.reason = REASON_DEADLINE
                    result.message = f"activeDeadlineSeconds {job.run_policy.active_deadline_seconds} reached"
                    break
                verdict = self._judge(exits, ending, self.restarts)
                if verdict.outcome == "succeeded":
                    result.outcome = OUTCOME_SUCCEEDED
                    result.exit_code = EXIT_SUCCEEDED
                    result.reason = verdict.reason
                    result.message = verdict.message
                    break
                self.console.note(verdict.message)
                if verdict.outcome != "retry":
                    result.reason = verdict.reason
                    result.message = verdict.message
                    break
                if self.stop.requested:
                    # Asked to stop while the failed attempt wound down: no new attempt starts.
                    self._interrupted(result, checkpoint_dir, f" before attempt {self.attempt + 1} started")
                    break
                self.restarts += 1
                self.attempt += 1
        finally:
            self.scraper.stop()
            self.console.clear_status()
        return result

    def _judge(self, exits: Mapping[int, Exit], ending: str, restarts: int) -> AttemptVerdict:
        """The operator's verdict on an attempt that ended: by its exits, or by its stall."""
        job = self.job
        failures = [
            failure.RankFailure(rank=e.rank, finish_key=e.finished_at, exit_code=e.exit_code)
            for e in exits.values()
            if e.exit_code != 0
        ]
        succeeded = [e.rank for e in exits.values() if e.exit_code == 0]
        stalled = self._stall if ending == "stalled" else None
        if stalled is not None:
            # The ranks' exits are the stop's doing, as pods deleted by the operator: the stall decides.
            failures, succeeded = [stalled[0]], []
        hung = self._hung if ending == "hung" else frozenset()
        if hung:
            # The hung ranks' exits are the stop's doing: training was over when it began.
            failures, succeeded = [], [rank for rank in succeeded if rank not in hung]
        verdict = judge_attempt(
            job.restart_policy,
            job.run_policy.backoff_limit,
            restarts,
            self.attempt,
            job.replicas,
            failures,
            succeeded,
            running_ranks=hung,
            finish_grace_left=0.0 if hung else None,
        )
        return verdict if stalled is None else replace(verdict, message=f"{stalled[1]}; {verdict.message}")

    def _stalled(self) -> tuple[failure.RankFailure, str] | None:
        """The attempt's stall, once no new step was read for the stall limit (policies.stall.limit)."""
        clock = self.scraper.stall_clock()
        limit, since = stall.clock(
            self.job.run_policy.stall_timeout_seconds,
            clock.step_seconds,
            clock.step_changed_at,
            clock.group_changed_at,
        )
        if limit is None or clock.finished:
            return None
        now = datetime.now(UTC)
        step, rank_steps = clock.step, clock.rank_steps
        left = stall.seconds_left(limit, step, since, now)
        if left is None or left > 0:
            return None
        nodes = {rank * self.job.nproc_per_node: self.host.node_name for rank in range(self.job.replicas)}
        return stall.stalled(limit, step, rank_steps, nodes, now)

    def _interrupted(self, result: RunResult, checkpoint_dir: Path, when: str = "") -> None:
        signum = self.stop.signum or signal.SIGINT
        name = signal.Signals(signum).name
        result.outcome = OUTCOME_INTERRUPTED
        result.exit_code = failure.exit_code_of_signal(signum)
        result.reason = name
        result.message = (
            f"stopped by {name}{when}; checkpoints in {checkpoint_dir} "
            "(run again with --resume to continue from them)"
        )

    def _watch(self, gang: Gang, grace: float, deadline: float | None) -> tuple[dict[int, Exit], str]:
        """Wait until every rank exited 0, one failed, the deadline passed, or a stop was asked for."""
        exits: dict[int, Exit] = {}
        ending = "completed"
        while len(exits) < len(gang.processes):
            if self.stop.requested:
                ending = "interrupted"
                self.console.note(
                    f"{signal.Signals(self.stop.signum or signal.SIGINT).name}: sending SIGTERM to every rank, "
                    f"waiting up to {grace:.0f}s for them to checkpoint and exit (again to kill now)"
                )
                gang.stop(grace, should_hurry=lambda: self.stop.hurry)
                break
            if deadline is not None and time.monotonic() >= deadline:
                ending = "deadline"
                self.console.note("activeDeadlineSeconds reached: stopping every rank")
                gang.stop(grace, should_hurry=self._hurry_noting(grace))
                break
            if self._hung_after_training(exits, gang):
                ending = "hung"
                gang.stop(grace, should_hurry=self._hurry_noting(grace))
                break
            # A rank that exited 0 passed the final barrier: training is over, nothing can stall.
            self._stall = None if exits else self._stalled()
            if self._stall is not None:
                ending = "stalled"
                self.console.note(f"{self._stall[1]}: stopping every rank")
                gang.stop(grace, should_hurry=self._hurry_noting(grace))
                break
            finished = gang.next_exit(timeout=0.2)
            if finished is None:
                continue
            exits[finished.rank] = finished
            self.scraper.forget(finished.rank)
            if finished.exit_code != 0:
                # The operator deletes every pod of a failed attempt; here that is SIGTERM to the rest.
                running = len(gang.running)
                if running:
                    self.console.note(
                        f"rank {finished.rank} exited with code {finished.exit_code}: "
                        f"stopping the other {running} rank(s) of attempt {self.attempt}"
                    )
                gang.stop(grace, should_hurry=self._hurry_noting(grace))
                break
        gang.wait_all()
        while (more := gang.next_exit(timeout=0)) is not None:
            exits.setdefault(more.rank, more)
        return exits, ending

    def _hung_after_training(self, exits: Mapping[int, Exit], gang: Gang) -> bool:
        """Rank 0 exited 0 (training is over) and ranks still run success.FINISH_GRACE_SECONDS later."""
        first = exits.get(0)
        if first is None or first.exit_code != 0:
            return False
        if time.time() - first.finished_at < success.FINISH_GRACE_SECONDS:
            return False
        self._hung = frozenset(range(self.job.replicas)) - {r for r, e in exits.items() if e.exit_code == 0}
        self.console.note(f"{success.hung_message(self._hung, self.attempt)}: stopping them")
        return bool(self._hung)

    def _hurry_noting(self, grace: float) -> Callable[[], bool]:
        """``should_hurry`` for a stop that a failure or the deadline began: a Ctrl-C meanwhile is noted
        (no new attempt will start), and a second one kills at once."""
        noted = False

        def should_hurry() -> bool:
            nonlocal noted
            if self.stop.requested and not noted:
                noted = True
                name = signal.Signals(self.stop.signum or signal.SIGINT).name
                self.console.note(
                    f"{name}: no new attempt will start; waiting up to {grace:.0f}s for the ranks to exit "
                    "(again to kill now)"
                )
            return self.stop.hurry

        return should_hurry

    def summary(self, result: RunResult) -> str:
        extra = []
        if any(r.metrics is not None for r in result.results):
            extra.append(
                "(steps, samples, bytes, p50, compute per step and loss as last scraped from each pod's /metrics)"
            )
        if (note := straggler_note(result.results, STRAGGLER_THRESHOLD)) is not None:
            extra.append(note)
        if (accuracy := accuracy_note(result.results)) is not None:
            extra.append(accuracy)
        if self.lost:
            extra.append(f"lost to in-place restarts: {describe_lost(self.lost)}")
        outcome = result.outcome
        if result.reason:
            outcome += f" ({result.reason})"
        if result.message:
            outcome += f": {result.message}"
        return render_summary(result.results, outcome, result.attempts, extra)
