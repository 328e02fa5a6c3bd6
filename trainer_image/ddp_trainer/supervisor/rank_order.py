"""The key this pod brings to every round of the rendezvous when the job's ranks follow the topology
(docs/scheduling.md, "Rank order").

The operator writes a bound pod's key into the pod's annotation ``ddp.dev/rank-order``; a downward API
volume shows it to the launcher as the file ``DDP_RANK_ORDER_FILE``. The pod is bound, and may be
running, before the key exists, and the kubelet rewrites the file when the annotation arrives, so the
launcher waits for it. The key is opaque here: the rendezvous ranks a round's members by sorting
their descriptors, whose address is the key (``ddp_trainer.supervisor.restarts.node_addr``); what the key holds
is the operator's (``ddp_operator.policies.topology.order_key``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

# How often the file is read while the key is missing: the kubelet updates it within about a second
# of the annotation.
POLL_SECONDS: Final = 0.2


class RankOrderMissingError(RuntimeError):
    """No key appeared in the file within the time the pod may take to join."""


def read_key(path: Path) -> str | None:
    """The key in ``path``; None while the file is missing or empty (the annotation is not written)."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text or None


def wait_for_key(
    path: Path,
    timeout: float,
    on_wait: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The key in ``path`` once it is there; ``on_wait`` is called once if it has to be waited for."""
    deadline = clock() + timeout
    waited = False
    while True:
        key = read_key(path)
        if key is not None:
            return key
        if clock() >= deadline:
            raise RankOrderMissingError(
                f"no rank order key in DDP_RANK_ORDER_FILE = {path} after {timeout:.0f} s: the operator "
                "writes it into the pod's annotation ddp.dev/rank-order once the pod is bound (is the "
                "operator running, and may it patch pods?)"
            )
        if not waited and on_wait is not None:
            on_wait()
        waited = True
        sleep(POLL_SECONDS)
