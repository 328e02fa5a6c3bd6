"""The tier's trainer processes are forks of a zygote (zygote.py): each must be the process a fresh
``python`` would have been, as far as the trainer can tell: its exit code or signal, its environment
and nothing else, its argv and streams, its own session, a hash seed other than its gang's neighbours'.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_gang import Gangs, TrainerProcess, base_env
from zygote import ForkedProcess, fresh_reason

pytestmark = pytest.mark.trainer

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGPIPE", "SIGCHLD", "SIGUSR1", "SIGQUIT")
PROBE = (
    f"SIGNALS = {SIGNALS!r}\n"
    + r"""
import os, sys
print("argv", sys.argv[1:])
print("env", sorted(k for k in os.environ if k.startswith("ZYGOTE_PROBE")))
print("session", os.getsid(0) == os.getpid())
print("hash", hash("ddp-operator"))
print("torch", "torch" in sys.modules, "ddp_trainer" in sys.modules)
import signal
for name in SIGNALS:
    print("signal", name, signal.getsignal(getattr(signal, name)))
sys.stdout.flush()
print("to stderr", file=sys.stderr)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "raise":
    raise ValueError("raised")
if mode == "wait":
    import time
    print("waiting", flush=True)
    while True:
        time.sleep(1)
"""
)


def probe(
    gangs: Gangs, tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None
) -> TrainerProcess:
    # Written once per test: rewriting it while an earlier probe of the test was reading it gave that
    # probe an empty script (a cold CI run: it printed nothing and exited 0).
    script = tmp_path / "probe.py"
    if not script.exists():
        staged = tmp_path / "probe.py.part"
        staged.write_text(PROBE)
        staged.rename(script)
    return gangs.start(name, env or {}, list(args), program=[sys.executable, str(script)])


def fields(process: TrainerProcess) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in process.stdout.splitlines() if " " in line)


@pytest.mark.parametrize(
    ("args", "code", "stderr"),
    [
        (("exit", "0"), 0, "to stderr"),
        (("exit", "3"), 3, "to stderr"),
        (("exit", "170"), 170, "to stderr"),
        (("raise",), 1, "ValueError: raised"),
        (("falls-off-the-end",), 0, "to stderr"),
    ],
    ids=["exits-0", "exits-3", "exits-170", "uncaught-exception-exits-1", "returns-exits-0"],
)
def test_a_forked_process_exits_as_a_fresh_one_would(
    gangs: Gangs, tmp_path: Path, args: tuple[str, ...], code: int, stderr: str
) -> None:
    process = probe(gangs, tmp_path, "probe", *args, env={"ZYGOTE_PROBE_A": "1"})
    assert isinstance(process.process, ForkedProcess)
    assert process.wait() == code
    assert stderr in process.stderr
    seen = fields(process)
    assert seen["argv"] == repr(list(args))
    assert seen["env"] == "['ZYGOTE_PROBE_A']"  # exactly its own variables: none of another's
    assert seen["session"] == "True"
    assert seen["torch"] == "True False"  # torch imported once, never our code


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_a_forked_process_dies_of_a_signal_as_popen_reports_it(
    gangs: Gangs, tmp_path: Path, signum: int
) -> None:
    process = probe(gangs, tmp_path, "probe", "wait")
    process.wait_for_stdout("^waiting")
    process.signal(signum)
    assert process.wait() == -signum


def test_a_forked_process_handles_signals_as_a_fresh_one_would(gangs: Gangs, tmp_path: Path) -> None:
    """Whatever the dispositions it inherits (a shell ignores SIGINT in its background jobs, and CI's
    lanes are such jobs), a fork ends up with a fresh interpreter's: compared, not assumed."""
    forked = probe(gangs, tmp_path, "forked", "exit", "0")
    script = tmp_path / "probe.py"
    with open(tmp_path / "fresh.out", "wb") as out:
        fresh = subprocess.run(
            [sys.executable, str(script), "exit", "0"], env=base_env(), stdout=out, check=True, timeout=60
        )
    assert forked.wait() == fresh.returncode == 0
    dispositions = [line for line in forked.stdout.splitlines() if line.startswith("signal ")]
    assert len(dispositions) == len(SIGNALS), forked.stdout
    assert dispositions == [
        line for line in (tmp_path / "fresh.out").read_text().splitlines() if line.startswith("signal ")
    ]


def test_a_gangs_processes_hash_strings_differently(gangs: Gangs, tmp_path: Path) -> None:
    started = [probe(gangs, tmp_path, f"probe{index}", "exit", "0") for index in range(3)]
    assert [process.wait() for process in started] == [0, 0, 0]
    assert len({fields(process)["hash"] for process in started}) == 3


@pytest.mark.parametrize(
    ("env", "argv", "reason"),
    [
        ({}, [sys.executable, "-m", "ddp_trainer"], None),
        ({"DDP_RESTART_MODE": "InPlace"}, [sys.executable, "-m", "ddp_trainer"], None),
        ({"OMP_NUM_THREADS": "2"}, [sys.executable, "-m", "ddp_trainer"], "OMP_NUM_THREADS"),
        (
            {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
            [sys.executable, "-m", "ddp_trainer"],
            "TORCH_DISTRIBUTED_DEBUG",
        ),
        ({"PYTHONPATH": "/x"}, [sys.executable, "script.py"], "PYTHONPATH"),
        ({}, ["/usr/bin/python3", "-m", "ddp_trainer"], "not this Python"),
        ({}, [sys.executable, "-X", "importtime", "script.py"], "interpreter option"),
    ],
    ids=["same", "our-variable", "omp-threads", "torch-variable", "pythonpath", "other-python", "option"],
)
def test_a_process_whose_imports_could_differ_starts_fresh(
    env: dict[str, str], argv: list[str], reason: str | None
) -> None:
    zygote_env = base_env()
    found = fresh_reason(zygote_env, {**zygote_env, **env}, argv)
    assert (found is None) if reason is None else (found is not None and reason in found), found
