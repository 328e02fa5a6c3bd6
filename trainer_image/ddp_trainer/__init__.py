"""The containerized DDP trainer that every rank pod of a DDPJob runs, and its metrics library.

``ddp_trainer.instrument(ddp_model)`` adds the gradient-sync metrics to any DDP script, and
``ddp_trainer.leave_process_group()`` ends the group so that exiting cannot abort the rank. They are
loaded lazily, so that light modules (``ddp_trainer.progress``, ``ddp_trainer.config``) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddp_trainer.library import Instrumentation, instrument
    from ddp_trainer.teardown import leave_process_group

__version__ = "0.1.0"
__all__ = ["Instrumentation", "__version__", "instrument", "leave_process_group"]


def __getattr__(name: str) -> Any:
    if name in ("instrument", "Instrumentation"):
        from ddp_trainer import library

        value = getattr(library, name)
        globals()[name] = value
        return value
    if name == "leave_process_group":
        from ddp_trainer import teardown

        globals()[name] = teardown.leave_process_group
        return teardown.leave_process_group
    raise AttributeError(f"module 'ddp_trainer' has no attribute {name!r}")
