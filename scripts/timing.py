"""Timing shared by the benchmark, the replay and the profiler: one timed call, repeated calls,
and the summary every JSON report carries (median, min, max, all times)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from hstu.ops.device_sync import sync


def wall_ms(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(milliseconds, result) of one call of fn, its device work included (synchronised after)."""
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3, result


class Timer:
    """Times one call: CUDA events on the current stream (device time incl. host gaps), else wall."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        sync(self.device)

    def _once(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if not self.cuda:
            return wall_ms(fn, self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), result

    def measure(
        self, fn: Callable[[], Any], setup: Callable[[], None] | None, warmup: int, repeats: int
    ) -> tuple[list[float], Any]:
        """Milliseconds of `repeats` timed calls after `warmup` untimed ones; setup() runs untimed before each."""
        times, result = [], None
        for i in range(warmup + repeats):
            if setup is not None:
                setup()
            self.sync()
            ms, result = self._once(fn)
            if i >= warmup:
                times.append(ms)
        return times, result


def summarize(times: list[float]) -> dict[str, Any]:
    """JSON summary of timed repeats in milliseconds; ValueError on an empty list."""
    if not times:
        raise ValueError("summarize needs at least one time, got an empty list")
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "repeats": len(times),
        "times_ms": times,
    }
