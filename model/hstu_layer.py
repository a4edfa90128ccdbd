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
        H, dv, dqk = self.num_heads, self.d_v, self.d_qk
        uvqk = self.uvqk(self.input_norm(x))
        if not self.meta_stu:
            uvqk = F.silu(uvqk)
        u, v, q, k = torch.split(uvqk, [H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        if self.meta_stu:
            u = F.silu(u)
        T = x.shape[0]
        return u, q.reshape(T, H, dqk), k.reshape(T, H, dqk), v.reshape(T, H, dv)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D] -> k [T, H, d_qk], v [T, H, d_v]: project()'s keys and values alone, from the
        layer's input. The host tier's hidden-state chunks are rebuilt into K/V this way: one
        matmul over the v and k rows of uvqk's weight (half of project()'s), few kernels, since a
        batch enqueues one rebuild per layer; k and v are views of its output."""
        H, dv, dqk = self.num_heads, self.d_v, self.d_qk
        w, b = self._kv_projection()
        vk = F.linear(self.input_norm(x), w, b)
        if not self.meta_stu:
            vk = F.silu(vk, inplace=True)
        T = x.shape[0]
        return vk[:, H * dv :].reshape(T, H, dqk), vk[:, : H * dv].reshape(T, H, dv)

    def _kv_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """uvqk's v and k rows (weight [H*(d_v + d_qk), D], bias), copied together once and again
        whenever uvqk's parameters change (their version counters: load_state_dict copies in place)."""
        w, b = self.uvqk.weight, self.uvqk.bias
        key = (w.data_ptr(), w._version, None if b is None else (b.data_ptr(), b._version))
        cached = getattr(self, "_kv_cache", None)
        if cached is None or cached[0] != key:
            H, dv, dqk = self.num_heads, self.d_v, self.d_qk
            rows = torch.cat([torch.arange(H * dv, 2 * H * dv), torch.arange(2 * H * dv + H * dqk, 2 * H * dv + 2 * H * dqk)])
            with torch.no_grad():
                rows = rows.to(w.device)
                cached = (key, w.index_select(0, rows), None if b is None else b.index_select(0, rows))
            self._kv_cache = cached
        return cached[1], cached[2]

    def finish(self, x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Residual output from attention [T, H, d_v] and gate u."""
        a = attn.reshape(x.shape[0], -1)
        gated = self.attn_norm(a) * u
        if self.meta_stu:
            gated = torch.cat([u, a, gated], dim=-1)
        return self.output(gated) + x
