"""Which copy of an object is the newest, from resourceVersions compared for equality only (versions.py)."""

from __future__ import annotations

from typing import Any

import pytest

from ddp_operator.versions import RECENT_VERSIONS, Freshness, resource_version

pytestmark = pytest.mark.unit


def _obj(version: str | None) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": version} if version is not None else {}}


# A step: (how the copy came: "watch", "answer" or "listing", its resourceVersion, taken?).
Step = tuple[str, str | None, bool]


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param([("watch", "5", True), ("watch", "3", True)], id="watch-events-are-taken-in-order"),
        pytest.param(
            [("watch", "5", True), ("answer", "9", True), ("watch", "7", False), ("watch", "9", True)],
            id="an-answer-waits-for-its-version",
        ),
        pytest.param(
            [("answer", "9", True), ("watch", "9", True), ("watch", "10", True)],
            id="events-after-the-answer-are-taken",
        ),
        pytest.param(
            [("watch", "9", True), ("watch", "10", True), ("answer", "9", False)],
            id="an-answer-the-watch-delivered-is-older",
        ),
        pytest.param(
            [("answer", "9", True), ("answer", "11", True), ("watch", "9", False), ("watch", "11", True)],
            id="the-last-answer-is-awaited",
        ),
        pytest.param(
            [("answer", "9", True), ("listing", "8", True), ("watch", "10", True)],
            id="a-listing-is-taken-and-ends-the-wait",
        ),
        pytest.param(
            [("answer", "9", True), ("watch", None, True), ("watch", "8", False)],
            id="a-copy-without-a-version-is-taken",
        ),
        pytest.param(
            [("answer", "z", True), ("watch", "10", False), ("watch", "z", True)],
            id="not-integers-either",
        ),
        pytest.param(
            [("answer", "lost", True)]
            + [("watch", str(n), False) for n in range(RECENT_VERSIONS)]
            + [("watch", "next", True)],
            id="fallback-never-waits-more-than-the-recent-versions",
        ),
    ],
)
def test_freshness(steps: list[Step]) -> None:
    versions = Freshness()
    take = {"watch": Freshness.watched, "answer": Freshness.answered, "listing": Freshness.listed}
    for number, (source, version, taken) in enumerate(steps):
        assert take[source](versions, _obj(version)) is taken, f"step {number}: {source} {version}"


@pytest.mark.parametrize(
    ("obj", "version"),
    [
        pytest.param({"metadata": {"resourceVersion": "123"}}, "123", id="string"),
        pytest.param({"metadata": {}}, None, id="absent"),
        pytest.param({}, None, id="no-metadata"),
    ],
)
def test_resource_version(obj: dict[str, Any], version: str | None) -> None:
    assert resource_version(obj) == version
