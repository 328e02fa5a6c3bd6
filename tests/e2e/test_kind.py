"""The chart, both images and the CPU example on a cluster with real nodes: kind, or any cluster.

Point it at a cluster with `DDP_E2E_KUBECONFIG=<path>` (the images must then be pullable there: set
`DDP_E2E_OPERATOR_IMAGE` / `DDP_E2E_TRAINER_IMAGE` to their references). Without it, the suite makes a
kind cluster when `kind` is on PATH and its node image (`KIND_NODE_IMAGE`, default kindest/node) is in
the local Docker, and loads the locally built images into it. Otherwise it skips saying which is missing.
.github/workflows/e2e-kind.yml runs it on a hosted runner.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from ddp_harness.binaries import default_bin_dir
from ddp_operator import __version__

pytestmark = [pytest.mark.e2e, pytest.mark.ci_may_skip]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ddp-operator"
KIND_CLUSTER = os.environ.get("DDP_E2E_KIND_CLUSTER", "ddp-e2e")
OPERATOR_IMAGE = os.environ.get("DDP_E2E_OPERATOR_IMAGE", f"ddp-operator:{__version__}")
TRAINER_IMAGE = os.environ.get("DDP_E2E_TRAINER_IMAGE", f"ddp-trainer:{__version__}")
T = TypeVar("T")


def tool(name: str) -> str | None:
    local = default_bin_dir() / name
    if os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 300.0, interval: float = 2.0) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r}")


@dataclass(frozen=True)
class Target:
    kubeconfig: Path
    kubectl: str
    helm: str
    images_loaded: bool  # kind: images were loaded, never pulled

    def kubectl_run(self, *args: str, stdin: str | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [self.kubectl, "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    def helm_run(self, *args: str) -> str:
        result = subprocess.run(
            [self.helm, "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout


def kind_unavailable_reason(kind: str | None) -> str | None:
    if kind is None:
        return "no `kind` on PATH and no DDP_E2E_KUBECONFIG: nothing to run the kind suite against"
    if shutil.which("docker") is None:
        return "kind needs Docker and there is no docker CLI"
    node_image = os.environ.get("KIND_NODE_IMAGE", "kindest/node")
    listed = subprocess.run(
        ["docker", "image", "ls", "-q", node_image], capture_output=True, text=True, timeout=60, check=False
    )
    if listed.returncode != 0:
        return f"kind needs a running Docker daemon: {listed.stderr.strip()[:200]}"
    if not listed.stdout.strip():
        return (
            f"kind's node image {node_image} is not in the local Docker and no registry can be pulled from "
            "here; set DDP_E2E_KUBECONFIG to use another cluster"
        )
    return None


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    kubectl, helm = tool("kubectl"), tool("helm")
    if kubectl is None or helm is None:
        pytest.skip("kubectl and helm are needed (hack/build-k8s.sh builds both)")
    given = os.environ.get("DDP_E2E_KUBECONFIG")
    if given:
        yield Target(Path(given), kubectl, helm, images_loaded=False)
        return
    kind = shutil.which("kind")
    reason = kind_unavailable_reason(kind)
    if reason or kind is None:
        pytest.skip(reason or "no kind")
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    create = [
        kind,
        "create",
        "cluster",
        "--name",
        KIND_CLUSTER,
        "--kubeconfig",
        str(kubeconfig),
        "--wait",
        "120s",
    ]
    if os.environ.get("KIND_NODE_IMAGE"):
        create += ["--image", os.environ["KIND_NODE_IMAGE"]]
    subprocess.run(create, check=True, timeout=600)
    try:
        for image in (OPERATOR_IMAGE, TRAINER_IMAGE):
            subprocess.run(
                [kind, "load", "docker-image", image, "--name", KIND_CLUSTER], check=True, timeout=1200
            )
        yield Target(kubeconfig, kubectl, helm, images_loaded=True)
    finally:
        if not os.environ.get("DDP_E2E_KEEP_CLUSTER"):
            subprocess.run([kind, "delete", "cluster", "--name", KIND_CLUSTER], check=False, timeout=300)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def allreduce_bytes(port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ddp_allreduce_bytes_total")
    )


def cpu_job(name: str) -> dict[str, Any]:
    example = REPO / "examples" / "digits-cpu.yaml"
    if example.is_file():
        job: dict[str, Any] = yaml.safe_load(example.read_text())
    else:
        job = {
            "apiVersion": "ddp.dev/v1alpha1",
            "kind": "DDPJob",
            "spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "trainer"}]}}},
        }
    job["metadata"] = {"name": name}
    trainer = next(c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == "trainer")
    trainer["image"] = TRAINER_IMAGE
    # Long enough to be scraped while it runs; still a couple of minutes on a hosted runner.
    trainer["args"] = ["--workload", "digits", "--epochs", "20", "--throttle-ms", "20"]
    return job


def test_chart_installs_and_the_cpu_example_trains_with_growing_allreduce_bytes(target: Target) -> None:
    release = f"ddp-{uuid.uuid4().hex[:6]}"
    repository, tag = OPERATOR_IMAGE.rsplit(":", 1)
    pull_policy = "Never" if target.images_loaded else "IfNotPresent"
    target.helm_run(
        "install", release, str(CHART), "--namespace", "ddp-system", "--create-namespace", "--wait",
        "--timeout", "5m", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
        "--set", f"image.pullPolicy={pull_policy}",
    )  # fmt: skip
    namespace = f"e2e-{uuid.uuid4().hex[:6]}"
    target.kubectl_run("create", "namespace", namespace)
    try:
        target.kubectl_run("apply", "-n", namespace, "-f", "-", stdin=json.dumps(cpu_job("digits")))
        rank0 = wait_for(
            "rank 0 running",
            lambda: next(
                (
                    p["metadata"]["name"]
                    for p in json.loads(
                        target.kubectl_run(
                            "get", "pods", "-n", namespace, "-l", "ddp.dev/rank=0", "-o", "json"
                        )
                    )["items"]
                    if p["status"].get("phase") == "Running"
                ),
                None,
            ),
        )
        port = free_port()
        forward = subprocess.Popen(
            [target.kubectl, "--kubeconfig", str(target.kubeconfig), "port-forward", "-n", namespace,
             f"pod/{rank0}", f"{port}:9400"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            first = wait_for("ddp_allreduce_bytes_total > 0 on rank 0", lambda: allreduce_bytes(port) or None)
            wait_for("ddp_allreduce_bytes_total growing", lambda: allreduce_bytes(port) > first, timeout=120)
        finally:
            forward.terminate()
            forward.wait(timeout=30)
        wait_for(
            "the job to succeed",
            lambda: (
                json.loads(target.kubectl_run("get", "ddpjob", "digits", "-n", namespace, "-o", "json"))
                .get("status", {})
                .get("phase")
                == "Succeeded"
            ),
            timeout=900,
        )
    finally:
        target.kubectl_run("delete", "namespace", namespace, "--wait=false", check=False)
        target.helm_run("uninstall", release, "--namespace", "ddp-system")
