"""Kubernetes resource quantities (``500m``, ``2``, ``4Gi``) as numbers: the one parser the operator and
``ddpjob run`` share."""

from __future__ import annotations

import re

_QUANTITY = re.compile(r"^([+-]?\d+(?:\.\d+)?)([a-zA-Z]*)$")
_SUFFIXES = {
    "": 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "Ki": 2.0**10,
    "Mi": 2.0**20,
    "Gi": 2.0**30,
    "Ti": 2.0**40,
    "Pi": 2.0**50,
}


def parse_quantity(text: str | int | float) -> float:
    """A Kubernetes resource quantity (``500m``, ``2``, ``4Gi``) as a number."""
    match = _QUANTITY.match(str(text).strip())
    if not match or match.group(2) not in _SUFFIXES:
        raise ValueError(f"not a resource quantity: {text!r}")
    return float(match.group(1)) * _SUFFIXES[match.group(2)]
