"""Timing shared by the benchmark, the replay and the profiler: one timed call, repeated calls,
and the summary every JSON report carries (median, min, max, all times)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

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
        return self.measure_interleaved([TimedRun(fn, setup)], warmup, repeats)[0]

    def measure_interleaved(self, runs: Sequence["TimedRun"], warmup: int, repeats: int) -> list[tuple[list[float], Any]]:
        """measure() of several runs taking turns, one call each a round: (times, last result) per run.
        Why: measured one after another, runs compared for a ratio drifted apart with the machine's
        state over the section (on an H100 the same pure onload of a batch-1 host-tier prefix timed
        2.39 ms in one pass and 2.75 ms in a later one, run DE); taking turns, drift falls on each alike."""
        times: list[list[float]] = [[] for _ in runs]
        results: list[Any] = [None] * len(runs)
        for i in range(warmup + repeats):
            for k, run in enumerate(runs):
                if run.setup is not None:
                    run.setup()
                self.sync()
                ms, results[k] = self._once(run.fn)
                if run.after is not None:
                    run.after()
                if i >= warmup:
                    times[k].append(ms)
        return list(zip(times, results))


@dataclass(frozen=True)
class TimedRun:
    """One timed call with its untimed setup (before) and after (e.g. reading counters); either may be None."""

    fn: Callable[[], Any]
    setup: Callable[[], None] | None = None
    after: Callable[[], None] | None = None


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
