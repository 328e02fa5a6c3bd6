"""A complete round with fewer members than the job trains on (torch's rendezvous drops a member whose
heartbeats come late, even from a complete round) is refused by the in-place agent before it serves
or starts anything: its workers would take their world for a bad configuration, a permanent failure.

The round is torch's own agent's result, replaced here by what it returns in that case: the race that
produces it (a starved launcher's heartbeat expiring between the round's completion and a peer's read
of it) cannot be brought about on purpose without staging it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from ddp_trainer.config import parse_env
from ddp_trainer.elastic import WORKERS_PORT_KEY, InPlaceAgent, ShortRoundError
from ddp_trainer.restarts import RestartLedger
from ddp_trainer.worker import forked_worker

pytestmark = pytest.mark.trainer


class Handler:
    """What WorkerSpec and the agent's constructor ask of a rendezvous handler."""

    def get_run_id(self) -> str:
        return "short-round"


@pytest.mark.parametrize(
    ("extra", "members", "refused"),
    [
        pytest.param({"DDP_MIN_MEMBERS": "2"}, 1, True, id="elastic-below-min-members"),
        pytest.param({"DDP_MIN_MEMBERS": "2"}, 2, False, id="elastic-at-min-members"),
        pytest.param({}, 2, True, id="fixed-size-one-pod-short"),
        pytest.param({}, 3, False, id="fixed-size-whole"),
    ],
)
def test_a_round_too_short_to_train_on_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, extra: dict[str, str], members: int, refused: bool
) -> None:
    env = parse_env(
        {
            "WORLD_SIZE": "3",
            "NNODES": "3",
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
            "DDP_RESTART_MODE": "InPlace",
            **extra,
        }
    )
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))

    def torchs_round(self: LocalElasticAgent, worker_group: WorkerGroup) -> None:
        worker_group.store = store
        worker_group.group_rank = 0
        worker_group.group_world_size = members
        worker_group.master_addr = "127.0.0.1"

    monkeypatch.setattr(LocalElasticAgent, "_rendezvous", torchs_round)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=1,
        rdzv_handler=Handler(),  # type: ignore[arg-type]
        entrypoint=forked_worker,
        args=([],),
        max_restarts=3,
        master_addr="127.0.0.1",
    )
    agent = InPlaceAgent(
        spec,
        env=env,
        exit_dir=tmp_path,
        progress_dir=tmp_path,
        ledger=RestartLedger(),
        gang_store=store,
        init_timeout=5,
    )
    group: Any = agent._worker_group
    if refused:
        with pytest.raises(ShortRoundError, match=f"the round has {members} member"):
            agent._rendezvous(group)
        assert not store.check([WORKERS_PORT_KEY]), "a refused round must not serve the workers' store"
        assert not agent.joined
    else:
        agent._rendezvous(group)
        assert store.check([WORKERS_PORT_KEY]) and group.master_port == int(store.get(WORKERS_PORT_KEY))
