"""The trainer's human-readable status lines, in a stable ``kind key=value ...`` format.

Rank 0 prints ``progress`` lines every ``--progress-every`` steps and a ``final`` line at the end;
``stopped`` says where a SIGTERM stopped the job and ``params`` (one per rank) carries a digest of the
parameters so that tools and tests can check that every rank holds the same model; ``health`` is the
gang health check's verdict (docs/trainer.md, "Health check"). ``ddpjob run``
parses these lines with :func:`parse_status_line`; this module imports nothing heavy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

STATUS_KINDS: Final = frozenset(
    {"progress", "final", "stopped", "params", "resumed", "resized", "launcher", "health"}
)
NOT_AVAILABLE: Final = "na"


def _format_value(value: object) -> str:
    if value is None:
        return NOT_AVAILABLE
    if isinstance(value, float):
        if math.isnan(value):
            return NOT_AVAILABLE
        return f"{value:.6g}"
    text = str(value)
    if not text or any(ch.isspace() or ch == "=" for ch in text):
        raise ValueError(f"status values must be non-empty and free of spaces and '=': {text!r}")
    return text


def format_status_line(kind: str, fields: Mapping[str, object]) -> str:
    """``kind key=value ...`` with floats in ``%.6g`` and missing values as ``na``."""
    if kind not in STATUS_KINDS:
        raise ValueError(f"unknown status kind {kind!r}")
    return " ".join([kind, *(f"{key}={_format_value(value)}" for key, value in fields.items())])


# The in-place launcher's fields that are also written under a deprecated name, with the same value
# (docs/trainer.md, "Deprecated names"), for readers of its log that know only that one: ``pod`` (its
# NODE_RANK) and ``members`` (the round's members).
DEPRECATED_LAUNCHER_FIELDS: Final[Mapping[str, str]] = {"pod": "node", "members": "nodes"}


def launcher_status_line(event: str, fields: Mapping[str, object]) -> str:
    """``launcher event=EVENT key=value ...``, then the deprecated aliases of the fields that have one."""
    aliases = {
        DEPRECATED_LAUNCHER_FIELDS[key]: v for key, v in fields.items() if key in DEPRECATED_LAUNCHER_FIELDS
    }
    return format_status_line("launcher", {"event": event, **fields, **aliases})


def parse_status_line(line: str) -> tuple[str, dict[str, str]] | None:
    """The kind and fields of a status line, or None for any other line (logs, warnings)."""
    words = line.strip().split()
    if not words or words[0] not in STATUS_KINDS:
        return None
    fields: dict[str, str] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or not key:
            return None
        fields[key] = value
    return words[0], fields


def _optional_float(text: str | None) -> float | None:
    if text is None or text == NOT_AVAILABLE:
        return None
    return float(text)


@dataclass(frozen=True)
class Progress:
    """One ``progress`` line: a step of rank 0's training loop."""

    step: int
    epoch: int
    loss: float
    samples_per_second: float
    allreduce_p50_ms: float | None
    overlap: float | None

    def line(self) -> str:
        return format_status_line(
            "progress",
            {
                "step": self.step,
                "epoch": self.epoch,
                "loss": self.loss,
                "samples_per_s": self.samples_per_second,
                "allreduce_p50_ms": self.allreduce_p50_ms,
                "overlap": self.overlap,
            },
        )


@dataclass(frozen=True)
class FinalResult:
    """The ``final`` line: held-out accuracy and loss after the last step."""

    accuracy: float
    loss: float
    steps: int

    def line(self) -> str:
        # accuracy comes first so that `final accuracy=0.9xx` can be matched as it is.
        return format_status_line(
            "final", {"accuracy": f"{self.accuracy:.4f}", "loss": self.loss, "steps": self.steps}
        )


def parse_progress(line: str) -> Progress | None:
    parsed = parse_status_line(line)
    if parsed is None or parsed[0] != "progress":
        return None
    fields = parsed[1]
    try:
        return Progress(
            step=int(fields["step"]),
            epoch=int(fields["epoch"]),
            loss=float(fields["loss"]),
            samples_per_second=float(fields["samples_per_s"]),
            allreduce_p50_ms=_optional_float(fields.get("allreduce_p50_ms")),
            overlap=_optional_float(fields.get("overlap")),
        )
    except (KeyError, ValueError):
        return None


def parse_final(line: str) -> FinalResult | None:
    parsed = parse_status_line(line)
    if parsed is None or parsed[0] != "final":
        return None
    fields = parsed[1]
    try:
        return FinalResult(
            accuracy=float(fields["accuracy"]), loss=float(fields["loss"]), steps=int(fields["steps"])
        )
    except (KeyError, ValueError):
        return None
