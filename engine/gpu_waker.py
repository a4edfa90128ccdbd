"""Wakes the GPU while the host plans a batch, so the batch's first launch does not wait for it.

Why: a lone cached forward spends its first ~0.3-0.8 ms on the host (lookup, pages, metadata,
inputs) with the GPU idle. Run IC's bench trace (H100) showed the batch's first kernel launch (the
staged inputs' copy) taking ~400 us on the host at batch 8 and returning only as the GPU started
the kernel: a launch onto an idle GPU waited for it. Here a side thread launches one tiny kernel on
a stream of its own as soon as a batch arrives, so that wait overlaps the host's planning instead
of following it. The model thread only sets an event (no CUDA call of its own). Off by default
(HSTU_GPU_WAKER=1 turns it on) until a same-call measurement says it pays.
"""

from __future__ import annotations

import logging
import threading

import torch

from hstu.ops import knobs

logger = logging.getLogger(__name__)

ENABLED = knobs.flag("HSTU_GPU_WAKER", default=False)


class GpuWaker:
    """One daemon thread per engine; ping() asks it to launch a tiny kernel on its own stream."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"GpuWaker needs a CUDA device, got {device}")
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._scratch = torch.zeros(1, device=device)
        self._asked = threading.Event()
        self._closed = False
        self.pings = 0  # kernels launched (a test's and a report's count)
        self._thread = threading.Thread(target=self._run, name="hstu-gpu-waker", daemon=True)
        self._thread.start()

    def ping(self) -> None:
        """Ask for one launch (pings while one is pending merge into it)."""
        self._asked.set()

    def _run(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            if self._closed:
                return
            try:
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    self._scratch.add_(1.0)
                self.pings += 1
            except Exception:  # the model thread's own CUDA calls raise any device error
                logger.exception("the GPU waker's launch failed; it stops")
                return

    def close(self) -> None:
        self._closed = True
        self._asked.set()
        self._thread.join(timeout=5.0)
