"""AsyncKVCacheManager behaviour through the model: tiers, eviction, invalidation, errors, faults."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from hstu.model.batch import RankingRequest
from hstu.engine import RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager, CacheCapacityError, HistoryConflictError
from tests.conftest import rel_err


def _setup(config, onload_fault=None, **kv):
    params = dict(page_size=4, num_pages=64, chunk_tokens=8, host_capacity_bytes=1 << 22)
    params.update(kv)
    mgr = AsyncKVCacheManager(KVCacheConfig.for_model(config, **params), onload_fault=onload_fault)
    return RankingEngine(InferenceRankingGR(config), mgr), mgr


def _check(model, requests):
    out = model.rank(requests)
    ref = model.forward_no_cache(requests)
    assert rel_err(torch.cat([o.logits for o in out]), ref) < 1e-5
    return out


def test_returning_user_reuses_gpu_pages(tiny_config, book):
    model, mgr = _setup(tiny_config)
    first = _check(model, [book.request(1, 10)])[0]
    second = _check(model, [book.request(1, 3)])[0]
    assert first.cached_tokens == 0 and second.cached_tokens == tiny_config.history_tokens(10)
    assert mgr.stats.snapshot()["gpu_hits"] == 1


def test_evicted_user_is_onloaded_from_host(tiny_config, book):
    model, mgr = _setup(tiny_config, num_pages=12)
    _check(model, [book.request(1, 12)])  # 26 tokens -> 7 pages, 3 full chunks offloaded
    mgr.drain()
    _check(model, [book.request(2, 12)])  # evicts user 1 from the GPU
    assert not mgr.gpu.contains(1)
    out = _check(model, [book.request(1, 2)])[0]
    stats = mgr.stats.snapshot()
    assert stats["host_hits"] == 1 and stats["gpu_evictions"] >= 1
    assert out.cached_tokens == 24 and stats["bytes_onloaded"] > 0


def test_host_byte_cap_evicts_least_recent_user(tiny_config, book):
    cfg = KVCacheConfig.for_model(tiny_config, page_size=4, chunk_tokens=8)
    model, mgr = _setup(tiny_config, num_pages=16, host_capacity_bytes=4 * cfg.chunk_bytes)
    for user in range(4):
        _check(model, [book.request(user, 9)])
        mgr.drain()
    assert mgr.stats.snapshot()["host_evictions"] >= 1
    assert not mgr.host.contains(0) and mgr.host.contains(3)


def test_changed_history_is_invalidated_not_reused(tiny_config, book):
    model, mgr = _setup(tiny_config)
    _check(model, [book.request(5, 10)])
    items, actions, times = book.histories[5]
    items[3] = (items[3] + 1) % tiny_config.num_items
    out = _check(model, [book.request(5, 2)])[0]
    assert out.cached_tokens == 0 and mgr.stats.snapshot()["invalidations"] == 1


def test_no_new_tokens_is_an_error_naming_lengths(tiny_config, book):
    model, _ = _setup(tiny_config)
    req = book.request(3, 6)
    _check(model, [req])
    n = tiny_config.history_tokens(6)
    with pytest.raises(HistoryConflictError, match=f"user 3: request has no new tokens: history is {n} tokens"):
        model.rank([req])


def test_shorter_history_is_an_error_naming_lengths_in_strict_mode(tiny_config, book):
    model, _ = _setup(tiny_config, on_shorter_history="raise")
    req = book.request(3, 6)
    _check(model, [req])
    short = RankingRequest.create(3, req.item_ids[:4], req.actions[:4], req.timestamps[:4], req.candidates, config=tiny_config)
    with pytest.raises(HistoryConflictError, match=r"history of 10 tokens is shorter than the 14 cached"):
        model.rank([short])
    _check(model, [book.request(3, 1)])  # the cache is still usable afterwards


def test_lenient_policies_recompute_correctly(tiny_config, book):
    model, mgr = _setup(tiny_config, on_no_new_tokens="recompute_last", on_shorter_history="invalidate")
    req = book.request(3, 6)
    _check(model, [req])
    again = _check(model, [req])[0]
    assert again.cached_tokens == tiny_config.history_tokens(6) - 1
    short = RankingRequest.create(3, req.item_ids[:4], req.actions[:4], req.timestamps[:4], req.candidates, config=tiny_config)
    assert _check(model, [short])[0].cached_tokens == 0


def _rerank(req: RankingRequest, config, seed: int) -> RankingRequest:
    """The same history with new candidates."""
    cands = np.random.default_rng(seed).integers(0, config.num_items, 4)
    return RankingRequest.create(req.user_id, req.item_ids, req.actions, req.timestamps, cands, req.contextual, config)


def test_rerank_of_an_unchanged_history_computes_only_the_candidates(tiny_config, book):
    model, mgr = _setup(tiny_config, on_no_new_tokens="candidates")
    first = [book.request(u, 5 + u) for u in range(3)]
    _check(model, first)
    mixed = [_rerank(first[0], tiny_config, 1), book.request(1, 2), _rerank(first[2], tiny_config, 2)]
    out = _check(model, mixed)
    assert [o.cached_tokens for o in out] == [tiny_config.history_tokens(5 + u) for u in range(3)]
    assert out[0].computed_tokens == 4 and out[2].computed_tokens == 4, "candidates only"
    unchanged = [_rerank(r, tiny_config, 3 + i) for i, r in enumerate(mixed)]
    out = _check(model, unchanged)  # no history token to append in the whole batch
    assert all(o.computed_tokens == 4 for o in out)


def test_rerank_of_an_equally_long_but_changed_history_reuses_nothing_past_the_change(tiny_config, book):
    model, mgr = _setup(tiny_config, on_no_new_tokens="candidates")
    req = book.request(1, 11)  # 24 tokens
    _check(model, [req])
    items = req.item_ids.copy()
    items[-1] = (items[-1] + 1) % tiny_config.num_items  # the last event's item: its token 22 differs
    changed = RankingRequest.create(1, items, req.actions, req.timestamps, [1, 2], req.contextual, tiny_config)
    (out,) = _check(model, [changed])  # the oracle: the stale entry is never read as this history's
    assert out.cached_tokens <= 16, "at most the host chunks before the change"
    assert mgr.stats.snapshot()["invalidated_diverged"] == 1


def test_rerank_after_gpu_eviction_onloads_the_whole_history_from_the_host(tiny_config, book):
    model, mgr = _setup(tiny_config, on_no_new_tokens="candidates")
    req = book.request(1, 11)  # 24 tokens: three full 8-token chunks
    _check(model, [req])
    mgr.evict_gpu([1])
    (out,) = _check(model, [_rerank(req, tiny_config, 5)])
    assert out.cached_tokens == 24 and mgr.stats.snapshot()["host_hits"] == 1


@pytest.mark.parametrize("prepare_worker", [True, False], ids=["prepare-worker", "prepare-inline"])
def test_batch_over_capacity_raises_and_leaves_state_intact(tiny_config, book, prepare_worker):
    model, mgr = _setup(tiny_config, num_pages=8, prepare_worker=prepare_worker)
    big = [book.request(u, 10) for u in range(3)]  # 3 x 6 pages > 8
    with pytest.raises(CacheCapacityError, match=r"batch needs 18 pages, 8 free, 0 evictable of 8 total"):
        model.rank(big)
    assert mgr.gpu.num_free_pages() == 8
    _check(model, [book.request(7, 4)])


def test_duplicate_user_in_batch_is_rejected(tiny_config, book):
    model, _ = _setup(tiny_config)
    with pytest.raises(ValueError, match="user 2 appears twice"):
        model.rank([book.request(2, 3), book.request(2, 1)])


def test_out_of_range_ids_name_the_value(tiny_config):
    with pytest.raises(ValueError, match=r"user 4: candidates value 500 out of range \[0, 500\)"):
        RankingRequest.create(4, [1], [0], [5], [500], config=tiny_config)
    with pytest.raises(ValueError, match=r"actions value -1 out of range"):
        RankingRequest.create(4, [1], [-1], [5], [1], config=tiny_config)


@pytest.mark.parametrize("failing_layer", [0, 1], ids=["first layer", "later layer"])
def test_injected_onload_failure_recomputes_and_counts(tiny_config, book, failing_layer):
    calls = []

    def fail_layer(users, layer):
        calls.append(layer)
        if layer == failing_layer:
            raise RuntimeError("injected onload failure")

    model, mgr = _setup(tiny_config, num_pages=12, onload_fault=fail_layer)
    _check(model, [book.request(1, 12)])
    mgr.drain()
    _check(model, [book.request(2, 12)])  # evict user 1 from the GPU
    out = _check(model, [book.request(1, 2), book.request(9, 2)])
    stats = mgr.stats.snapshot()
    assert calls and stats["onload_failures"] == 1 and stats["recomputes"] == 1
    assert out[0].cached_tokens == 0
    mgr.drain()
    assert mgr.gpu.pin_count(1) == 0 and mgr.host.pin_count(1) == 0


def _evicted_to_host(model, mgr, book, user):
    """`user`'s history committed, offloaded and then evicted from the GPU."""
    _check(model, [book.request(user, 12)])
    mgr.drain()
    mgr.evict_gpu([user])


def test_finish_commits_before_the_onload_settles(tiny_config, book, monkeypatch):
    """A batch's onload is enqueued whole on the model thread; finish() commits then, without
    waiting for the worker to see the copies land (on a GPU that held the model thread, and the
    next batch's host work, until the copies ended). The host pins drop when the worker settles."""
    from hstu.ops.kvcache.handle import OnloadHandle

    model, mgr = _setup(tiny_config)
    _evicted_to_host(model, mgr, book, 1)
    release = threading.Event()
    synchronize = OnloadHandle.synchronize
    monkeypatch.setattr(OnloadHandle, "synchronize", lambda h: (release.wait(10), synchronize(h)))
    out = _check(model, [book.request(1, 2)])[0]  # returns while the worker still waits
    assert out.cached_tokens == 24 and mgr.stats.snapshot()["bytes_onloaded"] > 0
    assert mgr.host.pin_count(1) == 1  # the copies have not settled
    n = mgr.gpu.lookup(1)[0]
    assert n == tiny_config.history_tokens(14)
    release.set()
    mgr.drain()
    assert mgr.host.pin_count(1) == 0 and mgr.gpu.pin_count(1) == 0
    assert _check(model, [book.request(1, 2)])[0].cached_tokens == n  # the committed entry serves


def test_a_diverged_history_waits_for_the_last_onloads_host_pins(tiny_config, book, monkeypatch):
    """finish() no longer waits for an onload to settle, so the user's host slots may still be
    pinned when its next request arrives. A plain extension runs beside that; a diverged history,
    which drops the user's host copy, joins the settle first instead of failing on the pin."""
    from hstu.ops.kvcache.handle import OnloadHandle

    model, mgr = _setup(tiny_config)
    _evicted_to_host(model, mgr, book, 1)
    release = threading.Event()
    synchronize = OnloadHandle.synchronize
    monkeypatch.setattr(OnloadHandle, "synchronize", lambda h: (release.wait(10), synchronize(h)))
    _check(model, [book.request(1, 2)])  # onloaded and committed; its settle is held
    assert mgr.host.pin_count(1) == 1
    timer = threading.Timer(0.3, release.set)
    timer.start()
    items, actions, times = book.histories[1]
    items[0] = (items[0] + 1) % tiny_config.num_items  # the user's history with another first event
    diverged = book.request(1, 2)
    started = time.perf_counter()
    out = _check(model, [diverged])[0]
    assert time.perf_counter() - started >= 0.25 and out.cached_tokens == 0
    assert mgr.stats.snapshot()["invalidated_diverged"] == 1
    timer.join()


def test_a_failed_offload_keeps_the_host_chunks_an_onload_still_reads(tiny_config, book, monkeypatch):
    """The batch's offload can now run before its onload settles; when it fails, the user's host
    chunks that the onload still has pinned stay (only unpinned copies are dropped)."""
    from hstu.ops.kvcache import transfers
    from hstu.ops.kvcache.handle import OnloadHandle

    model, mgr = _setup(tiny_config)
    _evicted_to_host(model, mgr, book, 1)
    chunks = len(mgr.host.lookup(1)[0])
    release = threading.Event()
    synchronize = OnloadHandle.synchronize
    monkeypatch.setattr(OnloadHandle, "synchronize", lambda h: (release.wait(10), synchronize(h)))
    monkeypatch.setattr(transfers, "store_host_chunks", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    _check(model, [book.request(1, 8)])  # onloaded, 16 new tokens: a new full chunk to offload, which fails
    mgr.transfers.join([])  # (nothing: the offload runs on its worker)
    for _ in range(100):
        if mgr.stats.snapshot()["offload_failures"]:
            break
        time.sleep(0.02)
    assert mgr.stats.snapshot()["offload_failures"] == 1 and mgr.host.pin_count(1) == 1
    release.set()
    mgr.drain()
    assert len(mgr.host.lookup(1)[0]) == chunks and mgr.host.pin_count(1) == 0


def test_an_onload_failing_after_commit_drops_what_its_batch_committed(tiny_config, book, monkeypatch):
    """A failure the worker finds only when it waits for the copies (on a GPU: a copy failing on
    the device) comes after finish() committed the batch: the users' GPU entries are dropped, so
    their next request recomputes (or onloads again) instead of reading pages never filled."""
    from hstu.ops.kvcache.handle import OnloadHandle

    model, mgr = _setup(tiny_config)
    _evicted_to_host(model, mgr, book, 1)

    committed = threading.Event()

    def fail(handle):
        committed.wait(10)
        raise RuntimeError("injected copy failure on the device")

    monkeypatch.setattr(OnloadHandle, "synchronize", fail)
    _check(model, [book.request(1, 2)])  # committed: the failure comes after
    committed.set()
    mgr.drain()
    monkeypatch.undo()
    stats = mgr.stats.snapshot()
    assert stats["onload_failures"] == 1
    assert mgr.gpu.lookup(1)[0] == 0 and mgr.host.pin_count(1) == 0  # (pinned by its offload then: kept at 0)
    out = _check(model, [book.request(1, 2)])[0]
    after = mgr.stats.snapshot()
    assert after["gpu_hits"] == stats["gpu_hits"] and after["host_hits"] == stats["host_hits"] + 1
    assert out.cached_tokens == 24


def test_a_late_onload_failure_leaves_a_pinned_entry_unusable(tiny_config, book):
    """While the failed batch's users are still pinned (their offload in flight), their entries
    keep their pages at length 0: no lookup reuses them, and the next commit replaces them."""
    model, mgr = _setup(tiny_config)
    _check(model, [book.request(1, 5)])
    mgr.drain()
    mgr.gpu.reserve([1], [mgr.gpu.lookup(1)[0]], [mgr.gpu.lookup(1)[0] + 1])  # pinned, as in flight
    mgr._onload_failed_late([1])
    assert mgr.gpu.lookup(1) == (0, b"") and mgr.gpu.pin_count(1) == 1
    mgr.gpu.release([1])
    gpu_hits = mgr.stats.snapshot()["gpu_hits"]
    _check(model, [book.request(1, 2)])
    assert mgr.stats.snapshot()["gpu_hits"] == gpu_hits


def test_failed_forward_leaves_no_pins(tiny_config, book, monkeypatch):
    model, mgr = _setup(tiny_config)
    _check(model, [book.request(1, 5)])
    monkeypatch.setattr(model.model.head, "forward", lambda y: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        model.rank([book.request(1, 2)])
    monkeypatch.undo()
    mgr.drain()
    assert mgr.gpu.pin_count(1) == 0
    _check(model, [book.request(1, 2)])


def test_a_forward_failing_before_its_first_layer_releases_the_pending_onload(tiny_config, book, monkeypatch):
    """The onload starts at the first layer's wait; a batch that fails before it (here in the
    embedding) still runs its worker through abort, so the host pins and page pins are dropped
    and the user is served from the host tier next time."""
    model, mgr = _setup(tiny_config)
    _check(model, [book.request(1, 11)])
    mgr.drain()
    mgr.evict_gpu([1])
    monkeypatch.setattr(model.model, "embed", lambda *a: (_ for _ in ()).throw(RuntimeError("embedding failed")))
    with pytest.raises(RuntimeError, match="embedding failed"):
        model.rank([book.request(1, 2)])
    monkeypatch.undo()
    mgr.drain()
    assert mgr.gpu.pin_count(1) == 0 and mgr.host.pin_count(1) == 0
    before = mgr.stats.snapshot()["host_hits"]
    out = _check(model, [book.request(1, 2)])
    assert mgr.stats.snapshot()["host_hits"] == before + 1 and out[0].cached_tokens > 0


def test_prepare_overlaps_embedding(tiny_config, book, monkeypatch):
    """A slow prepare and a slow embedding together take about the max, not the sum."""
    model, mgr = _setup(tiny_config)
    delay = 0.4
    slow_prepare, slow_embed = mgr._prepare, model.model.preprocessor.embed

    def prepare(*args):
        time.sleep(delay)
        return slow_prepare(*args)

    def embed(*args):
        time.sleep(delay)
        return slow_embed(*args)

    monkeypatch.setattr(mgr, "_prepare", prepare)
    monkeypatch.setattr(model.model.preprocessor, "embed", embed)
    model.rank([book.request(1, 3)])  # warm-up
    requests = [book.request(1, 3), book.request(2, 3)]
    start = time.perf_counter()
    model.rank(requests)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.5 * delay + 0.5, f"prepare did not overlap embedding: {elapsed:.2f}s for 2 x {delay}s"


def test_close_drains_and_rejects_new_work(tiny_config, book):
    model, mgr = _setup(tiny_config)
    _check(model, [book.request(1, 9)])
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        model.rank([book.request(1, 1)])
    assert np.isfinite(mgr.kv_pages.sum().item())


def test_without_host_tier_gpu_hits_still_work(tiny_config, book):
    model, mgr = _setup(tiny_config, host_capacity_bytes=0)
    _check(model, [book.request(1, 9)])
    assert _check(model, [book.request(1, 2)])[0].cached_tokens > 0
    mgr.evict_gpu([1])
    assert _check(model, [book.request(1, 2)])[0].cached_tokens == 0
    assert mgr.host_arena.shape[0] == 0


def test_evict_gpu_keeps_host_copy(tiny_config, book):
    model, mgr = _setup(tiny_config)
    _check(model, [book.request(1, 12)])
    mgr.evict_gpu([1])
    out = _check(model, [book.request(1, 1)])[0]
    assert out.cached_tokens == 24 and mgr.stats.snapshot()["host_hits"] == 1


def _block_offloads(monkeypatch) -> threading.Event:
    """Offloads wait in their host store until the returned event is set."""
    import hstu.ops.kvcache.transfers as transfers_module

    release = threading.Event()
    real_store = transfers_module.store_host_chunks

    def slow_store(*args):
        release.wait(10)
        real_store(*args)

    monkeypatch.setattr(transfers_module, "store_host_chunks", slow_store)
    return release


def test_an_unchanged_history_reranked_does_not_wait_for_the_users_offload(tiny_config, book, monkeypatch):
    """The most common ranking call: its pages are only read, so the offload of the request
    before it (the previous batch's kernels and D2H on a GPU) need not finish first."""
    model, mgr = _setup(tiny_config, on_no_new_tokens="candidates")
    release = _block_offloads(monkeypatch)
    first = book.request(1, 12)
    _check(model, [first])  # its offload now blocks in the host store
    assert mgr.gpu.pin_count(1) == 1
    out = _check(model, [_rerank(first, tiny_config, 7)])[0]  # must not wait for that offload
    assert out.cached_tokens == tiny_config.history_tokens(12) and out.computed_tokens == 4
    shorter = RankingRequest.create(1, first.item_ids[:5], first.actions[:5], first.timestamps[:5], [1, 2], config=tiny_config)
    waiting = threading.Thread(target=_check, args=(model, [shorter]))  # invalidates: it must wait
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive(), "a request that drops the user's entry went ahead of its offload"
    release.set()
    waiting.join(10)
    mgr.drain()
    assert mgr.gpu.pin_count(1) == 0


def test_plain_extension_does_not_wait_for_the_users_offload(tiny_config, book, monkeypatch):
    model, mgr = _setup(tiny_config)
    release = _block_offloads(monkeypatch)
    _check(model, [book.request(1, 12)])  # its offload now blocks in slow_store
    assert mgr.gpu.pin_count(1) == 1
    out = _check(model, [book.request(1, 3)])[0]  # must not wait for that offload
    assert out.cached_tokens == tiny_config.history_tokens(12)
    release.set()
    mgr.drain()
    assert mgr.gpu.pin_count(1) == 0 and len(mgr.host.lookup(1)[0]) == tiny_config.history_tokens(15) // 8


def _prefix(req: RankingRequest, events: int, config, candidates=(1, 2)) -> RankingRequest:
    """The user's earlier request: the first `events` events of `req`'s history."""
    return RankingRequest.create(
        req.user_id, req.item_ids[:events], req.actions[:events], req.timestamps[:events], list(candidates), config=config
    )


def test_a_shorter_prefix_history_is_ranked_read_only_from_the_longer_entry(tiny_config, book, monkeypatch):
    """A user's older request arriving after a newer one (reuse policy): only its candidates are
    computed, from the first tokens of the cached entry, which stays whole for the next request;
    it writes nothing, so it does not wait for the entry's offload either."""
    model, mgr = _setup(tiny_config, on_no_new_tokens="candidates", on_shorter_history="reuse")
    release = _block_offloads(monkeypatch)
    longer = book.request(1, 12)
    _check(model, [longer])
    long_len = tiny_config.history_tokens(12)
    for events in (5, 1, 11):  # off and on page boundaries (page_size 4), down to one event
        older = _prefix(longer, events, tiny_config)
        out = _check(model, [older, book.request(2, 3)])[0]
        assert (out.cached_tokens, out.computed_tokens) == (tiny_config.history_tokens(events), 2)
        assert mgr.gpu.lookup(1)[0] == long_len, "the longer entry is kept"
    assert mgr.stats.snapshot()["shorter_reused"] == 3 and mgr.stats.snapshot()["invalidations"] == 0
    out = _check(model, [book.request(1, 2)])[0]
    assert out.cached_tokens == long_len, "the next request extends the longer entry"
    release.set()
    mgr.drain()
    assert mgr.gpu.pin_count(1) == 0


def test_a_shorter_history_that_differs_is_still_invalidated_under_reuse(tiny_config, book):
    model, mgr = _setup(tiny_config, on_no_new_tokens="candidates", on_shorter_history="reuse")
    longer = book.request(1, 12)
    _check(model, [longer])
    edited = _prefix(longer, 6, tiny_config)
    items = edited.item_ids.copy()
    items[2] = (items[2] + 1) % tiny_config.num_items
    edited = RankingRequest.create(1, items, edited.actions, edited.timestamps, [1], config=tiny_config)
    assert _check(model, [edited])[0].cached_tokens == 0
    stats = mgr.stats.snapshot()
    assert (stats["shorter_reused"], stats["invalidated_shorter"]) == (0, 1)
    assert mgr.gpu.lookup(1)[0] == tiny_config.history_tokens(6), "the edited history replaced the entry"
    again = _prefix(longer, 5, tiny_config)  # a prefix of the old entry, not of the new one
    assert _check(model, [again])[0].cached_tokens == 0


def test_reuse_policy_needs_candidates_reranking(tiny_config):
    with pytest.raises(ValueError, match="on_shorter_history 'reuse'.*on_no_new_tokens 'candidates', got 'raise'"):
        KVCacheConfig.for_model(tiny_config, on_shorter_history="reuse")


def test_an_onload_starts_once_after_the_event_it_is_given():
    """A front pass hands start_onload the event recorded before it, so the copies do not wait
    for the front pass; the first call starts them, later ones (ready(), finish) are no-ops."""
    from hstu.ops.kvcache.batch import PreparedBatch

    calls = []
    prepared = PreparedBatch([], None, None, None, [], _start_onload=lambda after=None, ahead=None: calls.append(after))
    marker = object()
    prepared.start_onload(after=marker)
    prepared.start_onload()
    assert calls == [marker]


def test_finished_background_work_is_not_tracked_forever(monkeypatch):
    """A user that never returns is never joined: past the bound, finished offloads and settles
    are dropped (a failed one logged), pending ones kept."""
    from concurrent.futures import Future

    from hstu.ops.kvcache import transfers

    monkeypatch.setattr(transfers, "_MAX_TRACKED", 4)
    done, pending, failed = Future(), Future(), Future()
    done.set_result(None)
    failed.set_exception(RuntimeError("offload lost"))
    tracked = {1: done, 2: pending, 3: done, 4: failed, 5: done}
    tracked = transfers._track(tracked, [9], pending)
    assert tracked == {2: pending, 9: pending}


@pytest.mark.parametrize("ahead", [0, 1, None], ids=["ahead-0", "ahead-1", "all-at-once"])
def test_an_onload_enqueues_each_layers_copies_ahead_of_the_layer_that_reads_them(tiny_config, book, monkeypatch, ahead):
    """K/V copies go `ahead` layers in front of the layer the model thread runs (all at once:
    None), each before its layer; the answer is the no-cache model's and the onload settles."""
    from hstu.ops.kvcache import batch

    events = []
    monkeypatch.setattr(batch, "COPY_AHEAD", ahead)
    ready = batch.PreparedBatch.ready
    monkeypatch.setattr(batch.PreparedBatch, "ready", lambda self, layer: (events.append(("run", layer)), ready(self, layer)))
    config = dataclasses.replace(tiny_config, num_layers=4)
    model, mgr = _setup(config, onload_fault=lambda users, layer: events.append(("copy", layer)))
    _evicted_to_host(model, mgr, book, 1)
    events.clear()
    out = _check(model, [book.request(1, 2)])[0]
    assert out.cached_tokens == 24
    assert [layer for kind, layer in events if kind == "copy"] == [0, 1, 2, 3]
    runs = [i for i, (kind, _) in enumerate(events) if kind == "run"] + [len(events)]
    for layer in range(4):  # ready(layer) returned with the copies of layers 0..layer + ahead enqueued
        copied = sum(kind == "copy" for kind, _ in events[: runs[layer + 1]])
        assert copied == (4 if ahead is None else min(4, layer + 1 + ahead)), events
    mgr.drain()
    assert mgr.host.pin_count(1) == 0 and mgr.gpu.pin_count(1) == 0


def _finish_calls(mgr, monkeypatch) -> list[list[int]]:
    """The users each finish() returned to be ranked again."""
    calls = []
    finish = mgr.finish
    monkeypatch.setattr(mgr, "finish", lambda plan: calls.append(finish(plan)) or calls[-1])
    return calls


def _diverge_first_event(book, config, user: int) -> None:
    items, _, _ = book.histories[user]
    items[0] = (items[0] + 1) % config.num_items


def test_a_diverged_history_found_after_the_launch_is_ranked_again_from_scratch(tiny_config, book, monkeypatch):
    """check_after_launch (the default): the batch reuses the GPU entry of a user whose history
    changed, compares the prefix after the launch, drops that user's output and entry, and ranks
    the user again as a miss; the batch's other users keep their outputs from the first forward."""
    model, mgr = _setup(tiny_config)
    assert mgr.check_after_launch
    _check(model, [book.request(1, 10), book.request(2, 10)])
    calls = _finish_calls(mgr, monkeypatch)
    _diverge_first_event(book, tiny_config, 1)
    out = _check(model, [book.request(1, 2), book.request(2, 2)])
    assert calls == [[1], []], "user 1 alone ranked again"
    assert out[0].cached_tokens == 0 and out[1].cached_tokens == tiny_config.history_tokens(10)
    stats = mgr.stats.snapshot()
    assert stats["diverged_after_launch"] == 1 and stats["invalidated_diverged"] == 1
    # the retry committed the user's new history: its next request extends it
    assert _check(model, [book.request(1, 1)])[0].cached_tokens == tiny_config.history_tokens(12)


def test_with_check_after_launch_off_a_diverged_history_is_found_before_the_launch(tiny_config, book, monkeypatch):
    model, mgr = _setup(tiny_config)
    mgr.check_after_launch = False
    _check(model, [book.request(1, 10)])
    calls = _finish_calls(mgr, monkeypatch)
    _diverge_first_event(book, tiny_config, 1)
    (out,) = _check(model, [book.request(1, 2)])
    assert calls == [[]] and out.cached_tokens == 0
    stats = mgr.stats.snapshot()
    assert stats["diverged_after_launch"] == 0 and stats["invalidated_diverged"] == 1


def test_an_extension_compares_its_prefix_only_after_the_launch(tiny_config, book, monkeypatch):
    """The records of a GPU hit are compared with its entry's in finish(), after the forward was
    launched, not in the plan before it; the digests it takes over spare the commit any hashing of
    the prefix."""
    from hstu.model.identity import HistoryIdentity

    model, mgr = _setup(tiny_config)
    _check(model, [book.request(1, 10)])
    phase, compared = ["plan"], []
    finish, shares_prefix = mgr.finish, HistoryIdentity.shares_prefix
    monkeypatch.setattr(mgr, "finish", lambda plan: (phase.append("finish"), finish(plan))[1])
    monkeypatch.setattr(HistoryIdentity, "shares_prefix", lambda self, *a: compared.append(phase[-1]) or shares_prefix(self, *a))
    (out,) = _check(model, [book.request(1, 3)])
    assert out.cached_tokens == tiny_config.history_tokens(10)
    assert compared == ["finish"]


def test_the_plan_of_an_extension_builds_no_token_records(tiny_config, book, monkeypatch):
    """A request's identity builds its token records when they are first read: for a GPU hit that
    is after the launch (the prefix check, the commit's digest), never in the plan."""
    from hstu.model import batch as batch_module

    model, mgr = _setup(tiny_config)
    _check(model, [book.request(1, 10)])
    request = book.request(1, 3)
    built = []
    records = batch_module.token_records
    monkeypatch.setattr(batch_module, "token_records", lambda *a: built.append(1) or records(*a))
    plan = model._plan([request])
    assert plan.cached_lens == [tiny_config.history_tokens(10)] and not built
    mgr.abort(plan)


def test_a_host_tier_prefix_is_onloaded_unchecked_and_a_diverged_one_ranked_again(tiny_config, book, monkeypatch):
    """check_after_launch covers host-tier hits too: the plan compares no records before the onload
    starts; a user whose history changed inside its host prefix is found after the launch, its
    output and every copy of it dropped, and ranked again from scratch, the no-cache answer."""
    from hstu.model.identity import HistoryIdentity

    model, mgr = _setup(tiny_config)
    _evicted_to_host(model, mgr, book, 1)
    _evicted_to_host(model, mgr, book, 2)
    phase, compared = ["plan"], []
    finish, shares_prefix = mgr.finish, HistoryIdentity.shares_prefix
    calls = []
    monkeypatch.setattr(mgr, "finish", lambda plan: (phase.append("finish"), calls.append(finish(plan)))[1] or calls[-1])
    monkeypatch.setattr(HistoryIdentity, "shares_prefix", lambda self, *a: compared.append(phase[-1]) or shares_prefix(self, *a))
    _diverge_first_event(book, tiny_config, 1)
    out = _check(model, [book.request(1, 2), book.request(2, 2)])
    assert calls == [[1], []] and compared[:2] == ["finish", "finish"], "both compared after the first launch"
    assert out[0].cached_tokens == 0 and out[1].cached_tokens == 24, "user 2 onloaded its host prefix"
    stats = mgr.stats.snapshot()
    assert stats["diverged_after_launch"] == 1 and stats["host_hits"] >= 2
    # the retry committed the user's new history: its next request extends it
    assert _check(model, [book.request(1, 1)])[0].cached_tokens == tiny_config.history_tokens(14)
