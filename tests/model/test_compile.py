"""torch.compile(fullgraph=True) of the paged HSTU block (with the hstu custom ops) matches eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hstu.engine import RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from tests.conftest import rel_err


def _model(config):
    mgr = AsyncKVCacheManager(KVCacheConfig.for_model(config, page_size=4, num_pages=64, chunk_tokens=8))
    return RankingEngine(InferenceRankingGR(config), mgr), mgr


# Each model option that changes what the layers compute (issue 13), compiled with the custom ops.
_OPTIONS = {
    "default": {},
    "meta_stu": {"layer_variant": "meta_stu", "output_bias": False, "attn_scaling_seqlen": 64, "layer_norm_eps": 1e-5},
}


@pytest.mark.parametrize("options", list(_OPTIONS.values()), ids=list(_OPTIONS))
@torch.inference_mode()
def test_compiled_paged_block_matches_eager(tiny_config, book, options):
    tiny_config = dataclasses.replace(tiny_config, **options)
    model, mgr = _model(tiny_config)
    model.rank([book.request(1, 7), book.request(2, 3)])
    reqs = [book.request(1, 2), book.request(2, 4), book.request(3, 5)]
    ident = model.model.identity
    plan = mgr.plan(
        [r.user_id for r in reqs],
        [r.history_tokens(tiny_config) for r in reqs],
        [r.identity(ident) for r in reqs],
        [len(r.candidates) for r in reqs],
    )
    try:
        x = model.model.embed(reqs, plan.cached_lens)
        prepared = mgr.wait(plan)
        kv_eager, kv_compiled = prepared.kv_pages.clone(), prepared.kv_pages.clone()
        y_eager = model.model.block.forward_paged(x, kv_eager, prepared.metadata)
        compiled = torch.compile(model.model.block.forward_paged, fullgraph=True)
        y_compiled = compiled(x, kv_compiled, prepared.metadata)
    finally:
        mgr.abort(plan)
    assert rel_err(y_compiled, y_eager) < 1e-5
    assert torch.allclose(kv_compiled, kv_eager, rtol=1e-5, atol=1e-6)
    assert plan.cached_lens[0] > 0


def test_model_with_compiled_layers_matches_reference(tiny_config, book):
    model, mgr = _model(tiny_config)
    model.compile_paged_layers()
    for step in range(3):
        reqs = [book.request(u, 2 + step) for u in (1, 2)]
        out = model.forward(reqs)
        assert rel_err(out, model.forward_no_cache(reqs)) < 1e-5
    mgr.close()
