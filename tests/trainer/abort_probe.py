"""One of two gloo ranks for tests/trainer/test_blocked_leave.py: rank 0 is a worker with its control
thread (ddp_trainer.supervisor.membership) and its supervisor's end of the pipe in the same process.

CASE=blocked: rank 0 is asked to leave and then waits in an allreduce that rank 1 joins only after the
control thread's window: the control thread must abort the group (a no-op on gloo), the allreduce
must still give the right sum when rank 1 comes (gloo is not broken), and rank 0 must form a new
group in its own process afterwards. CASE=stop-check: rank 0 is asked to leave, steps, and its stop
check agrees; then it waits as long in a collective: nothing may be aborted.

Prints ``aborts=N sum=S pid=P regrouped=R`` on rank 0."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import time

import torch
import torch.distributed as dist

from ddp_trainer.supervisor import membership as membership_module
from ddp_trainer.supervisor.group_abort import GroupAborter
from ddp_trainer.supervisor.membership import Membership

WINDOW = 0.6
LATE = 3 * WINDOW + 1.0  # how long rank 1 keeps rank 0 waiting in the collective


def group(rank: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )


def main() -> None:
    case, rank, ports = os.environ["CASE"], int(sys.argv[1]), [int(p) for p in sys.argv[2:4]]
    membership_module.ABORT_STALL_SECONDS = WINDOW
    membership_module.ABORT_STALL_CAP_SECONDS = WINDOW
    group(rank, ports[0])
    aborts: list[float] = []
    if rank == 0:
        supervisor, worker = multiprocessing.Pipe()
        membership, aborter = Membership(worker), GroupAborter("gloo", torch.device("cpu"))

        def counted(waited: float) -> bool:
            aborts.append(waited)
            return aborter(waited)  # the real thing, on the real group

        membership.watch(counted)
        membership.step_done()
        supervisor.send(("leave",))
        if case == "stop-check":
            for _ in range(int(2 * WINDOW / 0.05)):  # steps go on past the window
                dist.all_reduce(torch.ones(1))
                membership.step_done()
                time.sleep(0.05)
            assert membership.leave_requested()
            membership.leaving()  # the stop check agreed to leave
    elif case == "stop-check":
        for _ in range(int(2 * WINDOW / 0.05)):
            dist.all_reduce(torch.ones(1))
    if rank == 1:
        time.sleep(LATE)
    total = torch.full((4,), float(rank + 1))
    dist.all_reduce(total)
    dist.destroy_process_group()
    group(rank, ports[1])  # the next round, in this process
    again = torch.ones(1)
    dist.all_reduce(again)
    dist.destroy_process_group()
    if rank == 0:
        print(
            f"aborts={len(aborts)} sum={total.tolist()} pid={os.getpid()} regrouped={again.item()}",
            flush=True,
        )
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
