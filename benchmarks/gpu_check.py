"""The checks a lent GPU makes that the CPU cannot: one script, run once on the device machine.

    python benchmarks/gpu_check.py --out DIR [--backend nccl]

1. The machine: torch, CUDA, NCCL.
2. Whether NCCL forms a group of 2 ranks on this machine's GPUs (NCCL refuses two ranks on one GPU:
   with one GPU every multi-rank NCCL check below is out of reach, and the script says so).
3. The trainer on the backend, on this machine's own torch: an uninterrupted 1-rank run (its /metrics
   read while it trains: the gradient-sync series must be filled, CUDA-event timing on NCCL), then the
   same run under the pod's supervisor with its worker SIGKILLed at step 35: no worker survives, so it
   resumes from the disk checkpoint and must end with the uninterrupted run's parameters. Then two pods
   of one rank on this GPU with the state on the device (gloo): rank 1's worker killed at step 35, rank
   0's keeps its process and device state, the new worker receives the state from it (``from=peer``),
   and both end with the uninterrupted 2-rank run's parameters, bit for bit.
4. A rank blocked on the device behind a kernel that does not finish (``torch.cuda._sleep`` standing in
   for a hung peer's NCCL allreduce): its /metrics must keep answering, as the operator's hang
   detection assumes (on the CPU the stand-in is a sleep).
5. The abort path on NCCL (``ddp_trainer.supervisor.group_abort``), as far as this machine's GPUs allow.
   One GPU: a collective queued behind a kernel that does not finish yet is aborted from a control
   thread (the worker's control thread does that when its round changed): the device fence must see the
   update in flight before the abort and call the state not exact, the host's wait must end, the next
   collective on the aborted group must raise, the process must survive (TORCH_NCCL_ASYNC_ERROR_HANDLING
   as the trainer defaults it) and form a new NCCL group itself. Two GPUs (the pair formed): the same
   with rank 1 never joining the allreduce, a real blocked peer: the abort must end rank 0's wait.
   A survivor of a lost NCCL peer keeping its process through a whole in-place restart needs two GPUs
   and the trainer under the supervisor; this phase does not run that.
6. ``bench_hook_work.py --device cuda``: our comm hook's own work per step on NCCL, against torch's
   own Python ``allreduce_hook``.
7. ``bench_sync_overhead.py --device cuda``: the metrics' cost at a ~10 ms and a ~50 ms transformer
   step (plain DDP, torch's hook, detailed, detailed with the exchange, light).

Everything is written to DIR (``summary.md``, one log per run, the reference's /metrics); the exit code is 0 when every check
that could run passed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ddp_operator.local.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
PATHS = [ROOT / "operator", ROOT / "trainer_image", ROOT / "harness", ROOT]
TRAIN = [
    "--workload",
    "digits",
    "--max-steps",
    "120",
    "--progress-every",
    "5",
    "--seed",
    "7",
    "--throttle-ms",
    "20",
]
NCCL_PAIR = """
import os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
torch.cuda.set_device(rank % torch.cuda.device_count())
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2)
x = torch.ones(4, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
print("allreduce", x.tolist())
dist.destroy_process_group()
"""


# A rank whose main thread blocks on the device behind a kernel that does not finish (what a survivor
# of a hung NCCL peer does: its allreduce kernel waits on the GPU, the host waits at its next sync).
# torch.cuda._sleep spins the GPU for a number of cycles, standing in for that kernel on one GPU.
BLOCKED_RANK = """
import os, sys, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import ddp_trainer
port, seconds = sys.argv[1], float(sys.argv[2])
backend = "nccl" if torch.cuda.is_available() else "gloo"
device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
dist.init_process_group(backend, init_method="tcp://127.0.0.1:" + port, rank=0, world_size=1)
model = DistributedDataParallel(torch.nn.Linear(64, 10).to(device), device_ids=[0] if backend == "nccl" else None)
metrics = ddp_trainer.instrument(model, host="127.0.0.1")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    loss = model(torch.randn(32, 64, device=device)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    metrics.step(32, loss=float(loss.item()))
print("trained", flush=True)
time.sleep(2)
print("blocking", time.time(), flush=True)
if backend == "nccl":
    try:
        hertz = torch.cuda.clock_rate() * 1e6  # MHz, read through NVML
    except Exception:
        hertz = 1.98e9  # the H200's boost clock, as read on the lent machine
    torch.cuda._sleep(int(seconds * hertz))
    torch.cuda.synchronize()
else:
    time.sleep(seconds)  # gloo's stand-in: a wait that releases the GIL, as a gloo collective's does
print("unblocked", time.time(), flush=True)
"""


# One NCCL rank whose collective is pending on the device when its control thread aborts the group
# (ddp_trainer.supervisor.group_abort). WORLD 1: the allreduce waits behind torch.cuda._sleep (one GPU
# cannot hold a peer that never comes: NCCL refuses two ranks on one GPU). WORLD 2: rank 1 never joins.
NCCL_ABORT = """
import datetime, os, sys, threading, time, torch, torch.distributed as dist
from ddp_trainer.supervisor.group_abort import GroupAborter, default_nccl_error_handling
rank, world, port, port2 = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
default_nccl_error_handling()
print("mode", os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), flush=True)
device = torch.device("cuda", rank)
torch.cuda.set_device(device)
def group(port, world):
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
group(port, world)
x = torch.ones(1 << 20, device=device)
dist.all_reduce(x)
torch.cuda.synchronize()
print("formed", x[0].item(), flush=True)
try:
    hertz = torch.cuda.clock_rate() * 1e6
except Exception:
    hertz = 1.98e9
aborter = GroupAborter("nccl", device)
torch.cuda._sleep(int(1.0 * hertz))
aborter.fence.issued_update()
pending = not aborter.fence.settled()
torch.cuda.synchronize()
print("fence", pending, aborter.fence.settled(), flush=True)
if world == 2 and rank == 1:
    time.sleep(40)  # the peer that never comes
    os._exit(0)
aborter.new_round()
if world == 1:
    torch.cuda._sleep(int(4.0 * hertz))  # holds the allreduce behind it on the device
y = torch.ones(4, device=device)
dist.all_reduce(y)
aborter.fence.issued_update()
threading.Timer(1.0, lambda: aborter(1.0)).start()
started = time.monotonic()
try:
    torch.cuda.synchronize()
    print("wait", "returned", round(time.monotonic() - started, 2), flush=True)
except Exception as error:
    print("wait", "raised", round(time.monotonic() - started, 2), type(error).__name__, flush=True)
print("after", "settled", aborter.settled_before_abort, "intact", aborter.intact(), "exact", aborter.state_is_exact(), flush=True)
try:
    z = torch.ones(1, device=device)
    dist.all_reduce(z)
    torch.cuda.synchronize()
    print("next", "returned", flush=True)
except Exception as error:
    print("next", "raised", type(error).__name__, str(error).splitlines()[0][:160] if str(error) else "", flush=True)
time.sleep(3)  # time for torch's NCCL watchdog to act on the aborted group (mode 2: not the process)
closer = threading.Thread(target=dist.destroy_process_group, daemon=True)
closer.start()
closer.join(30)
print("destroyed", not closer.is_alive(), flush=True)
group(port2, 1)
w = torch.full((2,), 5.0, device=device)
dist.all_reduce(w)
torch.cuda.synchronize()
print("regrouped", w[0].item(), os.getpid(), flush=True)
dist.destroy_process_group()
"""


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, PATHS), env.get("PYTHONPATH", "")])
    env.update(PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for key in ("RANK", "WORLD_SIZE", "NODE_RANK", "NNODES", "LOCAL_RANK", "NPROC_PER_NODE"):
        env.pop(key, None)
    return env


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[str] = []
        self.failed: list[str] = []

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)
        (self.out / "summary.md").write_text("\n".join(self.lines) + "\n")

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.say(f"- {'PASS' if ok else 'FAIL'} {name}: {detail}")
        if not ok:
            self.failed.append(name)


def machine(report: Report) -> None:
    probe = (
        "import torch, os\n"
        "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())\n"
        "print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')\n"
        "print('nccl', '.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else 'none')\n"
        "st = os.statvfs('/dev/shm'); print('shm_free_gib', round(st.f_bavail * st.f_frsize / 2**30, 1))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=environment(), capture_output=True, text=True, timeout=120
    )
    report.say("## The machine\n")
    report.say("```\n" + (done.stdout + done.stderr).strip() + "\n```")


def nccl_pair(report: Report) -> bool:
    report.say("\n## NCCL, 2 ranks\n")
    port = str(free_ports(1)[0])
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", NCCL_PAIR, str(rank), port],
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    for rank in ranks:
        try:
            outputs.append(rank.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            rank.kill()
            outputs.append("(no answer in 90 s)")
    formed = all(rank.returncode == 0 for rank in ranks)
    reason = [
        line for out in outputs for line in out.splitlines() if "Duplicate GPU" in line or "Error" in line
    ]
    report.say(f"formed: {formed}; {reason[-1].strip() if reason else outputs[0].strip()[-300:]}")
    return formed


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            return str(answer.read().decode())
    except OSError as error:
        return f"(unreadable: {error})"


def run(
    name: str, argv: list[str], env: dict[str, str], out: Path, metrics_port: int | None = None
) -> tuple[int, str, str]:
    """Run one trainer process (stdout and stderr in ``out/name.log``); its exit code, output, and its
    /metrics once it has trained 40-69 steps (with ``metrics_port``)."""
    log = out / f"{name}.log"
    metrics = ""
    with open(log, "w") as output:
        process = subprocess.Popen(argv, env=env, stdout=output, stderr=output, start_new_session=True)
        deadline = time.monotonic() + 240
        while process.poll() is None and time.monotonic() < deadline:
            if (
                metrics_port is not None
                and not metrics
                and re.search(r"^progress step=(4|5|6)\d ", log.read_text(), re.M)
            ):
                metrics = scrape(metrics_port)
            time.sleep(0.2)
        if process.poll() is None:
            process.kill()
        code = process.wait()
    return code, log.read_text(), metrics


def digest(text: str) -> str | None:
    found = re.findall(r"^params rank=0 sha256=(\w+)", text, re.M)
    return found[-1] if found else None


def trainer(report: Report, backend: str, out: Path) -> None:
    report.say(f"\n## The trainer on {backend}: a worker killed at step 35, restarted in place\n")
    python = [sys.executable, "-m", "ddp_trainer", "--metrics-host", "127.0.0.1"]
    metrics_port = free_ports(1)[0]
    env = environment()
    env.update(
        DDP_BACKEND=backend, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_PORT=str(free_ports(1)[0])
    )
    env["DDP_METRICS_PORT"] = str(metrics_port)
    started = time.monotonic()
    code, text, metrics = run("reference", [*python, *TRAIN], env, out, metrics_port)
    reference = digest(text)
    report.check(
        "uninterrupted run",
        code == 0 and reference is not None,
        f"exit {code}, digest {reference}, {time.monotonic() - started:.1f} s",
    )
    (out / "reference.metrics").write_text(metrics)
    build = re.search(r'^ddp_build_info\{[^}]*backend="(\w+)"', metrics, re.M)
    syncs = re.findall(
        r"^ddp_(allreduce\w*|bucket\w*|sync\w*|comm\w*)\s*(\{[^}]*\})?\s+([0-9.e+-]+)$", metrics, re.M
    )
    filled = [f"{name}={value}" for name, _, value in syncs if float(value) > 0]
    report.check(
        f"gradient-sync metrics on {backend}",
        build is not None and build.group(1) == backend and bool(filled),
        f"backend label {build.group(1) if build else None}; non-zero: {', '.join(filled[:6]) or 'none'}",
    )

    # No worker survives a 1-rank job: the new worker resumes from the disk checkpoint (step 30).
    env = environment()
    env.update(
        DDP_BACKEND=backend,
        WORLD_SIZE="1",
        NNODES="1",
        NODE_RANK="0",
        NPROC_PER_NODE="1",
        MASTER_PORT=str(free_ports(1)[0]),
        DDP_RESTART_MODE="InPlace",
        DDP_RESTART_BUDGET="3",
    )
    started = time.monotonic()
    checkpoints = ["--checkpoint-dir", tempfile.mkdtemp(prefix="gpu-check-ckpt-"), "--checkpoint-every", "10"]
    kill = ["--inject-fault", "0:step=35:kill:once"]
    code, text, _ = run("inplace", [*python, *TRAIN, *checkpoints, *kill], env, out)
    resumed = re.findall(r"resumed step=(\d+).*?from=(\w+)", text)
    after = digest(text)
    report.check(
        "1 rank, its worker killed: the supervisor on this torch restarts it from the disk",
        code == 0 and resumed[-1:] == [("30", "disk")],
        f"exit {code}, resumed {resumed}, {time.monotonic() - started:.1f} s",
    )
    report.check(
        "parameters equal the uninterrupted run's", after is not None and after == reference, f"{after}"
    )
    survivors(report, out)


def survivors(report: Report, out: Path) -> None:
    """Two pods of one rank on this GPU, the state on the device (gloo carries CUDA tensors; NCCL
    refuses two ranks on one device): rank 1's worker SIGKILLed at step 35. Rank 0's worker must keep
    its process and its device state, rank 1's new worker receive the state from it, and both end with
    the uninterrupted run's parameters."""
    report.say("\n## Survivors keep their processes and device state (2 pods, gloo, state on the GPU)\n")
    python = [sys.executable, "-m", "ddp_trainer", "--metrics-host", "127.0.0.1"]

    def pods(tag: str, extra: list[str], in_place: bool) -> list[tuple[int, str]]:
        port = str(free_ports(1)[0])
        processes = []
        for pod in (0, 1):
            env = environment()
            env.update(DDP_BACKEND="gloo", DDP_DEVICE="cuda", WORLD_SIZE="2", NNODES="2", NPROC_PER_NODE="1")
            env.update(NODE_RANK=str(pod), MASTER_PORT=port)
            if in_place:
                env.update(DDP_RESTART_MODE="InPlace", DDP_RESTART_BUDGET="3")
            else:
                env.update(RANK=str(pod), LOCAL_RANK="0")
            log = (out / f"{tag}-{pod}.log").open("w")
            processes.append(subprocess.Popen([*python, *TRAIN, *extra], env=env, stdout=log, stderr=log))
        results = []
        for pod, process in enumerate(processes):
            try:
                code = process.wait(timeout=240)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
            results.append((code, (out / f"{tag}-{pod}.log").read_text()))
        return results

    reference = pods("pair-reference", [], in_place=False)
    expected = digest(reference[0][1])
    report.check("uninterrupted 2-rank run", [c for c, _ in reference] == [0, 0], f"digest {expected}")
    started = time.monotonic()
    killed = pods("pair-killed", ["--inject-fault", "1:step=35:kill:once"], in_place=True)
    rounds = [re.findall(r"^launcher event=started .*workers=(\S+)", text, re.M) for _, text in killed]
    resumed = re.findall(r"resumed step=(\d+).*?from=(\w+)", killed[0][1])
    report.check(
        "rank 0's worker kept its process; rank 1's was started anew",
        [c for c, _ in killed] == [0, 0]
        and len(rounds[0]) == 2
        and rounds[0][0] == rounds[0][1]
        and rounds[1][0] != rounds[1][-1],
        f"exits {[c for c, _ in killed]}, workers by round {rounds}, {time.monotonic() - started:.1f} s",
    )
    report.check(
        "the new worker's state came from the survivor",
        resumed[-1:][0][1:] == ("peer",) if resumed else False,
        f"{resumed}",
    )
    after = {digest(text) for _, text in killed}
    report.check("parameters equal the uninterrupted run's", after == {expected}, f"{after}")


def blocked(report: Report, out: Path) -> None:
    """Does a rank's /metrics answer while its main thread waits on the device behind a kernel that
    does not finish? The operator's hang detection reads every pod's endpoint: a survivor that stopped
    answering would be named silent beside the hung rank."""
    report.say("\n## A rank blocked on the device: does its /metrics answer?\n")
    metrics_port = free_ports(1)[0]
    env = environment()
    env.update(DDP_METRICS_PORT=str(metrics_port), LOCAL_RANK="0")
    log = out / "blocked.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [sys.executable, "-c", BLOCKED_RANK, str(free_ports(1)[0]), "20"],
            env=env,
            stdout=output,
            stderr=output,
        )
        answers: list[tuple[bool, float]] = []
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            text = log.read_text()
            if "blocking" in text and "unblocked" not in text:
                started = time.monotonic()
                body = scrape(metrics_port)
                answers.append((not body.startswith("(unreadable"), time.monotonic() - started))
            time.sleep(1)
        if process.poll() is None:
            process.kill()
        code = process.wait()
    answered = [seconds for ok, seconds in answers if ok]
    report.check(
        "the endpoint answers while the main thread is blocked",
        code == 0 and len(answers) >= 5 and len(answered) == len(answers),
        f"exit {code}; {len(answered)} of {len(answers)} reads answered during the block, "
        f"slowest {max((s for _, s in answers), default=0):.2f} s",
    )


ABORT_LINES = ("mode", "formed", "fence", "wait", "after", "next", "destroyed", "regrouped")


def _fields(text: str, key: str) -> list[str]:
    """The words after ``key`` on the first line of ``text`` that starts with it."""
    found = re.findall(rf"^{key} (.*)$", text, re.M)
    return found[0].split() if found else []


def nccl_abort(report: Report, out: Path, pair: bool) -> None:
    """The abort path on NCCL (NCCL_ABORT): one rank with its collective queued behind a long kernel,
    and, where the pair formed (two GPUs), rank 0 blocked on a rank 1 that never joins."""
    for world in (1, 2) if pair else (1,):
        _nccl_abort_run(report, out, world)


def _nccl_abort_run(report: Report, out: Path, world: int) -> None:
    report.say(f"\n## Aborting an NCCL group with a collective pending ({world} rank(s))\n")
    ports = [str(port) for port in free_ports(2)]
    log = out / f"nccl-abort-{world}.log"
    with open(log, "w") as output:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", NCCL_ABORT, str(rank), str(world), *ports],
                env=environment(),
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]
        codes = []
        for rank in ranks:
            try:
                codes.append(rank.wait(timeout=120))
            except subprocess.TimeoutExpired:
                rank.kill()
                codes.append(rank.wait())
    text = log.read_text()
    shown = [line for line in text.splitlines() if line.split(" ")[0] in ABORT_LINES]
    report.say("```\n" + "\n".join(shown)[-2000:] + "\n```")
    mode, fence = _fields(text, "mode"), _fields(text, "fence")
    wait, after, following = _fields(text, "wait"), _fields(text, "after"), _fields(text, "next")
    destroyed, regrouped = _fields(text, "destroyed"), _fields(text, "regrouped")
    report.check(f"{world}: TORCH_NCCL_ASYNC_ERROR_HANDLING defaults to 2", mode == ["2"], f"{mode}")
    report.check(
        f"{world}: the fence sees an update in flight, then done", fence == ["True", "True"], f"{fence}"
    )
    one_gpu = "" if world == 2 else " (one GPU: the kernel ahead of the allreduce ends the wait too)"
    report.check(
        f"{world}: the host's wait ends after the abort",
        len(wait) > 1 and float(wait[1]) < 30,
        (" ".join(wait) or "no line") + one_gpu,
    )
    report.check(
        f"{world}: an update in flight at the abort makes the state not exact",
        after[:6] == ["settled", "False", "intact", "False", "exact", "False"],
        " ".join(after) or "no line",
    )
    report.check(
        f"{world}: the next collective on the aborted group raises",
        following[:1] == ["raised"],
        " ".join(following) or "no line",
    )
    report.check(
        f"{world}: the process survives and forms a new NCCL group itself",
        codes[0] == 0 and destroyed == ["True"] and regrouped[:1] == ["5.0"],
        f"exit {codes}; destroyed {destroyed}; regrouped {regrouped}",
    )


def bench(report: Report, out: Path, title: str, script: str, args: list[str], timeout: float) -> None:
    """One benchmark of benchmarks/ on the device, its table into the summary."""
    report.say(f"\n## {title} ({script} {' '.join(args)})\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    (out / f"{Path(script).stem}.log").write_text(done.stdout + done.stderr)
    report.say("```\n" + done.stdout.strip() + "\n```")
    report.check(script, done.returncode == 0, f"exit {done.returncode}")


def hook_work(report: Report, out: Path) -> None:
    """Our comm hook's own work per step on NCCL against torch's allreduce_hook (bench_hook_work.py)."""
    args = ["--device", "cuda", "--rounds", "5", "--steps", "30"]
    bench(report, out, "Our hook's own work per step on NCCL", "bench_hook_work.py", args, 240)


def sync_overhead(report: Report, out: Path) -> None:
    """What the metrics cost at a 10 ms and a 50 ms transformer step (bench_sync_overhead.py)."""
    args = ["--device", "cuda", "--rounds", "5", "--steps", "20"]
    bench(report, out, "What the metrics cost on NCCL", "bench_sync_overhead.py", args, 300)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="nccl")
    parser.add_argument(
        "--skip", nargs="*", default=[], help="machine, pair, trainer, blocked, abort, hook, overhead"
    )
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    report = Report(options.out)
    pair: list[bool] = []
    phases: list[tuple[str, Callable[[], object]]] = [
        ("machine", lambda: machine(report)),
        ("pair", lambda: pair.append(nccl_pair(report))),
        ("trainer", lambda: trainer(report, options.backend, options.out)),
        ("blocked", lambda: blocked(report, options.out)),
        ("abort", lambda: nccl_abort(report, options.out, pair == [True])),
        ("hook", lambda: hook_work(report, options.out)),
        ("overhead", lambda: sync_overhead(report, options.out)),
    ]
    for name, phase in phases:
        if name in options.skip:
            continue
        try:
            phase()
        except Exception as error:  # one phase's breakage must not cost the others' figures
            report.check(name, False, f"{type(error).__name__}: {error}")
    report.say(f"\nfailed: {report.failed or 'none'}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
