"""`ddpjob logs JOB [--rank N]... [-f]`: a rank's log by its rank, not its pod's name. With ``-f`` it
follows the rank across in-place restarts (the same container: its log goes on), replaced pods and new
attempts (the rank's newest pod, ``observe.newest_per_rank``'s rule, as the operator picks it), says
on stderr when it moves to another pod, and ends once the job has finished and every followed pod's
log is read (docs/cli.md)."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from ddp_operator.commands import cluster_access

if TYPE_CHECKING:
    from ddp_operator.jobview import LogKey
    from ddp_operator.kube_api import PodLogStream
    from ddp_operator.observe import PodObservation

DESCRIPTION = (
    "Print (or with -f follow) a DDPJob rank's log, whatever pod hosts it now. Several ranks "
    "(--rank repeated, or --all-ranks) are interleaved as they come, each line prefixed "
    "'[rank N attempt A]'."
)
POLL_SECONDS = 1.0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument("job", metavar="JOB")
    ranks = parser.add_mutually_exclusive_group()
    ranks.add_argument(
        "--rank", type=int, action="append", metavar="N", help="a pod rank (repeatable; default 0)"
    )
    ranks.add_argument("--all-ranks", action="store_true", help="every rank of the current attempt")
    parser.add_argument(
        "-f", "--follow", action="store_true", help="follow across restarts until the job ends"
    )
    parser.add_argument(
        "--tail", type=int, default=None, metavar="LINES", help="start with the last LINES lines"
    )
    parser.add_argument(
        "--prefix", action="store_true", help="prefix lines with rank and attempt even for one rank"
    )
    parser.add_argument(
        "--timestamps",
        action="store_true",
        help="begin each line with the time its container wrote it, as the kubelet recorded it (RFC 3339)",
    )
    cluster_access.add_connection_args(parser)


@dataclass
class _Rank:
    """One followed rank: the pod its log is read from, that pod's open stream, and the last line
    printed from each of its pods (a reconnect to the same container prints nothing twice)."""

    rank: int
    pod: PodObservation | None = None
    stream: PodLogStream | None = None
    reader: threading.Thread | None = None
    last: dict[str, LogKey] = field(default_factory=dict)
    # Pods whose log was opened after their container ended: that read returns all that is left.
    complete: set[str] = field(default_factory=set)


class Follower:
    """Reads the job every ``POLL_SECONDS``, moves each rank to its newest pod, and keeps one log
    stream a rank open on a thread; lines go to ``out`` whole, under one lock."""

    def __init__(
        self,
        session: cluster_access.Session,
        job: str,
        prefix: bool,
        tail: int | None,
        out: TextIO,
        err: TextIO,
        timestamps: bool = False,
    ) -> None:
        self.session, self.job, self.prefix, self.tail = session, job, prefix, tail
        self.timestamps = timestamps
        self.out, self.err = out, err
        self.ranks: dict[int, _Rank] = {}
        self.lock = threading.Lock()

    def _print(self, text: str, to: TextIO) -> None:
        with self.lock:
            print(text, file=to, flush=True)

    def _read(self, followed: _Rank, pod: PodObservation, stream: PodLogStream) -> None:
        from ddp_operator import jobview

        prefix = jobview.log_prefix(followed.rank, pod) if self.prefix else ""
        try:
            for line in stream.lines():
                key, text = jobview.split_log_line(line)
                if key is not None:
                    if key <= followed.last.get(pod.name, ("", -1)):
                        continue
                    followed.last[pod.name] = key
                self._print(prefix + (line if self.timestamps else text), self.out)
        except Exception as error:  # a broken connection: the next poll opens the log again
            self._print(f"ddpjob: rank {followed.rank}: log of {pod.name} interrupted: {error}", self.err)

    def _open(self, followed: _Rank, pod: PodObservation) -> None:
        from ddp_operator import jobview, names

        last = followed.last.get(pod.name)
        stream = self.session.api.pod_log_stream(
            self.session.namespace,
            pod.name,
            names.TRAINER_CONTAINER,
            # An ended container's log is read to its end and closed: a follow stream may never end
            # (a kubelet gone with its node; kwok keeps them open).
            follow=not pod.terminated,
            since_time=jobview.since_time(last) if last else None,
            # --tail shapes the start only: a later pod of the rank is read whole.
            tail_lines=self.tail if not followed.last else None,
        )
        if pod.terminated:
            followed.complete.add(pod.name)
        followed.stream = stream
        followed.reader = threading.Thread(
            target=self._read, args=(followed, pod, stream), name=f"log-rank-{followed.rank}", daemon=True
        )
        followed.reader.start()

    def poll(self, wanted: list[int] | None) -> bool:
        """One look at the job; True once there is nothing more to follow."""
        from ddp_operator import jobview, names
        from ddp_operator.kube_api import ApiError

        read = cluster_access.read_job(self.session, self.job)
        if read is None:
            self._print(f"ddpjob: DDPJob {self.job} is gone", self.err)
            return True
        current = jobview.rank_pods(read.job, read.pods)
        current_names = {p.name for p in read.pods}
        for rank in wanted if wanted is not None else sorted(current):
            followed = self.ranks.setdefault(rank, _Rank(rank))
            pod = current.get(rank)
            if pod is None:
                continue
            if followed.pod is None or followed.pod.name != pod.name:
                if followed.stream is not None:
                    followed.stream.close()  # the old pod may sit on a dead node: never wait for it
                self._print(f"--- {jobview.switch_note(rank, followed.pod, pod)}", self.err)
                followed.pod, followed.stream = pod, None
            followed.pod = pod
            reading = followed.reader is not None and followed.reader.is_alive()
            if (
                reading
                and pod.terminated
                and pod.name not in followed.complete
                and followed.stream is not None
            ):
                # Ended since its stream opened: that stream is closed and the rest read to its end.
                followed.stream.close()
                if followed.reader is not None:
                    followed.reader.join(timeout=10)
                reading = followed.reader is not None and followed.reader.is_alive()
            if not reading and jobview.log_ready(pod) and pod.name not in followed.complete:
                try:
                    self._open(followed, pod)
                except ApiError as error:  # not started yet after all, or its node is gone
                    if error.status not in (400, 404):
                        raise
        finished = (read.job.get("status") or {}).get("phase") in names.FINISHED_PHASES
        read_out = all(
            (f.reader is None or not f.reader.is_alive())
            and (f.pod is None or f.pod.name in f.complete or f.pod.name not in current_names)
            for f in self.ranks.values()
        )
        return finished and read_out

    def close(self) -> None:
        for followed in self.ranks.values():
            if followed.stream is not None:
                followed.stream.close()


def _print_once(session: cluster_access.Session, args: argparse.Namespace, wanted: list[int] | None) -> int:
    from ddp_operator import jobview, names

    read = cluster_access.read_job(session, args.job)
    if read is None:
        return cluster_access.no_such_job(session, args.job)
    current = jobview.rank_pods(read.job, read.pods)
    prefix = args.prefix or wanted is None or len(wanted) > 1
    for rank in wanted if wanted is not None else sorted(current):
        pod = current.get(rank)
        if pod is None or not jobview.log_ready(pod):
            state = "has no pod" if pod is None else f"has not started yet (pod {pod.name})"
            print(f"ddpjob: rank {rank} {state}", file=sys.stderr)
            continue
        stream = session.api.pod_log_stream(
            session.namespace, pod.name, names.TRAINER_CONTAINER, follow=False, tail_lines=args.tail
        )
        for line in stream.lines():
            text = line if args.timestamps else jobview.split_log_line(line)[1]
            print((jobview.log_prefix(rank, pod) if prefix else "") + text)
    return cluster_access.EXIT_OK


def main(args: argparse.Namespace) -> int:
    from ddp_operator.kube_api import ApiError

    wanted = None if args.all_ranks else (args.rank or [0])
    session = cluster_access.connect(args)
    follower: Follower | None = None
    try:
        if not args.follow:
            return _print_once(session, args, wanted)
        if session.api.get_job_blocking(session.namespace, args.job) is None:
            return cluster_access.no_such_job(session, args.job)
        prefix = args.prefix or wanted is None or len(wanted) > 1
        follower = Follower(session, args.job, prefix, args.tail, sys.stdout, sys.stderr, args.timestamps)
        while not follower.poll(wanted):
            time.sleep(POLL_SECONDS)
        return cluster_access.EXIT_OK
    except (ApiError, OSError) as error:
        return cluster_access.api_failure(error)
    except KeyboardInterrupt:
        return 130
    finally:
        if follower is not None:
            follower.close()
        session.api.close()
