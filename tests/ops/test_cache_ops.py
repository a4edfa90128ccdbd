"""The exportable cache protocol (csrc/export_cache.cpp, ops/cache_ops.py): lookup, allocate,
append, gather and commit on the opaque ExportKVCache handle, with its host tier's offload and
onload, eagerly on CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from hstu.ops.cache_ops import new_export_cache
from hstu.ops.kvcache.config import KVCacheConfig

_ops = torch.ops.hstu
L, PAGES, PS, H, D, CHUNK = 2, 6, 4, 2, 8, 8


def _new_cache(host_slots: int) -> torch.ScriptObject:
    sizes = KVCacheConfig(num_layers=L, num_heads=H, head_dim=D, page_size=PS, num_pages=PAGES, chunk_tokens=CHUNK)
    return new_export_cache(KVCacheConfig(**{**sizes.__dict__, "host_capacity_bytes": host_slots * sizes.chunk_bytes}), "cpu")


@pytest.fixture
def cache() -> torch.ScriptObject:
    """GPU tier only."""
    return _new_cache(host_slots=0)


@pytest.fixture
def tiered() -> torch.ScriptObject:
    """With a host tier of 4 chunks of 8 tokens."""
    return _new_cache(host_slots=4)


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])


def _records(*lengths: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Records [N, 2] of users with these history lengths, and their CSR offsets."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (sum(lengths), 2), generator=g), _offsets(list(lengths))


def _run_batch(cache, users: list[int], records, offsets, candidates: list[int]):
    """lookup -> allocate -> append K/V = position-coded values on every layer -> commit."""
    uid = torch.tensor(users)
    cached = _ops.cache_lookup(cache, uid, records, offsets)
    out = _ops.cache_allocate(cache, uid, cached, offsets, _offsets(candidates))
    rows, append_rows, pages, slots = out[0], out[4], out[5], out[6]
    k = rows[append_rows].float().view(-1, 1, 1).expand(-1, H, D).contiguous()
    for layer in range(L):
        _ops.cache_append(cache, layer, k + layer, -k - layer, pages, slots)
    _ops.cache_commit(cache, uid, records, offsets)
    return cached, out


def test_miss_then_extension_reuses_the_committed_prefix(cache):
    recs, offs = _records(5, 3)
    cached, out = _run_batch(cache, [7, 8], recs, offs, [2, 1])
    assert cached.tolist() == [0, 0]
    rows, q_batch, q_pos, max_q = out[0], out[1], out[3], out[9]
    assert rows.tolist() == [0, 1, 2, 3, 4, 8, 9, 5, 6, 7, 10]  # history columns, then N + candidate j
    assert q_pos.tolist() == [0, 1, 2, 3, 4, -1, -1, 0, 1, 2, -1]
    assert q_batch.tolist() == [0] * 7 + [1] * 4
    assert int(max_q) == 7

    longer = torch.cat([recs[:5], torch.tensor([[1, 2], [3, 4]])])
    cached, out = _run_batch(cache, [7], longer, torch.tensor([0, 7]), [1])
    assert cached.tolist() == [5]
    assert out[3].tolist() == [5, 6, -1]  # only the new tokens and the candidate are rows
    assert cache.reused_tokens() == 5


def test_gather_returns_what_append_wrote_per_user_and_layer(cache):
    recs, offs = _records(6, 2)
    _, out = _run_batch(cache, [1, 2], recs, offs, [1, 1])
    page_table, kv_lens = out[7], out[8]
    for layer in range(L):
        keys, values = _ops.cache_gather(cache, layer, page_table)
        assert keys.shape == (2, page_table.shape[1] * PS, H, D)
        for b, n in enumerate(kv_lens.tolist()):
            expect = torch.arange(n).float() + offs[b] + layer
            torch.testing.assert_close(keys[b, :n, 0, 0], expect)
            torch.testing.assert_close(values[b, :n, 1, 3], -expect)


def test_diverging_or_shorter_history_drops_the_entry(cache):
    recs, offs = _records(6)
    _run_batch(cache, [3], recs, offs, [1])
    changed = recs.clone()
    changed[2, 1] += 1
    assert _ops.cache_lookup(cache, torch.tensor([3]), changed, offs).tolist() == [0]
    _run_batch(cache, [3], recs, offs, [1])
    assert _ops.cache_lookup(cache, torch.tensor([3]), recs[:4], torch.tensor([0, 4])).tolist() == [0]
    assert cache.invalidations() == 2


def test_allocate_evicts_least_recently_used_users(cache):
    for user in range(3):  # 2 pages each: the pool of 6 is full
        recs, offs = _records(8, seed=user)
        _run_batch(cache, [user], recs, offs, [1])
    recs, offs = _records(8, seed=9)
    _run_batch(cache, [9], recs, offs, [1])
    assert cache.evictions() == 1 and cache.num_users() == 3
    first, first_offs = _records(8, seed=0)
    assert _ops.cache_lookup(cache, torch.tensor([0]), first, first_offs).tolist() == [0]


def test_a_batch_without_commit_is_released_and_dropped_at_the_next_lookup(cache):
    recs, offs = _records(5)
    uid = torch.tensor([4])
    cached = _ops.cache_lookup(cache, uid, recs, offs)
    _ops.cache_allocate(cache, uid, cached, offs, torch.tensor([0, 1]))
    assert cache.num_free_pages() == PAGES - 2
    assert _ops.cache_lookup(cache, uid, recs, offs).tolist() == [0]
    assert cache.num_users() == 0 and cache.num_free_pages() == PAGES


def test_commit_of_other_users_than_allocated_is_refused(cache):
    recs, offs = _records(3)
    cached = _ops.cache_lookup(cache, torch.tensor([1]), recs, offs)
    _ops.cache_allocate(cache, torch.tensor([1]), cached, offs, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="differ from the allocated batch"):
        _ops.cache_commit(cache, torch.tensor([2]), recs, offs)


def test_a_copy_keeps_the_configuration_and_starts_empty(cache):
    recs, offs = _records(5)
    _run_batch(cache, [1], recs, offs, [1])
    fresh = copy.deepcopy(cache)  # pickling, as an AOTInductor package stores the handle
    assert fresh.__obj_flatten__() == cache.__obj_flatten__()
    assert fresh.num_users() == 0 and cache.num_users() == 1


def test_commit_offloads_full_chunks_and_an_evicted_user_is_onloaded_from_them(tiered):
    recs, offs = _records(10)  # one full chunk of 8 tokens, 2 tokens stay GPU-only
    _run_batch(tiered, [0], recs, offs, [1])
    assert tiered.offloaded_chunks() == 1 and tiered.host_users() == 1
    for user in (1, 2):  # 2 pages each with user 0's 3: the pool of 6 evicts user 0
        other, other_offs = _records(8, seed=user)
        _run_batch(tiered, [user], other, other_offs, [1])
    assert tiered.evictions() == 1

    longer = torch.cat([recs, torch.tensor([[5, 6]])])
    cached, out = _run_batch(tiered, [0], longer, torch.tensor([0, 11]), [1])
    assert cached.tolist() == [8] and tiered.onloaded_tokens() == 8
    assert out[3].tolist() == [8, 9, 10, -1]  # the host prefix is not recomputed
    for layer in range(L):
        keys, values = _ops.cache_gather(tiered, layer, out[7])
        torch.testing.assert_close(keys[0, :11, 0, 0], torch.arange(11).float() + layer)  # onloaded 0..7, appended 8..10
        torch.testing.assert_close(values[0, :11, 1, 2], -torch.arange(11).float() - layer)


def test_a_history_diverging_inside_the_host_prefix_is_recomputed(tiered):
    recs, offs = _records(12)  # 3 pages, one chunk offloaded
    _run_batch(tiered, [0], recs, offs, [1])
    for user in (1, 2):  # the second evicts user 0 from the GPU
        other, other_offs = _records(8, seed=user)
        _run_batch(tiered, [user], other, other_offs, [1])
    changed = recs.clone()
    changed[3, 0] += 1
    assert _ops.cache_lookup(tiered, torch.tensor([0]), changed, offs).tolist() == [0]
    assert tiered.invalidations() == 1 and tiered.onloaded_tokens() == 0


def test_fakes_match_the_real_ops_in_dtype_device_and_shape(tiered):
    recs, offs = _records(10, 3)
    uid, check = torch.tensor([5, 6]), ("test_faketensor",)
    torch.library.opcheck(_ops.cache_lookup.default, (tiered, uid, recs, offs), test_utils=check)
    cached = _ops.cache_lookup(tiered, uid, recs, offs)
    torch.library.opcheck(_ops.cache_allocate.default, (tiered, uid, cached, offs, torch.tensor([0, 1, 3])), test_utils=check)
    out = _ops.cache_allocate(tiered, uid, cached, offs, torch.tensor([0, 1, 3]))
    k = torch.randn(out[4].shape[0], H, D)
    torch.library.opcheck(_ops.cache_append.default, (tiered, 0, k, k, out[5], out[6]), test_utils=check)
    torch.library.opcheck(_ops.cache_gather.default, (tiered, 1, out[7]), test_utils=check)
    torch.library.opcheck(_ops.cache_commit.default, (tiered, uid, recs, offs), test_utils=check)
