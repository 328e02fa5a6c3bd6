"""In-place restarts (DDP_RESTART_MODE=InPlace): "pods" are launcher processes on loopback, each with
its NODE_RANK, forming one gloo group through the rendezvous that NODE_RANK 0's launcher hosts, or,
as the operator runs them, the job's rendezvous pod (a process of its own here).

The order of events is asserted (a failure, then every pod's workers stopped, then the round
re-formed, then rank 0's resume), never the seconds between them: benchmarks/bench_inplace_restart.py
measures those.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from trainer_gang import (
    PYTHON,
    Gangs,
    TrainerProcess,
    assert_survivors_kept_their_processes,
    describe,
    events,
    finish,
    free_port,
    labelled,
    rounds_of_workers,
    samples,
    wait_all,
)

from ddp_operator import builders
from ddp_operator.policies import topology
from ddp_trainer.exitcodes import EXIT_PEER_LOST

pytestmark = pytest.mark.trainer

IN_PLACE = {"DDP_RESTART_MODE": "InPlace", "DDP_RESTART_BUDGET": "3"}
# Long enough to be killed mid-training (10 epochs of digits on 3 ranks are 150 steps).
TRAIN = ["--max-steps", "120", "--progress-every", "5", "--stop-check-every", "5", "--seed", "7"]
CHECKPOINT_EVERY = 10
HERE = Path(__file__).resolve().parent


def in_place_args(checkpoints: Path, *extra: str) -> list[str]:
    return [
        *TRAIN,
        "--throttle-ms",
        "40",
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
        "--init-timeout",
        "120",
        *extra,
    ]


# The digest of an uninterrupted 3-rank run of TRAIN, kept from the first test that ran one.
_REFERENCE: list[str] = []


def uninterrupted_digest(gangs: Gangs) -> str:
    """The parameters' digest of an uninterrupted 3-rank run of TRAIN (run once per module)."""
    if not _REFERENCE:
        reference = gangs.ranks(3, TRAIN, tag="reference")
        assert wait_all(reference) == [0, 0, 0], describe(reference)
        _REFERENCE.append(reference[0].digests()[0])
    return _REFERENCE[0]


def kill_worker(pod: TrainerProcess, rank: int) -> float:
    """SIGKILL the worker of global rank ``rank``; returns when."""
    workers = pod.worker_pids()
    assert rank in workers, describe([pod])
    os.kill(workers[rank], signal.SIGKILL)
    return time.time()


def freeze_workers(pods: list[TrainerProcess]) -> list[int]:
    """SIGSTOP every worker of ``pods`` (not their supervisors); returns their pids for ``thaw``."""
    pids = [pid for pod in pods for pid in pod.worker_pids().values()]
    assert len(pids) == len(pods), describe(pods)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def thaw(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def wait_for_a_step_after(pod: TrainerProcess, step: int, timeout: float = 120.0) -> None:
    """Until ``pod`` prints a progress line past ``step``; fails if it exits first."""
    deadline = time.monotonic() + timeout
    while not any(p.step > step for p in pod.progress()):
        assert pod.process.poll() is None and time.monotonic() < deadline, describe([pod])
        time.sleep(0.1)


def killed_pid(pod: TrainerProcess, rank: int) -> int:
    """The pid the worker of ``rank`` had in the pod's first round."""
    return rounds_of_workers(pod)[0][rank]


def assert_one_restart_in_order(pods: list[TrainerProcess], after: float) -> float:
    """Every pod stopped its workers once after ``after`` and then re-formed round 1; returns the last
    stop."""
    stopped = [float(e["time"]) for pod in pods for e in events(pod, "stopped")]
    reformed = [e for pod in pods for e in events(pod, "reformed")]
    assert len(stopped) == len(pods) and len(reformed) == len(pods), describe(pods)
    assert {e["restarts"] for e in reformed} == {"1"}
    assert min(stopped) >= after
    assert max(stopped) <= min(float(e["time"]) for e in reformed)
    return max(stopped)


def test_a_killed_worker_restarts_every_pod_in_place_and_resumes_from_the_checkpoint(
    gangs: Gangs, tmp_path: Path
) -> None:
    reference = gangs.ranks(3, TRAIN, tag="reference")
    _REFERENCE.clear()
    # Started in reverse: a pod's rendezvous rank must follow its NODE_RANK, not its start (or pid).
    pods = gangs.pods(
        3,
        1,
        in_place_args(tmp_path / "ckpt", "--metrics-linger", "120"),
        env=IN_PLACE,
        start_order=[2, 1, 0],
    )
    pods[0].wait_for_stdout(r"^progress step=35 ")
    killed = kill_worker(pods[1], rank=1)
    scrapes = finish(pods)
    assert wait_all(reference) == [0, 0, 0], describe(reference)

    [failed] = events(pods[1], "failed")
    assert (failed["rank"], failed["code"], failed["decision"]) == ("1", "137", "restart")
    assert float(failed["time"]) >= killed
    # From the kill, not from the failed pod's own report of it: a peer's workers may stop first (a
    # gloo reset reaches them at once; the failed pod's agent looks every 0.1 s, later on a loaded
    # machine).
    last_stop = assert_one_restart_in_order(pods, killed)
    # The survivors' state in their own processes, not the step-30 checkpoint: the group resumes at
    # the newest step a survivor completed, and the new worker receives it from a survivor.
    match = pods[0].wait_for_stdout(r"^resumed step=(\d+) epoch=\d+ from=(\w+)")
    resumed, origin = int(match.group(1)), match.group(2)
    assert resumed >= 35 and origin == "peer", describe(pods)
    # Only the killed worker started anew; the two survivors kept their processes, and the new worker
    # received the state from one of them over the group.
    assert assert_survivors_kept_their_processes(pods, {killed_pid(pods[1], 1)}) == 2
    assert [events(pod, "started")[-1]["kept"] for pod in pods] == ["0", "-", "2"]

    # Pod k holds global rank k, and every rank ends with the parameters of an uninterrupted run.
    expected = reference[0].digests()[0]
    _REFERENCE.append(expected)
    assert [pod.digests() for pod in pods] == [{0: expected}, {1: expected}, {2: expected}]

    for rank, text in enumerate(scrapes):
        assert samples(text, "ddp_group_restarts_total") == {str(rank): 1.0}
    rank0 = scrapes[0]
    assert labelled(rank0, "ddp_last_restart_info") == {
        "rank": "0",
        "cause": "ExitCode",
        "failed_rank": "1",
        "exit_code": "137",
    }
    at = {
        name: samples(rank0, f"ddp_last_restart_{name}")["0"]
        for name in ("failure_timestamp_seconds", "stopped_timestamp_seconds", "reformed_timestamp_seconds")
    }
    assert at["failure_timestamp_seconds"] == pytest.approx(float(failed["time"]), abs=1e-3)
    assert at["stopped_timestamp_seconds"] == pytest.approx(last_stop, abs=1e-3)
    [reformed] = events(pods[0], "reformed")
    assert at["reformed_timestamp_seconds"] == pytest.approx(float(reformed["time"]), abs=1e-3)
    resumed_at = samples(rank0, "ddp_last_restart_resumed_timestamp_seconds")["0"]
    assert at["reformed_timestamp_seconds"] <= resumed_at
    # The group resumed at the newest step a survivor held (a step only the killed worker completed
    # was never the group's): nothing is redone.
    redone = samples(rank0, "ddp_last_restart_steps_redone")["0"]
    assert redone == 0
    assert samples(rank0, "ddp_kept_step_seconds")["0"] > 0
    # Only rank 0's pod exports the restart's record.
    assert "ddp_last_restart_info" not in scrapes[1]


def write_like_the_kubelet(path: Path, text: str) -> None:
    """The kubelet writes a downward API file beside it and swaps it in: a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_text(text)
    partial.rename(path)


def test_the_rendezvous_orders_ranks_by_the_topology_through_a_restart_and_changes_no_parameter(
    gangs: Gangs, tmp_path: Path
) -> None:
    """Pods 0 and 2 on one rack, pod 1 on another: with the operator's order keys (shown late, as a
    kubelet shows an annotation written after the pod started), consecutive ranks share a rack
    whatever order the pods started in, the order holds through an in-place restart, and the ranks end
    with the parameters of an uninterrupted run (each global rank still trains its own shard)."""
    reference = [] if _REFERENCE else gangs.ranks(3, TRAIN, tag="reference")
    placement = {
        0: topology.Bound("node-b0", "rack-b"),
        1: topology.Bound("node-a1", "rack-a"),
        2: topology.Bound("node-b2", "rack-b"),
    }
    files = {rank: tmp_path / f"pod{rank}" / "placement" / "rank-order" for rank in placement}
    pods = gangs.pods(
        3,
        1,
        in_place_args(tmp_path / "ckpt", "--metrics-linger", "120"),
        env=IN_PLACE,
        start_order=[2, 0, 1],
        per_pod={rank: {"DDP_RANK_ORDER_FILE": str(path)} for rank, path in files.items()},
    )
    for pod in pods:
        pod.wait_for_stdout(r"^launcher event=waiting .*on=rank-order")
    keys = topology.keys_to_write(placement)
    for rank in (1, 2, 0):
        write_like_the_kubelet(files[rank], keys[rank] + "\n")

    pods[0].wait_for_stdout(r"^progress step=35 ")
    hosts = {rank: pod for pod in pods for rank in pod.worker_pids()}
    killed = kill_worker(hosts[1], rank=1)
    finish(pods)
    if reference:
        assert wait_all(reference) == [0, 0, 0], describe(reference)
        _REFERENCE.append(reference[0].digests()[0])
    assert_one_restart_in_order(pods, killed)

    # The rendezvous ranked the pods by their keys in every round: rank 0 on pod 0, each rack's pods on
    # consecutive ranks, the same before and after the restart.
    per_round: list[dict[int, int]] = []
    for round_index in range(2):
        ranks = {}
        for pod_rank, pod in enumerate(pods):
            started = [line for line in pod.status_lines("launcher") if line["event"] == "started"]
            assert len(started) == 2, describe(pods)
            for item in started[round_index]["workers"].split(","):
                ranks[int(item.split(":")[0])] = pod_rank
        per_round.append(ranks)
    assert per_round[0] == per_round[1], "the order holds through the restart"
    racks = [placement[per_round[0][rank]].domain for rank in range(3)]
    runs = sum(1 for rank in range(3) if rank == 0 or racks[rank] != racks[rank - 1])
    assert per_round[0][0] == 0 and runs == len(set(racks)), (per_round, racks)

    match = pods[0].wait_for_stdout(r"^resumed step=(\d+) epoch=\d+ from=(\w+)")
    assert int(match.group(1)) >= 35 and match.group(2) == "peer", describe(pods)
    assert assert_survivors_kept_their_processes(pods, {killed_pid(hosts[1], 1)}) == 2
    digests = {rank: digest for pod in pods for rank, digest in pod.digests().items()}
    assert digests == dict.fromkeys(range(3), uninterrupted_digest(gangs))


def test_a_permanent_exit_code_restarts_nothing_and_the_pod_exits_with_it(
    gangs: Gangs, tmp_path: Path
) -> None:
    pods = gangs.pods(
        2,
        1,
        in_place_args(tmp_path / "ckpt", "--inject-fault", "1:step=12:exit=3"),
        with_metrics=False,
        env=IN_PLACE,
    )
    assert wait_all(pods) == [EXIT_PEER_LOST, 3], describe(pods)
    [failed] = events(pods[1], "failed")
    assert (failed["code"], failed["decision"]) == ("3", "permanent")
    assert not [e for pod in pods for e in events(pod, "reformed")], describe(pods)
    assert "resumed step=" not in pods[0].stdout


def test_the_budget_ends_the_second_failure_with_the_workers_code(gangs: Gangs, tmp_path: Path) -> None:
    # The fault fires whenever rank 1 reaches step 15: once in the first round, again after the resume.
    pods = gangs.pods(
        2,
        1,
        in_place_args(tmp_path / "ckpt", "--inject-fault", "1:step=15:kill"),
        with_metrics=False,
        env={**IN_PLACE, "DDP_RESTART_BUDGET": "1"},
    )
    assert wait_all(pods) == [EXIT_PEER_LOST, 137], describe(pods)
    assert [e["decision"] for e in events(pods[1], "failed")] == ["restart", "budget-spent"]
    assert [e["restarts"] for pod in pods for e in events(pod, "reformed")] == ["1", "1"]
    assert "spent its restart budget (1); exiting 137" in pods[1].stderr


def rendezvous_store(gangs: Gangs, port: int, tag: str = "rendezvous") -> TrainerProcess:
    """The operator's rendezvous pod on loopback: its own program (builders.RENDEZVOUS_STORE_PROGRAM) in a
    process of its own, serving on ``port``."""
    store = gangs.start(tag, {}, [str(port)], program=[PYTHON, "-c", builders.RENDEZVOUS_STORE_PROGRAM])
    store.wait_for_stdout(r"^rendezvous store serving on port ")
    return store


def rendezvous_pod(gangs: Gangs) -> dict[str, str]:
    """A rendezvous pod (``rendezvous_store``); returns the pods' variables that point them at it, as the
    operator sets them."""
    port = free_port()
    rendezvous_store(gangs, port)
    return {"DDP_RENDEZVOUS_ENDPOINT": f"127.0.0.1:{port}", "POD_IP": "127.0.0.1"}


# An elastic job (2..3 pods) whose survivors may form a round without the lost pod.
ELASTIC_2_OF_3 = {"DDP_MIN_MEMBERS": "2", "DDP_REPLACEMENT_WAIT_SECONDS": "2"}


@pytest.mark.parametrize(
    ("lost", "elastic"),
    [(2, False), (0, False), (0, True)],
    ids=["rank-2", "rank-0", "elastic-rank-0"],
)
def test_a_lost_pod_started_again_joins_the_survivors_without_restarting_them(
    gangs: Gangs, tmp_path: Path, lost: int, elastic: bool
) -> None:
    """Any pod, rank 0's included: the store is the rendezvous pod's, which outlives every rank's pod,
    and the gang's counts and the restart's record live in it, not in rank 0's launcher. An elastic
    job's survivors form a round without pod 0 once its heartbeats are gone, train nothing in it (its
    first worker would be global rank 0 without the checkpoint volume) and wait for the new pod 0;
    that round is not counted, and the group, the same size again, ends with the uninterrupted run's
    parameters."""
    env = {**IN_PLACE, **rendezvous_pod(gangs), **(ELASTIC_2_OF_3 if elastic else {})}
    pods = gangs.pods(3, 1, in_place_args(tmp_path / "ckpt", "--metrics-linger", "120"), env=env)
    pods[0].wait_for_stdout(r"^progress step=35 ")
    pods[lost].end()  # the whole pod: its launcher and its worker, SIGKILL
    survivors = [pod for rank, pod in enumerate(pods) if rank != lost]
    for survivor in survivors:
        survivor.wait_for_stdout(r"^launcher event=stopped ")
    if elastic:
        # The round without pod 0 formed: every survivor waits in it for a pod to join.
        for survivor in survivors:
            survivor.wait_for_stdout(r"^launcher event=awaiting pod=\d+ members=2 missing=0 ")
    replacement = gangs.again(pods[lost], f"pod{lost}-again")
    # The survivors' launchers never ended: the replacement joined them in place.
    assert all(pod.process.poll() is None for pod in survivors), describe(pods)
    scrapes = rejoined_exactly(gangs, [replacement if rank == lost else pod for rank, pod in enumerate(pods)])
    assert assert_survivors_kept_their_processes(survivors) == 2
    info = labelled(scrapes[0], "ddp_last_restart_info")
    assert info is not None and info["cause"] == "PeerLost" and info["exit_code"] == str(EXIT_PEER_LOST)


def test_a_killed_worker_of_an_elastic_job_is_replaced_and_the_survivors_keep_their_processes(
    gangs: Gangs, tmp_path: Path
) -> None:
    """An elastic job (2..3 pods, its store the rendezvous pod's) loses a worker, not a pod: the failed
    pod's supervisor joins the next round at once, so the group re-forms with all 3 pods, the same ranks
    and world; the new worker receives the survivors' step and the job ends with the uninterrupted
    run's parameters."""
    # A round completes at once when all 3 pods are in: the long wait only keeps a loaded machine from
    # forming a round of 2 before the failed pod's supervisor joins.
    elastic = {**ELASTIC_2_OF_3, "DDP_REPLACEMENT_WAIT_SECONDS": "60"}
    env = {**IN_PLACE, **rendezvous_pod(gangs), **elastic}
    pods = gangs.pods(3, 1, in_place_args(tmp_path / "ckpt", "--metrics-linger", "120"), env=env)
    pods[0].wait_for_stdout(r"^progress step=35 ")
    killed = kill_worker(pods[2], rank=2)
    scrapes = finish(pods)
    assert_one_restart_in_order(pods, killed)
    assert assert_survivors_kept_their_processes(pods, {killed_pid(pods[2], 2)}) == 2
    assert [e["members"] for pod in pods for e in events(pod, "reformed")] == ["3", "3", "3"]
    match = pods[0].wait_for_stdout(r"^resumed step=(\d+) epoch=\d+ from=(\w+)")
    assert int(match.group(1)) >= 35 and match.group(2) == "peer", describe(pods)
    digests = {rank: digest for pod in pods for rank, digest in pod.digests().items()}
    assert digests == dict.fromkeys(range(3), uninterrupted_digest(gangs))
    assert samples(scrapes[0], "ddp_last_restart_steps_redone") == {"0": 0.0}, scrapes[0]


@pytest.mark.parametrize(
    "store_back_first",
    [True, False],
    ids=["store-back-then-a-worker-killed", "a-worker-killed-while-no-store-answers"],
)
def test_the_rendezvous_pod_lost_is_one_more_lost_pod(
    gangs: Gangs, tmp_path: Path, store_back_first: bool
) -> None:
    """The rendezvous pod's store is SIGKILLed mid-training and a new, empty one comes up behind the same
    address (the operator's replacement pod behind the same DNS name): the group trains on meanwhile,
    every supervisor reconnects and seeds the new store with the gang's counts, and a worker killed
    later (or while no store answers yet) is replaced in place as with the first store: one restart,
    the survivors keep their processes, the new worker's state comes from a survivor, nothing is
    redone, and the parameters are the uninterrupted run's."""
    port = free_port()
    first = rendezvous_store(gangs, port)
    env = {**IN_PLACE, "DDP_RENDEZVOUS_ENDPOINT": f"127.0.0.1:{port}", "POD_IP": "127.0.0.1"}
    pods = gangs.pods(3, 1, in_place_args(tmp_path / "ckpt", "--metrics-linger", "120"), env=env)
    pods[0].wait_for_stdout(r"^progress step=35 ")
    # The workers are frozen while the supervisors find the store lost (and, first, relink to the new
    # one): a new store's interpreter may take longer to start on a loaded machine than the steps left
    # take to run, and a group that finished has nothing to relink. The supervisors are not frozen.
    frozen = freeze_workers(pods)
    first.end()  # the rendezvous pod lost: SIGKILL
    if store_back_first:
        rendezvous_store(gangs, port, "rendezvous-again")
        for pod in pods:
            pod.wait_for_stdout(r"^launcher event=store-relinked pod=\d+ restarts=0 ")
        last = pods[0].progress()[-1].step
        thaw(frozen)
        wait_for_a_step_after(pods[0], last)  # the group trains on with the new store
        killed = kill_worker(pods[2], rank=2)
    else:
        for pod in pods:  # every supervisor found its store gone
            pod.wait_for_stdout(r"^launcher event=store-lost ")
        thaw(frozen)
        killed = kill_worker(pods[2], rank=2)
        for pod in pods[:2]:  # the survivors left the broken group while no store answers
            pod.wait_for_stdout(r"^launcher event=left ")
        rendezvous_store(gangs, port, "rendezvous-again")
    scrapes = finish(pods)
    assert_one_restart_in_order(pods, killed)
    assert assert_survivors_kept_their_processes(pods, {killed_pid(pods[2], 2)}) == 2
    match = pods[0].wait_for_stdout(r"^resumed step=(\d+) epoch=\d+ from=(\w+)")
    assert int(match.group(1)) >= 35 and match.group(2) == "peer", describe(pods)
    digests = {rank: digest for pod in pods for rank, digest in pod.digests().items()}
    assert digests == dict.fromkeys(range(3), uninterrupted_digest(gangs))
    assert samples(scrapes[0], "ddp_last_restart_steps_redone") == {"0": 0.0}, scrapes[0]
    for rank, text in enumerate(scrapes):
        assert samples(text, "ddp_group_restarts_total") == {str(rank): 1.0}


def test_a_pod_lost_with_the_rendezvous_pod_is_replaced_alone(gangs: Gangs, tmp_path: Path) -> None:
    """Two pods lost: the rendezvous pod's store and pod 1, both SIGKILLed. The replacement pod comes up
    first and the new store after it, so the new pod may join the empty store's first round before any
    survivor has seeded it; it moves on to the survivors' round, receives their state, and the group
    ends with the uninterrupted run's parameters, the survivors in their own processes."""
    port = free_port()
    first = rendezvous_store(gangs, port)
    env = {**IN_PLACE, "DDP_RENDEZVOUS_ENDPOINT": f"127.0.0.1:{port}", "POD_IP": "127.0.0.1"}
    pods = gangs.pods(3, 1, in_place_args(tmp_path / "ckpt", "--metrics-linger", "120"), env=env)
    pods[0].wait_for_stdout(r"^progress step=35 ")
    first.end()
    pods[1].end()
    survivors = [pods[0], pods[2]]
    for survivor in survivors:
        survivor.wait_for_stdout(r"^launcher event=stopped ")
    replacement = gangs.again(pods[1], "pod1-again")
    rendezvous_store(gangs, port, "rendezvous-again")
    assert all(pod.process.poll() is None for pod in survivors), describe(pods)
    rejoined_exactly(gangs, [pods[0], replacement, pods[2]])
    assert assert_survivors_kept_their_processes(survivors) == 2


def rejoined_exactly(gangs: Gangs, ended: list[TrainerProcess]) -> list[str]:
    """The 3 pods of a group a new pod joined (``ended``, by rank) finish: the new one received the
    survivors' step (35 or later) over the group, every rank ends with the uninterrupted run's
    parameters, one restart is counted on every pod however long the survivors waited, and no
    completed step was done again. Returns the pods' scrapes."""
    scrapes = finish(ended)
    match = ended[0].wait_for_stdout(r"^resumed step=(\d+) epoch=\d+ from=(\w+)")
    assert int(match.group(1)) >= 35 and match.group(2) == "peer", describe(ended)
    digests = [pod.digests() for pod in ended]
    assert [list(d) for d in digests] == [[0], [1], [2]]
    assert {d for found in digests for d in found.values()} == {uninterrupted_digest(gangs)}
    for rank, text in enumerate(scrapes):
        assert samples(text, "ddp_group_restarts_total") == {str(rank): 1.0}
    # The survivors' step is the newest any member completed: nothing is redone.
    assert samples(scrapes[0], "ddp_last_restart_steps_redone") == {"0": 0.0}, scrapes[0]
    return scrapes


@pytest.mark.parametrize("lost", [1, 0], ids=["rank-1", "rank-0"])
def test_a_standby_takes_the_lost_pods_rank_and_the_survivors_keep_theirs(
    gangs: Gangs, tmp_path: Path, lost: int
) -> None:
    """A standby pod (runPolicy.standbyPods) waits with torch imported and its forkserver up, and no
    rank of its own; once its assignment file names the lost pod's rank, it joins the survivors' next
    round as that pod, receives their state, and the group ends with the uninterrupted run's
    parameters. The assignment is written as the kubelet writes a downward API file (a new file renamed
    into place), after the survivors stopped: the order a real operator's decision comes in."""
    env = {**IN_PLACE, **rendezvous_pod(gangs)}
    args = in_place_args(tmp_path / "ckpt", "--metrics-linger", "120")
    pods = gangs.pods(3, 1, args, env=env)
    assignment = tmp_path / "placement" / "assignment"
    assignment.parent.mkdir()
    standby_env = {
        "WORLD_SIZE": "3",
        "NNODES": "3",
        "NPROC_PER_NODE": "1",
        "MASTER_PORT": pods[0].env["MASTER_PORT"],
        **env,
        "DDP_STANDBY_FILE": str(assignment),
    }
    standby = gangs.start("standby", standby_env, args, free_port())
    standby.wait_for_stdout(r"^launcher event=standby ")
    pods[0].wait_for_stdout(r"^progress step=35 ")
    pods[lost].end()  # the whole pod: its launcher and its worker, SIGKILL
    survivors = [pod for rank, pod in enumerate(pods) if rank != lost]
    for survivor in survivors:
        survivor.wait_for_stdout(r"^launcher event=stopped ")
    written = assignment.with_name(".assignment.new")
    written.write_text(f"rank={lost} budget=2\n")
    written.rename(assignment)
    standby.wait_for_stdout(rf"^launcher event=assigned pod={lost} budget=2 ")
    assert all(pod.process.poll() is None for pod in survivors), describe([*pods, standby])
    rejoined_exactly(gangs, [standby if rank == lost else pod for rank, pod in enumerate(pods)])
    assert assert_survivors_kept_their_processes(survivors) == 2


@pytest.mark.parametrize("late", ["replacement", "standby"])
def test_a_pod_that_comes_after_the_last_step_ends_0_and_trains_nothing(
    gangs: Gangs, tmp_path: Path, late: str
) -> None:
    """A rank's pod lost after the group's last step, whose loss the operator saw before the job's end
    (a kubelet reports late), gets a replacement or a standby takes its rank: that pod comes to a
    group that finished. It must end 0, so every rank's newest pod exited 0 and the job succeeds; with
    170 (a lost peer) the operator restarted the whole gang, which trained again (found on kind)."""
    env = {**IN_PLACE, **rendezvous_pod(gangs)}
    args = in_place_args(tmp_path / "ckpt")
    pods = gangs.pods(2, 1, args, env=env)
    assignment = tmp_path / "placement" / "assignment"
    standby = None
    if late == "standby":
        assignment.parent.mkdir()
        standby_env = {"WORLD_SIZE": "2", "NNODES": "2", "NPROC_PER_NODE": "1", **env}
        standby_env |= {"MASTER_PORT": pods[0].env["MASTER_PORT"], "DDP_STANDBY_FILE": str(assignment)}
        standby = gangs.start("standby", standby_env, args, free_port())
        standby.wait_for_stdout(r"^launcher event=standby ")
    assert wait_all(pods) == [0, 0], describe(pods)
    if standby is None:
        comer = gangs.again(pods[1], "pod1-late")
    else:
        written = assignment.with_name(".assignment.new")
        written.write_text("rank=1 budget=2\n")
        written.rename(assignment)
        comer = standby
    assert comer.wait() == 0, describe([*pods, comer])
    assert (
        "the group had trained to its last step when this pod came to join it; exiting 0" in comer.stderr
    ), describe([comer])
    assert not comer.digests(), "it trained nothing"


def test_a_standby_stopped_before_any_assignment_exits_0(gangs: Gangs, tmp_path: Path) -> None:
    """The job ended (or its standby is no longer wanted): SIGTERM ends the waiting standby cleanly."""
    env = {**IN_PLACE, **rendezvous_pod(gangs)}
    standby_env = {"WORLD_SIZE": "2", "NNODES": "2", "NPROC_PER_NODE": "1", "MASTER_PORT": str(free_port())}
    standby_env |= {**env, "DDP_STANDBY_FILE": str(tmp_path / "assignment")}
    standby = gangs.start("standby", standby_env, in_place_args(tmp_path / "ckpt"))
    standby.wait_for_stdout(r"^launcher event=standby ")
    standby.signal(signal.SIGTERM)
    assert standby.wait() == 0, describe([standby])
    standby.wait_for_stdout(r"^launcher event=released signal=SIGTERM")


def test_losing_the_rendezvous_host_ends_the_other_pods_with_peer_lost(gangs: Gangs, tmp_path: Path) -> None:
    pods = gangs.pods(3, 1, in_place_args(tmp_path / "ckpt"), with_metrics=False, env=IN_PLACE)
    pods[0].wait_for_stdout(r"^progress step=20 ")
    pods[0].end()
    assert wait_all(pods[1:], timeout=120) == [EXIT_PEER_LOST, EXIT_PEER_LOST], describe(pods)


def socket_inodes(port: int, state: str, remote: bool = False) -> set[str]:
    """The sockets (``socket:[inode]``) in TCP ``state`` (0A: listening, 01: established) whose local
    port, or with ``remote`` whose peer's port, is ``port`` (IPv4 or IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address = fields[2] if remote else fields[1]
            if int(address.rsplit(":", 1)[1], 16) == port and fields[3] == state:
                found.add(f"socket:[{fields[9]}]")
    return found


def holding(pid: int, inodes: set[str]) -> bool:
    with contextlib.suppress(OSError):
        return any(os.readlink(fd) in inodes for fd in Path(f"/proc/{pid}/fd").iterdir())
    return False


def assert_the_agent_serves_the_workers_store(pod: TrainerProcess) -> int:
    """Rank 0's launcher, not a worker, listens on its workers' store port, and every worker of the
    pod is connected to it: the launcher held the port from the round's start (torch's agent would
    pick a free one and leave the worker to bind it seconds later, which a busy machine's connection
    once took first). Returns the port."""
    [started] = events(pod, "started")[-1:]
    port = int(started["store"].rsplit(":", 1)[1])
    workers = list(pod.worker_pids().values())
    listening = socket_inodes(port, "0A")
    assert [pid for pid in [pod.process.pid, *workers] if holding(pid, listening)] == [pod.process.pid], (
        started,
        describe([pod]),
    )
    connected = socket_inodes(port, "01", remote=True)
    assert all(holding(pid, connected) for pid in workers), (started, describe([pod]))
    return port


def test_two_workers_per_pod_restart_in_place(gangs: Gangs, tmp_path: Path) -> None:
    pods = gangs.pods(2, 2, in_place_args(tmp_path / "ckpt", "--metrics-linger", "120"), env=IN_PLACE)
    pods[0].wait_for_stdout(r"^progress step=25 ")
    first_port = assert_the_agent_serves_the_workers_store(pods[0])
    killed = kill_worker(pods[1], rank=3)
    # Each round has a store of its own: the restarted workers meet at a new one, served the same way.
    pods[0].wait_for_stdout(r"^launcher event=started pod=0 restarts=1 .*\n(?:.*\n)*?progress step=\d+ ")
    assert assert_the_agent_serves_the_workers_store(pods[0]) != first_port
    scrapes = finish(pods)
    [failed] = events(pods[1], "failed")
    assert failed["code"] == "137" and float(failed["time"]) >= killed
    assert_one_restart_in_order(pods, killed)
    assert assert_survivors_kept_their_processes(pods, {killed_pid(pods[1], 3)}) == 3
    digests = [pod.digests() for pod in pods]
    assert [sorted(d) for d in digests] == [[0, 1], [2, 3]]
    assert len({d for found in digests for d in found.values()}) == 1
    assert samples(scrapes[1], "ddp_group_restarts_total") == {"2": 1.0}
    info = labelled(scrapes[0], "ddp_last_restart_info")
    assert info is not None and info["failed_rank"] == failed["rank"]


def torchrun_pods(gangs: Gangs, pods: int, args: list[str], tag: str = "torchrun") -> list[TrainerProcess]:
    """Stock torchrun "pods" with what the operator sets for a user's own torchrun image
    (docs/trainer.md, "Stock torchrun images"): no code of ours runs in them."""
    port = free_port()
    env = {
        "PET_NNODES": str(pods),
        "PET_NPROC_PER_NODE": "1",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "PET_RDZV_ID": "job-uid-0",
        "PET_MAX_RESTARTS": "3",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    program = [PYTHON, "-m", "torch.distributed.run", str(HERE / "inplace_probe.py")]
    return [
        gangs.start(
            f"{tag}{rank}",
            {**env, "PET_RDZV_CONF": f"is_host={1 if rank == 0 else 0},keep_alive_interval=2"},
            args,
            program=program,
        )
        for rank in range(pods)
    ]


def probe_lines(pods: list[TrainerProcess], prefix: str) -> list[str]:
    return [line for pod in pods for line in pod.stdout.splitlines() if line.startswith(prefix)]


def test_stock_torchrun_restarts_in_place_from_the_pet_variables(gangs: Gangs) -> None:
    pods = torchrun_pods(gangs, 2, ["--fail-once"])
    assert wait_all(pods) == [0, 0], describe(pods)
    # Both workers ran twice: the failed one's agent and the healthy one's both restarted them.
    assert len(probe_lines(pods, "probe started")) == 4, describe(pods)
    assert len(probe_lines(pods, "probe done")) == 2, describe(pods)


def test_stock_torchrun_takes_a_replacement_pod(gangs: Gangs) -> None:
    pods = torchrun_pods(gangs, 3, ["--steps", "200"])
    pods[0].wait_for_stdout(r"^probe step=20 ")
    pods[2].end()
    replacement = gangs.again(pods[2], "torchrun2-again")
    survivors = [pods[0], pods[1], replacement]
    assert wait_all(survivors) == [0, 0, 0], describe(survivors)
    assert len(probe_lines(survivors, "probe done")) == 3, describe(survivors)
