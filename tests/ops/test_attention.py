"""Paged HSTU attention (torch) equals the dense no-cache reference on the same K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hstu.ops.kvcache.layout import JaggedLayout
from hstu.ops.attention import dense_hstu_attention, paged_hstu_attention
from hstu.ops.kvcache.metadata import KVCacheMetadata

H, D, PS, SCALE_LEN = 2, 8, 4, 64


def _paged_case(history, cached, cands, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PS) for n in history) + 3
    kv_cache = torch.randn(1, num_pages, 2, PS, H, D, generator=g)
    free = torch.randperm(num_pages, generator=g).tolist()
    full, page_lists = [], []
    for n, m in zip(history, cands):
        q, k, v = (torch.randn(n + m, H, D, generator=g) for _ in range(3))
        pages = [free.pop() for _ in range(-(-n // PS))]
        for t in range(n):
            kv_cache[0, pages[t // PS], 0, t % PS] = k[t]
            kv_cache[0, pages[t // PS], 1, t % PS] = v[t]
        full.append((q, k, v))
        page_lists.append(pages)
    layout = JaggedLayout.build(history, cached, cands)
    meta = KVCacheMetadata.from_layout(page_lists, layout, PS)
    q_rows = torch.cat([q[c:] for (q, _, _), c in zip(full, cached)])
    k_rows = torch.cat([k[c:] for (_, k, _), c in zip(full, cached)])
    v_rows = torch.cat([v[c:] for (_, _, v), c in zip(full, cached)])
    expected = torch.cat(
        [dense_hstu_attention(q, k, v, n, SCALE_LEN)[c:] for (q, k, v), n, c in zip(full, history, cached)]
    )
    return q_rows, k_rows, v_rows, kv_cache, meta, expected


@pytest.mark.parametrize(
    "history,cached,cands",
    [([9], [0], [3]), ([9, 17, 5], [4, 16, 0], [2, 1, 4]), ([32, 3], [31, 1], [5, 1])],
)
def test_paged_attention_matches_dense(history, cached, cands):
    q, k, v, kv_cache, meta, expected = _paged_case(history, cached, cands)
    out = paged_hstu_attention(q, k, v, kv_cache, 0, meta, SCALE_LEN)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_candidates_do_not_see_each_other():
    q, k, v, kv_cache, meta, _ = _paged_case([6], [6 - 1], [3], seed=1)
    base = paged_hstu_attention(q, k, v, kv_cache, 0, meta, SCALE_LEN)
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 5.0
    v2[-1] += 5.0
    changed = paged_hstu_attention(q, k2, v2, kv_cache, 0, meta, SCALE_LEN)
    torch.testing.assert_close(base[:-1], changed[:-1])
    assert not torch.allclose(base[-1], changed[-1])


def test_metadata_rejects_pages_that_do_not_fit():
    layout = JaggedLayout.build([9], [0], [1])
    with pytest.raises(ValueError, match="cannot hold exactly 9 tokens"):
        KVCacheMetadata.from_pages([[0, 1]], [9], [0], [1], PS)
    assert np.all(layout.q_pos[-1:] == -1)
