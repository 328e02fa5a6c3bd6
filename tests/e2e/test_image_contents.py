"""The built images hold the product and nothing of the test harness (tests/unit/test_packaging.py
checks the wheel and what the Dockerfiles copy; this looks inside the images themselves)."""

from __future__ import annotations

import json

import pytest
from tests.e2e.test_containers import OPERATOR_IMAGE, TRAINER_IMAGE, docker, require_image
from tests.e2e.test_containers import docker_ready as docker_ready  # the fixture, skipping without Docker

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("docker_ready")]

# Lists what the image's Python can import of ours, and every file of a distribution named ddp-*.
_INVENTORY = """
import importlib.metadata, importlib.util, json
print(json.dumps({
    "importable": [m for m in ("ddp_operator", "ddp_trainer", "ddp_harness", "ddp_operator.cluster")
                   if importlib.util.find_spec(m.split(".")[0]) and importlib.util.find_spec(m)],
    "files": [str(f) for d in importlib.metadata.distributions()
              if (d.metadata["Name"] or "").startswith("ddp-") for f in (d.files or [])],
}))
"""


@pytest.mark.parametrize("image", [OPERATOR_IMAGE, TRAINER_IMAGE])
def test_the_image_holds_no_harness_code(image: str) -> None:
    require_image(image)
    result = docker("run", "--rm", "--entrypoint", "python3", image, "-c", _INVENTORY, timeout=120)
    inventory = json.loads(result.stdout)
    assert set(inventory["importable"]) == {"ddp_operator", "ddp_trainer"}
    assert inventory["files"], "no ddp-* distribution installed?"
    assert [f for f in inventory["files"] if "harness" in f or "ddp_operator/cluster/" in f] == []


# The modules a pod's start imports that had no valid bytecode beside their source (each one compiled
# anew at every start: the user cannot write __pycache__).
_UNCOMPILED = """
import importlib.util, json, os, struct, sys
for name in sys.argv[1:]:
    __import__(name)
missing = []
for module in list(sys.modules.values()):
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    if not origin or not origin.endswith(".py") or not os.path.exists(origin):
        continue
    cached = importlib.util.cache_from_source(origin)
    try:
        with open(cached, "rb") as f:
            header = f.read(16)
    except OSError:
        missing.append(origin)
        continue
    flags, mtime, size = struct.unpack("<III", header[4:16])
    source = os.stat(origin)
    fresh = header[:4] == importlib.util.MAGIC_NUMBER and (
        flags != 0 or (mtime, size) == (int(source.st_mtime) & 0xFFFFFFFF, source.st_size & 0xFFFFFFFF)
    )
    if not fresh:
        missing.append(origin)
print(json.dumps(sorted(missing)))
"""


@pytest.mark.parametrize(
    ("image", "modules"),
    [
        (OPERATOR_IMAGE, ["ddp_operator.handlers"]),
        (
            TRAINER_IMAGE,
            ["ddp_trainer.supervisor.inplace", "ddp_trainer.training.trainer", "torch._dynamo", "sklearn"],
        ),
    ],
    ids=["operator", "trainer"],
)
def test_what_a_pod_imports_is_compiled_in_the_image(image: str, modules: list[str]) -> None:
    """Every module a pod's start imports has its bytecode in the image: the pod's user cannot write it,
    so a module without it is compiled again at every start (the trainer's imports: 6.5 CPU-s without,
    2.6 with, docs/images.md)."""
    require_image(image)
    result = docker("run", "--rm", "--entrypoint", "python3", image, "-c", _UNCOMPILED, *modules, timeout=180)
    missing = json.loads(result.stdout.strip().splitlines()[-1])
    assert missing == [], f"{len(missing)} modules without bytecode, e.g. {missing[:5]}"
