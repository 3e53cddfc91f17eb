"""Timing and peak-memory helpers shared by the benchmark and by kernel tests.

`time_ms(fn, warmup=, reps=, device=)` runs `fn` `warmup` times untimed, then `reps` times
timed one by one, and returns statistics in milliseconds (`times_ms` the per-call times,
in run order; `summarize_ms` their statistics). On CUDA each run is bracketed by
a pair of CUDA events recorded on the current stream (the GPU's own clock, no host sync
inside the timed loop: launches queue ahead, as in training); elsewhere it uses
`time.perf_counter` around each run (CPU work is synchronous).

`back_to_back_ms(fn, reps=, device=)` is the mean time per call of `reps` calls queued
back to back between one pair of events (no event between calls).

`capture_cuda_graph(fn, warmup=)` captures one call of `fn` in a CUDA graph, after `warmup`
calls on a side stream, as capture wants; it returns the graph and the call's (static) result.

`PeakMemory(device)` is a context manager that reports the CUDA caching allocator's peak
inside the block (`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`),
both absolute and relative to what was allocated on entry. On CPU it reports None.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

__all__ = ["time_ms", "times_ms", "summarize_ms", "back_to_back_ms", "capture_cuda_graph", "percentile", "PeakMemory"]


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ascending values, linear interpolation (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile: expected at least one value")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _is_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def times_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 10,
    reps: int = 50,
    device: torch.device | str | None = None,
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Milliseconds of each timed call of `fn`, in run order (what `time_ms` summarises).

    Run order matters under expert parallelism: the benchmark takes, per iteration, the
    slowest rank's time. `setup`, when given, runs before every call outside the timed
    region (e.g. to zero gradients). `fn`'s return value is dropped right after each call,
    so its memory can be reused by the next one. `device` None means CUDA when available.
    """
    if warmup < 0 or reps < 1:
        raise ValueError(f"warmup: expected >= 0 and reps >= 1, got warmup={warmup} reps={reps}")
    cuda = _is_cuda(device)
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            if setup is not None:
                setup()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]
    times: list[float] = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def summarize_ms(times: list[float]) -> dict[str, float]:
    """{median, min, max, mean, p20, p80, reps} of per-call milliseconds."""
    times = sorted(times)
    return {
        "median": percentile(times, 50),
        "min": times[0],
        "max": times[-1],
        "mean": sum(times) / len(times),
        "p20": percentile(times, 20),
        "p80": percentile(times, 80),
        "reps": float(len(times)),
    }


def time_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 10,
    reps: int = 50,
    device: torch.device | str | None = None,
    setup: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Milliseconds per call of `fn`: {median, min, max, mean, p20, p80, reps} (see `times_ms`)."""
    return summarize_ms(times_ms(fn, warmup=warmup, reps=reps, device=device, setup=setup))


def back_to_back_ms(fn: Callable[[], object], *, reps: int = 50, device: torch.device | str | None = None) -> float:
    """Mean milliseconds per call of `reps` calls of `fn` issued back to back, timed as one
    block (CUDA events around the block, or `time.perf_counter` off CUDA). No warm-up."""
    if reps < 1:
        raise ValueError(f"reps: expected >= 1, got {reps}")
    if not _is_cuda(device):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e3 / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def capture_cuda_graph(fn: Callable[[], object], *, warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, result): `fn` run `warmup` times on a side stream (kernels compiled, the
    allocator's blocks made, away from the capturing stream's history), then once under capture.
    `result` is that captured call's return value: its tensors hold each replay's output."""
    if warmup < 0:
        raise ValueError(f"warmup: expected >= 0, got {warmup}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


class PeakMemory:
    """Peak CUDA memory inside a `with` block, in GB (1e9 bytes); None off CUDA.

    `peak_gb`: the allocator's peak while the block ran (everything resident included);
    `delta_gb`: that peak minus what was allocated on entry, i.e. what the block itself needed.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.cuda = _is_cuda(device)
        self.device = torch.device(device) if device is not None else None
        self.peak_gb: float | None = None
        self.delta_gb: float | None = None
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            self.peak_gb = peak / 1e9
            self.delta_gb = (peak - self._base) / 1e9
