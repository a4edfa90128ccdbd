"""torch.compile(fullgraph=True) of the paged HSTU block (with the hstu custom ops) matches eager."""

from __future__ import annotations

import torch

from hstu.model.preprocessor import JaggedLayout
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from tests.conftest import rel_err


def _model(config):
    mgr = AsyncKVCacheManager(KVCacheConfig.for_model(config, page_size=4, num_pages=64, chunk_tokens=8))
    return InferenceRankingGR(config, kv_cache=mgr), mgr


@torch.inference_mode()
def test_compiled_paged_block_matches_eager(tiny_config, book):
    model, mgr = _model(tiny_config)
    model.rank([book.request(1, 7), book.request(2, 3)])
    reqs = [book.request(1, 2), book.request(2, 4), book.request(3, 5)]
    hist = [r.history_tokens(tiny_config) for r in reqs]
    lookup = mgr.lookup([r.user_id for r in reqs], hist, [r.identity(model.identity) for r in reqs])
    layout = JaggedLayout.build(hist, lookup.cached_lens, [len(r.candidates) for r in reqs])
    prepared = mgr.wait_prepared(mgr.prepare_async(lookup, layout))
    try:
        x = model.preprocessor.embed(reqs, lookup.cached_lens)
        kv_eager, kv_compiled = mgr.kv_cache.clone(), mgr.kv_cache.clone()
        y_eager = model.block.forward_paged(x, kv_eager, prepared.metadata)
        compiled = torch.compile(model.block.forward_paged, fullgraph=True)
        y_compiled = compiled(x, kv_compiled, prepared.metadata)
    finally:
        mgr.abort(prepared)
    assert rel_err(y_compiled, y_eager) < 1e-5
    assert torch.allclose(kv_compiled, kv_eager, rtol=1e-5, atol=1e-6)
    assert lookup.cached_lens[0] > 0


def test_model_with_compiled_layers_matches_reference(tiny_config, book):
    model, mgr = _model(tiny_config)
    model.compile_paged_layers()
    for step in range(3):
        reqs = [book.request(u, 2 + step) for u in (1, 2)]
        out = model.forward(reqs)
        assert rel_err(out, model.forward_no_cache(reqs)) < 1e-5
    mgr.close()
