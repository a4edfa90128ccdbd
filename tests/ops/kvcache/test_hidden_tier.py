"""host_format "hidden": host chunks of layer inputs, rebuilt into K/V when onloaded.

The oracle holds through every path a hidden chunk takes (offload from a batch that computed it
whole, onload with the rebuild, mixed with K/V chunks, splits, prefetch, failures), the chunks move
at hidden_dim values a token and layer, and chunks a batch did not compute whole stay K/V."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hstu.engine import RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.ops.kvcache.planner import FixedSplit
from hstu.ops.kvcache.rebuild_graphs import RebuildGraphs, chunk_buckets


def _engine(config, onload_fault=None, **kv) -> RankingEngine:
    params = dict(page_size=4, num_pages=64, chunk_tokens=8, host_capacity_bytes=1 << 22, host_format="hidden")
    params.update(kv)
    cache = AsyncKVCacheManager(KVCacheConfig.for_model(config, **params), onload_fault=onload_fault)
    return RankingEngine(InferenceRankingGR(config), cache)


def _check(engine, requests):
    out = engine.rank(requests)
    torch.testing.assert_close(
        torch.cat([o.logits for o in out]), engine.forward_no_cache(requests), rtol=1e-5, atol=1e-6
    )
    return out


def test_a_chunk_computed_whole_goes_to_the_host_as_layer_inputs_and_comes_back_as_kv(tiny_config, book):
    engine = _engine(tiny_config)
    mgr, kv = engine.cache, engine.cache.config
    assert kv.hidden_chunk_bytes * 2 == kv.chunk_bytes  # D = H * d: half the bytes
    _check(engine, [book.request(1, 12)])  # 26 tokens: three 8-token chunks computed whole
    mgr.drain()
    stats = mgr.stats.snapshot()
    assert stats["hidden_chunks_offloaded"] == 3 and stats["bytes_offloaded"] == 3 * kv.hidden_chunk_bytes
    mgr.evict_gpu([1])
    (out,) = _check(engine, [book.request(1, 2)])
    stats = mgr.stats.snapshot()
    assert out.cached_tokens == 24 and stats["host_hits"] == 1
    assert stats["hidden_chunks_onloaded"] == 3 and stats["bytes_onloaded"] == 3 * kv.hidden_chunk_bytes
    mgr.drain()
    assert mgr.host.pin_count(1) == 0 and mgr.gpu.pin_count(1) == 0
    engine.close()


@pytest.mark.parametrize("tail_bytes", [0, 1 << 20], ids=["no tails", "tails"])
def test_a_chunk_completed_across_forwards_is_hidden_only_with_its_tail(tiny_config, book, tail_bytes):
    """Chunk 1 (tokens 8-15) fills over two forwards: with the first forward's partial rows kept
    (a tail) it goes to the host as layer inputs; without, as K/V from the pages. Both formats onload
    together."""
    engine = _engine(tiny_config, hidden_tail_bytes=tail_bytes)
    mgr, kv = engine.cache, engine.cache.config
    _check(engine, [book.request(1, 3)])  # 8 tokens: chunk 0 computed whole -> hidden
    _check(engine, [book.request(1, 3)])  # 14: no chunk full; tokens 8-13 kept as a tail
    _check(engine, [book.request(1, 3)])  # 20: chunk 1 completed from the tail
    mgr.drain()
    stats = mgr.stats.snapshot()
    hidden = 2 if tail_bytes else 1
    assert stats["hidden_chunks_offloaded"] == hidden
    assert stats["bytes_offloaded"] == hidden * kv.hidden_chunk_bytes + (2 - hidden) * kv.chunk_bytes
    assert list(mgr.transfers.slot_hidden[mgr.host.lookup(1)[0]]) == [True, bool(tail_bytes)]
    mgr.evict_gpu([1])
    (out,) = _check(engine, [book.request(1, 2)])
    assert out.cached_tokens == 16 and mgr.stats.snapshot()["hidden_chunks_onloaded"] == hidden
    engine.close()


def test_a_tail_is_taken_only_by_the_prefix_it_ends():
    from hstu.ops.kvcache.hidden_tier import HiddenTails, _Tail

    tails = HiddenTails(1 << 20, 2, 8, 4, torch.float32, torch.device("cpu"))
    slot = tails.allocate()
    tails.put(1, _Tail(slot, 1, 6, b"digest of 14"))  # tokens 8-13
    assert tails.take(1, 14, b"another history") is None and len(tails) == 0  # dropped, slot freed
    tails.put(1, _Tail(tails.allocate(), 1, 6, b"digest of 14"))
    assert tails.take(1, 12, b"digest of 14") is None  # ends elsewhere
    tails.put(1, _Tail(tails.allocate(), 1, 6, b"digest of 14"))
    assert tails.take(1, 14, b"digest of 14").rows == 6 and len(tails) == 0


def test_another_history_of_the_user_recomputes_and_matches(tiny_config, book):
    from tests.conftest import HistoryBook

    engine = _engine(tiny_config)
    mgr = engine.cache
    _check(engine, [book.request(1, 3)])  # 8 tokens
    _check(engine, [book.request(1, 3)])  # 14: a tail of tokens 8-13
    _check(engine, [HistoryBook(tiny_config, seed=9).request(1, 7)])  # another history: recomputed
    _check(engine, [book.request(1, 3)])  # the first one again (20 tokens): recomputed
    mgr.drain()
    assert mgr.stats.snapshot()["invalidations"] >= 2
    mgr.evict_gpu([1])
    _check(engine, [book.request(1, 1)])
    engine.close()


def test_tails_stay_within_their_byte_budget(tiny_config, book):
    kv = KVCacheConfig.for_model(tiny_config, page_size=4, chunk_tokens=8)
    slot_bytes = kv.num_layers * 8 * kv.hidden_dim * kv.element_size  # one chunk of layer inputs
    engine = _engine(tiny_config, hidden_tail_bytes=2 * slot_bytes + 7)
    for u in range(4):
        _check(engine, [book.request(u, 7)])  # 16 tokens: 2 chunks, no tail
        _check(engine, [book.request(u, 3)])  # 22: a tail of 6 rows
    tails = engine.cache._tails
    assert tails.num_slots == 2 and len(tails) == 2 and tails.buffer.numel() * 4 == 2 * slot_bytes
    for u in (2, 3):  # the two most recent users' tails complete their chunks
        _check(engine, [book.request(u, 1)])
    engine.cache.drain()
    assert engine.cache.stats.snapshot()["hidden_chunks_offloaded"] == 4 * 2 + 2
    engine.close()


def test_many_users_with_evictions_match_the_no_cache_model(tiny_config, book):
    """Returning users in random batches through a GPU tier too small for them: GPU hits, host
    hits of both formats, misses; every answer equals the no-cache model's."""
    engine = _engine(tiny_config, num_pages=96)
    for batch in book.random_batches(seed=3, rounds=30, num_users=12, max_users=4, new_events=(1, 6), candidates=(1, 5)):
        _check(engine, batch)
    stats = engine.cache.stats.snapshot()
    assert stats["host_hits"] > 0 and stats["hidden_chunks_onloaded"] > 0 and stats["gpu_evictions"] > 0
    engine.close()


@pytest.mark.parametrize("host_split", ["load_front", "compute_front"])
@pytest.mark.parametrize("onload_chunks", [1, 2])
def test_split_hidden_prefixes_match_the_no_cache_model(tiny_config, book, host_split, onload_chunks):
    engine = _engine(tiny_config, num_pages=128, host_split=host_split)
    mgr = engine.cache
    _check(engine, [book.request(1, 11)])  # 24 tokens: three hidden chunks
    mgr.drain()
    mgr.evict_gpu([1])
    mgr.cost_model = FixedSplit(onload_chunks / 3)
    (out,) = _check(engine, [book.request(1, 2)])
    assert out.cached_tokens == onload_chunks * 8
    assert mgr.stats.snapshot()["hidden_chunks_onloaded"] == onload_chunks
    mgr.cost_model = None
    mgr.drain()
    (again,) = _check(engine, [book.request(1, 2)])
    assert again.cached_tokens == 28
    engine.close()


def test_a_prefetched_hidden_user_is_a_gpu_hit(tiny_config, book):
    engine = _engine(tiny_config)
    mgr = engine.cache
    _check(engine, [book.request(1, 12)])
    mgr.drain()
    mgr.evict_gpu([1])
    assert engine.prefetch([1]) == 1
    mgr.drain()
    (out,) = _check(engine, [book.request(1, 2)])
    stats = mgr.stats.snapshot()
    assert out.cached_tokens == 24
    assert stats["prefetch_hits"] == 1 and stats["hidden_chunks_onloaded"] == 3
    engine.close()


def test_a_failed_rebuild_recomputes_the_user(tiny_config, book, monkeypatch):
    engine = _engine(tiny_config)
    mgr = engine.cache
    _check(engine, [book.request(1, 12)])
    mgr.drain()
    mgr.evict_gpu([1])

    def broken(layer, x):
        raise RuntimeError("rebuild failed")

    monkeypatch.setattr(mgr.transfers, "kv_rebuilder", broken)
    out = _check(engine, [book.request(1, 2), book.request(2, 3)])
    stats = mgr.stats.snapshot()
    assert out[0].cached_tokens == 0 and stats["onload_failures"] == 1 and stats["recomputes"] == 1
    mgr.drain()
    assert mgr.host.pin_count(1) == 0 and mgr.gpu.pin_count(1) == 0
    engine.close()


def test_users_not_admitted_keep_no_layer_inputs(tiny_config, book):
    """offload_min_seen=2: a user's first batch neither keeps its layer inputs nor offloads."""
    engine = _engine(tiny_config, offload_min_seen=2)
    mgr = engine.cache
    plan = mgr.plan([1], [26], [book.request(1, 12).identity(engine.model.identity)], [3])
    assert plan.hidden_chunks == {}
    mgr.abort(plan)
    engine.close()


def test_graph_buckets_keep_layer_inputs_for_the_hidden_chunks(tiny_config, book):
    """A batch that fits a bucket replays it and still offloads hidden chunks: the replay copies each
    layer's input into the graphs' shared buffer, and finish gathers them before the next replay."""
    engine = _engine(tiny_config, num_pages=256)
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96), capture=False)
    mgr = engine.cache
    _check(engine, [book.request(1, 12), book.request(2, 15)])  # 26 and 32 tokens: 3 + 4 chunks
    _check(engine, [book.request(3, 12), book.request(1, 1)])  # the next replay: user 3's 3 chunks
    mgr.drain()
    assert engine.graphs.replays == 2 and mgr.stats.snapshot()["hidden_chunks_offloaded"] == 10
    mgr.evict_gpu([1, 2, 3])
    _check(engine, [book.request(u, 1) for u in (1, 2, 3)])
    assert mgr.stats.snapshot()["hidden_chunks_onloaded"] == 10
    assert mgr.transfers.rebuild_graphs.replays == tiny_config.num_layers  # one onload, rebuilt by its bucket
    engine.close()


def test_hidden_format_checks_its_dimensions(tiny_config):
    with pytest.raises(ValueError, match="hidden_dim must lie in"):
        KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, host_format="hidden", hidden_dim=32)
    with pytest.raises(ValueError, match="host_format must be"):
        KVCacheConfig(num_layers=2, num_heads=2, head_dim=4, host_format="hiddn")
    cache = AsyncKVCacheManager(KVCacheConfig(num_layers=2, num_heads=2, head_dim=16, host_format="hidden", hidden_dim=8))
    with pytest.raises(ValueError, match="hidden_dim 8 must equal the model's embedding_dim 32"):
        RankingEngine(InferenceRankingGR(tiny_config), cache)
    cache.close()


def test_a_calibrated_planner_counts_layer_input_bytes_and_stays_correct(tiny_config, book):
    engine = _engine(tiny_config, num_pages=128)
    cost = engine.calibrate()
    if cost is not None:  # a CPU too noisy to fit leaves the planner off
        assert cost.hidden_bytes_per_token_layer == tiny_config.embedding_dim * 4
    mgr = engine.cache
    _check(engine, [book.request(u, 11 + u) for u in (1, 2, 3)])
    mgr.drain()
    mgr.evict_gpu([1, 2, 3])
    _check(engine, [book.request(u, 2) for u in (1, 2, 3)])
    engine.close()


@pytest.mark.parametrize("host_format", ["kv", "hidden"])
def test_the_planner_prices_a_users_hidden_chunks_from_their_slots(tiny_config, book, host_format):
    """A link too slow for the prefix's K/V but fast enough for its layer inputs: the planner
    recomputes the K/V prefix and onloads (part of) the hidden one; both answers are the no-cache
    model's."""
    from hstu.ops.kvcache.planner import CostModel

    # (load_front: a front pass beside the K/V onload would beat recomputing it whole here)
    engine = _engine(tiny_config, num_pages=128, host_format=host_format, host_split="load_front")
    mgr, kv = engine.cache, engine.cache.config
    _check(engine, [book.request(1, 11)])  # 24 tokens: three chunks in the host tier
    mgr.drain()
    mgr.evict_gpu([1])
    token_kv = kv.page_bytes // kv.page_size  # 256 B a token and layer; layer inputs: 128 B
    mgr.cost_model = CostModel(
        h2d_bytes_per_s=24 * token_kv / 0.040, bytes_per_token_layer=token_kv, per_row_s=1e-3, per_pair_s=0.0,
        hidden_bytes_per_token_layer=kv.hidden_dim * kv.element_size if host_format == "hidden" else 0,
    )
    _check(engine, [book.request(1, 2)])
    onloaded = mgr.stats.snapshot()["tokens_onloaded"]
    assert (onloaded > 0) == (host_format == "hidden"), onloaded
    engine.close()


def test_rebuild_buckets_are_powers_of_two_up_to_the_most_chunks():
    assert chunk_buckets(1) == (1,)
    assert chunk_buckets(8) == (1, 2, 4, 8)
    assert chunk_buckets(20) == (1, 2, 4, 8, 16, 20)


def test_rebuild_token_index_pads_the_bucket_with_the_scratch_page(tiny_config):
    graphs = RebuildGraphs(lambda layer, x: (x, x), torch.zeros(2, 9, 2, 4, 1, 1), num_layers=2, chunk_tokens=4,
                           hidden_dim=1, max_chunks=4, scratch_page=8, capture=False)
    assert graphs.bucket(3) == 4 and graphs.bucket(5) is None
    graphs.set_tokens(np.array([5] * 4 + [6] * 4, dtype=np.int32), np.tile(np.arange(4, dtype=np.int32), 2), bucket=4)
    assert graphs.token_index[0].tolist() == [5] * 4 + [6] * 4 + [8] * 8
    assert graphs.token_index[1].tolist() == [0, 1, 2, 3] * 2 + [0] * 8


@pytest.mark.parametrize("max_chunks", [2, 16], ids=["some onloads too large for the graphs", "all in the graphs"])
def test_rebuilds_through_the_graph_buffers_match_the_no_cache_model(tiny_config, book, max_chunks):
    """The rebuild graphs' static path (uncaptured on CPU): rows copied into the bucket's buffer,
    padded rows appended to nowhere (the scratch page, skipped), onloads past the largest bucket
    rebuilt eagerly; with evictions, prefetches and several users a batch, every answer equals the
    no-cache model's."""
    engine = _engine(tiny_config, num_pages=96)
    mgr = engine.cache
    mgr.capture_rebuild_graphs(max_chunks, capture=False)
    users = list(range(12))
    for step, batch in enumerate(
        book.random_batches(seed=5, rounds=30, num_users=12, max_users=4, new_events=(1, 6), candidates=(1, 5))
    ):
        _check(engine, batch)
        if step % 4 == 1:  # every user back to the host tier only; some prefetched again
            mgr.drain()
            mgr.evict_gpu(users)
            if step % 8 == 5:
                engine.prefetch(users[:3])
    mgr.drain()
    stats = mgr.stats.snapshot()
    assert stats["hidden_chunks_onloaded"] > 0 and stats["prefetch_hits"] > 0 and stats["onload_failures"] == 0
    assert mgr.transfers.rebuild_graphs.replays > 0
    engine.close()


def test_graphs_without_a_host_tier_capture_no_rebuild(tiny_config, book):
    """The replay's uncached pass: host_format "hidden" but no host tier, so no hidden chunk is ever
    onloaded and enable_cuda_graphs captures no rebuild (it used to raise, on the H200, run CG)."""
    engine = _engine(tiny_config, num_pages=256, host_capacity_bytes=0)
    engine.enable_cuda_graphs(max_batch=2, buckets=(64,), capture=False)
    assert engine.cache.transfers.rebuild_graphs is None and engine.graphs.layer_inputs() is None
    assert not engine.cache.keeps_hidden and not engine.cache.capture_rebuild_graphs(4, capture=False)
    _check(engine, [book.request(1, 12), book.request(2, 3)])
    engine.close()


def test_a_rebuild_failing_after_others_went_through_the_graph_buffers_recomputes_and_the_next_onload_is_right(
    tiny_config, book, monkeypatch
):
    """Layer 1's rebuild fails after layer 0's replayed: the batch recomputes the user; the user's
    next onload rewrites the token index and rows and answers like the no-cache model."""
    engine = _engine(tiny_config)
    mgr = engine.cache
    mgr.capture_rebuild_graphs(8, capture=False)
    graphs = mgr.transfers.rebuild_graphs
    replay = graphs.replay
    failures = []

    def failing_once(layer, bucket):
        if layer == 1 and not failures:
            failures.append(layer)
            raise RuntimeError("injected rebuild failure")
        replay(layer, bucket)

    monkeypatch.setattr(graphs, "replay", failing_once)
    _check(engine, [book.request(1, 12), book.request(2, 15)])
    mgr.drain()
    mgr.evict_gpu([1, 2])
    out = _check(engine, [book.request(1, 2)])
    assert failures and out[0].cached_tokens == 0 and mgr.stats.snapshot()["onload_failures"] == 1
    mgr.drain()
    mgr.evict_gpu([1])
    out = _check(engine, [book.request(1, 1), book.request(2, 1)])
    assert [o.cached_tokens for o in out] == [24, 32]
    mgr.drain()
    assert mgr.host.pin_count(1) == 0 and mgr.gpu.pin_count(2) == 0
    engine.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager rebuilds", "graph rebuilds"])
def test_each_layers_rebuild_is_enqueued_just_before_the_layer(tiny_config, book, graphs):
    """Copies of every layer first, then layer i's rebuild right before layer i runs (not all
    rebuilds before the first layer: their enqueue held the GPU idle, run CD)."""
    engine = _engine(tiny_config)
    mgr = engine.cache
    if graphs:
        mgr.capture_rebuild_graphs(8, capture=False)
    _check(engine, [book.request(1, 12)])
    mgr.drain()
    mgr.evict_gpu([1])
    order = []
    rebuild = mgr.transfers.kv_rebuilder
    layer_fns = []
    for i in range(tiny_config.num_layers):
        def run(x, kv, meta, i=i):
            order.append(("layer", i))
            return engine.model.block.paged_layer(i, x, kv, meta)
        layer_fns.append(run)

    def recording(layer, x):
        order.append(("rebuild", layer))
        return rebuild(layer, x)

    if graphs:
        mgr.transfers.rebuild_graphs.rebuild = recording
    else:
        mgr.transfers.kv_rebuilder = recording
    engine.layer_fns = layer_fns
    (out,) = _check(engine, [book.request(1, 2)])
    assert out.cached_tokens == 24
    expected = [entry for i in range(tiny_config.num_layers) for entry in (("rebuild", i), ("layer", i))]
    assert order[: 2 * tiny_config.num_layers] == expected
    engine.close()
