"""Paged HSTU attention: the semantics, a pure-torch implementation and the dispatch to Triton.

HSTU attention has no softmax: o_i = sum_j SiLU(q_i . k_j / sqrt(d_qk)) * v_j / scale_len, where
scale_len is a fixed config value (the max sequence length), so a token's output does not depend
on how long the batch is - which is what makes cached K/V reusable.

Jagged batch of B users: query rows q_offsets[b]:q_offsets[b+1] of q/k/v [T, H, d] belong to user
b, whose history (cached + new tokens, already appended) has kv_lens[b] tokens in its pages.
Row r with q_pos[r] >= 0 is a history token at that absolute position: it sees history keys
0..q_pos[r] (causal). Row r with q_pos[r] == -1 is a candidate: it sees the whole history plus its
own k[r], v[r]; candidates never see each other and are never written to the cache.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "torch")
_backend = "auto"


def attention_backend() -> str:
    """The backend paged_hstu_attention dispatches to: "auto" (Triton on CUDA when available) or "torch"."""
    return _backend


@contextlib.contextmanager
def use_attention_backend(name: str) -> Iterator[None]:
    """Within the block, paged_hstu_attention uses `name`; "torch" forces the torch implementation
    everywhere (benchmarks compare it with the Triton kernel). Process-wide, not per thread, so a
    model thread started inside the block sees it too; the previous backend is restored on exit."""
    global _backend
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    previous, _backend = _backend, name
    try:
        yield
    finally:
        _backend = previous


def paged_hstu_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    q_batch: torch.Tensor,
    q_local: torch.Tensor,
    q_pos: torch.Tensor,
    max_q: int,
    scale_len: int,
) -> torch.Tensor:
    """Padded torch implementation (CPU, fallback, compile-friendly: no host sync, static max_q).

    q, k: [T, H, d_qk]; v: [T, H, d_v]; kv_cache [L, P, 2, ps, H, d]; page_table [B, max_pages]
    int32 (padding entries may hold any valid page); kv_lens [B]; q_batch/q_local/q_pos [T] int64.
    Returns [T, H, d_v] in q's dtype (accumulated in float32).
    """
    B, max_pages = page_table.shape
    H = q.shape[1]
    page_size = kv_cache.shape[3]
    pages = kv_cache[layer].index_select(0, page_table.reshape(-1).long())  # [B*mp, 2, ps, H, d]
    pages = pages.view(B, max_pages, 2, page_size, H, -1).float()
    keys = pages[:, :, 0].reshape(B, max_pages * page_size, H, -1)
    values = pages[:, :, 1].reshape(B, max_pages * page_size, H, -1)
    return padded_hstu_attention(q, k, v, keys, values, kv_lens, q_batch, q_local, q_pos, max_q, scale_len)


def padded_hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_lens: torch.Tensor,
    q_batch: torch.Tensor,
    q_local: torch.Tensor,
    q_pos: torch.Tensor,
    max_q: int,
    scale_len: int,
) -> torch.Tensor:
    """The attention of paged_hstu_attention_torch over each user's history K/V already gathered:
    keys [B, K, H, d_qk], values [B, K, H, d_v] (positions 0..K-1, rows past kv_lens[b] ignored).
    Shared with the exported forward (engine/exported.py), whose cache op gathers the pages."""
    B, num_keys = keys.shape[0], keys.shape[1]
    T, H, d_qk = q.shape
    keys, values = keys.float(), values.float()

    is_cand = q_pos < 0
    last = (kv_lens.long() - 1).index_select(0, q_batch)
    eff_pos = torch.where(is_cand, last, q_pos)
    qp = q.new_zeros((B, max_q, H, d_qk), dtype=torch.float32)
    qp = qp.index_put((q_batch, q_local), q.float())
    pos_p = torch.full((B, max_q), -1, dtype=torch.long, device=q.device).index_put((q_batch, q_local), eff_pos)

    scale = 1.0 / math.sqrt(d_qk)
    scores = torch.einsum("bqhd,bkhd->bhqk", qp, keys) * scale
    key_idx = torch.arange(num_keys, device=q.device)
    mask = key_idx.view(1, 1, -1) <= pos_p.unsqueeze(-1)  # [B, max_q, K]
    weights = F.silu(scores) * mask.unsqueeze(1)
    out_p = torch.einsum("bhqk,bkhd->bqhd", weights, values)
    out = out_p[q_batch, q_local]  # [T, H, d_v]

    self_w = F.silu((q.float() * k.float()).sum(-1) * scale) * is_cand.unsqueeze(-1)  # [T, H]
    out = out + self_w.unsqueeze(-1) * v.float()
    return (out / scale_len).to(q.dtype)


def dense_hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, history_len: int, scale_len: int
) -> torch.Tensor:
    """No-cache reference for one user's full sequence [N, H, d]: first history_len rows are causal
    history, the remaining rows candidates (see the history and themselves)."""
    N, _, d_qk = q.shape
    idx = torch.arange(N, device=q.device)
    causal = idx.view(-1, 1) >= idx.view(1, -1)
    hist_key = idx.view(1, -1) < history_len
    is_cand_q = idx.view(-1, 1) >= history_len
    mask = torch.where(is_cand_q, hist_key | (idx.view(-1, 1) == idx.view(1, -1)), causal & hist_key)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(d_qk)
    weights = F.silu(scores) * mask
    return (torch.einsum("hqk,khd->qhd", weights, v.float()) / scale_len).to(q.dtype)


def paged_hstu_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, meta, scale_len: int
) -> torch.Tensor:
    """Paged HSTU attention for the jagged batch described by `meta` (a KVCacheMetadata).

    Uses the Triton kernel on CUDA when it is available (unless use_attention_backend("torch") is in
    force), the torch implementation elsewhere.
    """
    if q.is_cuda and _backend == "auto":
        from hstu.ops import triton_attention

        if triton_attention.available():
            return triton_attention.paged_hstu_attention_triton(q, k, v, kv_cache, layer, meta, scale_len)
    return paged_hstu_attention_torch(
        q, k, v, kv_cache, layer, meta.page_table, meta.kv_lens, meta.q_batch, meta.q_local, meta.q_pos, meta.max_q, scale_len
    )
