"""The rules of an attempt in the order ``decide()`` walks them: every policy module's ``RULES``.

Each module of this package is read once, at import: a module that exports ``RULES`` (policies/rule.py)
has them registered, ordered by ``Rule.order``. So a new policy is one module (and its table test, and
its row in docs/architecture.md): no list elsewhere names it. A policy module never imports this one
(tests/unit/test_architecture_rules.py): the registry imports them.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ddp_operator import policies
from ddp_operator.policies.rule import Phase, Rule

_RULES: list[Rule[Any]] = []


def register(rule: Rule[Any]) -> None:
    """Add ``rule`` at its place; two rules may share neither a name nor a place."""
    clash = [r for r in _RULES if r.name == rule.name or r.order == rule.order]
    if clash:
        raise ValueError(f"rule {rule.name} ({rule.order}) clashes with {clash[0].name} ({clash[0].order})")
    _RULES.append(rule)
    _RULES.sort(key=lambda r: r.order)


def unregister(rule: Rule[Any]) -> None:
    _RULES.remove(rule)


def every() -> tuple[Rule[Any], ...]:
    """Every rule, in order (docs/architecture.md's rules table lists them so)."""
    return tuple(_RULES)


def rules(phase: Phase) -> tuple[Rule[Any], ...]:
    """The rules asked in ``phase``, in their order."""
    return tuple(r for r in _RULES if phase in r.phases)


def _discover() -> None:
    for module in pkgutil.iter_modules(policies.__path__):
        if module.name in ("registry", "rule"):
            continue
        found = importlib.import_module(f"{policies.__name__}.{module.name}")
        for rule in getattr(found, "RULES", ()):
            register(rule)


_discover()
