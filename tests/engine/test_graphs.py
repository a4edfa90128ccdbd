"""CUDA-graph metadata: a batch padded to its bucket replays correctly whichever attention backend
the graphs captured (the torch path reads q_batch and q_local, which Triton does not)."""

from __future__ import annotations

from dataclasses import fields
from unittest import mock

import numpy as np
import pytest
import torch

from hstu.ops.attention import paged_hstu_attention_torch
from hstu.ops.kvcache.layout import JaggedLayout
from hstu.ops.kvcache.metadata import _HOST_FIELDS, _PADDING, KVCacheMetadata, PadSpec
from tests.ops.paged_cases import make_paged_case, reference_fp64, rel_err


def test_every_metadata_field_has_a_padding_rule():
    tensor_fields = {f.name for f in fields(KVCacheMetadata)} - set(_HOST_FIELDS)
    assert set(_PADDING) == tensor_fields


def _padded(case, spec: PadSpec, page_size: int) -> KVCacheMetadata:
    m = case.meta
    pages = [m.page_indices[m.page_indptr[b] : m.page_indptr[b + 1]].tolist() for b in range(m.kv_lens.shape[0])]
    layout = JaggedLayout.build(m.kv_lens.tolist(), m.cached_lens.tolist(), _candidates(m))
    return KVCacheMetadata.from_layout(pages, layout, page_size, pad=spec)


def _candidates(m: KVCacheMetadata) -> list[int]:
    return [int(((m.q_batch == b) & (m.q_pos < 0)).sum()) for b in range(m.kv_lens.shape[0])]


def test_a_padded_batch_gives_the_torch_backend_exactly_its_rows():
    case = make_paged_case([40, 25, 9], [30, 0, 4], [3, 2, 5], page_size=16, seed=2)
    scratch = case.kv_cache.shape[1]  # one extra page that no user owns
    case.kv_cache = torch.cat([case.kv_cache, torch.randn_like(case.kv_cache[:, :1])], 1)
    T, rows = case.q.shape[0], 96
    padded = _padded(case, PadSpec(rows, max_batch=5, max_pages=8, scratch_page=scratch), 16)
    assert padded.max_q == rows and padded.q_batch.shape[0] == rows and padded.kv_lens.shape[0] == 5
    g = torch.Generator().manual_seed(9)
    pad = lambda t: torch.cat([t, torch.randn((rows - T, *t.shape[1:]), generator=g)])  # noqa: E731
    out = paged_hstu_attention_torch(
        pad(case.q), pad(case.k), pad(case.v), case.kv_cache, case.layer, padded.page_table, padded.kv_lens,
        padded.q_batch, padded.q_local, padded.q_pos, padded.max_q, case.scale_len,
    )
    assert rel_err(out[:T], reference_fp64(case)) < 1e-5


def test_buckets_with_equal_specs_share_one_packed_layout():
    spec = PadSpec(rows=64, max_batch=4, max_pages=6, scratch_page=99)
    a = KVCacheMetadata.padded_empty(spec, page_size=16)
    b = _padded(make_paged_case([40, 25], [30, 0], [3, 2], page_size=16), spec, 16)
    assert a.layout_key == b.layout_key, "one copy of the packed buffer refreshes the bucket"


def test_metadata_larger_than_the_bucket_is_rejected():
    case = make_paged_case([40, 25], [30, 0], [3, 2], page_size=16)
    with pytest.raises(ValueError, match="q_batch has 40 entries; the bucket holds 8"):
        _padded(case, PadSpec(rows=8, max_batch=2, max_pages=4, scratch_page=0), 16)


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


def _static_engine(config, host_bytes: int = 1 << 20, onload_fault=None, **kv_options):
    from hstu.engine import RankingEngine
    from hstu.model.ranking import InferenceRankingGR
    from hstu.ops.kvcache.config import KVCacheConfig
    from hstu.ops.kvcache.manager import AsyncKVCacheManager

    kv = KVCacheConfig.for_model(
        config, page_size=4, num_pages=256, chunk_tokens=8, host_capacity_bytes=host_bytes, **kv_options
    )
    return RankingEngine(InferenceRankingGR(config), AsyncKVCacheManager(kv, onload_fault=onload_fault))


def test_the_static_forward_path_matches_no_cache_through_hits_onloads_and_fallbacks(tiny_config, book):
    """The whole-forward graph path without CUDA (capture=False replays eagerly over the same
    static, padded buffers): whole replays for GPU hits and misses, segmented replays with the
    per-layer onload waits for host-tier users, eager fallbacks for batches that fit no bucket."""
    engine = _static_engine(tiny_config)
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96), capture=False)
    for step in range(8):
        users = [(step + u) % 5 for u in range(3)] if step % 3 else [0, 1, 2, 3]  # 4 users: eager
        reqs = [book.request(u, 2 + step % 4, 2 + u) for u in users]
        if step == 5:
            engine.cache.drain()
            engine.cache.evict_gpu(users[:2])  # onloaded from the host tier, layer by layer
        out = engine.forward(reqs)
        torch.testing.assert_close(out, engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    graphs = engine.graphs
    assert graphs.replays >= 4 and graphs.segmented_replays >= 1
    assert engine.cache.stats.snapshot()["host_hits"] >= 1
    engine.close()



def _hits_and_recomputed_evictions_match_no_cache(engine, book, rtol: float, atol: float) -> None:
    """Four batches of three users, GPU hits and misses, two users evicted before the third (a cache
    with no host tier recomputes them), each equal to the no-cache model."""
    for step in range(4):
        users = [(step + u) % 4 for u in range(3)]
        reqs = [book.request(u, 2 + step, 2 + u) for u in users]
        if step == 2:
            engine.cache.drain()
            engine.cache.evict_gpu(users[:2])  # nowhere to onload from: recomputed
        got = engine.forward(reqs)
        torch.testing.assert_close(got, engine.forward_no_cache(reqs).to(got.device), rtol=rtol, atol=atol)


def test_a_cache_without_a_host_tier_captures_only_the_whole_forward(tiny_config, book):
    """No host slot, no onload: the segments, waited graphs and projection buffers would never be
    read, so none are made; GPU hits, evicted users (recomputed) and misses all replay `whole` and
    match the no-cache model. A batch asking for per-layer waits there is refused by name."""
    engine = _static_engine(tiny_config, host_bytes=1)  # less than one chunk: no host slot
    assert engine.cache.config.host_slots == 0
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96), capture=False)
    graphs = engine.graphs
    assert not graphs.onloads and not graphs.waits_in_graph and graphs._projections == []
    assert all(not b.segments and not b.waited for b in graphs._buckets.values())
    _hits_and_recomputed_evictions_match_no_cache(engine, book, rtol=1e-5, atol=1e-6)
    assert graphs.replays == 4 and graphs.segmented_replays == 0
    plan = engine._plan([book.request(0, 6, 2)])
    prepared = engine.cache.wait(plan)
    with pytest.raises(RuntimeError, match="captured without onload segments"):
        graphs.run(plan.pad, prepared.metadata, 1, before_layer=lambda layer: None)
    engine.cache.abort(plan)
    engine.close()


@pytest.mark.cuda
def test_captured_graphs_without_a_host_tier_match_no_cache_on_cuda(tiny_config, book):
    """The captured counterpart: only `whole` graphs, GPU hits and evicted (recomputed) users."""
    from hstu.engine import RankingEngine
    from hstu.model.ranking import InferenceRankingGR
    from hstu.ops.kvcache.config import KVCacheConfig
    from hstu.ops.kvcache.manager import AsyncKVCacheManager

    torch.backends.cuda.matmul.allow_tf32 = False
    kv = KVCacheConfig.for_model(tiny_config, page_size=4, num_pages=256, chunk_tokens=8, host_capacity_bytes=1)
    engine = RankingEngine(InferenceRankingGR(tiny_config, "cuda"), AsyncKVCacheManager(kv, "cuda"))
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96))
    assert not engine.graphs.onloads and all(not b.segments for b in engine.graphs._buckets.values())
    _hits_and_recomputed_evictions_match_no_cache(engine, book, rtol=1e-4, atol=1e-5)
    assert engine.graphs.replays == 4
    engine.close()


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("host_format", ["kv", "hidden"])
def test_segments_wait_for_a_layers_onload_after_its_projection(tiny_config, book, monkeypatch, split, host_format):
    """A host-tier batch's segments are cut after each layer's input projection, which reads no
    cached K/V: layer i's onload wait comes after projection i is enqueued (so it runs while the
    layer's pages land) and before anything of layer i reads the cache; HSTU_SPLIT_SEGMENTS=0 cuts
    at layer boundaries (the wait before the projection). Outputs equal the no-cache model's."""
    from hstu.engine import graphs as graphs_module
    from hstu.model.hstu_layer import HSTULayer
    from hstu.ops.kvcache.batch import PreparedBatch

    monkeypatch.setattr(graphs_module, "SPLIT_SEGMENTS", split)
    engine = _static_engine(tiny_config, host_format=host_format)
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96), capture=False)
    assert engine.graphs.split_layers == split
    events: list[tuple[str, int]] = []
    layers = list(engine.model.block.layers)
    projection, ready = HSTULayer.projection, PreparedBatch.ready

    def logged_projection(self, x, out=None):
        if self in layers:  # (the no-cache reference's and the K/V rebuild's projections are not the batch's)
            events.append(("project", layers.index(self)))
        return projection(self, x, out)

    def logged_ready(self, layer):
        events.append(("wait", layer))
        return ready(self, layer)

    monkeypatch.setattr(HSTULayer, "projection", logged_projection)
    monkeypatch.setattr(PreparedBatch, "ready", logged_ready)
    users = [0, 1, 2]
    reqs = [book.request(u, 3, 2 + u) for u in users]
    engine.forward(reqs)
    engine.cache.drain()
    engine.cache.evict_gpu(users[:2])  # onloaded from the host tier
    reqs = [book.request(u, 5, 2 + u) for u in users]
    events.clear()
    out = engine.forward(reqs)
    L = tiny_config.num_layers
    if split:
        expected = [e for i in range(L) for e in (("project", i), ("wait", i))]
    else:
        expected = [e for i in range(L) for e in (("wait", i), ("project", i))]
    assert events[: 2 * L] == expected
    assert engine.graphs.segmented_replays == 1 and len(engine.graphs._buckets[32].segments) == L + split
    torch.testing.assert_close(out, engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize("host_format", ["kv", "hidden"])
def test_onload_waits_inside_one_replay_match_no_cache(tiny_config, book, monkeypatch, host_format):
    """HSTU_ONLOAD_IN_GRAPH: a batch that onloads enqueues every layer's onload, then replays the
    whole forward once with the layers' waits inside (capture=False: the same control flow, no
    events), instead of a segment a layer; outputs still equal the no-cache model's."""
    from hstu.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "_ONLOAD_IN_GRAPH", True)
    engine = _static_engine(tiny_config, host_format=host_format)
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96), capture=False)
    for step in range(6):
        users = [(step + u) % 4 for u in range(3)]
        reqs = [book.request(u, 2 + step % 3, 2 + u) for u in users]
        if step in (3, 5):
            engine.cache.drain()
            engine.cache.evict_gpu(users[:2])
        torch.testing.assert_close(engine.forward(reqs), engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    graphs = engine.graphs
    assert graphs.waited_replays >= 2 and graphs.segmented_replays == 0
    stats = engine.cache.stats.snapshot()
    assert stats["host_hits"] >= 2 and (stats["hidden_chunks_onloaded"] > 0) == (host_format == "hidden")
    engine.close()


@pytest.mark.parametrize("host_format", ["kv", "hidden"])
def test_onload_waits_inside_one_replay_after_a_front_pass(tiny_config, book, monkeypatch, host_format):
    """HSTU_ONLOAD_IN_GRAPH with host_split "compute_front": the front pass starts the onload with
    the main pass's event set already attached, and the main pass replays once."""
    from hstu.engine import engine as engine_module
    from hstu.ops.kvcache.planner import FixedSplit

    monkeypatch.setattr(engine_module, "_ONLOAD_IN_GRAPH", True)
    engine = _static_engine(tiny_config, host_split="compute_front", host_format=host_format)
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96), capture=False)
    engine.rank([book.request(u, 11, 2) for u in (1, 2)])  # 24 tokens each: three chunks
    engine.cache.drain()
    engine.cache.evict_gpu([1, 2])
    engine.cache.cost_model = FixedSplit(1 / 3)  # the last chunk onloaded, 16 tokens recomputed in front
    reqs = [book.request(1, 1, 2), book.request(2, 1, 3)]
    outs = engine.rank(reqs)
    torch.testing.assert_close(torch.cat([o.logits for o in outs]), engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    assert [o.cached_tokens for o in outs] == [8, 8]
    assert engine.graphs.waited_replays == 1 and engine.graphs.segmented_replays == 0
    engine.close()


@pytest.mark.cuda
@pytest.mark.parametrize("host_split", ["load_front", "compute_front"])
@pytest.mark.parametrize("host_format", ["kv", "hidden"])
def test_onload_waits_inside_captured_graphs_match_no_cache_on_cuda(tiny_config, book, monkeypatch, host_split, host_format):
    """The captured waited graphs (external events, HSTU_ONLOAD_IN_GRAPH) against the no-cache model,
    for batches that onload from the host tier, repeated past the number of event sets."""
    from hstu.engine import RankingEngine
    from hstu.engine import engine as engine_module
    from hstu.model.ranking import InferenceRankingGR
    from hstu.ops.kvcache.config import KVCacheConfig
    from hstu.ops.kvcache.manager import AsyncKVCacheManager
    from hstu.ops.kvcache.planner import FixedSplit

    monkeypatch.setattr(engine_module, "_ONLOAD_IN_GRAPH", True)
    torch.backends.cuda.matmul.allow_tf32 = False
    kv = KVCacheConfig.for_model(tiny_config, page_size=4, num_pages=256, chunk_tokens=8, host_capacity_bytes=1 << 20,
                                 host_split=host_split, host_format=host_format)
    engine = RankingEngine(InferenceRankingGR(tiny_config, "cuda"), AsyncKVCacheManager(kv, "cuda"))
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96))
    if host_split == "compute_front":
        engine.cache.cost_model = FixedSplit(1 / 3)
    for step in range(6):
        users = (10 * step + 1, 10 * step + 2)
        engine.rank([book.request(u, 11, 2) for u in users])
        engine.cache.drain()
        engine.cache.evict_gpu(list(users))
        reqs = [book.request(u, 1, 2 + k) for k, u in enumerate(users)]
        outs = engine.rank(reqs)
        got = torch.cat([o.logits for o in outs])
        torch.testing.assert_close(got, engine.forward_no_cache(reqs).to(got.device), rtol=1e-4, atol=1e-5)
    assert engine.graphs.waited_replays == 6 and engine.graphs.segmented_replays == 0
    engine.close()


def test_staging_slots_hand_out_their_own_inputs_and_a_foreign_slot_is_not_staged(tiny_config):
    """pad_spec names the slot it hands out, with that slot's inputs region (views made at
    capture, over its staging buffer); stage() copies only a spec whose slot is the bucket's."""
    import dataclasses

    engine = _static_engine(tiny_config)
    engine.enable_cuda_graphs(max_batch=3, buckets=(32,), capture=False)
    graphs = engine.graphs
    specs = [graphs.pad_spec(20, 2) for _ in range(3)]
    assert [s.slot for s in specs] == [0, 1, 2]
    for spec in specs:
        inputs = graphs.inputs_of(spec)
        start = spec.staging.data_ptr()
        assert inputs.shape == (5, 32) and start < inputs.data_ptr() < start + spec.staging.numel()
    elsewhere = KVCacheMetadata.padded_empty(dataclasses.replace(specs[0], staging=None), 4)
    in_slot = KVCacheMetadata.padded_empty(specs[0], 4)  # packed into slot 0's staging buffer
    with torch.inference_mode():
        assert not graphs.stage(specs[0], elsewhere)  # not packed into the slot: never staged
        assert not graphs.stage(dataclasses.replace(specs[0], slot=1), in_slot)  # slot 1 is another buffer
        assert graphs.stage(specs[0], in_slot)
    with pytest.raises(ValueError, match="no inputs region"):
        graphs.inputs_of(PadSpec(32, 3, specs[0].max_pages, specs[0].scratch_page))
    engine.close()


@pytest.mark.parametrize(
    "buckets, kernel_stage, staged",
    [((32, 96), True, [32, 32]), ((12, 32), True, [32, 12]), ((12, 32), False, [12, 32]), ((12,), True, [12])],
    ids=["front and batch share a bucket", "each its own bucket (batch staged after the front's launch)",
         "each its own bucket, a copy engine stages (batch staged first)", "front eager"],
)
def test_front_passes_replay_from_their_own_staging_slot_and_match_no_cache(
    tiny_config, book, monkeypatch, buckets, kernel_stage, staged
):
    """host_split "compute_front" on the static graph path: the front pass (tokens 0..q-1 of each
    host-tier user, no candidates) replays its bucket, or runs eagerly when none fits, before the
    batch's segmented replay; a batch in a bucket of its own has its inputs staged after the front
    pass's launch when a kernel stages them (on the compute stream, behind the front pass anyway),
    and before the front's onload starts when a copy engine does (behind the copies, they would hold
    the batch's first layer). Answers equal the no-cache model's."""
    from hstu.engine.graphs import ForwardGraphs
    from hstu.ops.kvcache.planner import FixedSplit

    monkeypatch.setattr(ForwardGraphs, "onload_before_stage", property(lambda self: kernel_stage))
    engine = _static_engine(tiny_config, host_split="compute_front")
    engine.enable_cuda_graphs(max_batch=3, buckets=buckets, capture=False)
    engine.rank([book.request(u, 11, 2) for u in (1, 2)])  # 24 tokens each: three chunks
    engine.cache.drain()
    engine.cache.evict_gpu([1, 2])
    engine.cache.cost_model = FixedSplit(1 / 3)  # the last chunk onloaded, 16 tokens recomputed in front
    reqs = [book.request(1, 1, 2), book.request(2, 1, 3)]
    before, copies = engine.graphs.replays, []
    stage = engine.graphs.stage
    monkeypatch.setattr(engine.graphs, "stage", lambda pad, meta: copies.append(pad.rows) or stage(pad, meta))
    outs = engine.rank(reqs)
    torch.testing.assert_close(torch.cat([o.logits for o in outs]), engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    assert [o.cached_tokens for o in outs] == [8, 8]
    assert copies == staged, "bucket rows of each inputs copy, in order"
    assert engine.graphs.replays - before == len(staged), "the front pass, then the batch's"
    engine.close()


def _host_tier_batch(engine, book, split: float):
    """Users 1 and 2 with 24 cached tokens each (three chunks) in the host tier only, the planner
    fixed at onloading `split` of them; returns their next requests."""
    from hstu.ops.kvcache.planner import FixedSplit

    engine.rank([book.request(u, 11, 2) for u in (1, 2)])
    engine.cache.drain()
    engine.cache.evict_gpu([1, 2])
    engine.cache.cost_model = FixedSplit(split)
    return [book.request(1, 1, 2), book.request(2, 1, 3)]


def _record_onload_and_packing(engine, monkeypatch) -> list[str]:
    """The order in which the cache starts its onloads and packs metadata, from now on."""
    from hstu.ops.kvcache import manager

    events: list[str] = []
    onload_async, pack_layout = engine.cache.transfers.onload_async, manager.pack_layout
    transfers = engine.cache.transfers
    monkeypatch.setattr(transfers, "onload_async", lambda *a, **k: events.append("onload") or onload_async(*a, **k))
    monkeypatch.setattr(manager, "pack_layout", lambda *a, **k: events.append("pack") or pack_layout(*a, **k))
    return events


@pytest.mark.parametrize("host_split, split, order", [
    ("load_front", 1.0, ["onload", "pack"]),
    ("compute_front", 1 / 3, ["onload", "pack", "pack"]),  # (at reserve: its front pass's, then the batch's)
], ids=["onload", "front pass"])
@pytest.mark.parametrize("at_reserve", [True, False], ids=["at reserve", "after the plan"])
def test_a_graph_batchs_onload_starts_once_its_pages_are_reserved(
    tiny_config, book, monkeypatch, host_split, split, order, at_reserve
):
    """A graph-bucket batch's onload copies start as soon as its pages are reserved, before its
    metadata is packed, which they do not read (HSTU_ONLOAD_AT_RESERVE=0: after the whole plan, as
    before). Answers equal the no-cache model's either way."""
    from hstu.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "_ONLOAD_AT_RESERVE", at_reserve)
    engine = _static_engine(tiny_config, host_split=host_split)
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96), capture=False)
    reqs = _host_tier_batch(engine, book, split)
    events = _record_onload_and_packing(engine, monkeypatch)
    outs = engine.rank(reqs)
    torch.testing.assert_close(torch.cat([o.logits for o in outs]), engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    assert events == (order if at_reserve else order[1:] + order[:1])
    assert engine.cache.stats.snapshot()["host_hits"] == 2
    engine.close()


@pytest.mark.parametrize("front_first", [True, False], ids=["front first", "HSTU_FRONT_FIRST=0"])
def test_a_front_pass_launches_before_the_batchs_own_packing_and_its_later_copies(
    tiny_config, book, monkeypatch, front_first
):
    """compute_front with the onload at reserve: one layer's copies start at reserve, then the front
    pass's metadata is packed and the front pass launched, and only then the other layers' copies
    are enqueued and the batch's own metadata packed (HSTU_FRONT_FIRST=0: two layers' copies and
    both packings before the launch, as before). Answers equal the no-cache model's either way."""
    from hstu.ops.kvcache import manager

    monkeypatch.setattr(manager, "_FRONT_FIRST", front_first)
    engine = _static_engine(tiny_config, host_split="compute_front")
    engine.enable_cuda_graphs(max_batch=3, buckets=(12, 32), capture=False)
    reqs = _host_tier_batch(engine, book, 1 / 3)
    events: list[str] = []
    transfers, graphs = engine.cache.transfers, engine.graphs
    copy_layer, run, pack_layout = transfers._copy_layer, graphs.run, manager.pack_layout
    monkeypatch.setattr(transfers, "_copy_layer",
                        lambda parts, layer, s: events.append(f"copy {layer}") or copy_layer(parts, layer, s))
    monkeypatch.setattr(graphs, "run", lambda pad, *a, **k: events.append(f"run {pad.rows}") or run(pad, *a, **k))
    monkeypatch.setattr(manager, "pack_layout",
                        lambda p, layout, *a, **k: events.append(f"pack {layout.num_rows}") or pack_layout(p, layout, *a, **k))
    outs = engine.rank(reqs)
    torch.testing.assert_close(torch.cat([o.logits for o in outs]), engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    layers = [f"copy {i}" for i in range(tiny_config.num_layers)]
    front, batch = ["pack 32", "run 32"], ["pack 9", "run 12"]  # 16 tokens a user in front; the batch's 9 rows
    if front_first:
        assert events == layers[:1] + front + layers[1:] + batch
    else:
        assert events == layers[:2] + batch[:1] + front + layers[2:] + batch[1:]
    engine.close()


@pytest.mark.parametrize("host_split, split, failing", [("load_front", 1.0, 1), ("compute_front", 1 / 3, 2)],
                         ids=["in the plan", "the batch's own, after the front pass's launch"])
def test_a_batch_whose_packing_fails_after_its_onload_started_gives_everything_back(
    tiny_config, book, monkeypatch, host_split, split, failing
):
    """The metadata's packing raises after the onload started at reserve (in the plan, or, for a
    front pass's batch, in the forward: packed after the front's launch): rank() raises that error,
    the onload settles (its host pins dropped), the users' GPU pages are released, and the same
    batch then ranks correctly."""
    from hstu.ops.kvcache import manager

    engine = _static_engine(tiny_config, host_split=host_split)
    engine.enable_cuda_graphs(max_batch=3, buckets=(12, 32, 96), capture=False)
    reqs = _host_tier_batch(engine, book, split)
    events = _record_onload_and_packing(engine, monkeypatch)
    pack_layout = manager.pack_layout

    def fails_once(*args, **kwargs):
        out = pack_layout(*args, **kwargs)
        if events.count("pack") == failing:
            raise RuntimeError("packing failed")
        return out

    monkeypatch.setattr(manager, "pack_layout", fails_once)
    with pytest.raises(RuntimeError, match="packing failed"):
        engine.rank(reqs)
    assert events == ["onload"] + ["pack"] * failing
    engine.cache.drain()
    cache = engine.cache
    assert [(cache.gpu.pin_count(u), cache.host.pin_count(u)) for u in (1, 2)] == [(0, 0), (0, 0)]
    outs = engine.rank(reqs)
    torch.testing.assert_close(torch.cat([o.logits for o in outs]), engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    engine.close()


def test_static_inputs_pad_features_and_candidate_rows_to_the_bucket(tiny_config, book):
    from hstu.model.ranking import InferenceRankingGR
    from hstu.ops.kvcache.layout import JaggedLayout

    model = InferenceRankingGR(tiny_config)
    reqs = [book.request(0, 3, 2), book.request(1, 2, 4)]
    hist = [r.history_tokens(tiny_config) for r in reqs]
    layout = JaggedLayout.build(hist, [2, 0], [2, 4])
    stale = torch.full((5, 40), 7, dtype=torch.int64)  # a staging slot's previous batch
    inputs = model.static_inputs(reqs, layout, stale).numpy()
    T, M = layout.num_rows, layout.candidate_rows.shape[0]
    np.testing.assert_array_equal(inputs[:4, :T], model.preprocessor.features(reqs, [2, 0]))
    np.testing.assert_array_equal(inputs[4, :M], layout.candidate_rows)
    assert not inputs[:, T:].any() and not inputs[4, M:].any()
    with pytest.raises(ValueError, match=f"a batch of {T} rows does not fit a bucket of 8"):
        model.static_inputs(reqs, layout, torch.zeros((5, 8), dtype=torch.int64))


def test_logits_left_in_the_static_output_survive_a_retried_batch(tiny_config, book):
    """rank_async on CUDA takes a replayed batch's logits as views of the graph's static output
    (copied out on the stream before the next replay). A batch whose onload failed is ranked
    again (its failed users as misses, a whole replay, while the first was segmented); the
    engine copies the first replay's logits before the retry, and every user's logits are its own."""

    def fail_user_one(users, layer):
        if 1 in users:
            raise RuntimeError("injected onload failure")

    engine = _static_engine(tiny_config, onload_fault=fail_user_one)
    engine.enable_cuda_graphs(max_batch=3, buckets=(32, 96), capture=False)
    engine.rank([book.request(u, 6, 2) for u in (1, 2)])
    engine.cache.drain()
    engine.cache.evict_gpu([1])  # user 1 onloads from the host tier, and fails
    reqs = [book.request(1, 2, 2), book.request(2, 2, 3)]
    with torch.inference_mode():
        outputs, logits = engine._rank(reqs, owned=False)
    assert logits is None and engine.cache.stats.snapshot()["recomputes"] == 1
    torch.testing.assert_close(torch.cat([o.logits for o in outputs]), engine.forward_no_cache(reqs), rtol=1e-5, atol=1e-6)
    engine.close()


def test_compute_front_adds_a_bucket_for_a_batch_of_eights_front():
    from hstu.engine.engine import DEFAULT_GRAPH_BUCKETS, FRONT_GRAPH_BUCKET, default_graph_buckets

    assert default_graph_buckets() == DEFAULT_GRAPH_BUCKETS
    assert default_graph_buckets(host_split="compute_front")[-1] == FRONT_GRAPH_BUCKET > DEFAULT_GRAPH_BUCKETS[-1]
    assert FRONT_GRAPH_BUCKET not in default_graph_buckets(compile=True, host_split="compute_front")


def test_graph_buckets_from_the_environment(monkeypatch):
    from hstu.engine.engine import DEFAULT_GRAPH_BUCKETS, FRONT_GRAPH_BUCKET, default_graph_buckets

    assert all(b / a <= 1.5 for a, b in zip(DEFAULT_GRAPH_BUCKETS, DEFAULT_GRAPH_BUCKETS[1:]))
    monkeypatch.setenv("HSTU_GRAPH_BUCKETS", "1024, 256,512,256")
    assert default_graph_buckets() == (256, 512, 1024)
    assert default_graph_buckets(compile=True) == (256, 512, 1024)
    assert default_graph_buckets(host_split="compute_front") == (256, 512, 1024, FRONT_GRAPH_BUCKET)
    monkeypatch.setenv("HSTU_GRAPH_BUCKETS", "256,4k")
    with pytest.raises(ValueError, match="'256,4k'"):
        default_graph_buckets()
    monkeypatch.setenv("HSTU_GRAPH_BUCKETS", "0,256")
    with pytest.raises(ValueError, match=">= 1"):
        default_graph_buckets()
