"""Elastic jobs (DDP_MIN_MEMBERS): "pods" are in-place launchers on loopback (see
test_inplace_restarts.py) that may train on DDP_MIN_MEMBERS..NNODES of them.

A pod's deletion is a SIGTERM to its launcher; a replacement is a new launcher with that NODE_RANK.
The order of events and the counts are asserted, never the seconds between them.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from trainer_gang import (
    Gangs,
    TrainerProcess,
    assert_survivors_kept_their_processes,
    describe,
    events,
    finish,
    free_port,
    labelled,
    samples,
    wait_all,
)

from ddp_trainer.exitcodes import EXIT_PEER_LOST, EXIT_STOPPED

pytestmark = pytest.mark.trainer

ELASTIC = {"DDP_RESTART_MODE": "InPlace", "DDP_MIN_MEMBERS": "2", "DDP_REPLACEMENT_WAIT_SECONDS": "5"}
# Slow enough steps that the survivors are still training when a replacement has started (its
# launcher imports torch first), and enough of them; digits at world size 2 has 23 batches an epoch.
TRAIN = ["--epochs", "20", "--max-steps", "250", "--progress-every", "5", "--stop-check-every", "5"]


def elastic_args(checkpoints: Path, *extra: str) -> list[str]:
    return [
        *TRAIN,
        "--seed",
        "7",
        "--throttle-ms",
        "100",
        "--checkpoint-dir",
        str(checkpoints),
        "--checkpoint-every",
        "10",
        *extra,
    ]


def start_three(
    gangs: Gangs, args: list[str], with_metrics: bool = True, budget: int = 3, replacement_wait: int = 5
) -> list[TrainerProcess]:
    """Three pods, trained on together: NODE_RANK 0, whose launcher hosts the store, starts first, and
    the other two once it listens (started before it, a launcher's connection attempts back off for
    seconds, and a loaded machine once took one past the replacement wait). A pod that still joins more
    than the replacement wait (``replacement_wait``) after two others finds a round of 2, and the group
    grows for it once their workers run: its wait for that is bounded by its --init-timeout."""
    env = {
        **ELASTIC,
        "DDP_RESTART_BUDGET": str(budget),
        "DDP_REPLACEMENT_WAIT_SECONDS": str(replacement_wait),
    }
    [host] = gangs.pods(3, 1, args, with_metrics=with_metrics, env=env, start_order=[0])
    host.wait_until_listening(int(host.env["MASTER_PORT"]))
    others = [
        gangs.start(
            f"pod{rank}", {**host.env, "NODE_RANK": str(rank)}, args, free_port() if with_metrics else None
        )
        for rank in (1, 2)
    ]
    pods = [host, *others]
    wait_for_round(pods, 3)
    return pods


def wait_for_round(pods: list[TrainerProcess], members: int) -> None:
    """Until every pod's launcher has started its workers in a round of ``members`` pods."""
    pattern = rf"^launcher event=started pod=\d+ restarts=\d+ members={members} "
    for pod in pods:
        pod.wait_for_stdout(pattern)


def progress_after(pod: TrainerProcess, line: str) -> int:
    """The step of rank 0's first progress line printed after the line matching ``line``."""
    match = pod.wait_for_stdout(rf"^{line}.*\n(?:.*\n)*?progress step=(\d+) ")
    return int(match.group(1))


def steps(pod: TrainerProcess, kind: str) -> list[int]:
    return [int(fields["step"]) for fields in pod.status_lines(kind)]


def gauge(pod: TrainerProcess, name: str) -> float:
    found = samples(pod.scrape(), name)
    assert len(found) == 1, found
    return next(iter(found.values()))


def test_a_pod_leaves_the_survivors_train_on_and_a_new_pod_grows_the_group_back(
    gangs: Gangs, tmp_path: Path
) -> None:
    # The shrink spends the whole budget: the grow must not need any.
    pods = start_three(gangs, elastic_args(tmp_path / "ckpt", "--metrics-linger", "120"), budget=1)
    survivors = pods[:2]
    # A round of 2 and a grow instead of the first round of 3 would shift the counts, not break them.
    restarts_before = gauge(pods[0], "ddp_group_restarts_total")
    grows_before = gauge(pods[0], "ddp_group_grows_total")
    resizes_before = gauge(pods[0], "ddp_group_resizes_total")
    launchers = [pod.process.pid for pod in survivors]
    pods[0].wait_for_stdout(r"^progress step=20 ")

    # Shrink: pod 2 is deleted. Its workers and the others' stop together (the agreed stop), and the
    # survivors re-form without it once its heartbeats are gone and the replacement wait is over.
    pods[2].signal(signal.SIGTERM)
    assert pods[2].wait() == EXIT_STOPPED, describe(pods)
    wait_for_round(survivors, 2)
    shrunk = pods[0].wait_for_stdout(r"^resized from_world_size=3 world_size=2 step=(\d+) ")
    assert progress_after(pods[0], "resized from_world_size=3") > int(shrunk.group(1))
    for rank, pod in enumerate(survivors):
        assert samples(pod.scrape(), "ddp_group_members") == {str(rank): 2.0}
    assert [e["members"] for e in events(pods[0], "reformed")][-1] == "2"
    rank0 = pods[0].scrape()
    assert (
        samples(rank0, "ddp_last_restart_members_before"),
        samples(rank0, "ddp_last_restart_members_after"),
    ) == (
        {"0": 3.0},
        {"0": 2.0},
    )

    # Grow: a new pod 2 joins; the survivors stop with the agreed stop and the group re-forms as 3.
    replacement = gangs.again(pods[2], "pod2-again")
    wait_for_round([*survivors, replacement], 3)
    grown = pods[0].wait_for_stdout(r"^resized from_world_size=2 world_size=3 step=(\d+) ")
    assert [pod.process.pid for pod in survivors] == launchers
    assert all(pod.process.poll() is None for pod in survivors), describe(pods)
    scrapes = finish([*survivors, replacement])

    # Each resize resumed from the checkpoint the agreed stop wrote: no step was done twice.
    stopped, resumed = steps(pods[0], "stopped"), steps(pods[0], "resumed")
    assert stopped == resumed and stopped[-2:] == [int(shrunk.group(1)), int(grown.group(1))], describe(pods)
    # No survivor's worker failed or started anew: each left the group twice with its state (pod 2's
    # agreed stop, then its supervisor's leave for the grow) and kept its process.
    assert not [e for pod in survivors for e in events(pod, "failed")], describe(pods)
    assert [[e["why"] for e in events(pod, "left")] for pod in survivors] == [["stopped", "asked"]] * 2
    assert assert_survivors_kept_their_processes(survivors) == 2
    assert events(pods[0], "grow") or events(pods[1], "grow"), describe(pods)
    # The same model on every rank of the last round.
    digests = [pod.digests() for pod in (*survivors, replacement)]
    assert [list(found) for found in digests] == [[0], [1], [2]], describe(pods)
    assert len({digest for found in digests for digest in found.values()}) == 1

    # Two restarts, one of them a grow (not budgeted), on every pod; rank 0 measured the grow.
    for rank, text in enumerate(scrapes):
        assert samples(text, "ddp_group_restarts_total") == {str(rank): restarts_before + 2}
        assert samples(text, "ddp_group_grows_total") == {str(rank): grows_before + 1}
        # The shrink and the grow, counted where the rounds formed (status.elastic.resizes).
        assert samples(text, "ddp_group_resizes_total") == {str(rank): resizes_before + 2}
        assert samples(text, "ddp_group_members") == {str(rank): 3.0}
        assert samples(text, "ddp_group_nodes") == {str(rank): 3.0}  # the deprecated name, the same
    rank0 = scrapes[0]
    assert samples(rank0, "ddp_last_restart_members_before") == {"0": 2.0}
    assert samples(rank0, "ddp_last_restart_members_after") == {"0": 3.0}
    assert samples(rank0, "ddp_last_restart_nodes_before") == {"0": 2.0}
    assert samples(rank0, "ddp_last_restart_nodes_after") == {"0": 3.0}
    assert samples(rank0, "ddp_last_restart_steps_redone") == {"0": 0.0}
    info = labelled(rank0, "ddp_last_restart_info")
    assert info is not None and info["cause"] == "MemberJoined" and info["exit_code"] == ""
    assert "ddp_last_restart_members_before" not in scrapes[1]


def test_a_grow_after_the_last_stop_check_finds_the_job_done(gangs: Gangs, tmp_path: Path) -> None:
    # No stop check before the last step: a grow's SIGTERM cannot stop the workers, they finish.
    args = elastic_args(tmp_path / "ckpt", "--max-steps", "150", "--stop-check-every", "1000")
    # A first start without pod 2: the round of 2 forms once the replacement wait is over.
    pods = gangs.pods(3, 1, args, with_metrics=False, env=ELASTIC, start_order=[1, 0])
    wait_for_round(pods, 2)
    pods[0].wait_for_stdout(r"^progress step=10 ")
    late = gangs.start("pod2", {**pods[0].env, "NODE_RANK": "2"}, args)
    # The pods that stopped their workers for the grow find them done and meet the others at the
    # exit barrier, instead of starting a round that would keep those waiting.
    assert wait_all(pods) == [0, 0], describe([*pods, late])
    growers = [pod for pod in pods if events(pod, "grow")]
    assert growers, describe([*pods, late])
    for pod in growers:
        assert "training was over when a pod joined the round of 2; exiting 0" in pod.stderr
    started = [[(e["members"], e["nodes"]) for e in events(pod, "started")] for pod in pods]
    assert started == [[("2", "2")], [("2", "2")]]
    assert len({digest for pod in pods for digest in pod.digests().values()}) == 1
    assert "final accuracy=" in pods[0].stdout
    # The group ended without it: it took no part, so it is no failure of the job.
    assert late.wait() == 0, describe([*pods, late])
    # Either way it took no part: the rendezvous read closed as finished, or its host (pod 0's
    # launcher) already gone.
    assert any(
        line in late.stderr
        for line in (
            "the group had trained to its last step when this pod came to join it; exiting 0",
            "the elastic group had ended when this pod came to join it (",
        )
    ), late.stderr


def test_below_min_members_the_survivor_does_not_train_alone(gangs: Gangs, tmp_path: Path) -> None:
    # --init-timeout bounds the survivor's wait for a second pod, as it bounds a first start (on a
    # loaded CI machine pod 0 once gave up on a first round the others joined late). A replacement wait
    # longer than any start keeps the first round open for all three; below DDP_MIN_MEMBERS it plays no
    # part.
    pods = start_three(
        gangs,
        elastic_args(tmp_path / "ckpt", "--init-timeout", "30"),
        with_metrics=False,
        replacement_wait=240,
    )
    pods[0].wait_for_stdout(r"^progress step=10 ")
    started = len(events(pods[0], "started"))
    for pod in pods[1:]:
        pod.signal(signal.SIGTERM)
    assert wait_all(pods) == [EXIT_PEER_LOST, EXIT_STOPPED, EXIT_STOPPED], describe(pods)
    # Its worker left the group with the others' agreed stop, kept its state, and waited with it for a
    # round it never had: no worker failed or started again.
    assert not events(pods[0], "failed"), describe(pods)
    assert [e["why"] for e in events(pods[0], "left")] == ["stopped"], describe(pods)
    assert len(events(pods[0], "started")) == started, describe(pods)
    assert events(pods[0], "stopped"), describe(pods)
    assert re.search(r"pod 0 left the rendezvous .*exiting 170", pods[0].stderr, re.DOTALL), describe(pods)
