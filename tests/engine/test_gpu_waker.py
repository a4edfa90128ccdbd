"""The GPU waker: a side thread's tiny kernel as a batch arrives (engine/gpu_waker.py)."""

from __future__ import annotations

import time

import pytest
import torch

from hstu.engine import gpu_waker


def test_it_needs_a_cuda_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        gpu_waker.GpuWaker(torch.device("cpu"))


def test_the_engine_has_none_off_cuda(monkeypatch):
    from hstu.engine import RankingEngine

    monkeypatch.setattr(gpu_waker, "ENABLED", True)
    engine = RankingEngine.create(device="cpu")
    try:
        assert engine._waker is None  # the CPU path never starts the thread
    finally:
        engine.close()


@pytest.mark.cuda
def test_a_ping_launches_one_kernel_on_its_own_stream_and_close_joins_the_thread():
    waker = gpu_waker.GpuWaker(torch.device("cuda"))
    try:
        waker.ping()
        deadline = time.monotonic() + 5.0
        while waker.pings < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert waker.pings >= 1
        torch.cuda.synchronize()
        assert waker._scratch.item() == float(waker.pings)
    finally:
        waker.close()
    assert not waker._thread.is_alive()
