"""The containerized DDP trainer that every rank pod of a DDPJob runs, and its metrics library.

``ddp_trainer.instrument(ddp_model)`` adds the gradient-sync metrics to any DDP script, and
``ddp_trainer.process_group_session()`` brackets the process group's life so that exiting cannot abort
the rank (``ddp_trainer.leave_process_group()`` is the step it ends with, for scripts that end the
group by hand). They are loaded lazily, so that light modules (``ddp_trainer.progress``,
``ddp_trainer.config``) import without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddp_trainer.library.instrumentation import Instrumentation, instrument
    from ddp_trainer.library.teardown import GroupSession, leave_process_group, process_group_session

__version__ = "0.1.0"
__all__ = [
    "GroupSession",
    "Instrumentation",
    "__version__",
    "instrument",
    "leave_process_group",
    "process_group_session",
]

_LAZY = {
    "instrument": "ddp_trainer.library.instrumentation",
    "Instrumentation": "ddp_trainer.library.instrumentation",
    "GroupSession": "ddp_trainer.library.teardown",
    "leave_process_group": "ddp_trainer.library.teardown",
    "process_group_session": "ddp_trainer.library.teardown",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ddp_trainer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value
