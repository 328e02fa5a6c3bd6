"""Measuring gradient synchronization: our comm hook (detailed mode) and the DDP logger (both modes).

Timing rules (docs/metrics.md):
- gloo completes a future on its worker thread once the allreduce is done, so the wall clock read in
  the ``then()`` callback is the completion time;
- NCCL completes the future at enqueue, so the hook records CUDA events around the collective and
  resolves them later (at a step boundary, or when the next bucket arrives and they are ready); it
  never synchronizes inside the hook;
- service time = end - max(start, end of the previous bucket): buckets run one after the other, so
  the time a bucket waited behind an earlier one is not its own.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at registration.

import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BuiltinCommHookType, GradBucket
from torch.nn.parallel import DistributedDataParallel

from ddp_trainer.metrics import RankMetrics

HookFn = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]
COMPRESSED_RATIO: Final = {"allreduce": 1.0, "fp16": 0.5, "bf16": 0.5}
_NS_PER_S: Final = 1e9


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
        # min_compression_rate is 0 (see SyncRecorder), so every matrix is sent as its P and Q factors.
        rank = min(rows, cols, state.matrix_approximation_rank)
        total += (rows + cols) * rank * element
    return total


class SyncRecorder:
    """Feeds one rank's metrics from a DDP model: comm hook counts and timings, DDP logger gauges."""

    def __init__(
        self,
        metrics: RankMetrics,
        world_size: int,
        comm_hook: str,
        mode: str,
        logger_sample_every: int = 10,
        powersgd_rank: int = 2,
        process_group: Any = None,
    ) -> None:
        if comm_hook not in (*COMPRESSED_RATIO, "powersgd"):
            raise ValueError(f"unknown comm hook {comm_hook!r}")
        if mode not in ("detailed", "light"):
            raise ValueError(f"unknown sync-metrics mode {mode!r}")
        self.metrics = metrics
        self.world_size = world_size
        self.comm_hook = comm_hook
        self.mode = mode
        self.logger_sample_every = logger_sample_every
        self.powersgd_rank = powersgd_rank
        self.process_group = process_group
        self._lock = threading.Lock()
        self._previous_end: float | None = None
        self._recent_service: deque[float] = deque(maxlen=512)
        self._pending_events: list[tuple[Any, Any]] = []
        self._previous_end_event: Any = None
        self._inner_state: Any = None
        self._inner_hook: HookFn | None = None
        self._light_bucket_bytes: list[int] | None = None
        self._light_rebuilt = False
        self._ddp: DistributedDataParallel | None = None
        # One step's payload, counted into the counters only when its last bucket is reduced, so that a
        # scrape at any moment sees bytes, calls and sync steps of whole steps (bytes per step exact).
        self._step_gradient_bytes = 0
        self._step_payload_bytes = 0
        self._step_calls = 0
        self._step_inflight = 0
        self._step_saw_last = False

    # --- installation -------------------------------------------------------------------------------
    def install(self, ddp: DistributedDataParallel) -> None:
        """Register the hook this mode needs on ``ddp`` (before its first forward)."""
        self._ddp = ddp
        _private(ddp)._set_ddp_runtime_logging_sample_rate(self.logger_sample_every)
        self.metrics.world_size.set(self.world_size)
        data = _logging_data(ddp)
        self.metrics.bucket_cap_bytes.set(int(data.get("bucket_cap_bytes", 0)))
        self.metrics.buckets.set(len(_bucket_sizes(data.get("bucket_sizes"))))
        if self.mode == "detailed":
            self._inner_state, self._inner_hook = self._builtin_python_hook()
            ddp.register_comm_hook(self._inner_state, self._timed_hook)
        elif self.comm_hook == "fp16":
            # DDP's C++ FP16 hook: compression without any Python on the gradient path.
            _private(ddp)._register_builtin_comm_hook(BuiltinCommHookType.FP16_COMPRESS)
        elif self.comm_hook == "bf16":
            # There is no C++ bf16 hook; torch's own Python hook is the cheapest that exists.
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(self.process_group, default_hooks.bf16_compress_hook)

    def detach(self) -> None:
        """Forget the DDP model once training is over.

        The comm hook registered on the model refers back to this recorder: with ``_ddp`` that is a
        cycle through the C++ reducer that the garbage collector cannot see, and it would keep the
        model and its process group alive until the interpreter exits (see ``ddp_trainer.teardown``).
        """
        self._ddp = None
        self._inner_state = None
        self._inner_hook = None

    def _builtin_python_hook(self) -> tuple[Any, HookFn | None]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.comm_hook == "fp16":
            return self.process_group, default_hooks.fp16_compress_hook
        if self.comm_hook == "bf16":
            return self.process_group, default_hooks.bf16_compress_hook
        if self.comm_hook == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=self.process_group,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=2,
                min_compression_rate=0.0,
                use_error_feedback=True,
                warm_start=True,
            )
            return state, powerSGD_hook.powerSGD_hook
        return self.process_group, None  # plain allreduce: done in _timed_hook itself, one callback fewer

    # --- detailed mode: the comm hook ---------------------------------------------------------------
    def _timed_hook(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        gradient_bytes = buffer.numel() * buffer.element_size()
        if self.comm_hook == "powersgd":
            payload = _powersgd_payload(state, bucket, gradient_bytes)
        else:
            payload = int(gradient_bytes * COMPRESSED_RATIO[self.comm_hook])
        with self._lock:
            self._step_gradient_bytes += gradient_bytes
            self._step_payload_bytes += payload
            self._step_calls += 1
            self._step_inflight += 1
        is_last = bucket.is_last()
        if buffer.is_cuda:
            return self._cuda_timed(state, bucket, is_last)
        start = time.perf_counter()
        if self._inner_hook is None:
            buffer.div_(self.world_size)
            group = self.process_group if self.process_group is not None else dist.group.WORLD
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

    def _record_wall(self, start: float, end: float, is_last: bool) -> None:
        with self._lock:
            begin = start if self._previous_end is None else max(start, self._previous_end)
            self._previous_end = end if self._previous_end is None else max(end, self._previous_end)
            service = max(end - begin, 0.0)
            self._recent_service.append(service)
        self.metrics.allreduce_duration.observe(end - start)
        self.metrics.allreduce_service_seconds.inc(service)
        self._bucket_done(is_last)

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
        metrics = self.metrics
        metrics.gradient_bytes.inc(gradient_bytes)
        metrics.allreduce_bytes.inc(payload)
        metrics.allreduce_calls.inc(calls)
        metrics.sync_steps.inc()
        metrics.last_sync_timestamp.set(time.time())

    def _cuda_timed(
        self, state: Any, bucket: GradBucket, is_last: bool
    ) -> torch.futures.Future[torch.Tensor]:
        self.resolve_ready_events()
        start_event = _cuda().Event(enable_timing=True)
        start_event.record()
        if self._inner_hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            inner = default_hooks.allreduce_hook(self.process_group, bucket)
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

    def resolve_ready_events(self, wait: bool = False) -> None:
        """Turn finished CUDA event pairs into durations (``wait``: synchronize on the pending ones)."""
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
            service = max(service, 0.0)
            self.metrics.allreduce_duration.observe(elapsed)
            self.metrics.allreduce_service_seconds.inc(service)
            with self._lock:
                self._recent_service.append(service)
        if keep:
            with self._lock:
                self._pending_events = keep + self._pending_events

    # --- per step -----------------------------------------------------------------------------------
    def after_step(self, samples: int, step_seconds: float) -> None:
        """Account one finished optimizer step on this rank."""
        metrics = self.metrics
        metrics.samples.inc(samples)
        metrics.step_duration.observe(step_seconds)
        if self.mode == "light":
            self.account_light_step()
        elif self._pending_events:
            self.resolve_ready_events()

    def account_light_step(self) -> None:
        """Light mode: one step's bytes and calls, from the bucket sizes DDP's logger reports."""
        # DDP rebuilds its buckets in the forward of its second step; until the logger says so, read it.
        if not self._light_rebuilt and self._ddp is not None:
            data = _logging_data(self._ddp)
            self._light_rebuilt = bool(data.get("has_rebuilt_buckets"))
            key = "rebuilt_bucket_sizes" if self._light_rebuilt else "bucket_sizes"
            self._light_bucket_bytes = _bucket_sizes(data.get(key)) or _bucket_sizes(data.get("bucket_sizes"))
        sizes = self._light_bucket_bytes or []
        gradient_bytes = sum(sizes)
        metrics = self.metrics
        metrics.gradient_bytes.inc(gradient_bytes)
        metrics.allreduce_bytes.inc(int(gradient_bytes * COMPRESSED_RATIO[self.comm_hook]))
        metrics.allreduce_calls.inc(len(sizes))
        metrics.sync_steps.inc()
        metrics.last_sync_timestamp.set(time.time())

    def refresh_from_logger(self) -> dict[str, float]:
        """Copy DDP's logger averages into the gauges; returns them (seconds, ratio) for the progress line."""
        if self._ddp is None:
            return {}
        data = _logging_data(self._ddp)
        sizes = _bucket_sizes(data.get("rebuilt_bucket_sizes")) or _bucket_sizes(data.get("bucket_sizes"))
        self.metrics.buckets.set(len(sizes))
        result: dict[str, float] = {}
        comm = data.get("avg_backward_comm_time")
        if comm is None:
            return result
        compute = float(data.get("avg_backward_compute_time", 0)) / _NS_PER_S
        comm_seconds = float(comm) / _NS_PER_S
        overlap = float(data.get("avg_backward_compute_comm_overlap_time", 0)) / _NS_PER_S
        ratio = min(max(overlap / comm_seconds, 0.0), 1.0) if comm_seconds > 0 else 0.0
        self.metrics.backward_compute_seconds.set(compute)
        self.metrics.backward_comm_seconds.set(comm_seconds)
        self.metrics.backward_overlap_seconds.set(overlap)
        self.metrics.comm_overlap_ratio.set(ratio)
        result.update(compute=compute, comm=comm_seconds, overlap=overlap, ratio=ratio)
        return result

    def allreduce_p50_seconds(self) -> float | None:
        """Median service time of the recent bucket allreduces (None in light mode)."""
        with self._lock:
            recent = list(self._recent_service)
        return statistics.median(recent) if recent else None
