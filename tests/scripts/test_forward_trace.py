"""traced_call: one call's host span, runtime calls and device activity on one clock."""

from __future__ import annotations

import pytest
import torch

from hstu.scripts.forward_trace import traced_call


def test_on_a_cpu_the_call_runs_and_there_is_no_trace():
    assert traced_call(lambda: 41 + 1, torch.device("cpu")) == (42, {})


@pytest.mark.cuda
def test_a_kernel_of_the_call_lies_inside_its_span_on_the_device():
    device = torch.device("cuda")
    x = torch.ones(1 << 20, device=device)
    result, trace = traced_call(lambda: (x * 2).sum(), device, min_call_us=0.0)
    assert result.item() == 2 * (1 << 20)
    start, end = trace["call_us"]
    assert start == 0 and end > 0
    runs = [run for stream in trace["streams"].values() for run in stream]
    assert runs and all(run[0] >= 0 and run[2] in ("kernel", "copy") for run in runs)
    assert any(name == "cudaLaunchKernel" for _, _, name, _ in trace["host_calls"])
