"""Offload admission (seen often enough), pacing, and prefetch."""

from __future__ import annotations

import pytest

from hstu.engine import RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.admission import ByteBudget, FrequencyAdmission
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from tests.conftest import rel_err


def test_a_user_is_admitted_on_its_second_sighting():
    adm = FrequencyAdmission(min_seen=2)
    adm.see(7)
    assert not adm.admits(7)
    adm.see(7)
    assert adm.admits(7) and not adm.admits(8)


def test_aging_forgets_old_popularity_and_capacity_bounds_memory():
    adm = FrequencyAdmission(min_seen=2, capacity=3, window=4)
    adm.see(1), adm.see(1)
    assert adm.admits(1)
    adm.see(2), adm.see(3)  # the 4th sighting halves every count: user 1 drops to 1
    assert not adm.admits(1)
    for u in (4, 5, 6, 7):
        adm.see(u)
    assert len(adm._counts) <= 3


def test_byte_budget_paces_past_its_burst():
    assert ByteBudget(None).delay_for(10**12) == 0.0
    budget = ByteBudget(1_000_000.0, burst_bytes=1000)
    assert budget.delay_for(1000) == 0.0
    assert budget.delay_for(500_000) == pytest.approx(0.5, rel=0.05)
    with pytest.raises(ValueError, match="bytes_per_s must be positive or None, got 0"):
        ByteBudget(0)


def _engine(config, **kv):
    cfg = KVCacheConfig.for_model(config, page_size=4, num_pages=128, chunk_tokens=8, **kv)
    return RankingEngine(InferenceRankingGR(config), AsyncKVCacheManager(cfg))


def test_a_user_seen_once_is_not_offloaded_and_the_bytes_are_counted(tiny_config, book):
    engine = _engine(tiny_config, offload_min_seen=2)
    mgr = engine.cache
    engine.rank([book.request(1, 11)])
    mgr.drain()
    stats = mgr.stats.snapshot()
    assert len(mgr.host.lookup(1)[0]) == 0
    assert stats["offload_rejected_users"] == 1 and stats["offload_rejected_bytes"] == 3 * mgr.config.chunk_bytes
    engine.rank([book.request(1, 2)])  # seen twice: admitted
    mgr.drain()
    assert len(mgr.host.lookup(1)[0]) == 3 and mgr.stats.snapshot()["bytes_offloaded"] > 0
    engine.close()


def test_no_offload_is_submitted_when_the_host_holds_every_full_chunk(tiny_config, book):
    engine = _engine(tiny_config, on_no_new_tokens="candidates")
    mgr = engine.cache
    engine.rank([book.request(1, 11)])  # 24 history tokens: 3 chunks of 8 offloaded
    mgr.drain()
    submitted = []
    offload_async = mgr.transfers.offload_async
    mgr.transfers.offload_async = lambda jobs, *a: (submitted.append([j.user for j in jobs]), offload_async(jobs, *a))
    engine.rank([book.request(1, 0, num_candidates=4)])  # a re-rank: the same history, new candidates
    engine.rank([book.request(1, 1)])  # 26 tokens: inside the 4th chunk
    assert submitted == [], "nothing new to store: no job for the offload worker"
    engine.rank([book.request(1, 3)])  # 32 tokens: the 4th chunk is full
    mgr.drain()
    assert submitted == [[1]] and len(mgr.host.lookup(1)[0]) == 4
    engine.close()


def test_paced_offloads_still_complete(tiny_config, book):
    engine = _engine(tiny_config, offload_bytes_per_s=1e9)
    engine.rank([book.request(1, 11)])
    engine.cache.drain()
    assert len(engine.cache.host.lookup(1)[0]) == 3
    engine.close()


def test_prefetch_puts_a_host_tier_user_back_on_the_gpu_before_its_request(tiny_config, book):
    engine = _engine(tiny_config)
    mgr = engine.cache
    engine.rank([book.request(1, 11)])
    mgr.evict_gpu([1])
    assert mgr.prefetch([1, 1, 99]) == 1, "one host-tier user; duplicates and unknown users skipped"
    assert mgr.prefetch([1]) == 0, "idempotent while in flight or done"
    req = book.request(1, 2)
    (out,) = engine.rank([req])
    stats = mgr.stats.snapshot()
    assert out.cached_tokens == 24 and (stats["gpu_hits"], stats["host_hits"]) == (1, 0)
    assert stats["prefetches"] == 1 and stats["prefetch_hits"] == 1
    assert rel_err(out.logits, engine.forward_no_cache([req])) < 1e-5
    mgr.drain()
    assert mgr.gpu.pin_count(1) == 0 and mgr.host.pin_count(1) == 0
    engine.close()


def test_prefetch_never_evicts(tiny_config, book):
    cfg = KVCacheConfig.for_model(tiny_config, page_size=4, num_pages=8, chunk_tokens=8)
    engine = RankingEngine(InferenceRankingGR(tiny_config), AsyncKVCacheManager(cfg))
    mgr = engine.cache
    engine.rank([book.request(1, 11)])  # 7 of 8 pages
    mgr.drain()
    engine.rank([book.request(2, 3)])  # evicts user 1 from the GPU
    before = mgr.gpu.num_users()
    assert mgr.prefetch([1]) == 0, "not enough free pages: nobody is evicted for a prefetch"
    assert mgr.gpu.num_users() == before
    engine.close()
