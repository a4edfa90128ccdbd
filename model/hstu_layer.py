"""One HSTU layer (inference): x -> LN -> Linear -> SiLU -> split u, v, q, k; pointwise attention;
out = Linear(LN(a) * u) + x. The attention itself is supplied by the caller (dense or paged)."""

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
        self.input_norm = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.uvqk = nn.Linear(D, H * (2 * self.d_v + 2 * self.d_qk))
        self.attn_norm = nn.LayerNorm(H * self.d_v, eps=config.layer_norm_eps)
        self.output = nn.Linear(H * self.d_v, D)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, D] -> u [T, H*d_v], q [T, H, d_qk], k [T, H, d_qk], v [T, H, d_v]."""
        H, dv, dqk = self.num_heads, self.d_v, self.d_qk
        uvqk = F.silu(self.uvqk(self.input_norm(x)))
        u, v, q, k = torch.split(uvqk, [H * dv, H * dv, H * dqk, H * dqk], dim=-1)
        T = x.shape[0]
        return u, q.reshape(T, H, dqk), k.reshape(T, H, dqk), v.reshape(T, H, dv)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Residual output from attention [T, H, d_v] and gate u."""
        a = self.attn_norm(attn.reshape(x.shape[0], -1))
        return self.output(a * u) + x
