"""scripts/attention_ncu.py: each asked shape launched the asked number of times, in order (CUDA)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


@pytest.mark.cuda
def test_launches_each_asked_shape_in_order():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    done = subprocess.run([sys.executable, "-m", "hstu.scripts.attention_ncu", "--shapes", "rerank8", "batch1",
                           "--launches", "3"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if "launches" in line]
    assert [line.split(":")[0] for line in lines] == ["batch1", "rerank8"]  # bench_kernels' order
    assert "launches 0..2" in lines[0] and "launches 3..5" in lines[1]
