"""CUDA-graph metadata refresh: a padded bucket replays correctly whichever attention backend
the graphs captured (the torch path reads q_batch and q_local, which Triton does not)."""

from __future__ import annotations

from dataclasses import fields
from unittest import mock

import pytest
import torch

from hstu.engine.graphs import _PADDING, pad_metadata, static_metadata
from hstu.ops.attention import paged_hstu_attention_torch
from hstu.ops.kvcache.metadata import KVCacheMetadata
from tests.ops.paged_cases import make_paged_case, reference_fp64, rel_err


def test_every_metadata_field_has_a_padding_rule():
    tensor_fields = {f.name for f in fields(KVCacheMetadata)} - {"max_q", "packed"}
    assert set(_PADDING) == tensor_fields


def _padded_torch_attention(case, static, pad_rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    pad = lambda t: torch.cat([t, torch.randn((pad_rows, *t.shape[1:]), generator=g)])  # noqa: E731
    return paged_hstu_attention_torch(
        pad(case.q), pad(case.k), pad(case.v), case.kv_cache, case.layer, static.page_table, static.kv_lens,
        static.q_batch, static.q_local, static.q_pos, static.max_q, case.scale_len,
    )


def test_a_bucket_refreshed_after_another_batch_gives_the_torch_backend_this_batchs_rows():
    previous = make_paged_case([60, 8, 33, 20], [50, 0, 1, 19], [4, 6, 1, 2], page_size=16, seed=1)
    case = make_paged_case([40, 25, 9], [30, 0, 4], [3, 2, 5], page_size=16, seed=2)
    scratch = case.kv_cache.shape[1]  # one extra page that no user owns
    case.kv_cache = torch.cat([case.kv_cache, torch.zeros_like(case.kv_cache[:, :1])], 1)
    T, rows = case.q.shape[0], 96
    static = static_metadata(rows, max_batch=5, max_pages=8, scratch_page=scratch, device="cpu")
    pad_metadata(static, previous.meta, scratch)  # stale state a bucket holds from its last replay
    pad_metadata(static, case.meta, scratch)
    out = _padded_torch_attention(case, static, rows - T)
    assert rel_err(out[:T], reference_fp64(case)) < 1e-5


def test_metadata_larger_than_the_bucket_is_rejected():
    case = make_paged_case([40, 25], [30, 0], [3, 2], page_size=16)
    static = static_metadata(8, max_batch=2, max_pages=4, scratch_page=0, device="cpu")
    with pytest.raises(ValueError, match="q_batch has 40 entries; the bucket holds 8"):
        pad_metadata(static, case.meta, 0)


@pytest.mark.cuda
def test_cuda_graphs_with_the_torch_attention_match_eager(tiny_config, book):
    from hstu.engine import RankingEngine
    from hstu.model.ranking import InferenceRankingGR
    from hstu.ops import triton_attention
    from hstu.ops.kvcache.config import KVCacheConfig
    from hstu.ops.kvcache.manager import AsyncKVCacheManager

    def engine() -> RankingEngine:
        kv = KVCacheConfig.for_model(tiny_config, page_size=4, num_pages=256, chunk_tokens=8)
        return RankingEngine(InferenceRankingGR(tiny_config, "cuda"), AsyncKVCacheManager(kv, "cuda"))

    with mock.patch.object(triton_attention, "available", lambda: False):
        graphed, eager = engine(), engine()
        graphed.enable_cuda_graphs(max_batch=4, buckets=(64, 128))
        for step in range(4):
            users = [(step + u) % 5 for u in range(3)]
            reqs = [book.request(u, 3 + step) for u in users]
            torch.testing.assert_close(graphed.forward(reqs), eager.forward(reqs), rtol=1e-5, atol=1e-6)
        assert graphed.graphs.replays >= 3
        graphed.close()
        eager.close()
