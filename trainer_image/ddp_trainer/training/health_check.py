"""The gang health check, the collectives (the arithmetic and the verdict: ``ddp_trainer.library.health``).

Every rank of the group must call :func:`check_links` together: it runs collectives and point-to-point
messages on the default process group. It uses buffers of zeros, never a random draw, and nothing of
DDP's: the training's random stream and DDP's gradient buckets are as they were (a resumed run stays
the uninterrupted one, docs/restarts.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import torch
import torch.distributed as dist

from ddp_trainer.library.health import HealthResult, iterations_within, judge, ring_rounds

# Tags of the ping-pong's two messages.
_PING: Final = 1
_PONG: Final = 2


def _synchronize(device: torch.device) -> None:
    """A CUDA collective returns before it ran; the clock must wait for the device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, run: Callable[[], None]) -> float:
    _synchronize(device)
    started = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - started


def _agreed_iterations(device: torch.device, warm_up_seconds: float) -> int:
    """The measured iterations of one part, the same on every rank: planned at the slowest warm-up."""
    slowest = torch.tensor([warm_up_seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return iterations_within(float(slowest.item()))


def _all_reduce_times(device: torch.device, buffer: torch.Tensor) -> list[float]:
    def run() -> None:
        dist.all_reduce(buffer)

    count = _agreed_iterations(device, _timed(device, run))
    return [_timed(device, run) for _ in range(count)]


def _late(delay: float) -> None:
    if delay:
        time.sleep(delay)  # the testing aid: this rank is late in every send


def _ping(buffers: tuple[torch.Tensor, torch.Tensor], peer: int, delay: float) -> None:
    """Send a ping to ``peer`` and wait for its echo. The send is issued before the receive: NCCL runs
    a pair's point-to-point operations in the order they were issued, and the peer receives first."""
    outbox, echo = buffers
    _late(delay)
    ping = dist.isend(outbox, dst=peer, tag=_PING)
    pong = dist.irecv(echo, src=peer, tag=_PONG)
    for work in (ping, pong):
        assert work is not None  # None only for a rank outside the group
        work.wait()


def _echo(inbox: torch.Tensor, peer: int, delay: float) -> None:
    """Receive ``peer``'s ping and send it back."""
    dist.recv(inbox, src=peer, tag=_PING)
    _late(delay)
    dist.send(inbox, dst=peer, tag=_PONG)


def _round_trip_times(
    device: torch.device, rank: int, world_size: int, buffer: torch.Tensor, delay: float
) -> list[float]:
    """This rank's round trips on its link to the next rank (link ``rank``), one per iteration.

    The links are timed in rounds (``ring_rounds``) that start together: a rank late in one round must
    not make its peers' next round trip look slow (the delay would travel around the ring)."""
    rounds = ring_rounds(world_size)
    successor, predecessor = (rank + 1) % world_size, (rank - 1) % world_size
    buffers = (buffer, torch.zeros_like(buffer))
    inbox = torch.zeros_like(buffer)

    def iteration() -> float:
        mine = 0.0
        for links in rounds:
            dist.barrier()
            if rank in links:
                mine = _timed(device, lambda: _ping(buffers, successor, delay))
            elif predecessor in links:
                _echo(inbox, predecessor, delay)
        return mine

    started = time.perf_counter()
    iteration()  # the warm-up: its whole time plans the rounds, barriers included
    count = _agreed_iterations(device, time.perf_counter() - started)
    return [iteration() for _ in range(count)]


def check_links(
    rank: int, world_size: int, device: torch.device, nbytes: int, delay: float = 0.0
) -> HealthResult:
    """Measure the group's all-reduce bus bandwidth and every rank's link to the next; every rank
    returns the same verdict. ``delay``: seconds this rank sleeps before each send (testing aid)."""
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    nbytes = buffer.numel() * buffer.element_size()
    reductions = _all_reduce_times(device, buffer)
    trips = _round_trip_times(device, rank, world_size, buffer, delay)
    mine = torch.tensor(reductions + trips, dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    rows = [row.cpu().tolist() for row in gathered]
    split = len(reductions)
    return judge(world_size, nbytes, [row[:split] for row in rows], [row[split:] for row in rows])
