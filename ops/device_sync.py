"""Waiting for a device's queued work, for wall-clock timings (benchmarks, the planner's start-up
measurements): a timed region that ends without it measures only the launches."""

from __future__ import annotations

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op off CUDA), so a wall time includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
