"""The in-place launcher's fence around torch's private agent surface (ddp_trainer.elastic): the
installed torch passes it, and a torch whose agent changed what InPlaceAgent overrides or reads is
named at launcher start instead of failing with a TypeError in the middle of a restart."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

from ddp_trainer.elastic import (
    PRIVATE_METHODS,
    TorchAgentMismatchError,
    check_torch_agent,
    worker_exit_codes,
)
from ddp_trainer.exitcodes import first_failure
from ddp_trainer.predecessor import (
    TorchRendezvousMismatchError,
    check_torch_rendezvous,
    evict_predecessors,
)

pytestmark = pytest.mark.trainer


def test_the_installed_torch_is_the_one_the_overrides_were_written_against() -> None:
    check_torch_agent()


class StopTakesMore(LocalElasticAgent):
    def _stop_workers(self, worker_group: Any, is_restart: bool = False) -> None:  # type: ignore[override]
        pass


class NoExitBarrier(LocalElasticAgent):
    _exit_barrier = None  # type: ignore[assignment]


class NoProcessContext:
    _remaining_restarts = 3


class ProcessesElsewhere(MultiprocessContext):
    def _start(self) -> None:
        self._processes: list[Any] = []


@pytest.mark.parametrize(
    ("agent_class", "agent", "named"),
    [
        pytest.param(
            StopTakesMore, None, "_stop_workers('self', 'worker_group', 'is_restart')", id="a-new-parameter"
        ),
        pytest.param(NoExitBarrier, None, "_exit_barrier() is gone", id="a-method-gone"),
        pytest.param(
            LocalElasticAgent, NoProcessContext(), "the agent has no _pcontext", id="an-attribute-gone"
        ),
        pytest.param(
            ProcessesElsewhere,
            None,
            "ProcessesElsewhere._start() no longer keeps its processes in _pc",
            id="the-workers-processes-moved",
        ),
    ],
)
def test_a_changed_agent_is_refused_with_what_changed(
    agent_class: type, agent: object | None, named: str
) -> None:
    with pytest.raises(TorchAgentMismatchError) as refused:
        if issubclass(agent_class, MultiprocessContext):
            check_torch_agent(context_class=agent_class)
        else:
            check_torch_agent(agent_class, agent)
    assert named in str(refused.value)
    assert "restartMode: Recreate" in str(refused.value)


def test_every_overridden_method_of_in_place_agent_is_fenced() -> None:
    from ddp_trainer.elastic import InPlaceAgent

    overridden = {name for name in vars(InPlaceAgent) if name.startswith("_") and not name.startswith("__")}
    ours = {
        "_publish",
        "_grow_under_way",
        "_grow",
        "_agreed_stop",
        "_has_pod_zero",
        "_await_pod_zero",
        "_abc_impl",
    }
    assert overridden - ours <= set(PRIVATE_METHODS)


@pytest.mark.parametrize(
    ("reported", "exits", "expected"),
    [
        pytest.param({2: 170}, [170, -9], (3, 137), id="the-kill-wins-over-the-peer-torch-saw-first"),
        pytest.param({3: -9}, [-15, -9], (3, 137), id="a-peer-torch-stopped-is-collateral"),
        pytest.param({2: 170}, [170, -15], (2, 170), id="a-peer-lost-in-another-pod-stays-170"),
        pytest.param({2: 1}, [1, None], (2, 1), id="a-worker-still-running-adds-nothing"),
        pytest.param({3: 1}, [0, 1], (3, 1), id="a-worker-that-finished-adds-nothing"),
    ],
)
def test_the_pod_reports_the_first_own_failure_of_all_its_workers(
    reported: dict[int, int], exits: list[int | None], expected: tuple[int, int]
) -> None:
    """torch reports one failed worker per poll; the pod's code comes from every worker that ended
    (a pod of two workers, global ranks 2 and 3)."""
    context = SimpleNamespace(
        _pc=SimpleNamespace(processes=[SimpleNamespace(exitcode=code) for code in exits])
    )
    group: Any = SimpleNamespace(
        workers=[SimpleNamespace(local_rank=0, global_rank=2), SimpleNamespace(local_rank=1, global_rank=3)]
    )
    ended = {rank: code for rank, code in zip((2, 3), exits, strict=True) if code}
    assert worker_exit_codes(context, group) == ended
    assert first_failure({**reported, **worker_exit_codes(context, group)}, []) == expected


def test_no_process_context_reads_no_exit_codes() -> None:
    group: Any = SimpleNamespace(workers=[SimpleNamespace(local_rank=0, global_rank=0)])
    assert worker_exit_codes(None, group) == {}


def _handler(store: Any, run_id: str, addr: str) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    params = RendezvousParameters(
        backend="c10d", endpoint="", run_id=run_id, min_nodes=1, max_nodes=1, local_addr=addr
    )
    return create_handler(store, C10dRendezvousBackend(store, run_id), params)


@pytest.fixture
def rendezvous_store() -> Any:
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_the_installed_torch_rendezvous_is_the_one_a_new_pods_join_was_written_against(
    rendezvous_store: Any,
) -> None:
    check_torch_rendezvous(_handler(rendezvous_store, "fence", "000000"))


@pytest.mark.parametrize(
    ("handler", "named"),
    [
        pytest.param(
            SimpleNamespace(_this_node=1, _settings=1), "has no _state_holder", id="no-state-holder"
        ),
        pytest.param(
            SimpleNamespace(_state_holder=SimpleNamespace(sync=print), _this_node=1, _settings=1),
            "its state holder has no mark_dirty()",
            id="a-holder-method-gone",
        ),
    ],
)
def test_a_changed_rendezvous_is_refused_with_what_changed(handler: object, named: str) -> None:
    with pytest.raises(TorchRendezvousMismatchError) as refused:
        check_torch_rendezvous(handler)
    assert named in str(refused.value) and "restartMode: Recreate" in str(refused.value)


@pytest.mark.parametrize(
    ("newcomer", "removed"),
    [pytest.param("000001", 1, id="the-same-rank"), pytest.param("000002", 0, id="another-rank")],
)
def test_a_new_pod_removes_its_ranks_lost_predecessor_from_a_complete_round(
    rendezvous_store: Any, newcomer: str, removed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that completed a round and was lost keeps the round complete (torch starts the next
    only when its last member left); a new pod of its rank removes it, and the round is open again."""
    # As the launcher runs it (ddp_trainer.elastic.prepare_workers): no workers' store in the round.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    lost = _handler(rendezvous_store, "evict", "000001")
    lost.next_rendezvous()  # the round of one completes; its member then "dies" (never leaves)
    new = _handler(rendezvous_store, "evict", newcomer)
    assert evict_predecessors(new) == removed
    new._state_holder.sync()
    state = new._state_holder.state
    assert [node.addr for node in state.participants] == ([] if removed else ["000001"])
    assert state.complete is not bool(removed) and state.round == removed
