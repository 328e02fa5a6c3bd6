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
