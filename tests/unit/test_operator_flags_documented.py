"""Every option of the operator's command line is in docs/operator.md's table (the list mirrors code)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ddp_operator.commands.operator import configure_parser

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "operator.md"


def test_every_operator_option_is_documented() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    configure_parser(parser)
    options = set(re.findall(r"(--[a-z][a-z-]+)", parser.format_help()))
    assert options, "the parser should have options"
    text = DOC.read_text()
    missing = sorted(o for o in options if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text))
    assert not missing, f"options missing from docs/operator.md: {missing}"
