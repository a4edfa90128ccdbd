"""gated_layer_norm: LayerNorm(a) * u in one kernel, against the two torch ops and a float64
reference. On the CPU through the two ops and through Triton's interpreter (a fresh process with
TRITON_INTERPRET=1, skipped without triton); the CUDA kernel, its graph capture and its compiled
form in the `cuda`-marked tests."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hstu.ops.gated_norm import gated_layer_norm, gated_layer_norm_torch
from tests.ops.interpreted import run_interpreted


def _inputs(T: int, N: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """a [T, N]; u a column slice of a [T, 4N] projection (row stride 4N), as the layer's gate is."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(T, N, generator=g) * 3 + 1).to(device, dtype)
    u = torch.randn(T, 4 * N, generator=g).to(device, dtype)[:, N : 2 * N]
    w = (torch.rand(N, generator=g) + 0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype)
    return a, u, w, b


def _reference(a, u, w, b, eps=1e-6) -> torch.Tensor:
    a64 = a.double()
    mean = a64.mean(-1, keepdim=True)
    var = ((a64 - mean) ** 2).mean(-1, keepdim=True)
    return ((a64 - mean) / torch.sqrt(var + eps) * w.double() + b.double()) * u.double()


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_cpu_is_the_two_op_form():
    a, u, w, b = _inputs(7, 48, torch.float32)
    torch.testing.assert_close(gated_layer_norm(a, u, w, b, 1e-6), F.layer_norm(a, (48,), w, b, 1e-6) * u)
    assert _rel(gated_layer_norm(a, u, w, b, 1e-6), _reference(a, u, w, b)) < 1e-6


def test_shapes_are_checked_and_named():
    a, u, w, b = _inputs(4, 16, torch.float32)
    with pytest.raises(ValueError, match=r"\(4, 16\) and \(4, 8\)"):
        gated_layer_norm(a, u[:, :8], w, b, 1e-6)
    with pytest.raises(ValueError, match=r"N=16"):
        gated_layer_norm(a, u, w[:8], b, 1e-6)


_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {root!r})
    from tests.ops.test_gated_norm import _inputs, _reference, _rel
    from hstu.ops import gated_norm

    for T, N, dtype, tol in ((1, 16, torch.float32, 1e-6), (9, 48, torch.float32, 1e-6), (13, 40, torch.bfloat16, 1e-2)):
        a, u, w, b = _inputs(T, N, dtype, seed=T)
        out = gated_norm._launch(a, u, w, b, 1e-6)
        assert out.dtype == dtype and out.shape == a.shape and out.is_contiguous()
        err = _rel(out, _reference(a, u, w, b))
        assert err < tol, (T, N, dtype, err)
    assert gated_norm._launch(*_inputs(0, 16, torch.float32), 1e-6).shape == (0, 16)
    print("ok")
    """
)


def test_triton_kernel_in_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_SCRIPT.format(root=str(Path(__file__).resolve().parents[2])), "ok", timeout=300)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T,N", [(1, 1024), (3072, 1024), (5, 40)])
def test_cuda_kernel_within_the_two_op_error(T, N, dtype):
    """The fused kernel's error against float64 is at most the two ops' (bf16: within 2x; fp32: 1e-5)."""
    from hstu.ops import gated_norm

    a, u, w, b = _inputs(T, N, dtype, "cuda", seed=T)
    ref = _reference(a, u, w, b)
    fused = gated_norm._launch(a, u, w, b, 1e-6)
    two_op = gated_layer_norm_torch(a, u, w, b, 1e-6)
    if dtype == torch.float32:
        assert _rel(fused, ref) < 1e-5
    else:
        assert _rel(fused, ref) <= 2 * _rel(two_op, ref)


@pytest.mark.cuda
@cuda
def test_cuda_kernel_in_a_graph_and_compiled():
    from hstu.ops import gated_norm

    a, u, w, b = _inputs(512, 1024, torch.bfloat16, "cuda")
    expected = gated_norm._launch(a, u, w, b, 1e-6)
    graph = torch.cuda.CUDAGraph()
    gated_layer_norm(a, u, w, b, 1e-6)  # compiled before the capture
    with torch.cuda.graph(graph):
        out = gated_layer_norm(a, u, w, b, 1e-6)
    u.mul_(2)  # the replay reads the live gate (a power of 2: the product doubles exactly)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected * 2, rtol=0, atol=0)
    # traced, it is the two torch ops (Inductor fuses them): within one bf16 rounding of the kernel
    compiled = torch.compile(lambda a, u: gated_layer_norm(a, u, w, b, 1e-6), fullgraph=True)
    torch.testing.assert_close(compiled(a, u), out)
