"""Measuring gradient synchronization: one recorder per timing strategy, chosen once per DDP model.

- :class:`WallClockRecorder` (detailed mode, gradients in host memory, i.e. gloo): our comm hook reads
  the wall clock in the future's ``then()`` callback, which gloo runs on its worker thread once the
  allreduce is done;
- :class:`CudaEventRecorder` (detailed mode, gradients on a GPU, i.e. NCCL): NCCL completes the future
  at enqueue, so the hook records CUDA events around the collective and resolves them later (at a step
  boundary, or when the next bucket arrives and they are ready); it never synchronizes in the hook;
- :class:`LoggerRecorder` (light mode): no Python hook at all; bytes and calls come from the bucket
  sizes DDP's C++ logger reports.

The two hook strategies count every bucket and time the buckets of one synchronized step in
``SyncSettings.time_every`` (docs/metrics.md, "What is sampled"): a timed bucket costs ten times a
counted one, and on a GPU's short steps that difference is the hook's whole cost.

All three copy DDP's logger averages (backward compute, comm, overlap) into the gauges. Service time =
end - max(start, end of the previous bucket): buckets run one after the other, so the time a bucket
waited behind an earlier one is not its own.

Each also splits this rank's steps into the parts the straggler exchange compares
(``ddp_trainer.library.straggler``, docs/metrics.md): the wait in the step's gradient collectives, and data,
communication and compute outside them. Every strategy reads the step's boundaries from
``Instrumentation.step()`` and the forward's start from a forward pre-hook on the DDP model; the two
hook strategies time each bucket (hook entered, collective issued, collective done: the wall clock on
gloo, CUDA events on NCCL, resolved at a later step boundary); light mode, which has no comm hook,
reads the wait from DDP's logger (the last sampled step: communication not overlapped by compute).
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at registration.

import math
import re
import statistics
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Final, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import BuiltinCommHookType, GradBucket  # type: ignore[attr-defined]  # public, re-exported implicitly
from torch.nn.parallel import DistributedDataParallel

from ddp_trainer.library.runqueue import GlooThreadDelay
from ddp_trainer.library.straggler import Window, step_parts
from ddp_trainer.metrics import RankMetrics, payload_bytes

HookFn = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]
COMM_HOOKS: Final = ("allreduce", "fp16", "bf16", "powersgd")
SYNC_MODES: Final = ("detailed", "light")
_NS_PER_S: Final = 1e9


@dataclass(frozen=True)
class SyncSettings:
    """What a recorder needs to know about the group and the chosen gradient allreduce."""

    world_size: int
    comm_hook: str = "allreduce"
    logger_sample_every: int = 10
    powersgd_rank: int = 2
    # Detailed mode times the buckets of one sync in this many (docs/metrics.md); 1: every sync.
    time_every: int = 1
    # None: the default group.
    process_group: dist.ProcessGroup | None = None


class LoggerAverages(NamedTuple):
    """DDP's logger averages of the sampled steps, in seconds, and overlap / comm in [0, 1]."""

    compute: float
    comm: float
    overlap: float
    ratio: float


def _private(ddp: DistributedDataParallel) -> Any:
    """DDP's logger and built-in hooks are private, untyped APIs (pinned torch range: pyproject.toml)."""
    return ddp


def _cuda() -> Any:
    return torch.cuda


# DDP's logger is private: what this module reads of it is probed on the installed torch at run time,
# and a torch without it degrades the series that come from it (said once in the log), never the job.
_warned: set[str] = set()


def _private_call(ddp: DistributedDataParallel, name: str, *args: Any) -> Any:
    """``ddp.<name>(*args)``, or None where the installed torch's DDP has no such method."""
    method = getattr(_private(ddp), name, None)
    if method is None:
        if name not in _warned:
            _warned.add(name)
            print(
                f"ddp_trainer: torch {torch.__version__}'s DistributedDataParallel has no {name}() (a private "
                "API): the series taken from DDP's logger stay empty (docs/metrics.md)",
                file=sys.stderr,
                flush=True,
            )
        return None
    return method(*args)


def _logging_data(ddp: DistributedDataParallel) -> dict[str, Any]:
    return dict(_private_call(ddp, "_get_ddp_logging_data") or {})


def _bucket_sizes(text: object) -> list[int]:
    return [int(size) for size in re.findall(r"\d+", str(text or ""))]


def _powersgd_payload(state: Any, bucket: GradBucket, gradient_bytes: int) -> int:
    """Bytes PowerSGD's allreduces carry for one bucket: full until it starts, then P and Q per matrix."""
    if state.iter < state.start_powerSGD_iter:
        return gradient_bytes
    element = bucket.buffer().element_size()
    total = 0
    for tensor in bucket.gradients():
        if tensor.ndimension() <= 1:
            total += tensor.numel() * element
            continue
        rows = tensor.shape[0]
        cols = tensor.numel() // rows
        # min_compression_rate is 0 (see _builtin_python_hook), so every matrix is sent as its P and Q.
        rank = min(rows, cols, state.matrix_approximation_rank)
        total += (rows + cols) * rank * element
    return total


class SyncRecorder(ABC):
    """Feeds one rank's metrics from one DDP model; :func:`attach_recorder` picks the strategy."""

    def __init__(self, metrics: RankMetrics, settings: SyncSettings) -> None:
        self.metrics = metrics
        self.settings = settings
        self._ddp: DistributedDataParallel | None = None
        self._lock = threading.Lock()
        self._recent_service: deque[float] = deque(maxlen=512)
        # The steps since the last exchange, split into their parts (sums), taken by the exchange.
        self._window = Window(0)
        self._forward_handle: Any = None
        # perf_counter() of the last step's end (None before the first) and of the forward after it.
        self._began: float | None = None
        self._forward_at: float | None = None
        # Collectives between the last step's end and the next one's (the exchange): blocked seconds
        # and gloo's stall in them.
        self._between_comm = 0.0
        self._between_wait = 0.0
        self._between_stall = 0.0
        # time.monotonic() of the last synchronized step (None before the first).
        self.last_sync_at: float | None = None

    def install(self, ddp: DistributedDataParallel) -> None:
        """Set up the gauges and register what this strategy needs on ``ddp`` (before its first forward)."""
        self._ddp = ddp
        _private_call(ddp, "_set_ddp_runtime_logging_sample_rate", self.settings.logger_sample_every)
        self.metrics.world_size.set(self.settings.world_size)
        data = _logging_data(ddp)
        self.metrics.bucket_cap_bytes.set(int(data.get("bucket_cap_bytes", 0)))
        self.metrics.buckets.set(len(_bucket_sizes(data.get("bucket_sizes"))))
        self._register(ddp)
        self._forward_handle = ddp.register_forward_pre_hook(self._forward_pre_hook)

    @abstractmethod
    def _register(self, ddp: DistributedDataParallel) -> None:
        """Register this strategy's comm hook (or none) on ``ddp``."""

    def _forward_pre_hook(self, module: Any, args: Any) -> None:
        self._forward_started()

    def _forward_started(self) -> None:
        """A forward of the DDP model starts: the first one after a step's end ends the data part."""
        if self._forward_at is None:
            self._forward_at = time.perf_counter()

    @abstractmethod
    def step_done(self) -> None:
        """Once per optimizer step, after it: the step's end; whatever this strategy accounts per step."""

    @contextmanager
    def collective_between_steps(self) -> Iterator[Callable[[], None]]:
        """Around a collective between two steps (the exchange), which calls what this yields once
        the collective is issued: issuing it is communication of the next step, the time blocked in it
        a wait (not data), and gloo's stall in it counts too."""
        started = time.perf_counter()
        issued: list[float] = []
        marks: list[dict[str, float]] = []

        def note_issued() -> None:
            issued.append(time.perf_counter())
            marks.append(self._stall_marks())

        try:
            yield note_issued
        finally:
            ended = time.perf_counter()
            arrived = issued[0] if issued else started
            self._between_comm += arrived - started
            self._between_wait += ended - arrived
            self._between_stall += self._stall_since(marks[0]) if marks else 0.0

    def _stall_marks(self) -> dict[str, float]:
        return {}

    def _stall_since(self, marks: dict[str, float]) -> float:
        return 0.0

    def _with_between(self, parts: Window) -> Window:
        """A step with the collectives run since the previous one (they ran in its data part)."""
        comm, wait, stall = self._between_comm, self._between_wait, self._between_stall
        self._between_comm = self._between_wait = self._between_stall = 0.0
        comm = min(comm, parts.data)
        wait = min(wait, parts.data - comm)
        return replace(
            parts,
            data=parts.data - comm - wait,
            comm=parts.comm + comm,
            wait=parts.wait + wait,
            stall=parts.stall + stall,
        )

    def _without_between(self, parts: Window) -> Window:
        """A sampled step without the collectives run since the previous one: they ran in its data part
        and are taken out of it, counted nowhere (one exchange in a sample of steps would weigh as
        many steps as the sample stands for)."""
        outside = self._between_comm + self._between_wait
        self._drop_between()
        return replace(parts, data=max(parts.data - outside, 0.0))

    def _drop_between(self) -> None:
        self._between_comm = self._between_wait = self._between_stall = 0.0

    def _end_step(self) -> tuple[float | None, float | None, float]:
        """(when the step began, its forward, now) on the wall clock, and the next step begins."""
        now = time.perf_counter()
        began, forward = self._began, self._forward_at
        self._began, self._forward_at = now, None
        return began, forward, now

    @abstractmethod
    def flush(self) -> None:
        """Bring the series up to date (timings still pending are waited for)."""

    def detach(self) -> None:
        """Forget the DDP model once training is over.

        A comm hook registered on the model refers back to its recorder: with ``_ddp`` that is a
        cycle through the C++ reducer that the garbage collector cannot see, and it would keep the
        model and its process group alive until the interpreter exits (see ``ddp_trainer.library.teardown``).
        """
        self._ddp = None
        if self._forward_handle is not None:
            self._forward_handle.remove()  # the hook refers back to this recorder
            self._forward_handle = None

    def refresh_from_logger(self) -> LoggerAverages | None:
        """Copy DDP's logger averages into the gauges; None until the logger has sampled a step."""
        if self._ddp is None:
            return None
        data = _logging_data(self._ddp)
        sizes = _bucket_sizes(data.get("rebuilt_bucket_sizes")) or _bucket_sizes(data.get("bucket_sizes"))
        self.metrics.buckets.set(len(sizes))
        comm = data.get("avg_backward_comm_time")
        if comm is None:
            return None
        compute = float(data.get("avg_backward_compute_time", 0)) / _NS_PER_S
        comm_seconds = float(comm) / _NS_PER_S
        overlap = float(data.get("avg_backward_compute_comm_overlap_time", 0)) / _NS_PER_S
        ratio = min(max(overlap / comm_seconds, 0.0), 1.0) if comm_seconds > 0 else 0.0
        self.metrics.backward_compute_seconds.set(compute)
        self.metrics.backward_comm_seconds.set(comm_seconds)
        self.metrics.backward_overlap_seconds.set(overlap)
        self.metrics.comm_overlap_ratio.set(ratio)
        return LoggerAverages(compute=compute, comm=comm_seconds, overlap=overlap, ratio=ratio)

    def take_window(self) -> Window | None:
        """This rank's steps since the last call, split into their parts (None: no step measured)."""
        with self._lock:
            window, self._window = self._window, Window(0)
        return window if window.steps > 0 else None

    def _add_step(self, parts: Window) -> None:
        with self._lock:
            self._window = self._window + parts

    def allreduce_p50_seconds(self) -> float | None:
        """Median service time of the recent bucket allreduces (None without a timing hook)."""
        with self._lock:
            recent = list(self._recent_service)
        return statistics.median(recent) if recent else None

    def _count_step(self, gradient_bytes: int, payload: int, calls: int) -> None:
        metrics = self.metrics
        metrics.gradient_bytes.inc(gradient_bytes)
        metrics.allreduce_bytes.inc(payload)
        metrics.allreduce_calls.inc(calls)
        metrics.sync_steps.inc()
        metrics.last_sync_timestamp.set(time.time())
        self.last_sync_at = time.monotonic()


class LoggerRecorder(SyncRecorder):
    """Light mode: no Python on the gradient path; one step's bytes and calls from the bucket sizes."""

    def __init__(self, metrics: RankMetrics, settings: SyncSettings) -> None:
        super().__init__(metrics, settings)
        self._bucket_bytes: list[int] | None = None
        self._rebuilt = False
        self._gradient_elements = 0
        # The steps since the last exchange: how many, their data parts, their waits in collectives
        # between steps, and their wall time (sums).
        self._steps = 0
        self._data = 0.0
        self._comm = 0.0
        self._between = 0.0
        self._total = 0.0

    def _register(self, ddp: DistributedDataParallel) -> None:
        # Buckets hold the parameters that need gradients: their element count is what compression sends.
        self._gradient_elements = sum(p.numel() for p in ddp.parameters() if p.requires_grad)
        if self.settings.comm_hook == "fp16":
            # DDP's C++ FP16 hook: compression without any Python on the gradient path.
            _private(ddp)._register_builtin_comm_hook(BuiltinCommHookType.FP16_COMPRESS)
        elif self.settings.comm_hook == "bf16":
            # There is no C++ bf16 hook; torch's own Python hook is the cheapest that exists.
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(self.settings.process_group, default_hooks.bf16_compress_hook)

    def step_done(self) -> None:
        began, forward, now = self._end_step()
        if began is not None:
            parts = self._with_between(step_parts(began, forward, (), now))
            with self._lock:
                self._steps += 1
                self._data += parts.data
                self._comm += parts.comm
                self._between += parts.wait
                self._total += parts.seconds
        # DDP rebuilds its buckets in the forward of its second step; until the logger says so, read it.
        if not self._rebuilt and self._ddp is not None:
            data = _logging_data(self._ddp)
            self._rebuilt = bool(data.get("has_rebuilt_buckets"))
            key = "rebuilt_bucket_sizes" if self._rebuilt else "bucket_sizes"
            self._bucket_bytes = _bucket_sizes(data.get(key)) or _bucket_sizes(data.get("bucket_sizes"))
        sizes = self._bucket_bytes or []
        gradient_bytes = sum(sizes)
        payload = payload_bytes(self.settings.comm_hook, gradient_bytes, self._gradient_elements)
        self._count_step(gradient_bytes, payload, len(sizes))

    def flush(self) -> None:
        pass  # every step was counted when it ended; the logger's averages are copied by the caller

    def take_window(self) -> Window | None:
        """The steps since the last call, with the wait of the logger's last sampled step (no hook sees
        the buckets here): its communication not overlapped by backward compute. None before the
        logger's first sample."""
        with self._lock:
            steps, data, comm, between, total = (
                self._steps,
                self._data,
                self._comm,
                self._between,
                self._total,
            )
            self._steps, self._data, self._comm, self._between, self._total = 0, 0.0, 0.0, 0.0, 0.0
        if steps == 0 or self._ddp is None:
            return None
        logged = _logging_data(self._ddp)
        sent, overlap = logged.get("backward_comm_time"), logged.get("backward_compute_comm_overlap_time")
        if sent is None or overlap is None:
            return None
        outside = data + comm + between
        # One sampled step's wait, taken for every step of the window, can exceed what the window has
        # room for (a step sampled while the machine was loaded): the wait never eats the backward
        # compute DDP itself measured, so the compute left is never a bogus 0.
        measured_compute = float(logged.get("avg_backward_compute_time") or 0) / _NS_PER_S * steps
        room = max(total - outside - measured_compute, 0.0)
        wait = min(max(float(sent) - float(overlap), 0.0) / _NS_PER_S * steps, room)
        return Window(steps, data=data, compute=total - outside - wait, comm=comm, wait=between + wait)


def _first_tensor(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]


class _CommHookRecorder(SyncRecorder):
    """Detailed mode: our comm hook counts every bucket (wrapping the chosen built-in hook) and times
    the buckets of one synchronization in ``time_every``.

    Counting is a few integer additions per bucket, with no lock: DDP calls the hook from one thread
    during a backward, and a sync's totals reach the counters only at a step boundary (the next sync's
    first bucket, ``step_done()`` or ``flush()``), when DDP has waited for every bucket of it, so a
    scrape sees whole syncs. Timing a bucket (clock reads or CUDA events, a callback, a histogram
    observation) costs ten times more, so only the timed syncs pay for it; the others issue their
    collective as torch's own ``allreduce_hook`` does. Every rank times the same syncs (the n-th of
    its DDP model), so the ranks' step parts compare like with like.
    """

    def __init__(self, metrics: RankMetrics, settings: SyncSettings) -> None:
        super().__init__(metrics, settings)
        self._inner_state: Any = None
        self._inner_hook: HookFn | None = None
        self._group: Any = None
        self._every = max(settings.time_every, 1)
        self._syncs = 0  # syncs begun
        self._open = False  # a sync has begun and is not counted yet
        self._last_seen = False  # its last bucket reached the hook
        self._timing = False  # its buckets are timed
        self._gradient_bytes = 0
        self._payload_bytes = 0
        self._calls = 0
        self._bytes_are_payload = settings.comm_hook == "allreduce"
        self._world_size = settings.world_size

    def _register(self, ddp: DistributedDataParallel) -> None:
        self._inner_state, self._inner_hook = self._builtin_python_hook()
        group = self.settings.process_group
        self._group = dist.group.WORLD if group is None else group
        ddp.register_comm_hook(self._inner_state, self._hook)

    def detach(self) -> None:
        super().detach()
        self._inner_state = None
        self._inner_hook = None
        self._group = None

    def _builtin_python_hook(self) -> tuple[Any, HookFn | None]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        group, hook = self.settings.process_group, self.settings.comm_hook
        if hook == "fp16":
            return group, default_hooks.fp16_compress_hook
        if hook == "bf16":
            return group, default_hooks.bf16_compress_hook
        if hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=self.settings.powersgd_rank,
                start_powerSGD_iter=2,
                min_compression_rate=0.0,
                use_error_feedback=True,
                warm_start=True,
            )
            return state, powerSGD_hook.powerSGD_hook
        return group, None  # plain allreduce: issued by the hook itself, as torch's allreduce_hook does

    @property
    def next_sync_timed(self) -> bool:
        return self._syncs % self._every == 0

    def _hook(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        # Every line here runs once per bucket, so it stays a few attribute reads and additions.
        if self._last_seen:
            self._commit()  # no step_done() since the last sync: DDP waited for all of its buckets
        if not self._open:
            self._timing = self._syncs % self._every == 0
            self._syncs += 1
            self._open = True
        buffer = bucket.buffer()
        size = buffer.nbytes
        self._gradient_bytes += size
        if not self._bytes_are_payload:  # else the payload is the gradient bytes, taken at the commit
            self._payload_bytes += self._payload(state, bucket, buffer, size)
        self._calls += 1
        is_last = self._last_seen = bucket.is_last()
        if self._timing:
            return self._timed(state, bucket, buffer, is_last)
        if self._inner_hook is not None:
            return self._inner_hook(state, bucket)
        # _issue, inlined: torch's allreduce_hook.
        buffer.div_(self._world_size)
        return dist.all_reduce(buffer, group=self._group, async_op=True).get_future().then(_first_tensor)

    def _payload(self, state: Any, bucket: GradBucket, buffer: torch.Tensor, size: int) -> int:
        if self.settings.comm_hook == "powersgd":
            return _powersgd_payload(state, bucket, size)
        return payload_bytes(self.settings.comm_hook, size, buffer.numel())

    def _issue(
        self, state: Any, bucket: GradBucket, buffer: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor]:
        """Reduce ``bucket`` with the chosen hook, as the untimed path does."""
        if self._inner_hook is not None:
            return self._inner_hook(state, bucket)
        buffer.div_(self._world_size)
        return dist.all_reduce(buffer, group=self._group, async_op=True).get_future().then(_first_tensor)

    @abstractmethod
    def _timed(
        self, state: Any, bucket: GradBucket, buffer: torch.Tensor, is_last: bool
    ) -> torch.futures.Future[torch.Tensor]:
        """Reduce ``bucket`` (its ``buffer``) and record its timing the way this strategy can."""

    @abstractmethod
    def _sync_timed(self) -> None:
        """A timed sync is over: take its buckets' timings."""

    def _commit(self) -> bool:
        """The open sync is over (DDP waited for its buckets): count it. Returns whether it was timed."""
        if not self._open:
            return False
        gradient, payload, calls = self._gradient_bytes, self._payload_bytes, self._calls
        if self._bytes_are_payload:
            payload = gradient
        self._gradient_bytes = self._payload_bytes = self._calls = 0
        self._open = self._last_seen = False
        self._count_step(gradient, payload, calls)
        if not self._timing:
            return False
        self.metrics.timed_steps.inc()
        self._sync_timed()
        return True

    def _record_sync(self, timings: list[tuple[float, float]]) -> None:
        """A timed sync's buckets, (elapsed, service) each: the histogram, the recent service times,
        and the service counter, where the sync stands for the ``time_every`` syncs it samples."""
        observe = self.metrics.allreduce_duration.observe
        for elapsed, _ in timings:
            observe(elapsed)
        services = [service for _, service in timings]
        with self._lock:
            self._recent_service.extend(services)
        self.metrics.allreduce_service_seconds.inc(sum(services) * self._every)


class WallClockRecorder(_CommHookRecorder):
    """Gradients in host memory (gloo): the future completes when the allreduce is done."""

    def __init__(self, metrics: RankMetrics, settings: SyncSettings) -> None:
        super().__init__(metrics, settings)
        # The timed sync's buckets: [hook entered, collective issued, collective done] (NaN until done).
        self._buckets: list[list[float]] = []
        # The last timed sync's buckets, done, for its step's parts.
        self._timed_buckets: list[tuple[float, float, float]] = []
        # gloo's threads relay every rank's collectives: read their CPU waits from the step's last
        # collective to its end (ddp_trainer.library.runqueue).
        self._stalls = GlooThreadDelay()
        self._stall_mark: dict[str, float] | None = None

    def _timed(
        self, state: Any, bucket: GradBucket, buffer: torch.Tensor, is_last: bool
    ) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        timing = [start, start, math.nan]
        self._buckets.append(timing)
        # gloo runs the callbacks on its worker thread once the allreduce is done.
        if self._inner_hook is None:
            buffer.div_(self._world_size)
            work = dist.all_reduce(buffer, group=self._group, async_op=True).get_future()
            timing[1] = time.perf_counter()

            def allreduce_done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
                timing[2] = time.perf_counter()
                return fut.value()[0]

            future = work.then(allreduce_done)
        else:
            inner = self._inner_hook(state, bucket)
            timing[1] = time.perf_counter()

            def inner_done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                timing[2] = time.perf_counter()
                return fut.value()

            future = inner.then(inner_done)
        if is_last:
            self._stall_mark = self._stalls.mark()
        return future

    def _sync_timed(self) -> None:
        buckets, self._buckets = self._buckets, []
        done = sorted(((t[0], t[1], t[2]) for t in buckets if not math.isnan(t[2])), key=lambda t: t[2])
        previous_end: float | None = None
        timings = []
        for start, _, end in done:
            # Buckets run one after the other: the time one waited behind an earlier one is not its own.
            service = max(end - (start if previous_end is None else max(start, previous_end)), 0.0)
            previous_end = end
            timings.append((end - start, service))
        self._record_sync(timings)
        self._timed_buckets = done

    def step_done(self) -> None:
        began, forward, now = self._end_step()
        timed = self._commit()
        mark, self._stall_mark = self._stall_mark, None
        buckets, self._timed_buckets = self._timed_buckets, []
        if began is None or not timed:
            self._drop_between()  # an untimed step is not measured, nor what ran in it
            return
        stall = self._stalls.since(mark) if mark else 0.0
        parts = replace(step_parts(began, forward, buckets, now), stall=stall)
        self._add_step(self._with_between(parts) if self._every == 1 else self._without_between(parts))

    def _stall_marks(self) -> dict[str, float]:
        return self._stalls.mark()

    def _stall_since(self, marks: dict[str, float]) -> float:
        return self._stalls.since(marks) if marks else 0.0

    def detach(self) -> None:
        super().detach()
        self._stalls.close()

    def flush(self) -> None:
        if self._last_seen:
            self._commit()  # a sync no step_done() has counted (the library used without step())


class CudaEventRecorder(_CommHookRecorder):
    """Gradients on a GPU (NCCL): events around each timed collective, resolved off the gradient path.

    A timed step's parts are read on the device's timeline: events at the previous step's end (recorded
    by ``step_done()`` only when the next sync is a timed one), at the forward's start, per bucket when
    the hook was entered, once its collective was queued, and after it, and at the step's end. They
    are resolved once they are done (at a later step boundary or exchange; a flush waits for them);
    nothing synchronizes in the hook.
    """

    def __init__(self, metrics: RankMetrics, settings: SyncSettings) -> None:
        super().__init__(metrics, settings)
        self._began_event: Any = None
        self._forward_event: Any = None
        # The timed sync's buckets: [entered, issued, done] events (done: None until the callback).
        self._bucket_events: list[list[Any]] = []
        # Timed syncs still to resolve: [buckets, began, forward, ended] (the last three None when no
        # step_done() marked the step around it).
        self._pending: list[list[Any]] = []

    @staticmethod
    def _event() -> Any:
        event = _cuda().Event(enable_timing=True)
        event.record()
        return event

    def _forward_started(self) -> None:
        if self._forward_event is None and self._began_event is not None:
            self._forward_event = self._event()

    @contextmanager
    def collective_between_steps(self) -> Iterator[Callable[[], None]]:
        """The exchange's own time is left out on the device: the next step begins after it."""
        try:
            yield lambda: None
        finally:
            if self._began_event is not None:
                self._began_event = self._event()
            self._forward_event = None

    def _timed(
        self, state: Any, bucket: GradBucket, buffer: torch.Tensor, is_last: bool
    ) -> torch.futures.Future[torch.Tensor]:
        timing: list[Any] = [self._event(), None, None]
        issued = self._issue(state, bucket, buffer)
        # On the stream the collective waits for: after whatever the hook queued before it (compression).
        timing[1] = self._event()
        self._bucket_events.append(timing)

        def enqueued(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            # Runs at enqueue on NCCL: the event lands on the stream right after the collective.
            timing[2] = self._event()
            return fut.value()

        return issued.then(enqueued)

    def _sync_timed(self) -> None:
        buckets, self._bucket_events = self._bucket_events, []
        self._pending.append([buckets, None, None, None])

    def step_done(self) -> None:
        if self._commit() and self._began_event is not None:
            self._pending[-1][1:] = [self._began_event, self._forward_event, self._event()]
        # The next step's beginning, only when its sync is a timed one.
        self._began_event = self._event() if self.next_sync_timed else None
        self._forward_event = None
        if self._pending:
            self._resolve(wait=False)

    def take_window(self) -> Window | None:
        # Never waits: a timed step whose events are not done yet goes to the next window.
        self._resolve(wait=False)
        return super().take_window()

    def flush(self) -> None:
        if self._last_seen:
            self._commit()
        self._resolve(wait=True)

    def _resolve(self, wait: bool) -> None:
        """Turn the timed syncs whose events are done into service times and step parts (``wait``:
        synchronize on them)."""
        while self._pending:
            buckets, began, forward, ended = self._pending[0]
            last = [e for e in (ended, buckets[-1][2] if buckets else None) if e is not None]
            if not wait and not all(event.query() for event in last):
                return  # they complete in stream order: the later ones are not done either
            self._pending.pop(0)
            done = [timing for timing in buckets if timing[2] is not None]
            previous_end: Any = None
            timings: list[tuple[float, float]] = []
            for start_event, _, end_event in done:
                end_event.synchronize()
                elapsed = start_event.elapsed_time(end_event) / 1000.0
                service = elapsed
                if previous_end is not None:
                    service = min(elapsed, previous_end.elapsed_time(end_event) / 1000.0)
                previous_end = end_event
                timings.append((elapsed, max(service, 0.0)))
            self._record_sync(timings)
            if began is not None and ended is not None:
                marks = [(_offset(began, t[0]), _offset(began, t[1]), _offset(began, t[2])) for t in done]
                at_forward = None if forward is None else _offset(began, forward)
                self._add_step(step_parts(0.0, at_forward, marks, _offset(began, ended)))


def _offset(began: Any, event: Any) -> float:
    """Seconds from CUDA event ``began`` to ``event`` (once it is done)."""
    event.synchronize()
    return float(began.elapsed_time(event)) / 1000.0


def attach_recorder(
    ddp: DistributedDataParallel, metrics: RankMetrics, settings: SyncSettings, mode: str
) -> SyncRecorder:
    """Choose the timing strategy for ``ddp`` once, and install it (before the model's first forward)."""
    if settings.comm_hook not in COMM_HOOKS:
        raise ValueError(f"unknown comm hook {settings.comm_hook!r}")
    if mode not in SYNC_MODES:
        raise ValueError(f"unknown sync-metrics mode {mode!r}")
    recorder: SyncRecorder
    if mode == "light":
        if settings.comm_hook == "powersgd":
            raise ValueError("light mode cannot derive PowerSGD's payload without a hook")
        recorder = LoggerRecorder(metrics, settings)
    elif any(parameter.is_cuda for parameter in ddp.parameters()):
        # DDP puts a model on one device: its buckets live where its parameters do.
        recorder = CudaEventRecorder(metrics, settings)
    else:
        recorder = WallClockRecorder(metrics, settings)
    recorder.install(ddp)
    return recorder
