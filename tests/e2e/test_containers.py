"""Our real images in real containers: DDP across two trainer containers, and the operator image.

The images come from hack/build-images.sh (tagged with the package version). Docker runs here only as
root with dockerd started (the script starts it); where that is not so, each test skips saying why.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from ddp_operator import __version__
from ddp_operator.local.ports import free_ports

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TRAINER_IMAGE = f"ddp-trainer:{__version__}"
OPERATOR_IMAGE = f"ddp-operator:{__version__}"
METRICS_PORT = 9400
RENDEZVOUS_PORT = 29500
CHECKPOINT_DIR = "/var/run/ddp/checkpoints"
BUILD_HINT = "build it with hack/build-images.sh"
T = TypeVar("T")


def docker(*args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 120.0, interval: float = 0.5) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")


def docker_unavailable_reason() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI on PATH (hack/build-images.sh installs Debian's docker.io)"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30, check=False)
    if info.returncode != 0:
        return f"no Docker daemon answers (hack/build-images.sh starts dockerd as root): {info.stderr.strip()[:200]}"
    return None


@pytest.fixture(scope="module")
def docker_ready() -> None:
    reason = docker_unavailable_reason()
    if reason:
        pytest.skip(reason)


def require_image(image: str) -> None:
    if docker("image", "inspect", image, check=False).returncode != 0:
        pytest.skip(f"image {image} is not built; {BUILD_HINT}")


@dataclass
class DockerResources:
    """Containers, networks and volumes a test made, removed at teardown whatever happened."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    containers: list[str] = field(default_factory=list)
    networks: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)

    def cleanup(self) -> None:
        for name in self.containers:
            docker("rm", "-f", "-v", name, check=False)
        for name in self.networks:
            docker("network", "rm", name, check=False)
        for name in self.volumes:
            docker("volume", "rm", "-f", name, check=False)


@pytest.fixture
def resources(docker_ready: None) -> Iterator[DockerResources]:
    made = DockerResources()
    yield made
    made.cleanup()


def published_port(container: str, port: int) -> int:
    answer = docker("port", container, f"{port}/tcp").stdout.strip().splitlines()[0]
    return int(answer.rsplit(":", 1)[1])


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as response:
            text: str = response.read().decode()
            return text
    except OSError:
        return None


def counter(text: str, name: str) -> float:
    """Sum of a counter's samples (one per rank label) in a Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def status_lines(logs: str, kind: str) -> list[dict[str, str]]:
    from ddp_trainer.progress import parse_status_line

    found = []
    for line in logs.splitlines():
        parsed = parse_status_line(line)
        if parsed and parsed[0] == kind:
            found.append(parsed[1])
    return found


def start_rank(
    resources: DockerResources, network: str, volume: str, rank: int, master: str, run: int
) -> str:
    name = f"ddp-e2e-{resources.tag}-r{rank}-{run}"
    env = {
        "MASTER_ADDR": master,
        "MASTER_PORT": str(RENDEZVOUS_PORT),
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "LOCAL_RANK": "0",
        "NNODES": "2",
        "NODE_RANK": str(rank),
        "NPROC_PER_NODE": "1",
        "DDP_BACKEND": "gloo",
        "DDP_METRICS_PORT": str(METRICS_PORT),
        "DDP_CHECKPOINT_DIR": CHECKPOINT_DIR,
        "DDPJOB_ATTEMPT": str(run),
        "PYTHONUNBUFFERED": "1",
    }
    mounts = ["-v", f"{volume}:{CHECKPOINT_DIR}"] if rank == 0 else []
    docker(
        "run", "-d", "--name", name, "--hostname", name, "--network", network,
        "-p", f"127.0.0.1::{METRICS_PORT}", "--shm-size", "256m", "--stop-timeout", "60",
        *(arg for key, value in env.items() for arg in ("-e", f"{key}={value}")),
        *mounts, TRAINER_IMAGE,
        # Long enough to be stopped mid-run; throttled so two containers on 2 cores stay responsive.
        "--workload", "digits", "--epochs", "1000", "--throttle-ms", "20", "--stop-check-every", "2",
    )  # fmt: skip
    resources.containers.append(name)
    return name


def exit_code(container: str) -> int | None:
    state = json.loads(docker("inspect", "-f", "{{json .State}}", container).stdout)
    return None if state["Running"] else int(state["ExitCode"])


def test_two_trainer_containers_train_stop_together_and_resume(resources: DockerResources) -> None:
    require_image(TRAINER_IMAGE)
    network = f"ddp-e2e-{resources.tag}"
    volume = f"ddp-e2e-ckpt-{resources.tag}"
    docker("network", "create", network)
    resources.networks.append(network)
    docker("volume", "create", volume)
    resources.volumes.append(volume)
    # A fresh named volume is root-owned; the image runs as its numeric non-root USER.
    user = docker("image", "inspect", "-f", "{{.Config.User}}", TRAINER_IMAGE).stdout.strip()
    assert re.fullmatch(r"\d+(:\d+)?", user), f"the trainer image's USER must be numeric, is {user!r}"
    docker(
        "run", "--rm", "--user", "0", "--entrypoint", "chown", "-v", f"{volume}:/v", TRAINER_IMAGE, user, "/v"
    )

    master = f"ddp-e2e-{resources.tag}-r0-0"
    ranks = [start_rank(resources, network, volume, rank, master, run=0) for rank in (0, 1)]
    assert ranks[0] == master
    ports = [published_port(name, METRICS_PORT) for name in ranks]

    def allreduce_bytes() -> list[float] | None:
        texts = [scrape(port) for port in ports]
        if any(text is None for text in texts):
            return None
        values = [counter(text or "", "ddp_allreduce_bytes_total") for text in texts]
        return values if all(value > 0 for value in values) else None

    first = wait_for("ddp_allreduce_bytes_total > 0 on both ranks", allreduce_bytes, timeout=180)

    def grown() -> list[float] | None:
        now = allreduce_bytes()
        return now if now and all(b > a for a, b in zip(first, now, strict=True)) else None

    wait_for("ddp_allreduce_bytes_total growing on both ranks", grown, timeout=60)

    # SIGTERM to one rank: the ranks agree to stop, rank 0 writes a checkpoint, both exit 143.
    docker("stop", "-t", "60", ranks[1], timeout=90)

    def exit_codes() -> list[int] | None:
        codes = [exit_code(name) for name in ranks]
        return [code for code in codes if code is not None] if None not in codes else None

    codes = wait_for("both ranks to exit", exit_codes, timeout=90)
    logs = docker("logs", ranks[0]).stdout
    assert codes == [143, 143], f"exit codes {codes}; rank 0 log tail:\n{logs[-2000:]}"
    stopped = status_lines(logs, "stopped")
    assert stopped and stopped[-1]["checkpoint"] != "none", logs[-2000:]
    stopped_step = int(stopped[-1]["step"])
    listing = docker(
        "run", "--rm", "--entrypoint", "ls", "-v", f"{volume}:/v", TRAINER_IMAGE, "/v"
    ).stdout.split()  # fmt: skip
    assert f"ckpt-{stopped_step:010d}.pt" in listing, listing

    # New containers on the same volume resume from that step.
    master = f"ddp-e2e-{resources.tag}-r0-1"
    resumed_ranks = [start_rank(resources, network, volume, rank, master, run=1) for rank in (0, 1)]
    resumed = wait_for(
        "rank 0 to resume from the checkpoint",
        lambda: status_lines(docker("logs", resumed_ranks[0]).stdout, "resumed"),
        timeout=180,
    )
    assert int(resumed[0]["step"]) == stopped_step
    for name in resumed_ranks:
        docker("stop", "-t", "60", name, check=False, timeout=90)


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local control plane of our own (one kwok node is enough), from prebuilt binaries only."""
    from ddp_harness import ClusterOptions, default_bin_dir, down, up
    from ddp_harness.binaries import pinned_versions, stale_binaries

    bin_dir = default_bin_dir()
    stale = stale_binaries(bin_dir, pinned_versions())
    if stale:
        pytest.skip(f"control-plane binaries missing in {bin_dir}: {', '.join(stale)} (hack/build-k8s.sh)")
    if shutil.which("openssl") is None:
        pytest.skip("the local control plane needs the `openssl` command for its certificates")
    state_dir = tmp_path_factory.mktemp("e2e-cluster")
    cluster = up(ClusterOptions(state_dir=state_dir, bin_dir=bin_dir, nodes=1, build=False))
    try:
        yield cluster
    finally:
        down(state_dir, keep_state=True)


def test_operator_image_answers_liveness_and_serves_the_local_cluster(
    resources: DockerResources, control_plane: Any, tmp_path: Path
) -> None:
    require_image(OPERATOR_IMAGE)
    user = docker("image", "inspect", "-f", "{{.Config.User}}", OPERATOR_IMAGE).stdout.strip()
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), (
        f"the operator image's USER must be numeric non-root, is {user!r}"
    )

    # The documented install order: the CRD first (helm installs crds/ before templates), then the operator.
    crds = REPO / "crds"
    control_plane.kubectl_run("apply", "--server-side", "-f", str(crds))
    control_plane.kubectl_run("wait", "--for=condition=Established", "--timeout=60s", "crd/ddpjobs.ddp.dev")

    # The container shares the host's network (the apiserver listens on 127.0.0.1) and mounts the
    # kubeconfig's certificate files at the same paths, read-only.
    config = yaml.safe_load(Path(control_plane.kubeconfig).read_text())
    files = paths_in_kubeconfig(config)
    staged = tmp_path / "kube"
    staged.mkdir()
    for path in files:  # the image's user must be able to read them
        shutil.copy(path, staged / Path(path).name)
    rewrite_paths(config, {p: f"/etc/ddp/kube/{Path(p).name}" for p in files})
    (staged / "kubeconfig").write_text(yaml.safe_dump(config))
    for entry in staged.iterdir():
        entry.chmod(0o644)
    staged.chmod(0o755)
    health_port = free_port()
    name = f"ddp-e2e-{resources.tag}-operator"
    docker(
        "run", "-d", "--name", name, "--network", "host", "--read-only", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges", "--tmpfs", "/tmp", "-v", f"{staged}:/etc/ddp/kube:ro",
        OPERATOR_IMAGE, "--kubeconfig", "/etc/ddp/kube/kubeconfig", "--all-namespaces",
        f"--liveness=http://127.0.0.1:{health_port}/healthz", "--metrics-port", str(free_port()),
        "--metrics-address", "127.0.0.1",
    )  # fmt: skip
    resources.containers.append(name)

    def healthy() -> bool:
        if exit_code(name) is not None:
            raise AssertionError(f"the operator container exited:\n{docker('logs', name).stderr[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    wait_for("the operator image's liveness probe", healthy, timeout=90)

    job = {
        "apiVersion": "ddp.dev/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": "from-image", "namespace": "default"},
        "spec": {
            "replicas": 2,
            "template": {"spec": {"containers": [{"name": "trainer", "image": TRAINER_IMAGE}]}},
        },
    }
    control_plane.apply_json(job)
    try:
        pods = wait_for(
            "the containerized operator to create both rank pods",
            lambda: (
                [
                    p["metadata"]["name"]
                    for p in control_plane.get_json(
                        "pods", "-n", "default", "-l", "ddp.dev/job-name=from-image"
                    )["items"]
                ]
                or None
            ),
            timeout=180,
        )
    except AssertionError as error:
        operator_log = docker("logs", name, check=False)
        raise AssertionError(
            f"{error}\noperator log:\n{(operator_log.stdout + operator_log.stderr)[-4000:]}"
        ) from None
    assert sorted(pods) == ["from-image-0-0", "from-image-1-0"]
    logs = docker("logs", name)
    assert "Traceback" not in logs.stdout + logs.stderr, logs.stderr[-3000:]


def rewrite_paths(config: dict[str, Any], renamed: dict[str, str]) -> None:
    for section, key in (("clusters", "cluster"), ("users", "user")):
        for entry in config.get(section) or []:
            body = entry.get(key) or {}
            for field_name, value in body.items():
                if isinstance(value, str) and value in renamed:
                    body[field_name] = renamed[value]


def paths_in_kubeconfig(config: dict[str, Any]) -> list[str]:
    paths = []
    for section, key in (("clusters", "cluster"), ("users", "user")):
        for entry in config.get(section) or []:
            for field_name, value in (entry.get(key) or {}).items():
                if field_name.endswith(("-authority", "-certificate", "-key")) and isinstance(value, str):
                    paths.append(value)
    return paths


def free_port() -> int:
    return free_ports(1)[0]
