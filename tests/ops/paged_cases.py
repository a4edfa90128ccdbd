"""Random paged-attention batches and a float64 reference, shared by the attention tests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from hstu.ops.kvcache.layout import JaggedLayout
from hstu.ops.kvcache.metadata import KVCacheMetadata


@dataclass
class PagedCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    layer: int
    meta: KVCacheMetadata
    scale_len: int


def make_paged_case(
    history_lens: list[int],
    cached_lens: list[int],
    num_candidates: list[int],
    *,
    num_layers: int = 2,
    layer: int = 1,
    heads: int = 2,
    head_dim: int = 64,
    page_size: int = 16,
    spare_pages: int = 5,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedCase:
    """A jagged batch: user b has history_lens[b] tokens in its pages (cached_lens[b] reused, the
    rest new rows of this batch, already appended) and num_candidates[b] candidate rows.

    Pages are a random permutation of the pool, and every slot (unused ones too) holds random
    data, so a kernel that reads past a user's history or through a wrong page gets wrong answers.
    """
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [-(-h // page_size) for h in history_lens]
    num_pages = sum(need) + spare_pages
    perm = rng.permutation(num_pages).astype(np.int64)
    page_lists, start = [], 0
    for n in need:
        page_lists.append(perm[start : start + n].tolist())
        start += n

    layout = JaggedLayout.build(history_lens, cached_lens, num_candidates)
    meta = KVCacheMetadata.from_layout(page_lists, layout, page_size)
    T = layout.num_rows
    shape = (T, heads, head_dim)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    kv_cache = torch.randn((num_layers, num_pages, 2, page_size, heads, head_dim), generator=g).to(dtype)
    pages = torch.from_numpy(meta.append_page_ids.numpy().astype(np.int64))
    offs = torch.from_numpy(meta.append_offsets.numpy().astype(np.int64))
    rows = meta.append_rows
    kv_cache[layer, pages, 0, offs] = k[rows]
    kv_cache[layer, pages, 1, offs] = v[rows]
    scale_len = max(history_lens) + max(num_candidates) + 3
    return PagedCase(q.to(device), k.to(device), v.to(device), kv_cache.to(device), layer, meta.to(device), scale_len)


def reference_fp64(case: PagedCase) -> torch.Tensor:
    """Per-user dense HSTU attention in float64 on the CPU, straight from the definition."""
    m = case.meta
    q, k, v = (t.detach().cpu().double() for t in (case.q, case.k, case.v))
    cache = case.kv_cache[case.layer].detach().cpu().double()  # [P, 2, ps, H, d]
    out = torch.zeros_like(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    offsets, kv_lens, q_pos = m.q_offsets.cpu().tolist(), m.kv_lens.cpu().tolist(), m.q_pos.cpu()
    indptr, indices = m.page_indptr.cpu().tolist(), m.page_indices.cpu().long()
    for b in range(len(kv_lens)):
        pages = indices[indptr[b] : indptr[b + 1]]
        keys = cache[pages, 0].reshape(-1, *cache.shape[3:])[: kv_lens[b]]  # [n, H, d]
        vals = cache[pages, 1].reshape(-1, *cache.shape[3:])[: kv_lens[b]]
        for r in range(offsets[b], offsets[b + 1]):
            pos = int(q_pos[r])
            last = kv_lens[b] - 1 if pos < 0 else pos
            s = torch.einsum("hd,nhd->hn", q[r], keys[: last + 1]) * scale
            o = torch.einsum("hn,nhd->hd", torch.nn.functional.silu(s), vals[: last + 1])
            if pos < 0:
                s_self = (q[r] * k[r]).sum(-1) * scale
                o = o + torch.nn.functional.silu(s_self).unsqueeze(-1) * v[r]
            out[r] = o / case.scale_len
    return out


class Float64Rows:
    """A case's tensors in float64, for emulating a kernel's schedule row by row: row(b, r, h,
    keys, own) = row r's (user b, head h) SiLU-weighted sum over the cache's `keys`, plus its own
    key's term when `own` (not yet divided by the case's scale_len)."""

    def __init__(self, case: PagedCase):
        m = case.meta
        self.q, self.k, self.v = (t.double() for t in (case.q, case.k, case.v))
        self.cache = case.kv_cache[case.layer].double()
        self.pt = m.page_table.long()
        self.kv_lens, self.q_pos = m.kv_lens.tolist(), m.q_pos.tolist()
        self.scale = 1.0 / math.sqrt(self.q.shape[-1])

    def last_key(self, b: int, r: int) -> int:
        return self.kv_lens[b] - 1 if self.q_pos[r] < 0 else self.q_pos[r]

    def row(self, b: int, r: int, h: int, keys: torch.Tensor, own: bool) -> torch.Tensor:
        ps = self.cache.shape[2]
        kt = self.cache[self.pt[b, keys // ps], 0, keys % ps, h]
        vt = self.cache[self.pt[b, keys // ps], 1, keys % ps, h]
        acc = torch.nn.functional.silu(kt @ self.q[r, h] * self.scale) @ vt
        if own:
            acc = acc + torch.nn.functional.silu((self.q[r, h] * self.k[r, h]).sum() * self.scale) * self.v[r, h]
        return acc


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm())


def padded_like_graph_bucket(case: PagedCase, rows: int, user_slots: int):
    """(q, k, v, metadata) of the case's batch padded as a CUDA graph bucket pads it: random rows
    past T up to `rows`, user slots past B up to `user_slots` with kv_len 0 and q_offsets at T."""
    m, T = case.meta, case.q.shape[0]
    extra_users = user_slots - m.kv_lens.shape[0]

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, torch.randn((rows - T, *t.shape[1:]), device=t.device).to(t.dtype)])

    meta = SimpleNamespace(
        page_table=torch.cat([m.page_table, m.page_table.new_zeros((extra_users, m.page_table.shape[1]))]),
        kv_lens=torch.cat([m.kv_lens, m.kv_lens.new_zeros(extra_users)]),
        q_offsets=torch.cat([m.q_offsets, m.q_offsets.new_full((extra_users,), T)]),
        q_pos=torch.cat([m.q_pos, m.q_pos.new_zeros(rows - T)]),
        max_q=rows,
    )
    return pad(case.q), pad(case.k), pad(case.v), meta
