"""Deferred write-back (KVCacheConfig.writeback "deferred"): resident users are never written to the
host; users nearing eviction are written back before it; a dirty user evicted first is counted and
recomputed; every answer equals the no-cache model's."""

from __future__ import annotations

import pytest

import hstu.ops.kvcache.manager as manager_module
from hstu.ops.kvcache.config import KVCacheConfig
from tests.ops.kvcache.test_manager import _check
from tests.ops.kvcache.test_manager import _setup as _setup_manager


def _setup(config, **kv):
    return _setup_manager(config, **{"writeback": "deferred", **kv})


def test_a_user_that_stays_on_the_gpu_is_never_written_to_the_host(tiny_config, book):
    model, mgr = _setup(tiny_config)
    for extra in (12, 3, 2):
        _check(model, [book.request(1, extra)])
    mgr.drain()
    stats = mgr.stats.snapshot()
    assert stats["bytes_offloaded"] == 0 and stats["writebacks"] == 0 and stats["gpu_hits"] == 2
    assert not mgr.host.contains(1) and 1 in mgr._dirty


def test_a_user_nearing_eviction_is_written_back_before_it(tiny_config, book):
    model, mgr = _setup(tiny_config, num_pages=16)
    _check(model, [book.request(1, 12)])  # 26 tokens, 7 pages: twice that exceeds the 9 free
    mgr.drain()
    assert len(mgr.host.lookup(1)[0]) == 3 and mgr.stats.snapshot()["writebacks"] == 1
    _check(model, [book.request(2, 12)])
    _check(model, [book.request(3, 12)])  # evicts user 1 (written back) for its pages
    assert not mgr.gpu.contains(1)
    out = _check(model, [book.request(1, 2)])[0]
    stats = mgr.stats.snapshot()
    assert out.cached_tokens == 24 and stats["host_hits"] == 1 and stats["writeback_lost_users"] == 0


def test_evict_gpu_writes_a_dirty_user_back_first(tiny_config, book):
    model, mgr = _setup(tiny_config)
    _check(model, [book.request(1, 12)])
    assert not mgr.host.contains(1)
    mgr.evict_gpu([1])
    assert not mgr.gpu.contains(1) and len(mgr.host.lookup(1)[0]) == 3
    out = _check(model, [book.request(1, 1)])[0]
    assert out.cached_tokens == 24 and mgr.stats.snapshot()["host_hits"] == 1


def test_a_dirty_user_evicted_before_its_write_back_is_counted_and_recomputed(tiny_config, book, monkeypatch):
    monkeypatch.setattr(manager_module, "_DEMAND_MARGIN", 0)  # never written back ahead of eviction
    model, mgr = _setup(tiny_config, num_pages=12)
    _check(model, [book.request(1, 12)])
    _check(model, [book.request(2, 12)])  # evicts user 1, dirty
    stats = mgr.stats.snapshot()
    assert stats["writeback_lost_users"] == 1 and stats["bytes_offloaded"] == 0
    assert not mgr.gpu.contains(1) and not mgr.host.contains(1) and 1 not in mgr._dirty
    out = _check(model, [book.request(1, 2)])[0]
    assert out.cached_tokens == 0 and mgr.stats.snapshot()["misses"] == 3


def test_a_write_back_after_a_diverged_history_stores_the_new_history(tiny_config, book):
    model, mgr = _setup(tiny_config)
    _check(model, [book.request(5, 10)])
    items, _, _ = book.histories[5]
    items[3] = (items[3] + 1) % tiny_config.num_items  # the history changes: the entry is dropped
    _check(model, [book.request(5, 2)])
    assert mgr.stats.snapshot()["invalidations"] == 1
    mgr.evict_gpu([5])
    out = _check(model, [book.request(5, 1)])[0]
    assert out.cached_tokens > 0 and mgr.stats.snapshot()["host_hits"] == 1


def test_many_users_under_eviction_match_the_no_cache_model(tiny_config, book):
    model, mgr = _setup(tiny_config, num_pages=64, host_capacity_bytes=1 << 20)
    for step in range(4):
        for first in range(0, 12, 3):
            _check(model, [book.request(u, 4 + step + u % 2) for u in range(first, first + 3)])
    mgr.drain()
    stats = mgr.stats.snapshot()
    assert stats["gpu_evictions"] > 0 and stats["writebacks"] > 0 and stats["host_hits"] > 0, stats
    assert all(mgr.gpu.pin_count(u) == 0 for u in range(12))


def test_deferred_write_back_needs_kv_host_chunks(tiny_config):
    with pytest.raises(ValueError, match="writeback 'deferred' writes K/V pages back later; host_format 'hidden'"):
        KVCacheConfig.for_model(tiny_config, writeback="deferred", host_format="hidden")
    with pytest.raises(ValueError, match="writeback must be 'eager' or 'deferred', got 'lazy'"):
        KVCacheConfig.for_model(tiny_config, writeback="lazy")
