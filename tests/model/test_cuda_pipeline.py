"""The async pipeline on CUDA: side streams, pinned host tier, bf16 oracle with eviction.

bf16 criterion: the cached model's error against an fp64 reference (same bf16-rounded weights,
dense, no cache) is within 2x of the bf16 no-cache model's error against that reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from hstu.engine import RankingEngine
from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from tests.configs import cuda_pipeline_model
from tests.conftest import HistoryBook, rel_err

pytestmark = pytest.mark.cuda


def _fp64_twin(model: InferenceRankingGR) -> InferenceRankingGR:
    twin = InferenceRankingGR(HSTUConfig(**{**model.config.to_dict(), "dtype": "float32"}), device="cuda").double()
    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return twin


@pytest.mark.parametrize("host_format", ["kv", "hidden"])
def test_bf16_oracle_on_cuda_with_eviction(host_format):
    cfg = cuda_pipeline_model("bfloat16")
    kv = KVCacheConfig.for_model(cfg, page_size=16, num_pages=160, chunk_tokens=32)
    kv = KVCacheConfig.for_model(cfg, page_size=16, num_pages=160, chunk_tokens=32, host_capacity_bytes=120 * kv.chunk_bytes,
                                 host_format=host_format)
    mgr = AsyncKVCacheManager(kv, device="cuda")
    assert mgr.host_arena.is_pinned()
    model = RankingEngine(InferenceRankingGR(cfg, device="cuda"), mgr)
    ref64 = _fp64_twin(model.model)
    book = HistoryBook(cfg, seed=3)
    worst_ratio, batches = 0.0, 0
    for reqs in book.random_batches(seed=4, rounds=60, num_users=40, max_users=5, new_events=(4, 40), candidates=(8, 64)):
        for r in reqs:
            if len(book.histories[r.user_id][0]) > 400:
                book.histories.pop(r.user_id)
        out = model.forward(reqs)
        plain = model.forward_no_cache(reqs)
        exact = ref64.forward_no_cache(reqs)
        base = max(rel_err(plain, exact), 1e-4)
        worst_ratio = max(worst_ratio, rel_err(out, exact) / base)
        batches += 1
    mgr.close()
    stats = mgr.stats.snapshot()
    assert worst_ratio <= 2.0, worst_ratio
    assert stats["gpu_evictions"] > 0 and stats["host_hits"] > 0 and stats["onload_failures"] == 0
    assert (stats["hidden_chunks_onloaded"] > 0) == (host_format == "hidden")


def test_fp32_oracle_on_cuda_matches_no_cache():
    cfg = cuda_pipeline_model("float32")
    mgr = AsyncKVCacheManager(KVCacheConfig.for_model(cfg, page_size=16, num_pages=96, chunk_tokens=32,
                                                      host_capacity_bytes=64 << 20), device="cuda")
    model = RankingEngine(InferenceRankingGR(cfg, device="cuda"), mgr)
    book = HistoryBook(cfg, seed=5)
    torch.backends.cuda.matmul.allow_tf32 = False
    for step in range(20):
        reqs = [book.request(u, 5 + step % 7, 16) for u in range(step % 4, step % 4 + 3)]
        out = model.forward(reqs)
        assert rel_err(out, model.forward_no_cache(reqs)) < 1e-5
    mgr.close()


@pytest.mark.parametrize("compile_layers", [False, True], ids=["eager_layers", "compiled_layers"])
def test_cuda_graph_replay_matches_eager_and_reference(compile_layers):
    cfg = cuda_pipeline_model("float32")
    torch.backends.cuda.matmul.allow_tf32 = False
    buckets = (128, 256, 512)  # 3 layers x 3 buckets = 9 compiles: past Dynamo's default limit of 8

    def build():
        kv = KVCacheConfig.for_model(cfg, page_size=16, num_pages=128, chunk_tokens=32, host_capacity_bytes=32 << 20)
        return RankingEngine(InferenceRankingGR(cfg, device="cuda"), AsyncKVCacheManager(kv, device="cuda"))

    graphed, eager = build(), build()
    torch._dynamo.reset()
    counters.clear()
    graphed.enable_cuda_graphs(max_batch=4, buckets=buckets, compile=compile_layers)
    if compile_layers:  # every (layer, bucket) compiled, none skipped at the recompile limit
        assert counters["stats"]["unique_graphs"] == cfg.num_layers * len(buckets), dict(counters["stats"])
    book_g, book_e = HistoryBook(cfg, seed=8), HistoryBook(cfg, seed=8)
    for step in range(12):
        users = [step % 5, 5 + step % 3] if step % 4 else [1, 2, 3, 4, 6]  # 5 users: eager fallback
        new = 3 + step % 6
        rg = [book_g.request(u, new, 20) for u in users]
        re = [book_e.request(u, new, 20) for u in users]
        out_g, out_e = graphed.forward(rg), eager.forward(re)
        assert rel_err(out_g, out_e) < 1e-5
        assert rel_err(out_g, graphed.forward_no_cache(rg)) < 1e-5
    assert graphed.graphs.replays >= 8
    if compile_layers:  # serving never compiled: eager fallbacks ran the eager layers
        assert counters["stats"]["unique_graphs"] == cfg.num_layers * len(buckets)
    graphed.close()
    eager.close()


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_rerank_of_unchanged_histories_on_cuda_computes_only_candidates(cuda_graphs):
    cfg = cuda_pipeline_model("float32")
    torch.backends.cuda.matmul.allow_tf32 = False
    kv = KVCacheConfig.for_model(cfg, page_size=16, num_pages=128, chunk_tokens=32, host_capacity_bytes=32 << 20,
                                 on_no_new_tokens="candidates")
    engine = RankingEngine(InferenceRankingGR(cfg, device="cuda"), AsyncKVCacheManager(kv, device="cuda"))
    if cuda_graphs:
        engine.enable_cuda_graphs(max_batch=4, buckets=(128, 512))
    book = HistoryBook(cfg, seed=11)
    first = [book.request(u, 31 if u == 0 else 20 + 7 * u, 16) for u in range(3)]  # user 0: 64 tokens
    engine.forward(first)
    rng = np.random.default_rng(12)

    def rerank(r):
        cands = rng.integers(0, cfg.num_items, 16)
        return RankingRequest.create(r.user_id, r.item_ids, r.actions, r.timestamps, cands, r.contextual, cfg)

    for batch in ([rerank(first[0]), book.request(1, 3, 16), rerank(first[2])], [rerank(r) for r in first]):
        out = engine.rank(batch)
        logits = torch.cat([o.logits for o in out])
        assert rel_err(logits, engine.forward_no_cache(batch)) < 1e-5
        assert out[0].computed_tokens == 16 and out[0].cached_tokens == cfg.history_tokens(31)
    engine.cache.drain()
    engine.cache.evict_gpu([0])  # the host tier holds user 0's whole history (two 32-token chunks)
    batch = [rerank(first[0])]
    (out,) = engine.rank(batch)
    assert rel_err(out.logits, engine.forward_no_cache(batch)) < 1e-5
    assert (out.cached_tokens, out.computed_tokens) == (64, 16), "onloaded whole, candidates computed"
    engine.close()


@pytest.mark.parametrize("host_format", ["kv", "hidden"])
@pytest.mark.parametrize(
    "cuda_graphs, in_graph, logits_by_kernel",
    [(False, False, False), (True, False, False), (True, True, False), (True, False, True)],
    ids=["eager", "cuda_graphs", "waits_in_graph", "logits_by_kernel"],
)
def test_pipelined_batches_with_eviction_and_prefetch_match_no_cache(
    cuda_graphs, in_graph, logits_by_kernel, host_format, monkeypatch
):
    """rank_async launches up to three batches before reading the first: pages freed by one batch
    (evicted, invalidated, prefetched into) must not be overwritten while an earlier launched batch
    still reads them (finish() commits before the onload lands; an onload waits only for the last
    batch that used its pages). Every batch's logits equal the no-cache model's (fp32). in_graph:
    the layers' onload waits inside one whole-forward replay (HSTU_ONLOAD_IN_GRAPH);
    logits_by_kernel: the logits written to pinned memory by a kernel (HSTU_LOGITS_OUT=kernel)."""
    from collections import deque

    from hstu.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "_ONLOAD_IN_GRAPH", in_graph)
    monkeypatch.setattr(engine_module, "_LOGITS_BY_KERNEL", logits_by_kernel)

    cfg = cuda_pipeline_model("float32")
    torch.backends.cuda.matmul.allow_tf32 = False
    kv = KVCacheConfig.for_model(cfg, page_size=16, num_pages=160, chunk_tokens=32)
    kv = KVCacheConfig.for_model(cfg, page_size=16, num_pages=160, chunk_tokens=32, host_capacity_bytes=200 * kv.chunk_bytes,
                                 host_format=host_format)
    engine = RankingEngine(InferenceRankingGR(cfg, device="cuda"), AsyncKVCacheManager(kv, device="cuda"))
    if cuda_graphs:
        engine.enable_cuda_graphs(max_batch=5, buckets=(256, 1024))
    book = HistoryBook(cfg, seed=21)
    pending, done = deque(), []
    batches = book.random_batches(seed=22, rounds=50, num_users=30, max_users=5, new_events=(4, 60), candidates=(8, 48))
    for step, reqs in enumerate(batches):
        for r in reqs:
            if len(book.histories[r.user_id][0]) > 500:
                book.histories.pop(r.user_id)
        pending.append((reqs, engine.rank_async(reqs)))
        if step % 5 == 2:
            engine.prefetch(list(range(30)))
        if len(pending) > 3:
            reqs, launched = pending.popleft()
            done.append((reqs, launched.result()))
    done += [(reqs, launched.result()) for reqs, launched in pending]
    engine.cache.drain()
    stats = engine.cache.stats.snapshot()
    for reqs, outputs in done:
        assert all(o.logits.device.type == "cpu" for o in outputs)
        logits = torch.cat([o.logits for o in outputs]).cuda()
        assert rel_err(logits, engine.forward_no_cache(reqs)) < 1e-5
    assert stats["gpu_evictions"] > 0 and stats["host_hits"] > 0, stats
    if cuda_graphs and host_format == "hidden":  # the onloads' rebuilds replayed their CUDA graphs
        assert engine.cache.transfers.rebuild_graphs.replays > 0
    if in_graph:
        assert engine.graphs.waited_replays > 0 and engine.graphs.segmented_replays == 0
    engine.close()


def test_captured_rebuilds_follow_weights_loaded_after_capture():
    """The rebuild graphs read the live uvqk weights (views): after load_state_dict (in place) an
    onloaded hidden chunk is rebuilt with the new weights, so answers still equal the no-cache model's."""
    cfg = cuda_pipeline_model("float32")
    torch.backends.cuda.matmul.allow_tf32 = False
    kv = KVCacheConfig.for_model(cfg, page_size=16, num_pages=160, chunk_tokens=32, host_capacity_bytes=64 << 20,
                                 host_format="hidden")
    engine = RankingEngine(InferenceRankingGR(cfg, device="cuda"), AsyncKVCacheManager(kv, device="cuda"))
    engine.enable_cuda_graphs(max_batch=2, buckets=(256,))
    engine.model.load_state_dict(InferenceRankingGR(cfg, device="cuda").state_dict())  # other weights, same tensors
    book = HistoryBook(cfg, seed=9)
    first = [book.request(u, 40, 16) for u in (0, 1)]  # 82 tokens each: two hidden chunks
    engine.rank(first)
    engine.cache.drain()
    engine.cache.evict_gpu([0, 1])
    batch = [book.request(u, 3, 16) for u in (0, 1)]
    out = engine.rank(batch)
    assert rel_err(torch.cat([o.logits for o in out]).cuda(), engine.forward_no_cache(batch)) < 1e-5
    stats = engine.cache.stats.snapshot()
    assert stats["hidden_chunks_onloaded"] == 4 and engine.cache.transfers.rebuild_graphs.replays == cfg.num_layers
    engine.close()
