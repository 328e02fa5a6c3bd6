"""A new pod takes its rank's place in the rendezvous at once: the one module that edits torch's c10d
rendezvous state (a private surface of ``torch.distributed.elastic.rendezvous.dynamic_rendezvous``).

There is one pod per rank (the operator's contract, docs/restarts.md): a pod created for rank K (a
replacement, or a standby assigned K) exists because rank K's previous pod was lost. That pod's
entry stays in torch's rendezvous state until its heartbeats are older than the keep-alive bound
(``ddp_trainer.elastic.KEEP_ALIVE_INTERVAL`` x ``KEEP_ALIVE_MAX_ATTEMPT``, 10 s): a lost pod never
leaves the round it was in, and torch starts the next round only once the last member of a complete
round has left. So before a pod joins, it removes every member with its own address
(``ddp_trainer.restarts.node_addr``: the pod's rank, and the order key where ranks follow the
topology) that is not itself, the way torch's own
sanitizer removes a member whose heartbeats stopped. Without a predecessor in the state, this is one
read of it.

What it touches, checked by :func:`check_torch_rendezvous` when the launcher starts (a torch that
changed it ends the pod at once with a clear message): the handler's ``_state_holder`` (``sync()``,
``state``, ``mark_dirty()``), ``_this_node`` and ``_settings``; the state's ``participants``,
``wait_list``, ``redundancy_list`` and ``last_heartbeats``; ``_remove_participant_epilogue``.
"""

from __future__ import annotations

from typing import Any, Final

# The state's collections a member may be in (torch's _RendezvousState, as its sanitizer clears them).
STATE_FIELDS: Final = ("participants", "wait_list", "redundancy_list", "last_heartbeats")
HANDLER_FIELDS: Final = ("_state_holder", "_this_node", "_settings")
HOLDER_METHODS: Final = ("sync", "mark_dirty")


class TorchRendezvousMismatchError(RuntimeError):
    """The installed torch's c10d rendezvous is not the one evict_predecessors() was written against."""


def check_torch_rendezvous(handler: object) -> None:
    """Raise TorchRendezvousMismatchError naming what differs from what evict_predecessors() uses."""
    import torch
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    problems = [
        f"the rendezvous handler has no {name}" for name in HANDLER_FIELDS if not hasattr(handler, name)
    ]
    holder = getattr(handler, "_state_holder", None)
    problems += [
        f"its state holder has no {name}()"
        for name in HOLDER_METHODS
        if not callable(getattr(holder, name, None))
    ]
    state = dynamic_rendezvous._RendezvousState()
    problems += [f"its state has no {name}" for name in STATE_FIELDS if not hasattr(state, name)]
    if not callable(getattr(dynamic_rendezvous, "_remove_participant_epilogue", None)):
        problems.append("_remove_participant_epilogue() is gone")
    if problems:
        raise TorchRendezvousMismatchError(
            f"torch {torch.__version__}'s c10d rendezvous is not the one a new pod's join was built on "
            f"(torch 2.15): {'; '.join(problems)}. Use a torch in pyproject.toml's range, or "
            "runPolicy.restartMode: Recreate (docs/trainer.md)"
        )


def evict_predecessors(handler: Any) -> int:
    """Remove from the rendezvous state every member with this handler's own node's address (its pod
    rank) other than that node; returns how many were removed. A compare-and-set of the whole state, retried
    on a concurrent change as torch's own state holder does."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _remove_participant_epilogue

    holder, me = handler._state_holder, handler._this_node
    addr = me.addr
    while True:
        holder.sync()
        state = holder.state
        gone = {
            node
            for field in STATE_FIELDS
            for node in getattr(state, field)
            if getattr(node, "addr", None) == addr and node != me
        }
        if not gone:
            return 0
        was_participant = any(node in state.participants for node in gone)
        for node in gone:
            state.participants.pop(node, None)
            state.last_heartbeats.pop(node, None)
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        if was_participant:
            _remove_participant_epilogue(state, handler._settings)
        holder.mark_dirty()
        if holder.sync():
            return len(gone)
