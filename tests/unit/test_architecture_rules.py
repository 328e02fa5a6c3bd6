"""docs/architecture.md lists the rules of a live attempt in the order reconcile.py walks them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddp_operator import reconcile

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_the_documented_rules_are_the_live_rules_in_their_order() -> None:
    text = DOC.read_text()
    table = text[text.index("| rule | decides |") :].split("\n\n", 1)[0]
    documented = re.findall(r"^\s*\| `(_rule_\w+)` \|", table, re.MULTILINE)
    assert documented == [rule.__name__ for rule in reconcile._LIVE_RULES]
