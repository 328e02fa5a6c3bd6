"""What the job commands show (`ddpjob get|describe|logs|top|wait`, docs/cli.md). Pure: each takes the
objects the apiserver returned (a DDPJob, its pods, its Events) and the time, and returns text or a
verdict; ``commands/`` reads and prints. The rank's pod is ``observe.newest_per_rank``'s, the rule the
operator itself follows."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ddp_operator import names
from ddp_operator.observe import PodObservation, int_field, newest_per_rank, observe_pod, parse_time
from ddp_operator.policies import restart_events
from ddp_operator.progress.render import RankResult, format_duration, rank_table

JsonDict = Mapping[str, Any]


def _mapping(value: Any) -> Mapping[str, Any]:
    """A field that should hold an object; empty when it is absent or something else."""
    return value if isinstance(value, Mapping) else {}


def _status(job: JsonDict) -> Mapping[str, Any]:
    return _mapping(job.get("status"))


def _meta(job: JsonDict) -> Mapping[str, Any]:
    return _mapping(job.get("metadata"))


def phase_reason(job: JsonDict) -> tuple[str, str]:
    """The reason and message of the job's phase: its condition of the same name (status.py keeps
    exactly that one True); empty for a phase without a condition (Pending, Starting)."""
    status = _status(job)
    for condition in status.get("conditions") or []:
        if isinstance(condition, Mapping) and condition.get("type") == status.get("phase"):
            return str(condition.get("reason") or ""), str(condition.get("message") or "")
    return "", ""


def job_attempt(job: JsonDict, pods: Sequence[PodObservation]) -> int | None:
    """The attempt whose pods are the job's now: ``status.attempt``, else the newest any pod carries
    (a job the operator has not written a status for yet)."""
    recorded = _status(job).get("attempt")
    if isinstance(recorded, int) and not isinstance(recorded, bool):
        return recorded
    attempts = [p.attempt for p in pods if p.attempt is not None]
    return max(attempts) if attempts else None


def own_pods(job: JsonDict, pods: Sequence[JsonDict]) -> list[PodObservation]:
    """The job's pods among those its name label selected: a recreated job's leftovers (another owner
    UID) are not its own."""
    uid = _meta(job).get("uid")
    observed = [observe_pod(pod) for pod in pods]
    return [p for p in observed if uid is None or p.owner_uid in (None, uid)]


def rank_pods(job: JsonDict, pods: Sequence[PodObservation]) -> dict[int, PodObservation]:
    """Each rank's pod now: the newest of the job's current attempt (``observe.newest_per_rank``)."""
    return newest_per_rank(pods, job_attempt(job, pods))


def age(created: Any, now: datetime) -> str:
    start = parse_time(created)
    return "-" if start is None else format_duration(max(int((now - start).total_seconds()), 0))


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


GET_COLUMNS = (
    "NAME",
    "PHASE",
    "READY",
    "ATTEMPT",
    "RESTARTS",
    "STEP",
    "DONE",
    "SAMPLES/S",
    "STRAGGLER",
    "AGE",
)


def get_row(job: JsonDict, now: datetime) -> tuple[str, ...]:
    status = _status(job)
    progress = _mapping(status.get("progress"))
    straggler = _mapping(status.get("straggler"))
    done = progress.get("percentComplete")
    return (
        str(_meta(job).get("name", "")),
        str(status.get("phase") or "-"),
        str(status.get("ready") or "-"),
        str(status.get("attempt", "-")),
        str(status.get("restarts", 0)),
        str(progress.get("step", "-")),
        "-" if done is None else f"{done}%",
        str(progress.get("samplesPerSecond", "-")),
        f"rank {straggler['rank']} ({straggler.get('slowdown', '?')}x)" if "rank" in straggler else "-",
        age(_meta(job).get("creationTimestamp"), now),
    )


def get_table(jobs: Sequence[JsonDict], now: datetime, with_namespace: bool = False) -> str:
    """`ddpjob get`: one row a job, sorted by namespace and name."""
    ordered = sorted(jobs, key=lambda j: (str(_meta(j).get("namespace", "")), str(_meta(j).get("name", ""))))
    header = (("NAMESPACE",) if with_namespace else ()) + GET_COLUMNS
    rows = [
        ((str(_meta(job).get("namespace", "")),) if with_namespace else ()) + get_row(job, now)
        for job in ordered
    ]
    return _table([header, *rows])


def _pod_state(pod: PodObservation) -> str:
    if pod.deleting:
        return "Terminating"
    if pod.terminated and pod.exit_code is not None:
        return f"{pod.phase} (exit {pod.exit_code}{', ' + pod.reason if pod.reason else ''})"
    if pod.waiting_reason:
        return f"{pod.phase} ({pod.waiting_reason})"
    return pod.phase


def _fields(mapping: Mapping[str, Any], skip: Sequence[str] = ()) -> str:
    return ", ".join(f"{key}={value}" for key, value in mapping.items() if key not in skip)


def _status_lines(status: Mapping[str, Any]) -> list[str]:
    """`ddpjob describe`'s lines of what the operator read of the training and its restarts."""
    lines: list[str] = []
    for label, key in (
        ("Elastic", "elastic"),
        ("Progress", "progress"),
        ("Goodput", "goodput"),
        ("Straggler", "straggler"),
    ):
        value = status.get(key)
        if key == "goodput" and value is not None:
            value = f"{value} of the wall time since {status.get('startTime', '-')}"
        elif isinstance(value, Mapping):
            value = _fields(value)
        if isinstance(value, str):
            lines.append(f"{label + ':':<13}{value}")
    lost = status.get("lostSeconds")
    if isinstance(lost, Mapping):
        lines.append(f"Lost:        {restart_events.describe_lost(lost)}")
    restart = status.get("lastRestart")
    if isinstance(restart, Mapping):
        lines.append(f"Last restart: {_fields(restart, skip=('note',))}")
        if restart.get("note"):
            lines.append(f"  note: {restart['note']}")
    return lines


def describe(
    job: JsonDict,
    pods: Sequence[PodObservation],
    events: Sequence[JsonDict],
    now: datetime,
    max_events: int = 15,
) -> str:
    """`ddpjob describe`: phase, conditions, progress, the last restart's anatomy, goodput, the
    straggler, each rank's pod, the standby pods, and the job's recent Events, in one screen."""
    meta, status = _meta(job), _status(job)
    spec = _mapping(job.get("spec"))
    reason, message = phase_reason(job)
    lines = [
        f"Name:        {meta.get('namespace', '')}/{meta.get('name', '')}",
        f"Phase:       {status.get('phase') or '-'}" + (f" ({reason})" if reason else ""),
        f"Age:         {age(meta.get('creationTimestamp'), now)}",
        f"Replicas:    {spec.get('replicas', '-')} x {spec.get('nprocPerNode', 1)} process(es)"
        f"  world size {status.get('worldSize', '-')}  ready {status.get('ready') or '-'}",
        f"Attempt:     {status.get('attempt', '-')}  restarts {status.get('restarts', 0)}"
        f"  pods replaced {status.get('podReplacements', 0)}",
    ]
    if message:
        lines.append(f"Message:     {message}")
    lines.extend(_status_lines(status))
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    if conditions:
        lines.append("Conditions:")
        rows = [("TYPE", "STATUS", "REASON", "SINCE", "MESSAGE")] + [
            (
                str(c.get("type", "")),
                str(c.get("status", "")),
                str(c.get("reason", "")),
                age(c.get("lastTransitionTime"), now),
                str(c.get("message", "")),
            )
            for c in conditions
        ]
        lines.extend("  " + line for line in _table(rows).splitlines())
    current = rank_pods(job, pods)
    if current:
        lines.append("Ranks:")
        rows = [("RANK", "POD", "STATE", "NODE", "AGE")] + [
            (str(rank), pod.name, _pod_state(pod), pod.node or "-", age(pod.created_at, now))
            for rank, pod in sorted(current.items())
        ]
        lines.extend("  " + line for line in _table(rows).splitlines())
    standbys = [p for p in pods if p.standby_waiting and not p.deleting]
    if standbys:
        lines.append("Standby pods (runPolicy.standbyPods: no rank until a lost pod's is given):")
        waiting = [("POD", "STATE", "NODE", "AGE")] + [
            (pod.name, _pod_state(pod), pod.node or "-", age(pod.created_at, now))
            for pod in sorted(standbys, key=lambda p: p.name)
        ]
        lines.extend("  " + line for line in _table(waiting).splitlines())
    lines.append("Events:" if events else "Events:      <none>")
    if events:
        recent = sorted(events, key=_event_time)[-max_events:]
        rows = [("LAST SEEN", "TYPE", "REASON", "COUNT", "MESSAGE")] + [
            (
                age(_event_time(e) or None, now),
                str(e.get("type", "")),
                str(e.get("reason", "")),
                str(int_field(e.get("count"), 1)),
                str(e.get("message", "")),
            )
            for e in recent
        ]
        lines.extend("  " + line for line in _table(rows).splitlines())
    return "\n".join(lines)


def _event_time(event: JsonDict) -> str:
    """An Event's latest time as the apiserver wrote it (RFC 3339 strings sort as times)."""
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        value = event.get(key)
        if value:
            return str(value)
    return str(_meta(event).get("creationTimestamp") or "")


@dataclass(frozen=True)
class WaitVerdict:
    """Where `ddpjob wait` stands: ``done`` once the answer is known; ``met`` whether the job reached
    the phase waited for; ``message`` the reason either way."""

    done: bool
    met: bool
    message: str


def wait_verdict(job: JsonDict | None, wanted: str) -> WaitVerdict:
    """Whether a job is in phase ``wanted`` (met), can no longer get there (a finished job in another
    phase, or a deleted one), or may still (not done)."""
    if job is None:
        return WaitVerdict(True, False, "the DDPJob does not exist (deleted?)")
    phase = str(_status(job).get("phase") or "")
    reason, message = phase_reason(job)
    said = f"phase {phase or 'unset'}" + (f" ({reason}: {message})" if reason or message else "")
    if phase == wanted:
        return WaitVerdict(True, True, said)
    if phase in names.FINISHED_PHASES:
        return WaitVerdict(True, False, said)
    return WaitVerdict(False, False, said)


def metrics_port(pod: JsonDict) -> int | None:
    """The trainer container's port named ``metrics`` (builders declare it), None with metrics off."""
    spec = _mapping(pod.get("spec"))
    for container in spec.get("containers") or []:
        if container.get("name") != names.TRAINER_CONTAINER:
            continue
        for port in container.get("ports") or []:
            if port.get("name") == names.METRICS_PORT_NAME and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


def top_screen(job: JsonDict, results: Sequence[RankResult], now: datetime) -> str:
    """`ddpjob top`: the job's line, then the per-rank table `ddpjob run` prints at its end (one
    renderer: ``render.rank_table``), from each rank pod's own /metrics."""
    meta, status = _meta(job), _status(job)
    progress = _mapping(status.get("progress"))
    head = (
        f"{meta.get('namespace', '')}/{meta.get('name', '')}  {status.get('phase') or '-'}"
        f"  attempt {status.get('attempt', '-')}  restarts {status.get('restarts', 0)}"
        f"  step {progress.get('step', '-')}"
        + (f" ({progress['percentComplete']}%)" if "percentComplete" in progress else "")
        + f"  samples/s {progress.get('samplesPerSecond', '-')}"
        + (f"  goodput {status['goodput']}" if status.get("goodput") is not None else "")
        + f"  at {now.strftime('%H:%M:%S')}"
    )
    lines = [head, ""]
    if results:
        lines.extend(rank_table(results))
    else:
        lines.append("no rank pods yet")
    straggler = status.get("straggler")
    if isinstance(straggler, Mapping):
        lines.append(f"straggler: {_fields(straggler)}")
    silent = [str(r.rank) for r in results if r.metrics is None]
    if silent:
        lines.append(
            f"no metrics from rank(s) {', '.join(silent)}: not running, metrics disabled, or no "
            "`pods/proxy` get permission"
        )
    return "\n".join(lines)


# A kubelet log line with timestamps=true: "<RFC 3339 with up to 9 fraction digits> <text>". The key
# orders lines across reconnects to one container (whole seconds, then nanoseconds).
LogKey = tuple[str, int]
_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d) ")


def split_log_line(line: str) -> tuple[LogKey | None, str]:
    """A timestamped log line's order key and text; (None, line) when it carries no timestamp."""
    match = _LOG_TIME.match(line)
    if match is None or match.group(3) != "Z":
        return None, line
    return (match.group(1), int((match.group(2) or "").ljust(9, "0"))), line[match.end() :]


def since_time(key: LogKey) -> str:
    """The ``sinceTime`` that resends every line from ``key``'s second on (the API takes whole
    seconds): the reader drops those at or before ``key`` itself."""
    return f"{key[0]}Z"


def log_prefix(rank: int, pod: PodObservation) -> str:
    return f"[rank {rank} attempt {pod.attempt if pod.attempt is not None else '?'}] "


def switch_note(rank: int, before: PodObservation | None, after: PodObservation) -> str:
    """What `ddpjob logs` says when a rank's log moves to another pod."""
    why = "a new attempt" if before is not None and before.attempt != after.attempt else "a replacement pod"
    if before is None:
        return f"rank {rank}: pod {after.name} (attempt {after.attempt})"
    return f"rank {rank}: now pod {after.name} ({why}, attempt {after.attempt}; was {before.name})"


def log_ready(pod: PodObservation) -> bool:
    """Whether the pod's trainer container has a log to read: it started, or it ended."""
    return pod.started_at is not None or pod.terminated or pod.phase in ("Running", "Succeeded", "Failed")
