"""The job commands against a real apiserver (docs/cli.md): `ddpjob logs -f` follows ranks across a
replaced pod and a new attempt, `ddpjob wait` answers 0 for Succeeded and 1 for Failed, `get` and
`describe` show what the operator wrote.

kwok's pods run no process: what a rank prints is written into its pod's log by the test (the harness
serves it through kwok's kubelet endpoint), so the lines a follower prints say which pod it read.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

import pytest
from tests.integration.operator_fixtures import kube, namespace, wait_phase
from tests.integration.operator_harness import Kube, OperatorProcess, ddpjob, running_ranks, wait_for
from tests.integration.test_faults import operators, start_operator

from ddp_operator import jobview

pytestmark = pytest.mark.integration
__all__ = ["kube", "namespace", "operators"]  # fixtures, imported for pytest


def ddpjob_command(kube: Kube, namespace: str, *args: str) -> list[str]:
    """`ddpjob ARGS...` against the local cluster's namespace, with this interpreter."""
    return [
        sys.executable,
        "-m",
        "ddp_operator",
        *args,
        "--kubeconfig",
        str(kube.kubeconfig),
        "-n",
        namespace,
    ]


class Command:
    """`ddpjob ARGS...` against the local cluster, as a child process whose output is collected."""

    def __init__(self, kube: Kube, namespace: str, *args: str) -> None:
        self.process = subprocess.Popen(
            ddpjob_command(kube, namespace, *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._drain, args=(stream, into), daemon=True)
            for stream, into in ((self.process.stdout, self.out), (self.process.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _drain(stream: IO[str] | None, into: list[str]) -> None:
        assert stream is not None
        for line in stream:
            into.append(line.rstrip("\n"))

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def printed(self, line: str) -> bool:
        return line in self.out


def run(kube: Kube, namespace: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ddpjob_command(kube, namespace, *args), capture_output=True, text=True, timeout=timeout, check=False
    )


def started(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess], job: dict[str, Any]
) -> None:
    start_operator(kube, namespace, tmp_path, operators, "-v")
    kube.apply(job, namespace)
    running_ranks(kube, namespace, job["metadata"]["name"], job["spec"]["replicas"], attempt=0)
    wait_phase(kube, namespace, job["metadata"]["name"], "Running")


def say(kube: Kube, namespace: str, pod: str, follower: Command, *lines: str) -> None:
    """Write ``lines`` into ``pod``'s log and wait until the follower printed each (as it must, once
    it follows that pod), with the prefix of its rank and attempt."""
    kube.write_pod_log(namespace, pod, "".join(f"{line}\n" for line in lines))
    for line in lines:
        wait_for(
            f"`ddpjob logs -f` to print {line!r} from {pod} (stdout so far: {follower.out[-5:]}, stderr: {follower.err[-5:]})",
            lambda line=line: any(out.endswith(line) for out in follower.out),  # type: ignore[misc]
            timeout=60,
        )


def test_logs_follow_ranks_across_a_replaced_pod_and_a_new_attempt(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    started(kube, namespace, tmp_path, operators, ddpjob("follow", replicas=2))
    kube.write_pod_log(namespace, "follow-0-0", "before the follower\n")
    follower = Command(kube, namespace, "logs", "follow", "--rank", "0", "--rank", "1", "-f")
    # The same rank 1 followed with the kubelet's timestamps kept (what a benchmark times steps by).
    stamped = Command(kube, namespace, "logs", "follow", "--rank", "1", "-f", "--timestamps")
    try:
        say(kube, namespace, "follow-0-0", follower, "rank 0 first pod line 1")
        say(kube, namespace, "follow-1-0", follower, "rank 1 first pod line 1")
        assert "[rank 0 attempt 0] before the follower" in follower.out, (
            "a follower starts at the log's start"
        )

        # Rank 1's pod lost: replaced alone; the follower moves to the replacement and says so.
        kube.run("delete", "pod", "follow-1-0", "-n", namespace, "--wait=false")
        running_ranks(kube, namespace, "follow", 2, attempt=0)
        wait_for("the replacement follow-1-0r1 running", lambda: any(
            p["metadata"]["name"] == "follow-1-0r1" and p["status"].get("phase") == "Running"
            for p in kube.live_pods(namespace, "follow")
        ), timeout=90)  # fmt: skip
        say(kube, namespace, "follow-1-0r1", follower, "rank 1 replacement line 1")
        assert any("now pod follow-1-0r1" in line and "replacement" in line for line in follower.err), (
            follower.err
        )

        # Rank 0's launcher gives up (a retried code, its own decision): the whole gang starts attempt 1;
        # both ranks move to it.
        kube.end_pod(namespace, "follow-0-0", 143)
        running_ranks(kube, namespace, "follow", 2, attempt=1)
        say(kube, namespace, "follow-0-1", follower, "rank 0 attempt 1 line 1")
        say(kube, namespace, "follow-1-1", follower, "rank 1 attempt 1 line 1")
        assert "[rank 0 attempt 1] rank 0 attempt 1 line 1" in follower.out
        assert any("now pod follow-0-1" in line and "new attempt" in line for line in follower.err), (
            follower.err
        )

        # Nothing printed twice across the switches and reconnects.
        assert len(follower.out) == len(set(follower.out)), follower.out

        # The job succeeds: the follower reads the last lines and ends by itself, with 0.
        for rank in (0, 1):
            kube.write_pod_log(namespace, f"follow-{rank}-1", f"rank {rank} last line\n")
            kube.end_pod(namespace, f"follow-{rank}-1", 0)
        wait_phase(kube, namespace, "follow", "Succeeded")
        assert follower.wait(timeout=60) == 0, "\n".join(follower.err)
        assert {"[rank 0 attempt 1] rank 0 last line", "[rank 1 attempt 1] rank 1 last line"} <= set(
            follower.out
        )

        assert stamped.wait(timeout=60) == 0, "\n".join(stamped.err)
        rank1 = [line.split("] ", 1)[1] for line in follower.out if line.startswith("[rank 1 ")]
        times, texts = zip(*(line.split(" ", 1) for line in stamped.out), strict=True)
        assert list(texts) == rank1, "the same lines, in the same order, each behind its time"
        assert all(jobview.split_log_line(f"{t} x")[0] is not None for t in times), times
        once = run(kube, namespace, "logs", "follow", "--rank", "1", "--timestamps")
        # Rank 1's newest pod (attempt 1) printed two lines: the same two, with the same times.
        assert once.returncode == 0 and once.stdout.splitlines() == stamped.out[-2:], once.stdout
    finally:
        follower.stop()
        stamped.stop()


def test_wait_answers_for_succeeded_and_failed_and_describe_says_why(
    kube: Kube, namespace: str, tmp_path: Path, operators: list[OperatorProcess]
) -> None:
    start_operator(kube, namespace, tmp_path, operators, "-v")
    for job in ("ok", "bad"):
        kube.apply(ddpjob(job, replicas=2), namespace)
    for job in ("ok", "bad"):
        running_ranks(kube, namespace, job, 2, attempt=0)
    waiters = {
        job: Command(kube, namespace, "wait", job, "--for=Succeeded", "--timeout=5m") for job in ("ok", "bad")
    }
    try:
        for rank in (0, 1):
            kube.end_pod(namespace, f"ok-{rank}-0", 0)
        # Exit code 1 is permanent (docs/restarts.md): the job fails at once.
        kube.end_pod(namespace, "bad-1-0", 1)
        assert waiters["ok"].wait(timeout=120) == 0, waiters["ok"].err
        assert waiters["bad"].wait(timeout=120) == 1, waiters["bad"].err
        assert any("will not reach Succeeded" in line and "Failed" in line for line in waiters["bad"].err), (
            waiters["bad"].err
        )
    finally:
        for waiter in waiters.values():
            waiter.stop()

    timed_out = run(kube, namespace, "wait", "ok", "--for=Running", "--timeout=1s")
    assert timed_out.returncode == 1 and "Succeeded" in timed_out.stderr, (
        "a finished job never reaches Running"
    )
    missing = run(kube, namespace, "wait", "nope")
    assert missing.returncode == 2 and "no DDPJob 'nope'" in missing.stderr

    listed = run(kube, namespace, "get")
    assert listed.returncode == 0, listed.stderr
    phases = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
    assert phases == {"bad": "Failed", "ok": "Succeeded"}

    described = run(kube, namespace, "describe", "bad")
    assert described.returncode == 0, described.stderr
    reason = kube.status(namespace, "bad")["conditions"]
    failed = next(c for c in reason if c["type"] == "Failed")
    assert f"Phase:       Failed ({failed['reason']})" in described.stdout, described.stdout
    assert "Events:" in described.stdout and "<none>" not in described.stdout.split("Events:")[1]
