"""LayerNorm(a) * u in one pass: the HSTU layer's gate before its output projection.

Why: done as two torch ops it is two kernels a layer, a LayerNorm writing a [T, N] tensor and a
multiply reading it back with the gate u. u is a column slice of the projection's output (row
stride 4 N), which torch's elementwise kernels do not vectorise. At the seed shapes' batch 8 on an
H100 (run DB) the pair took ~20 us of a ~280 us layer; one kernel reads a and u once and writes
the product once: ~9 us (run DC; e2e batch 8 3.65 -> 3.25 ms cached, 17.8 -> 16.3 uncached).

Shapes: a [T, N] contiguous; u [T, N] with unit stride over N (any row stride); weight and bias
[N]. Returns [T, N] in a's dtype: LayerNorm statistics and the product in float32, one rounding
at the end (the two-op form rounds the norm before the multiply, so 16-bit results may differ by
one unit in the last place).

Dispatch: the Triton kernel for CUDA tensors when Triton is there (eager code and CUDA-graph
captures), the two torch ops otherwise: on the CPU, under HSTU_FUSED_GATE=0 (same-call
comparisons), and while torch.compile or torch.export traces, where Inductor fuses the two ops
itself and an AOTInductor package stays free of a Python-only op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hstu.ops import knobs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch ops serve.
    triton = None

_FUSED = knobs.flag("HSTU_FUSED_GATE", default=True)


def gated_layer_norm_torch(a: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           eps: float) -> torch.Tensor:
    """The two-op form: F.layer_norm(a) * u."""
    return F.layer_norm(a, (a.shape[-1],), weight, bias, eps) * u


def gated_layer_norm(a: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     eps: float) -> torch.Tensor:
    """LayerNorm(a; weight, bias, eps) * u over the last dim (see the module docstring)."""
    if a.dim() != 2 or u.shape != a.shape:
        raise ValueError(f"a and u must both be [T, N]; got {tuple(a.shape)} and {tuple(u.shape)}")
    if weight.shape != (a.shape[1],) or (bias is not None and bias.shape != (a.shape[1],)):
        raise ValueError(f"weight and bias must be [N={a.shape[1]}], got {tuple(weight.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")
    fused = _FUSED and triton is not None and a.is_cuda and bias is not None and u.stride(1) == 1
    if not fused or torch.compiler.is_compiling():
        return gated_layer_norm_torch(a, u, weight, bias, eps)
    return _launch(a, u, weight, bias, eps)


if triton is not None:

    @triton.jit
    def _gated_layer_norm_kernel(a_ptr, u_ptr, w_ptr, b_ptr, out_ptr, T, N, stride_a, stride_u, stride_out, eps,
                                 BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        """ROWS rows a program; a row's N values in one block (statistics in float32)."""
        cols = tl.arange(0, BLOCK_N)
        in_row = cols < N
        w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
        for i in range(ROWS):
            row = tl.program_id(0) * ROWS + i
            if row < T:
                a = tl.load(a_ptr + row * stride_a + cols, mask=in_row, other=0.0).to(tl.float32)
                mean = tl.sum(a, axis=0) / N
                centred = tl.where(in_row, a - mean, 0.0)
                rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / N + eps)
                u = tl.load(u_ptr + row * stride_u + cols, mask=in_row, other=0.0).to(tl.float32)
                out = (centred * rstd * w + b) * u
                tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=in_row)

    _ROWS = 4  # rows a program: fewer programs than rows at thousands of rows, one weight load each

    def _launch(a: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        a = a.contiguous()
        T, N = a.shape
        out = torch.empty_like(a)
        if T:
            block_n = triton.next_power_of_2(N)
            _gated_layer_norm_kernel[(triton.cdiv(T, _ROWS),)](
                a, u, weight, bias, out, T, N, a.stride(0), u.stride(0), out.stride(0), eps,
                BLOCK_N=block_n, ROWS=_ROWS, num_warps=4 if block_n <= 2048 else 8,
            )
        return out
