"""Suite-wide rules.

CI runs with DDP_CI_STRICT=1 (`.ci/run` and the hosted kind workflow): there, every prerequisite is
installed by `make test` itself, so a test that skips means something failed to install or start, and
it counts as a failure instead of passing quietly.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Generator
from types import FrameType

import pytest

STRICT = os.environ.get("DDP_CI_STRICT") == "1"


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# A run stopped with SIGTERM (hack/test-all.sh stops the other lane when one fails; CI's own timeout)
# ends like Ctrl-C: pytest then runs every fixture's teardown, so no control plane, real node or kind
# cluster outlives it and poisons the next run on the machine.
signal.signal(signal.SIGTERM, _interrupt)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if STRICT and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under DDP_CI_STRICT=1, where make test installs every prerequisite: {reason}"
        )
