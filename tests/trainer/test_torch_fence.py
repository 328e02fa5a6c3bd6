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

pytestmark = pytest.mark.trainer


def test_the_installed_torch_is_the_one_the_overrides_were_written_against() -> None:
    check_torch_agent()


class StopTakesMore(LocalElasticAgent):
    def _stop_workers(self, worker_group: Any, is_restart: bool = False) -> None:  # type: ignore[override]
        pass


class NoShutdownTimeout(LocalElasticAgent):
    """torch 2.11's agent: its constructor takes no shutdown_timeout (seen on a lent GPU machine)."""

    def __init__(self, spec: Any, logs_specs: Any, start_method: str = "spawn") -> None:
        super().__init__(spec, logs_specs, start_method)


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
            NoShutdownTimeout,
            None,
            "its constructor takes no shutdown_timeout",
            id="a-constructor-keyword-gone",
        ),
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
