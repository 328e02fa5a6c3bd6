"""The in-place launcher's fence around torch's private agent surface (ddp_trainer.elastic): the
installed torch passes it, and a torch whose agent changed what InPlaceAgent overrides or reads is
named at launcher start instead of failing with a TypeError in the middle of a restart."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from ddp_trainer.elastic import PRIVATE_METHODS, TorchAgentMismatchError, check_torch_agent

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
    ],
)
def test_a_changed_agent_is_refused_with_what_changed(
    agent_class: type, agent: object | None, named: str
) -> None:
    with pytest.raises(TorchAgentMismatchError) as refused:
        check_torch_agent(agent_class, agent)
    assert named in str(refused.value)
    assert "restartMode: Recreate" in str(refused.value)


def test_every_overridden_method_of_in_place_agent_is_fenced() -> None:
    from ddp_trainer.elastic import InPlaceAgent

    overridden = {name for name in vars(InPlaceAgent) if name.startswith("_") and not name.startswith("__")}
    ours = {"_publish", "_grow_under_way", "_grow", "_agreed_stop", "_abc_impl"}
    assert overridden - ours <= set(PRIVATE_METHODS)
