"""What the pod's supervisor does with a round the rendezvous completed before anything starts in it.

A complete round with fewer members than the job trains on (a rendezvous that dropped a member whose
heartbeats came late; ddp_trainer.supervisor.rendezvous never forms one, and the supervisor does not take that on
trust) is refused before it serves or starts anything: its workers would take their world for a bad
configuration, a permanent failure.

The round is the handler's result, replaced here by what it would return in that case.

An elastic round without pod 0 (its pod lost, or late) trains nothing: its members wait for a pod to
join and form the next round with it. tests/trainer/test_inplace_restarts.py proves it on real
launchers; here the paths that end the wait (a pod comes, the rendezvous closes, nobody comes) are
driven by a stand-in for the handler."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousStoreInfo

from ddp_trainer.config import TrainConfig, parse_args, parse_env
from ddp_trainer.supervisor.inplace import (
    FIRST_POD_KEY,
    GROWS_KEY,
    RESIZES_KEY,
    RESTARTS_KEY,
    WORKERS_HOST_KEY,
    WORKERS_PORT_KEY,
    PodZeroMissingError,
    ShortRoundError,
    Supervisor,
)
from ddp_trainer.supervisor.restarts import RestartLedger

pytestmark = pytest.mark.trainer


class Handler:
    """A rendezvous whose rounds are given: (store, this pod's rank, members) each."""

    def __init__(self, rounds: list[tuple[Store, int, int]] | None = None) -> None:
        self.rounds = rounds or []

    def get_run_id(self) -> str:
        return "short-round"

    def next_rendezvous(self) -> RendezvousInfo:
        store, rank, members = self.rounds.pop(0)
        return RendezvousInfo(store, rank, members, RendezvousStoreInfo("127.0.0.1", 0))


def supervisor(
    env_vars: dict[str, str], handler: Handler, store: Store, tmp_path: Path, timeout: int
) -> Supervisor:
    config: TrainConfig = parse_args(["--init-timeout", str(timeout)])
    return Supervisor(
        parse_env(env_vars), config, [], handler=handler,  # type: ignore[arg-type]
        gang_store=store, exit_dir=tmp_path, progress_dir=tmp_path, ledger=RestartLedger(),
    )  # fmt: skip


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
    tmp_path: Path, extra: dict[str, str], members: int, refused: bool
) -> None:
    env = {
        "WORLD_SIZE": "3",
        "NNODES": "3",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "DDP_RESTART_MODE": "InPlace",
        **extra,
    }
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    pod = supervisor(env, Handler([(store, 0, members)]), store, tmp_path, 5)
    if refused:
        with pytest.raises(ShortRoundError, match=f"the round has {members} member"):
            pod.join_round()
        assert not store.check([WORKERS_PORT_KEY]), "a refused round must not serve the workers' store"
        assert not pod.joined
    else:
        _, _, _, port = pod.join_round()
        assert store.check([WORKERS_PORT_KEY]) and port == int(store.get(WORKERS_PORT_KEY))


class WaitingHandler(Handler):
    """A rendezvous where a pod comes to wait after ``waits_after`` polls, or that is closed."""

    def __init__(self, waits_after: int | None, closed: bool = False) -> None:
        super().__init__()
        self.polls, self.waits_after, self.closed = 0, waits_after, closed

    def num_nodes_waiting(self) -> int:
        self.polls += 1
        return 1 if self.waits_after is not None and self.polls > self.waits_after else 0

    def is_closed(self) -> bool:
        return self.closed


@pytest.mark.parametrize(
    ("handler", "ends"),
    [
        pytest.param(WaitingHandler(waits_after=3), None, id="pod-0-joins-the-next-round"),
        pytest.param(
            WaitingHandler(waits_after=None, closed=True), RendezvousClosedError, id="the-job-ended"
        ),
        pytest.param(WaitingHandler(waits_after=None), PodZeroMissingError, id="no-pod-comes"),
    ],
)
def test_an_elastic_round_without_pod_0_trains_nothing_and_waits_for_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    handler: WaitingHandler,
    ends: type[Exception] | None,
) -> None:
    """Pod 1 of an elastic 2..3 job whose store is the rendezvous pod's: the first round ranks it
    0 of 2 (pod 0 is missing), the next one 1 of 3 (pod 0 is back)."""
    env = {
        "WORLD_SIZE": "3",
        "NNODES": "3",
        "NODE_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "DDP_RESTART_MODE": "InPlace",
        "DDP_MIN_MEMBERS": "2",
        "DDP_RENDEZVOUS_ENDPOINT": "127.0.0.1:29400",
        "POD_IP": "127.0.0.1",
    }
    gang = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    # The second round's store as pod 0's supervisor, its rank 0, leaves it.
    second = PrefixStore("round/2", gang)
    for key, value in ((FIRST_POD_KEY, "0"), (WORKERS_HOST_KEY, "127.0.0.1"), (WORKERS_PORT_KEY, "29501")):
        second.set(key, value)
    for key in (RESTARTS_KEY, GROWS_KEY, RESIZES_KEY):
        second.set(key, "1")
    handler.rounds = [(PrefixStore("round/1", gang), 0, 2), (second, 1, 3)]
    pod = supervisor(env, handler, gang, tmp_path, 1)
    if ends is not None:
        with pytest.raises(ends):
            pod.join_round()
        assert not pod.joined and len(handler.rounds) == 1, "no next round without a pod to join"
    else:
        group_rank, _, _, port = pod.join_round()
        assert not handler.rounds and (group_rank, port) == (1, 29501)
        assert pod.joined
    # Pod 1 said which pod the first round's rank 0 was, and served nothing in it.
    first = PrefixStore("round/1", gang)
    assert first.get(FIRST_POD_KEY) == b"1" and not first.check([WORKERS_PORT_KEY, WORKERS_HOST_KEY])
    assert "launcher event=awaiting pod=1 members=2 missing=0 " in capsys.readouterr().out
