"""`make test`'s layout (hack/test-all.sh), run with a stand-in make and stand-ins for the kind scripts:
every tier starts only after what it needs is built, the two build chains overlap, and a failed build
fails the run naming the build that failed. The real steps take an hour; here each takes a moment."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A make that records when each target list starts and ends; ``FAIL`` names one that exits 3. Steps
# that must overlap wait for the other to start (``await``), so a layout that ran them one after the
# other fails this test by the wait running out, however loaded the machine is.
FAKE_MAKE = """#!/usr/bin/env bash
shift
trace() { echo "$(date +%s%N) $1 $TARGETS" >>"$TRACE"; }
await() {
  for _ in $(seq 1200); do grep -q " start $1\\$" "$TRACE" && return 0; sleep 0.05; done
  echo "$TARGETS never ran beside $1" >&2; exit 4
}
TARGETS="$*"
trace start
case "$TARGETS" in
  "k8s-binaries kueue-binary") await images ;;
  images) await "k8s-binaries kueue-binary" ;;
  test-trainer) await test-integration-b ;;
  *) sleep 0.2 ;;
esac
[[ "$TARGETS" == "${FAIL:-}" ]] && { echo "stand-in failure of $TARGETS"; exit 3; }
trace end
"""
FAKE_SCRIPT = """#!/usr/bin/env bash
echo "$(date +%s%N) start {name} ${{*:1:2}}" >>"$TRACE"
sleep 0.3
echo "$(date +%s%N) end {name} ${{*:1:2}}" >>"$TRACE"
"""


def run_layout(
    tmp_path: Path, fail: str = ""
) -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[int, int]]]:
    hack = tmp_path / "hack"
    hack.mkdir()
    shutil.copy(ROOT / "hack" / "test-all.sh", hack / "test-all.sh")
    for name in ("kind-cluster", "build-kind"):
        (hack / f"{name}.sh").write_text(FAKE_SCRIPT.format(name=name))
    (tmp_path / "make").write_text(FAKE_MAKE)
    for script in (*hack.iterdir(), tmp_path / "make"):
        script.chmod(0o755)
    trace = tmp_path / "trace"
    env = {
        **os.environ,
        "MAKE": str(tmp_path / "make"),
        "TRACE": str(trace),
        "FAIL": fail,
        "TMPDIR": str(tmp_path),
        "DDP_E2E_KIND_CLUSTER": "layout-test",
    }
    result = subprocess.run(
        [str(hack / "test-all.sh")], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    spans: dict[str, list[int]] = {}
    for line in trace.read_text().splitlines():
        stamp, edge, what = line.split(" ", 2)
        spans.setdefault(what, [0, 0])[0 if edge == "start" else 1] = int(stamp)
    return result, {what: (span[0], span[1]) for what, span in spans.items()}


# (a step, the steps that must have ended before it starts)
ORDER = [
    ("test-integration-b", ["k8s-binaries kueue-binary", "test-unit"]),
    ("test-trainer", ["test-unit"]),
    ("test-integration-a", ["k8s-binaries kueue-binary", "test-trainer"]),
    ("test-e2e-node", ["node-binaries kube-router", "images", "test-integration-a"]),
    ("kind", ["images", "build-kind rootfs", "node-binaries kube-router"]),
    ("kind-cluster up layout-test", ["kind"]),
    ("test-e2e-kind", ["kind-cluster up layout-test", "test-integration-b"]),
]


@pytest.fixture(scope="module")
def layout(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[int, int]]]:
    return run_layout(tmp_path_factory.mktemp("layout"))


@pytest.mark.parametrize(("step", "after"), ORDER, ids=[step for step, _ in ORDER])
def test_a_step_starts_once_what_it_needs_is_done(
    layout: tuple[subprocess.CompletedProcess[str], dict[str, tuple[int, int]]], step: str, after: list[str]
) -> None:
    result, spans = layout
    assert result.returncode == 0, result.stdout + result.stderr
    for needed in after:
        assert spans[needed][1] <= spans[step][0], f"{step} started before {needed} ended"


def test_the_chains_and_the_lanes_overlap(
    layout: tuple[subprocess.CompletedProcess[str], dict[str, tuple[int, int]]],
) -> None:
    _, spans = layout

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]

    assert overlap("images", "k8s-binaries kueue-binary"), "the image chain runs beside the compiles"
    assert overlap("test-trainer", "test-integration-b"), "lane A beside lane B"
    assert "kind-cluster down layout-test" in spans, "the kind cluster is deleted at the end"


@pytest.mark.parametrize("fail", ["images", "k8s-binaries kueue-binary"])
def test_a_failed_build_fails_the_run_and_names_it(tmp_path: Path, fail: str) -> None:
    result, spans = run_layout(tmp_path, fail=fail)
    assert result.returncode != 0
    stage = {
        "images": "images",
        "node-binaries kube-router": "node",
        "k8s-binaries kueue-binary": "control-plane",
    }[fail]
    assert f"the background build '{stage}' failed" in result.stdout + result.stderr, (
        result.stdout + result.stderr
    )
    assert "test-e2e-kind" not in spans and "kind-cluster down layout-test" in spans


def _real_node_tests() -> dict[str, bool]:
    """Each test function of the real-node module, and whether it carries the ``kind_suite`` mark."""
    tree = ast.parse((ROOT / "tests" / "e2e" / "test_real_node.py").read_text())
    return {
        node.name: any(ast.unparse(d) == "pytest.mark.kind_suite" for d in node.decorator_list)
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def _imported_by_kind_suite() -> set[str]:
    tree = ast.parse((ROOT / "tests" / "e2e" / "test_kind.py").read_text())
    return {
        alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module == "test_real_node"
        for alias in node.names
        if alias.name.startswith("test_")
    }


def test_each_real_node_test_runs_once_in_make_test() -> None:
    """The kind suite runs exactly the marked real-node tests, and lane A deselects exactly those."""
    marked = {name for name, kind in _real_node_tests().items() if kind}
    assert marked, "no real-node test is marked kind_suite"
    assert _imported_by_kind_suite() == marked
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest-e2e-node:", 1)[1].split("\n\n", 1)[0]
    assert '-m "not kind_suite"' in recipe, recipe


def test_each_integration_module_runs_once_in_make_test() -> None:
    """Lane A's part of the integration tier (INTEGRATION_A) is what lane B's part leaves out: every
    module runs, once."""
    makefile = (ROOT / "Makefile").read_text()
    line = next(x for x in makefile.splitlines() if x.startswith("INTEGRATION_A ="))
    part_a = line.split("=", 1)[1].split()
    assert part_a and all((ROOT / path).is_file() for path in part_a), part_a
    recipe_a = makefile.split("\ntest-integration-a:", 1)[1].split("\n\n", 1)[0]
    recipe_b = makefile.split("\ntest-integration-b:", 1)[1].split("\n\n", 1)[0]
    assert "$(PYTEST) $(INTEGRATION_A) " in recipe_a, recipe_a
    assert (
        "$(PYTEST) tests/integration " in recipe_b and "$(addprefix --ignore=,$(INTEGRATION_A))" in recipe_b
    )
    script = (ROOT / "hack" / "test-all.sh").read_text()
    assert "test-integration-a" in script and "test-integration-b" in script
