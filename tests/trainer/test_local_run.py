"""`ddpjob run` end to end: real rank processes on gloo, restarted and stopped like the operator would.

Each test runs the real command in its own session and checks what a user would: the exit status,
the ranks' output, the checkpoints, and that no process of the job is left once the command is over
(every rank carries ``DDPJOB_NAME`` in its environment, torchrun's workers too, so /proc tells).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.trainer, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]

REPO = Path(__file__).resolve().parents[2]
# Bounds on how long a broken test can hang; nothing asserts on elapsed time.
RUN_TIMEOUT = 300.0

TRAINER_JOB = """\
apiVersion: ddp.dev/v1alpha1
kind: DDPJob
metadata:
  name: {name}
spec:
  replicas: 2
  runPolicy:
    backoffLimit: 2
    restartMode: {mode}
  template:
    spec:
      terminationGracePeriodSeconds: 60
      containers:
        - name: trainer
          image: ddp-trainer:test
          args: [{args}]
"""


def job_processes(job_name: str) -> list[int]:
    """PIDs of live processes whose environment says they belong to ``job_name``."""
    marker = f"DDPJOB_NAME={job_name}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in environ and state != "Z":
            found.append(int(entry.name))
    return found


def rank_pid(job_name: str, node_rank: int, attempt: int) -> int | None:
    """The main process of one rank pod of one attempt."""
    wanted = {
        f"DDPJOB_NAME={job_name}".encode(),
        f"NODE_RANK={node_rank}".encode(),
        f"DDPJOB_ATTEMPT={attempt}".encode(),
    }
    for pid in job_processes(job_name):
        try:
            environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if wanted <= environ and os.getsid(pid) == pid:
            return pid
    return None


def wait_for(condition: Callable[[], object], what: str, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class DdpjobRun:
    """`ddpjob run` in its own session, its output in a file the test can read while it runs."""

    def __init__(self, manifest: Path, workdir: Path, *extra: str) -> None:
        self.log_path = workdir.parent / f"{workdir.name}.log"
        self.workdir = workdir
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ddp_operator", "run", str(manifest), "--workdir", str(workdir), *extra],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self) -> int:
        try:
            return self.process.wait(timeout=RUN_TIMEOUT)
        finally:
            self._log.close()

    def end(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self._log.close()


@pytest.fixture
def runs() -> Iterator[list[DdpjobRun]]:
    started: list[DdpjobRun] = []
    yield started
    for run in started:
        run.end()


def start(runs: list[DdpjobRun], manifest: Path, workdir: Path, *extra: str) -> DdpjobRun:
    run = DdpjobRun(manifest, workdir, "--progress-interval", "1", *extra)
    runs.append(run)
    return run


def trainer_manifest(tmp_path: Path, name: str, *args: str, mode: str = "Recreate") -> Path:
    """A 2-rank job of the built-in trainer; whole-gang restarts unless ``mode`` says InPlace."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(TRAINER_JOB.format(name=name, args=", ".join(f'"{a}"' for a in args), mode=mode))
    return path


def checkpoint_steps(directory: Path) -> list[int]:
    return sorted(
        int(m.group(1)) for p in directory.glob("ckpt-*.pt") if (m := re.match(r"ckpt-(\d+)", p.name))
    )


def test_demo_manifest_trains_to_the_accuracy(tmp_path: Path, runs: list[DdpjobRun]) -> None:
    manifest = REPO / "examples" / "digits-cpu.yaml"
    run = start(runs, manifest, tmp_path / "work")
    code = run.wait()
    output = run.output
    assert code == 0, output
    match = re.search(r"^\[rank 0\] final accuracy=([0-9.]+)", output, re.MULTILINE)
    assert match, output
    assert float(match.group(1)) >= 0.90
    assert f"held-out accuracy: {match.group(1)}" in output
    assert "outcome: Succeeded" in output


def test_stock_torchrun_forms_one_group_of_four(tmp_path: Path, runs: list[DdpjobRun]) -> None:
    run = start(runs, REPO / "examples" / "torchrun-script.yaml", tmp_path / "work")
    code = run.wait()
    output = run.output
    assert code == 0, output
    joined = re.findall(
        r"^\[rank (\d)\] rank (\d) \(local (\d)\) joined a group of world size (\d+)", output, re.M
    )
    # Pod n holds global ranks 2n and 2n+1, every one of them in a group of 4.
    assert sorted(joined) == [
        ("0", "0", "0", "4"),
        ("0", "1", "1", "4"),
        ("1", "2", "0", "4"),
        ("1", "3", "1", "4"),
    ]
    assert len(re.findall(r"allreduce sum=10 \(expected 10\)", output)) == 4
    assert not job_processes("torchrun-script")


def test_sigkilled_rank_restarts_the_gang_from_the_checkpoint(tmp_path: Path, runs: list[DdpjobRun]) -> None:
    name = "kill-one"
    manifest = trainer_manifest(
        tmp_path, name, "--max-steps=80", "--checkpoint-every=10", "--progress-every=10", "--throttle-ms=40"
    )
    run = start(runs, manifest, tmp_path / "work")
    checkpoints = tmp_path / "work" / "checkpoints"
    wait_for(lambda: checkpoint_steps(checkpoints) or run.process.poll() is not None, "a first checkpoint")
    saved_before_kill = checkpoint_steps(checkpoints)
    victim = rank_pid(name, node_rank=1, attempt=0)
    assert saved_before_kill and victim is not None, run.output
    os.kill(victim, signal.SIGKILL)

    code = run.wait()
    output = run.output
    assert code == 0, output
    assert re.search(r"rank 1 exited with code 137 in attempt 0.*restarting the gang as attempt 1", output), (
        output
    )
    resumed = re.search(r"^\[rank 0\] resumed step=(\d+)", output, re.MULTILINE)
    assert resumed, output
    assert int(resumed.group(1)) >= saved_before_kill[0]
    assert re.search(r"^\[rank 0\] final accuracy=.* steps=80", output, re.MULTILINE), output
    summary = output[output.rindex("attempt  rank") :]
    assert re.search(r"^0\s+1\s+kill-one-1-0\s+137 \(SIGKILL\)", summary, re.MULTILINE), summary
    assert re.search(r"^1\s+1\s+kill-one-1-1\s+0\s", summary, re.MULTILINE), summary
    assert "attempts: 2 (restarts: 1)" in summary
    assert not job_processes(name)


@pytest.mark.parametrize(
    ("signum", "status"),
    [pytest.param(signal.SIGINT, 130, id="ctrl-c"), pytest.param(signal.SIGTERM, 143, id="sigterm")],
)
def test_a_stop_signal_stops_every_rank_after_a_checkpoint(
    tmp_path: Path, runs: list[DdpjobRun], signum: signal.Signals, status: int
) -> None:
    name = f"interrupt-{status}"
    manifest = trainer_manifest(
        tmp_path, name, "--max-steps=100000", "--progress-every=5", "--throttle-ms=20"
    )
    run = start(runs, manifest, tmp_path / "work")
    wait_for(
        lambda: "[rank 0] progress step=" in run.output or run.process.poll() is not None, "training to start"
    )
    assert len({rank_pid(name, r, 0) for r in (0, 1)} - {None}) == 2, run.output
    os.kill(run.process.pid, signum)

    code = run.wait()
    output = run.output
    assert code == status, output
    stopped = re.search(r"^\[rank 0\] stopped step=(\d+) checkpoint=(\S+)", output, re.MULTILINE)
    assert stopped, output
    assert Path(stopped.group(2)).exists()
    assert checkpoint_steps(tmp_path / "work" / "checkpoints")[-1] == int(stopped.group(1))
    assert f"outcome: Interrupted ({signum.name})" in output
    assert not job_processes(name)


def test_invalid_manifest_exits_2_naming_the_field(tmp_path: Path, runs: list[DdpjobRun]) -> None:
    manifest = trainer_manifest(tmp_path, "bad", "--max-steps=1")
    manifest.write_text(manifest.read_text().replace("replicas: 2", "replicas: -1"))
    run = start(runs, manifest, tmp_path / "work")
    assert run.wait() == 2
    assert "spec.replicas" in run.output
    assert not (tmp_path / "work").exists()


def test_a_stop_while_a_failed_attempt_winds_down_starts_no_new_attempt(
    tmp_path: Path, runs: list[DdpjobRun]
) -> None:
    # Pod 1 fails with a retryable code; pod 0 ignores SIGTERM, so the runner waits out its grace period.
    script = (
        'if [ "$NODE_RANK" = 1 ]; then sleep 1; exit 137; fi; '
        "trap '' TERM; echo holding; while true; do sleep 0.2; done"
    )
    manifest = tmp_path / "winding-down.yaml"
    manifest.write_text(
        "apiVersion: ddp.dev/v1alpha1\nkind: DDPJob\nmetadata: {name: winding-down}\n"
        "spec:\n  replicas: 2\n  restartPolicy: OnFailure\n  runPolicy: {backoffLimit: 3}\n"
        "  template:\n    spec:\n      containers:\n      - name: trainer\n        image: unused\n"
        f"        command: [bash, -c, {json.dumps(script)}]\n"
    )
    run = start(runs, manifest, tmp_path / "work", "--grace-period", "600")
    wait_for(lambda: "stopping the other 1 rank(s)" in run.output, "pod 1 to fail")
    os.kill(run.process.pid, signal.SIGINT)
    wait_for(lambda: "no new attempt will start" in run.output, "the stop to be noted")
    os.kill(run.process.pid, signal.SIGINT)  # the second one kills pod 0 at once
    code = run.wait()
    output = run.output
    assert code == 130, output
    assert "outcome: Interrupted (SIGINT)" in output and "attempts: 1 (restarts: 0)" in output, output
    assert "attempt 1:" not in output, output
    assert not job_processes("winding-down")


def test_active_deadline_stops_every_rank(tmp_path: Path, runs: list[DdpjobRun]) -> None:
    manifest = tmp_path / "deadline.yaml"
    manifest.write_text(
        "apiVersion: ddp.dev/v1alpha1\nkind: DDPJob\nmetadata: {name: deadline}\n"
        "spec:\n  replicas: 2\n  runPolicy: {activeDeadlineSeconds: 2}\n"
        "  template:\n    spec:\n      containers:\n      - name: trainer\n        image: unused\n"
        "        command: [bash, -c, 'echo holding; sleep 600']\n"
    )
    run = start(runs, manifest, tmp_path / "work", "--grace-period", "5")
    code = run.wait()
    output = run.output
    assert code == 1, output
    assert "outcome: Failed (DeadlineExceeded): activeDeadlineSeconds 2 reached" in output, output
    assert not job_processes("deadline")


def test_a_stalled_gang_restarts_and_succeeds(tmp_path: Path, runs: list[DdpjobRun]) -> None:
    # runPolicy.stallTimeoutSeconds as the operator honours it: one rank stopped after training started,
    # no new step for 10 s, the gang restarts (reason Stalled, counted against backoffLimit 1) and the
    # next attempt resumes from the checkpoint and finishes.
    name = "stall"
    manifest = trainer_manifest(
        tmp_path, name, "--max-steps=200", "--checkpoint-every=10", "--progress-every=10", "--throttle-ms=50"
    )
    manifest.write_text(
        manifest.read_text().replace("backoffLimit: 2", "backoffLimit: 1\n    stallTimeoutSeconds: 10")
    )
    # The stopped rank cannot take its SIGTERM: it is killed at once instead of after the grace period,
    # which is longer than the run may take (its wait below would time out).
    run = start(runs, manifest, tmp_path / "work", "--grace-period", "3600")
    checkpoints = tmp_path / "work" / "checkpoints"
    wait_for(lambda: checkpoint_steps(checkpoints) or run.process.poll() is not None, "a first checkpoint")
    victim = rank_pid(name, node_rank=1, attempt=0)
    assert checkpoint_steps(checkpoints) and victim is not None, run.output
    os.kill(victim, signal.SIGSTOP)

    code = run.wait()
    output = run.output
    assert code == 0, output
    stalled = re.search(
        r"no synchronized step for 10s after step (\d+); furthest behind: rank 1 \(its metrics did not answer\)"
        r".*; the gang stalled \(rank 1 furthest behind\) in attempt 0; restarting the gang as attempt 1 "
        r"\(restart 1 of 1\)",
        output,
    )
    assert stalled and int(stalled.group(1)) >= 10, output
    assert re.search(r"^\[rank 0\] resumed step=\d+", output, re.MULTILINE), output
    assert re.search(r"^\[rank 0\] final accuracy=.* steps=200", output, re.MULTILINE), output
    assert "attempts: 2 (restarts: 1)" in output and "outcome: Succeeded" in output, output
    assert not job_processes(name)


def test_a_failed_worker_restarts_in_place_and_is_counted(tmp_path: Path, runs: list[DdpjobRun]) -> None:
    # runPolicy.restartMode InPlace as the operator honours it: rank 1's worker exits 137 once; every
    # rank's launcher restarts its workers in place (no new attempt), rank 0 resumes from the checkpoint,
    # and `ddpjob run` counts and prints the restart from rank 0's metrics as the operator's Event says it.
    name = "in-place"
    manifest = trainer_manifest(
        tmp_path,
        name,
        "--max-steps=80",
        "--checkpoint-every=10",
        "--progress-every=10",
        "--throttle-ms=40",
        "--inject-fault=1:step=35:exit=137:once",
        mode="InPlace",
    )
    run = start(runs, manifest, tmp_path / "work")
    code = run.wait()
    output = run.output
    assert code == 0, output
    assert re.search(
        r"restarted in place: ExitCode of rank 1 \(exit code 137\): restarted in place \(restart 1 of 2\)",
        output,
    ), output
    assert re.search(r"^\[rank 0\] resumed step=(\d+)", output, re.MULTILINE), output
    assert "attempt 1:" not in output, "no new attempt: the launchers restarted in place"
    # The restart's cost by phase, summed as the operator sums status.lostSeconds.
    assert re.search(r"lost to in-place restarts: \d+\.\d\ds to 1 restart\(s\)", output), output
    assert re.search(r"^\[rank 0\] final accuracy=.* steps=80", output, re.MULTILINE), output
    assert "outcome: Succeeded" in output
    assert not job_processes(name)
