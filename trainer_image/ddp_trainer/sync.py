"""Measuring gradient synchronization: one recorder per timing strategy, chosen once per DDP model.

- :class:`WallClockRecorder` (detailed mode, gradients in host memory, i.e. gloo): our comm hook reads
  the wall clock in the future's ``then()`` callback, which gloo runs on its worker thread once the
  allreduce is done;
- :class:`CudaEventRecorder` (detailed mode, gradients on a GPU, i.e. NCCL): NCCL completes the future
  at enqueue, so the hook records CUDA events around the collective and resolves them later (at a step
  boundary, or when the next bucket arrives and they are ready); it never synchronizes in the hook;
- :class:`LoggerRecorder` (light mode): no Python hook at all; bytes and calls come from the bucket
  sizes DDP's C++ logger reports.

All three copy DDP's logger averages (backward compute, comm, overlap) into the gauges. Service time =
end - max(start, end of the previous bucket): buckets run one after the other, so the time a bucket
waited behind an earlier one is not its own.

Each also measures this rank's compute time per step, what the straggler exchange compares: the two
hook strategies from a forward pre-hook on the DDP model to the first bucket reaching the comm hook
(wall clock on gloo, CUDA events on NCCL), so no wait on a peer is in it; light mode, which has no
hook, from DDP's logger (the last sampled step's forward + backward compute).
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at registration.

import re
import statistics
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BuiltinCommHookType, GradBucket
from torch.nn.parallel import DistributedDataParallel

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


def _logging_data(ddp: DistributedDataParallel) -> dict[str, Any]:
    return dict(_private(ddp)._get_ddp_logging_data())


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
        # This window's compute times per step (seconds), taken by the straggler exchange.
        self._compute: list[float] = []
        # time.monotonic() of the last synchronized step (None before the first).
        self.last_sync_at: float | None = None

    def install(self, ddp: DistributedDataParallel) -> None:
        """Set up the gauges and register what this strategy needs on ``ddp`` (before its first forward)."""
        self._ddp = ddp
        _private(ddp)._set_ddp_runtime_logging_sample_rate(self.settings.logger_sample_every)
        self.metrics.world_size.set(self.settings.world_size)
        data = _logging_data(ddp)
        self.metrics.bucket_cap_bytes.set(int(data.get("bucket_cap_bytes", 0)))
        self.metrics.buckets.set(len(_bucket_sizes(data.get("bucket_sizes"))))
        self._register(ddp)

    @abstractmethod
    def _register(self, ddp: DistributedDataParallel) -> None:
        """Register this strategy's comm hook (or none) on ``ddp``."""

    @abstractmethod
    def step_done(self) -> None:
        """Once per optimizer step, after it: whatever this strategy accounts per step."""

    @abstractmethod
    def flush(self) -> None:
        """Bring the series up to date (timings still pending are waited for)."""

    def detach(self) -> None:
        """Forget the DDP model once training is over.

        A comm hook registered on the model refers back to its recorder: with ``_ddp`` that is a
        cycle through the C++ reducer that the garbage collector cannot see, and it would keep the
        model and its process group alive until the interpreter exits (see ``ddp_trainer.teardown``).
        """
        self._ddp = None

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

    def take_compute(self) -> float | None:
        """Mean compute time per step since the last call (None: no step measured since)."""
        with self._lock:
            window, self._compute = self._compute, []
        return sum(window) / len(window) if window else None

    def _note_compute(self, seconds: float) -> None:
        with self._lock:
            self._compute.append(seconds)
            if len(self._compute) > 4096:  # nobody takes them (no exchange): keep the recent ones
                del self._compute[:2048]

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

    def take_compute(self) -> float | None:
        """The logger's last sampled step: forward + backward compute (to its last gradient; no hook
        sees the first bucket here). None before the logger's first sample."""
        if self._ddp is None:
            return None
        data = _logging_data(self._ddp)
        forward, backward = data.get("forward_compute_time"), data.get("backward_compute_time")
        if forward is None or backward is None:
            return None
        return (float(forward) + float(backward)) / _NS_PER_S


class _CommHookRecorder(SyncRecorder):
    """Detailed mode: our comm hook counts every bucket (wrapping the chosen built-in hook) and times it."""

    def __init__(self, metrics: RankMetrics, settings: SyncSettings) -> None:
        super().__init__(metrics, settings)
        self._inner_state: Any = None
        self._inner_hook: HookFn | None = None
        # One step's payload, counted into the counters only when its last bucket is reduced, so that a
        # scrape at any moment sees bytes, calls and sync steps of whole steps (bytes per step exact).
        self._step_gradient_bytes = 0
        self._step_payload_bytes = 0
        self._step_calls = 0
        self._step_inflight = 0
        self._step_saw_last = False
        # Set by the forward pre-hook, cleared by the step's first bucket: when to measure compute.
        self._awaiting_first_bucket = False
        self._forward_handle: Any = None

    def _register(self, ddp: DistributedDataParallel) -> None:
        self._inner_state, self._inner_hook = self._builtin_python_hook()
        ddp.register_comm_hook(self._inner_state, self._timed_hook)
        self._forward_handle = ddp.register_forward_pre_hook(self._forward_pre_hook)

    def detach(self) -> None:
        super().detach()
        self._inner_state = None
        self._inner_hook = None
        if self._forward_handle is not None:
            self._forward_handle.remove()  # the hook refers back to this recorder
            self._forward_handle = None

    def _forward_pre_hook(self, module: Any, args: Any) -> None:
        self._forward_started()
        self._awaiting_first_bucket = True

    @abstractmethod
    def _forward_started(self) -> None:
        """Mark the start of a step's forward (compute time runs from here to the first bucket)."""

    @abstractmethod
    def _first_bucket(self) -> None:
        """The step's first bucket is ready: its compute time ends here."""

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
        return group, None  # plain allreduce: issued by the strategy itself, one callback fewer

    def _timed_hook(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        gradient_bytes = buffer.numel() * buffer.element_size()
        if self.settings.comm_hook == "powersgd":
            payload = _powersgd_payload(state, bucket, gradient_bytes)
        else:
            payload = payload_bytes(self.settings.comm_hook, gradient_bytes, buffer.numel())
        if self._awaiting_first_bucket:
            self._awaiting_first_bucket = False
            self._first_bucket()
        with self._lock:
            self._step_gradient_bytes += gradient_bytes
            self._step_payload_bytes += payload
            self._step_calls += 1
            self._step_inflight += 1
        return self._timed(state, bucket, bucket.is_last())

    @abstractmethod
    def _timed(self, state: Any, bucket: GradBucket, is_last: bool) -> torch.futures.Future[torch.Tensor]:
        """Reduce ``bucket`` and record its timing the way this strategy can."""

    def _bucket_done(self, is_last: bool) -> None:
        """Count a step into the counters once every bucket of it is reduced (gloo may finish them out
        of order on its worker threads, so the last bucket's callback alone does not say so)."""
        with self._lock:
            self._step_inflight -= 1
            self._step_saw_last = self._step_saw_last or is_last
            if self._step_inflight > 0 or not self._step_saw_last:
                return
            gradient_bytes, payload, calls = (
                self._step_gradient_bytes,
                self._step_payload_bytes,
                self._step_calls,
            )
            self._step_gradient_bytes = self._step_payload_bytes = self._step_calls = 0
            self._step_saw_last = False
        self._count_step(gradient_bytes, payload, calls)

    def _record_service(self, elapsed: float, service: float) -> None:
        self.metrics.allreduce_duration.observe(elapsed)
        self.metrics.allreduce_service_seconds.inc(service)
        with self._lock:
            self._recent_service.append(service)


class WallClockRecorder(_CommHookRecorder):
    """Gradients in host memory (gloo): the future completes when the allreduce is done."""

    def __init__(self, metrics: RankMetrics, settings: SyncSettings) -> None:
        super().__init__(metrics, settings)
        self._previous_end: float | None = None
        self._forward_at = 0.0

    def _forward_started(self) -> None:
        self._forward_at = time.perf_counter()

    def _first_bucket(self) -> None:
        self._note_compute(time.perf_counter() - self._forward_at)

    def _timed(self, state: Any, bucket: GradBucket, is_last: bool) -> torch.futures.Future[torch.Tensor]:
        start = time.perf_counter()
        if self._inner_hook is None:
            buffer = bucket.buffer()
            buffer.div_(self.settings.world_size)
            group = self.settings.process_group
            if group is None:
                group = dist.group.WORLD
            future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

            def allreduce_done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
                self._record_wall(start, time.perf_counter(), is_last)
                return fut.value()[0]

            return future.then(allreduce_done)
        inner = self._inner_hook(state, bucket)

        def inner_done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self._record_wall(start, time.perf_counter(), is_last)
            return fut.value()

        return inner.then(inner_done)

    def step_done(self) -> None:
        pass  # the hook's callbacks counted the step when its last bucket was reduced

    def flush(self) -> None:
        pass  # nothing is pending: each allreduce was timed when it completed

    def _record_wall(self, start: float, end: float, is_last: bool) -> None:
        with self._lock:
            begin = start if self._previous_end is None else max(start, self._previous_end)
            self._previous_end = end if self._previous_end is None else max(end, self._previous_end)
        self._record_service(end - start, max(end - begin, 0.0))
        self._bucket_done(is_last)


class CudaEventRecorder(_CommHookRecorder):
    """Gradients on a GPU (NCCL): events around each collective, resolved off the gradient path."""

    def __init__(self, metrics: RankMetrics, settings: SyncSettings) -> None:
        super().__init__(metrics, settings)
        self._pending_events: list[tuple[Any, Any]] = []
        self._previous_end_event: Any = None
        self._forward_event: Any = None
        self._pending_compute: list[tuple[Any, Any]] = []

    def _forward_started(self) -> None:
        self._forward_event = _cuda().Event(enable_timing=True)
        self._forward_event.record()

    def _first_bucket(self) -> None:
        if self._forward_event is None:
            return
        ready = _cuda().Event(enable_timing=True)
        ready.record()  # on the stream the backward ran on: after the first bucket's gradients
        with self._lock:
            self._pending_compute.append((self._forward_event, ready))
        self._forward_event = None

    def _resolve_compute(self, wait: bool) -> None:
        with self._lock:
            pending, self._pending_compute = self._pending_compute, []
        keep = []
        for index, (start_event, end_event) in enumerate(pending):
            if not wait and not end_event.query():
                keep = pending[index:]
                break
            end_event.synchronize()
            self._note_compute(start_event.elapsed_time(end_event) / 1000.0)
        if keep:
            with self._lock:
                self._pending_compute = keep + self._pending_compute

    def take_compute(self) -> float | None:
        self._resolve_compute(wait=True)
        return super().take_compute()

    def _timed(self, state: Any, bucket: GradBucket, is_last: bool) -> torch.futures.Future[torch.Tensor]:
        self._resolve_events(wait=False)
        start_event = _cuda().Event(enable_timing=True)
        start_event.record()
        if self._inner_hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            # torch's built-in hooks take None for the default group, though typed ProcessGroup.
            group: Any = self.settings.process_group
            inner = default_hooks.allreduce_hook(group, bucket)
        else:
            inner = self._inner_hook(state, bucket)

        def enqueued(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            # Runs at enqueue on NCCL: the event lands on the stream right after the collective.
            end_event = _cuda().Event(enable_timing=True)
            end_event.record()
            with self._lock:
                self._pending_events.append((start_event, end_event))
            self._bucket_done(is_last)
            return fut.value()

        return inner.then(enqueued)

    def step_done(self) -> None:
        if self._pending_events:
            self._resolve_events(wait=False)
        if self._pending_compute:
            self._resolve_compute(wait=False)

    def flush(self) -> None:
        self._resolve_events(wait=True)

    def _resolve_events(self, wait: bool) -> None:
        """Turn finished event pairs into durations (``wait``: synchronize on the pending ones)."""
        with self._lock:
            pending, self._pending_events = self._pending_events, []
        keep = []
        for index, (start_event, end_event) in enumerate(pending):
            if not wait and not end_event.query():
                keep = pending[index:]  # events complete in stream order
                break
            end_event.synchronize()
            elapsed = start_event.elapsed_time(end_event) / 1000.0
            service = elapsed
            if self._previous_end_event is not None:
                service = min(elapsed, self._previous_end_event.elapsed_time(end_event) / 1000.0)
            self._previous_end_event = end_event
            self._record_service(elapsed, max(service, 0.0))
        if keep:
            with self._lock:
                self._pending_events = keep + self._pending_events


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
