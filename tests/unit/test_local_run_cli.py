"""`ddpjob run`: manifest loading, refusal of invalid manifests, the console and process bookkeeping."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest

from ddp_operator import cli
from ddp_operator.commands.run import load_manifest
from ddp_operator.local.console import Console
from ddp_operator.local.supervisor import members_outside_group, session_members, stopped_members
from ddp_operator.policies.failure import exit_code_from_returncode as exit_code_of

pytestmark = pytest.mark.unit

VALID = """\
apiVersion: ddp.dev/v1alpha1
kind: DDPJob
metadata:
  name: demo
spec:
  replicas: 2
  template:
    spec:
      containers:
        - name: trainer
          image: trainer:1
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "field"),
    [
        pytest.param(VALID.replace("replicas: 2", "replicas: 0"), "spec.replicas", id="replicas-zero"),
        pytest.param(
            VALID.replace("name: trainer", "name: main"), "spec.template.spec.containers", id="no-trainer"
        ),
        pytest.param(VALID.replace("name: demo", "name: Demo_1"), "metadata.name", id="bad-name"),
        pytest.param(
            VALID.replace("replicas: 2", "restartPolicy: Always"), "spec.restartPolicy", id="bad-policy"
        ),
        pytest.param(VALID.replace("kind: DDPJob", "kind: Pod"), "kind", id="not-a-ddpjob"),
        pytest.param("a: [unclosed", "not valid YAML", id="not-yaml"),
    ],
)
def test_invalid_manifest_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str
) -> None:
    code = cli.main(["run", str(write(tmp_path, text)), "--workdir", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == 2
    assert field in err
    assert not (tmp_path / "work").exists()  # nothing started


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", str(tmp_path / "absent.yaml")]) == 2
    assert "absent.yaml" in capsys.readouterr().err


def test_secret_reference_exits_2_with_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = VALID + textwrap.indent(
        "env:\n  - name: TOKEN\n    valueFrom:\n      secretKeyRef: {name: hf, key: token}\n", " " * 10
    )
    code = cli.main(["run", str(write(tmp_path, text)), "--workdir", str(tmp_path / "work")])
    assert code == 2
    assert "spec.template.spec.containers[0].env[0].valueFrom.secretKeyRef" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_unknown_program_exits_2_naming_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = VALID + "          command: [no-such-program-here]\n"
    code = cli.main(["run", str(write(tmp_path, text)), "--workdir", str(tmp_path / "work")])
    assert code == 2
    err = capsys.readouterr().err
    assert "spec.template.spec.containers[0].command" in err and "no-such-program-here" in err


def test_suspended_job_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = VALID.replace("replicas: 2", "replicas: 2\n  runPolicy:\n    suspend: true")
    assert cli.main(["run", str(write(tmp_path, text)), "--workdir", str(tmp_path / "work")]) == 0
    assert "suspend" in capsys.readouterr().err


def test_help_says_the_image_is_not_used(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "image is NOT used" in capsys.readouterr().out


def test_load_manifest_picks_the_ddpjob_of_several_documents(tmp_path: Path) -> None:
    text = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n---\n" + VALID
    assert load_manifest(str(write(tmp_path, text)))["metadata"]["name"] == "demo"


def test_load_manifest_refuses_two_jobs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 DDPJobs"):
        load_manifest(str(write(tmp_path, VALID + "---\n" + VALID)))


def test_load_manifest_reads_stdin() -> None:
    assert load_manifest("-", stdin=io.StringIO(VALID))["spec"]["replicas"] == 2


@pytest.mark.parametrize(
    ("returncode", "exit_code"),
    [
        pytest.param(0, 0, id="success"),
        pytest.param(3, 3, id="own-code"),
        pytest.param(-9, 137, id="sigkill"),
        pytest.param(-15, 143, id="sigterm"),
    ],
)
def test_exit_by_signal_reads_like_a_kubelet(returncode: int, exit_code: int) -> None:
    assert exit_code_of(returncode) == exit_code


def test_session_members_reads_proc(tmp_path: Path) -> None:
    # state ppid pgrp session follow the command name, which may itself hold ") ".
    stats = {
        "100": "100 (python) S 1 100 100 0",
        "101": "101 (weird) name) S 100 100 100 0",
        "102": "102 (worker) S 101 102 100 0",
        "200": "200 (other) S 1 200 200 0",
    }
    for pid, stat in stats.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "stat").write_text(stat)
    (tmp_path / "self").mkdir()
    assert sorted(session_members(100, proc_root=tmp_path)) == [100, 101, 102]
    # killpg(100) reaches 100 and 101; only 102, in a group of its own, needs a signal of its own.
    assert members_outside_group(100, proc_root=tmp_path) == [102]
    assert stopped_members(100, proc_root=tmp_path) == []


@pytest.mark.parametrize(
    ("states", "stopped"),
    [
        pytest.param("SSS", [], id="all-running-or-sleeping"),
        pytest.param("TTT", [100, 101, 102], id="the-whole-pod-frozen"),
        pytest.param("SRt", [102], id="one-worker-traced"),
        pytest.param("SDZ", [], id="uninterruptible-and-zombie-are-not-stopped"),
    ],
)
def test_stopped_members_are_the_ones_a_sigterm_cannot_reach(
    tmp_path: Path, states: str, stopped: list[int]
) -> None:
    for offset, state in enumerate(states):
        pid = 100 + offset
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python) {state} 1 100 100 0")
    assert sorted(stopped_members(100, proc_root=tmp_path)) == stopped


def test_console_plain_prints_progress_at_most_every_interval() -> None:
    stream = io.StringIO()
    console = Console(stream, live=False, plain_interval=10)
    console.rank_line(1, "hello")
    console.status("step 1", now=100.0)
    console.status("step 2", now=105.0)
    console.status("step 3", now=111.0)
    assert stream.getvalue().splitlines() == ["[rank 1] hello", "[progress] step 1", "[progress] step 3"]


def test_console_live_redraws_the_status_below_log_lines() -> None:
    stream = io.StringIO()
    console = Console(stream, live=True)
    console.status("step 1")
    console.rank_line(0, "log")
    console.clear_status()
    assert stream.getvalue() == "\r\x1b[2Kstep 1\r\x1b[2K[rank 0] log\nstep 1\r\x1b[2K"


QUEUED = """\
apiVersion: ddp.dev/v1alpha1
kind: DDPJob
metadata:
  name: demo
  labels:
    kueue.x-k8s.io/queue-name: team-a-gpus
    kueue.x-k8s.io/priority-class: high
spec:
  replicas: 2
  scheduling:
    gang: Workload
  template:
    spec:
      containers:
        - name: trainer
          image: trainer:1
          command: [python, -c, "import os, sys; sys.exit(0 if os.environ['WORLD_SIZE'] == '2' else 3)"]
"""


def test_kueue_labels_and_the_gang_are_ignored_by_ddpjob_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Admission and gang scheduling are the cluster's business: on one machine both ranks just run."""
    code = cli.main(["run", str(write(tmp_path, QUEUED)), "--workdir", str(tmp_path / "work")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Succeeded" in out.out + out.err, out
