"""The host link's side of the planner's cost model, measured on the device in use at start-up:

  h2d_bytes_per_s   pinned host -> device copies of a realistic size (CUDA), or a host copy (CPU)
The compute side is measured through the engine's forward (engine/calibration.py). Either can be
overridden (settings); the result is reported in the metrics.
"""

from __future__ import annotations

import statistics
import time

import torch

from hstu.ops.device_sync import sync


def _time(fn, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of fn() after one warm-up call (device-synchronised)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_h2d(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Bytes per second of a pinned host -> device copy (host copy on CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _time(lambda: dst.copy_(src, non_blocking=True), device)
