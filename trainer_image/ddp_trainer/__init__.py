"""The containerized DDP trainer that every rank pod of a DDPJob runs, and its metrics library.

``ddp_trainer.instrument(ddp_model)`` adds the gradient-sync metrics to any DDP script. It is loaded
lazily, so that light modules (``ddp_trainer.progress``, ``ddp_trainer.config``) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddp_trainer.library import Instrumentation, instrument

__version__ = "0.1.0"
__all__ = ["Instrumentation", "__version__", "instrument"]


def __getattr__(name: str) -> Any:
    if name in ("instrument", "Instrumentation"):
        from ddp_trainer import library

        value = getattr(library, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddp_trainer' has no attribute {name!r}")
