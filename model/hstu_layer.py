"""One HSTU layer (inference): x -> LN -> Linear -> split u, v, q, k; pointwise attention; a
residual output projection. The attention itself is supplied by the caller (dense or paged).

Two variants (HSTUConfig.layer_variant), over the same attention and KV layout:
  nvidia    SiLU on u, v, q and k;  out = Linear(LN(a) * u) + x            (NVIDIA recsys-examples)
  meta_stu  SiLU on u only;         out = Linear([u, a, u * LN(a)]) + x    (Meta's STU layer)
The output projection's bias is HSTUConfig.output_bias (upstream layers have none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hstu.model.config import HSTUConfig
from hstu.ops.gated_norm import gated_layer_norm


class HSTULayer(nn.Module):
    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        D, H = config.embedding_dim, config.num_heads
        self.num_heads, self.d_qk, self.d_v = H, config.head_dim_qk, config.head_dim_v
        self.meta_stu = config.layer_variant == "meta_stu"
        self.input_norm = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.uvqk = nn.Linear(D, H * (2 * self.d_v + 2 * self.d_qk))
        self.attn_norm = nn.LayerNorm(H * self.d_v, eps=config.layer_norm_eps)
        width = 3 if self.meta_stu else 1
        self.output = nn.Linear(width * H * self.d_v, D, bias=config.output_bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, D] -> u [T, H*d_v], q [T, H, d_qk], k [T, H, d_qk], v [T, H, d_v]."""
        return self.split_projection(self.projection(x))

    def projection(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, D] -> uvqk [T, H*(2*d_v + 2*d_qk)], the layer's input projection (activated where
        the variant activates all of it); out: a [T, width] contiguous buffer it is written into
        (the CUDA graph segments hand it from one replay to the next without a copy). The part of
        the layer that reads no cached K/V: a host-tier batch runs it before its pages land."""
        h = self.input_norm(x)
        if out is None:
            uvqk = self.uvqk(h)
        elif self.uvqk.bias is None:
            uvqk = torch.mm(h, self.uvqk.weight.t(), out=out)
        else:  # what F.linear runs for a 2-D input with a bias
            uvqk = torch.addmm(self.uvqk.bias, h, self.uvqk.weight.t(), out=out)
        if not self.meta_stu:
            uvqk = F.silu(uvqk, inplace=out is not None)
        return uvqk

    def split_projection(
        self, uvqk: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """projection()'s output -> u [T, H*d_v], q [T, H, d_qk], k [T, H, d_qk], v [T, H, d_v] (views,
        but u under meta_stu)."""
        H, dv, dqk = self.num_heads, self.d_v, self.d_qk
        u, v, q, k = torch.split(uvqk, [H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        if self.meta_stu:
            u = F.silu(u)
        T = uvqk.shape[0]
        return u, q.reshape(T, H, dqk), k.reshape(T, H, dqk), v.reshape(T, H, dv)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D] -> k [T, H, d_qk], v [T, H, d_v]: project()'s keys and values alone, from the
        layer's input (half of its matmul). The host tier's hidden-state chunks are rebuilt into
        K/V this way. Two matmuls over views of uvqk's v and k rows, not one over a copy of them:
        the rebuild is captured in CUDA graphs (ops/kvcache/rebuild_graphs.py) that must read the
        live weights, which load_state_dict updates in place."""
        H, dv, dqk = self.num_heads, self.d_v, self.d_qk
        h = self.input_norm(x)
        w, b = self.uvqk.weight, self.uvqk.bias
        v_rows, k_rows = slice(H * dv, 2 * H * dv), slice(2 * H * dv + H * dqk, 2 * H * dv + 2 * H * dqk)
        v = F.linear(h, w[v_rows], None if b is None else b[v_rows])
        k = F.linear(h, w[k_rows], None if b is None else b[k_rows])
        if not self.meta_stu:
            v, k = F.silu(v, inplace=True), F.silu(k, inplace=True)
        T = x.shape[0]
        return k.view(T, H, dqk), v.view(T, H, dv)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Residual output from attention [T, H, d_v] and gate u."""
        a = attn.reshape(x.shape[0], -1)
        norm = self.attn_norm
        gated = gated_layer_norm(a, u, norm.weight, norm.bias, norm.eps)
        if self.meta_stu:
            gated = torch.cat([u, a, gated], dim=-1)
        if self.output.bias is None:  # the residual added in the matmul's epilogue: one kernel, not two
            return torch.addmm(x, gated, self.output.weight.t())
        return self.output(gated) + x
