"""Suite-wide rules.

CI runs with DDP_CI_STRICT=1 (`.ci/run` and the hosted kind workflow): there, every prerequisite is
installed by `make test` itself, so a test that skips means something failed to install or start, and
it counts as a failure instead of passing quietly.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

STRICT = os.environ.get("DDP_CI_STRICT") == "1"


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
