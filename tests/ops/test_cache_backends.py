"""Behaviour of the C++ cache bookkeeping backends: GpuPageManager (GPU page pool) and HostStorage
(host arena slot index), through their pybind11 bindings."""

from __future__ import annotations

import random
import threading
from types import ModuleType

import numpy as np
import pytest

from hstu.ops._build import load_extension


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    return load_extension()


def gpu_state(mgr, users) -> tuple:
    """Everything observable about a GpuPageManager for the given user ids."""
    per_user = tuple((u, mgr.contains(u), mgr.lookup(u), tuple(mgr.pages(u)), mgr.pin_count(u)) for u in users)
    return per_user, mgr.num_free_pages(), mgr.num_users(), mgr.evictions()


def host_state(store, users) -> tuple:
    per_user = tuple((u, store.contains(u), store.lookup(u), store.pin_count(u)) for u in users)
    return per_user, store.num_free_slots(), store.num_reserved_slots(), store.num_users(), store.evictions()


def run_threads(worker, n_threads: int, failures: list) -> None:
    """Run worker(t) on n_threads threads, join them all, then fail with what the workers caught."""
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures, failures


def cache_user(mgr, user: int, length: int, fingerprint: bytes = b"") -> list[int]:
    """One full lifecycle (reserve, commit, release) leaving `user` cached with `length` tokens."""
    (pages,) = mgr.reserve([user], [0], [length])
    mgr.commit(user, length, fingerprint)
    mgr.release([user])
    return pages


# GpuPageManager


def test_reserve_arrays_hands_out_the_pages_reserve_would_as_int32_arrays(ext):
    lists, arrays = ext.GpuPageManager(num_pages=16, page_size=4), ext.GpuPageManager(num_pages=16, page_size=4)
    for users, keep, target in (([1, 2], [0, 0], [5, 8]), ([3], [0], [9]), ([1], [0], [13])):
        want = lists.reserve(users, keep, target)
        got = arrays.reserve_arrays(users, keep, target)
        assert [a.dtype for a in got] == [np.int32] * len(users) and [a.tolist() for a in got] == want
        for m in (lists, arrays):
            m.release(users)


def test_reserve_sizes_pages_to_ceil_target_and_pins_user(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    pages = mgr.reserve([1, 2], [0, 0], [5, 8])
    assert [len(p) for p in pages] == [2, 2]
    assert len(set(pages[0]) | set(pages[1])) == 4
    assert mgr.num_free_pages() == 4
    assert mgr.lookup(1) == (0, b""), "new tokens are not valid before commit"
    assert mgr.pin_count(1) == mgr.pin_count(2) == 1
    assert mgr.allocations() == 4


def test_commit_sets_length_and_digest_as_python_int_and_bytes(ext):
    mgr = ext.GpuPageManager(num_pages=4, page_size=4)
    mgr.reserve([7], [0], [6])
    mgr.commit(7, 6, b"\xff" * 16)
    assert mgr.lookup(7) == (6, b"\xff" * 16)
    assert mgr.lookup(8) == (0, b"")


def test_commit_rejects_length_beyond_reserved_pages(ext):
    mgr = ext.GpuPageManager(num_pages=4, page_size=4)
    mgr.reserve([1], [0], [5])
    with pytest.raises(ValueError, match="length 9"):
        mgr.commit(1, 9, b"")
    with pytest.raises(ValueError, match="user 2"):
        mgr.commit(2, 1, b"")


def test_grow_keeps_prefix_pages_and_appends_new_ones(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    first = cache_user(mgr, 1, 6)
    (grown,) = mgr.reserve([1], [6], [13])
    assert grown[:2] == first and len(grown) == 4
    assert mgr.lookup(1)[0] == 6


def test_eviction_takes_least_recently_used_unpinned_user_first(ext):
    mgr = ext.GpuPageManager(num_pages=6, page_size=4)
    for user in (1, 2, 3):
        cache_user(mgr, user, 8)
    mgr.lookup(2)  # lookup is not a use
    mgr.reserve([1], [8], [8])  # reserve is: 2 is now the least recently used
    mgr.release([1])
    mgr.reserve([4], [0], [8])
    assert not mgr.contains(2) and mgr.contains(1) and mgr.contains(3)
    assert mgr.evictions() == 1
    assert mgr.take_evicted() == [2]


def test_pinned_user_is_never_evicted(ext):
    mgr = ext.GpuPageManager(num_pages=6, page_size=4)
    mgr.reserve([1], [0], [8])  # pinned, least recently used
    cache_user(mgr, 2, 8)
    cache_user(mgr, 3, 8)
    mgr.reserve([4], [0], [8])
    assert mgr.contains(1) and not mgr.contains(2)
    with pytest.raises(ext.CacheCapacityError):
        mgr.reserve([5], [0], [16])  # 3 is the only evictable user: 2 pages
    assert mgr.contains(1) and mgr.pin_count(1) == 1


def test_users_of_the_call_are_not_evicted_for_it(ext):
    mgr = ext.GpuPageManager(num_pages=4, page_size=4)
    cache_user(mgr, 1, 8)
    with pytest.raises(ext.CacheCapacityError, match="batch needs 3 pages, 2 free, 0 evictable of 4 total"):
        mgr.reserve([1, 2], [8, 0], [8, 12])


def test_capacity_error_names_numbers_and_leaves_state_unchanged(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    cache_user(mgr, 1, 8, fingerprint=b"11")
    cache_user(mgr, 2, 4, fingerprint=b"22")
    mgr.reserve([3], [0], [8])  # pinned: 2 pages
    before = gpu_state(mgr, range(1, 6))
    with pytest.raises(ext.CacheCapacityError, match="batch needs 7 pages, 3 free, 3 evictable of 8 total"):
        mgr.reserve([4, 5], [0, 0], [16, 12])
    assert gpu_state(mgr, range(1, 6)) == before
    assert mgr.take_evicted() == []
    assert issubclass(ext.CacheCapacityError, RuntimeError)


def test_keep_len_shrink_reuses_own_pages_and_frees_the_surplus(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    first = cache_user(mgr, 1, 16)
    (shrunk,) = mgr.reserve([1], [5], [6])
    assert shrunk == first[:2]
    assert mgr.lookup(1)[0] == 5
    assert mgr.num_free_pages() == 6
    mgr.release([1])
    (restarted,) = mgr.reserve([1], [0], [3])
    assert restarted == first[:1] and mgr.lookup(1)[0] == 0


def test_shrinking_pinned_user_raises_logic_error(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    (pages,) = mgr.reserve([1], [0], [12])
    mgr.commit(1, 4, b"")
    with pytest.raises(RuntimeError, match="user 1 is pinned"):
        mgr.reserve([1], [2], [12])  # drops committed tokens
    with pytest.raises(RuntimeError, match="user 1 is pinned"):
        mgr.reserve([1], [4], [4])  # frees pages the in-flight batch writes
    assert mgr.pages(1) == pages and mgr.pin_count(1) == 1
    (grown,) = mgr.reserve([1], [4], [13])  # growing a pinned user is allowed
    assert grown[:3] == pages and mgr.pin_count(1) == 2


def test_invalid_keep_or_target_len_raises_value_error_naming_values(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    cache_user(mgr, 1, 5)
    with pytest.raises(ValueError, match="keep_len 6 not in \\[0, cached length 5\\]"):
        mgr.reserve([1], [6], [8])
    with pytest.raises(ValueError, match="target_len 4 must be >= max\\(keep_len 5, 1\\)"):
        mgr.reserve([1], [5], [4])
    with pytest.raises(ValueError, match="target_len 0"):
        mgr.reserve([2], [0], [0])
    with pytest.raises(ValueError, match="differ in length"):
        mgr.reserve([2], [0, 0], [1])


def test_duplicate_user_in_one_reserve_raises_and_changes_nothing(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    before = gpu_state(mgr, [1, 2])
    with pytest.raises(ValueError, match="user 1 appears twice"):
        mgr.reserve([1, 2, 1], [0, 0, 0], [4, 4, 4])
    assert gpu_state(mgr, [1, 2]) == before


def test_release_of_unpinned_user_raises_and_changes_nothing(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    mgr.reserve([1, 2], [0, 0], [4, 4])
    with pytest.raises(RuntimeError, match="user 2 is not pinned"):
        mgr.release([1, 2, 2])
    with pytest.raises(RuntimeError, match="user 3 is not pinned"):
        mgr.release([3])
    assert mgr.pin_count(1) == mgr.pin_count(2) == 1
    mgr.release([1, 2])
    assert mgr.pin_count(1) == mgr.pin_count(2) == 0


def test_invalidate_frees_pages_refuses_pinned_and_ignores_absent(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    cache_user(mgr, 1, 8)
    mgr.reserve([2], [0], [8])
    mgr.invalidate(1)
    assert not mgr.contains(1) and mgr.pages(1) == [] and mgr.num_free_pages() == 6
    with pytest.raises(RuntimeError, match="user 2 is pinned"):
        mgr.invalidate(2)
    mgr.invalidate(99)
    assert mgr.num_users() == 1 and mgr.evictions() == 0


def test_take_evicted_returns_evictions_in_order_then_clears(ext):
    mgr = ext.GpuPageManager(num_pages=3, page_size=1)
    for user in (1, 2, 3):
        cache_user(mgr, user, 1)
    mgr.reserve([4], [0], [2])
    assert mgr.take_evicted() == [1, 2]
    assert mgr.take_evicted() == []
    assert mgr.evictions() == 2


def test_manager_rejects_bad_construction(ext):
    with pytest.raises(ValueError, match="num_pages=0"):
        ext.GpuPageManager(0, 16)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        ext.HostStorage(4, 0)


# HostStorage


def test_host_reserve_commit_appends_chunks_in_order(ext):
    store = ext.HostStorage(num_slots=8, chunk_tokens=32)
    first = store.reserve(1, 0, 2)
    assert store.lookup(1) == ([], b""), "reserved slots belong to no user before commit"
    assert store.num_reserved_slots() == 2
    assert store.commit(1, first, 0, b"5")
    second = store.reserve(1, 2, 1)
    assert store.commit(1, second, 2, b"6")
    assert store.lookup(1) == (first + second, b"6")
    assert store.num_free_slots() == 5 and store.num_reserved_slots() == 0
    assert store.chunk_tokens() == 32 and store.num_slots() == 8


def test_host_reserve_rejects_first_chunk_that_would_leave_a_hole(ext):
    store = ext.HostStorage(num_slots=8, chunk_tokens=32)
    store.commit(1, store.reserve(1, 0, 2), 0, b"")
    with pytest.raises(ValueError, match="first_chunk 3 must be 0 \\(rewrite\\) or its committed chunk count 2"):
        store.reserve(1, 3, 1)
    with pytest.raises(ValueError, match="first_chunk 1"):
        store.reserve(2, 1, 1)
    with pytest.raises(ValueError, match="n_chunks 0"):
        store.reserve(1, 2, 0)


def test_host_abort_returns_reserved_slots(ext):
    store = ext.HostStorage(num_slots=4, chunk_tokens=32)
    slots = store.reserve(1, 0, 3)
    store.abort(slots)
    assert store.num_free_slots() == 4 and store.num_reserved_slots() == 0 and not store.contains(1)
    with pytest.raises(ValueError, match="not a reserved slot"):
        store.abort(slots)
    with pytest.raises(ValueError, match="not a reserved slot"):
        store.commit(1, slots, 0, b"")


def test_host_commit_after_eviction_returns_false_and_frees_slots(ext):
    store = ext.HostStorage(num_slots=4, chunk_tokens=32)
    store.commit(1, store.reserve(1, 0, 2), 0, b"")
    pending = store.reserve(1, 2, 1)
    store.commit(2, store.reserve(2, 0, 3), 0, b"")  # evicts user 1
    assert store.take_evicted() == [1]
    assert store.commit(1, pending, 2, b"9") is False
    assert not store.contains(1) and store.num_free_slots() == 1 and store.num_reserved_slots() == 0


def test_host_commit_after_invalidate_or_rewrite_returns_false(ext):
    store = ext.HostStorage(num_slots=8, chunk_tokens=32)
    store.commit(1, store.reserve(1, 0, 1), 0, b"")
    pending = store.reserve(1, 1, 1)
    store.invalidate(1)
    assert store.commit(1, pending, 1, b"") is False
    store.commit(2, store.reserve(2, 0, 2), 0, b"")
    pending = store.reserve(2, 2, 1)
    store.commit(2, store.reserve(2, 0, 1), 0, b"")  # rewrite to a shorter history
    assert store.commit(2, pending, 2, b"") is False
    assert len(store.lookup(2)[0]) == 1 and store.num_free_slots() == 7


def test_host_rewrite_from_chunk_zero_frees_old_slots_at_commit(ext):
    store = ext.HostStorage(num_slots=6, chunk_tokens=32)
    old = store.reserve(1, 0, 3)
    store.commit(1, old, 0, b"1")
    new = store.reserve(1, 0, 2)
    assert store.lookup(1) == (old, b"1"), "the old version stays readable until commit"
    assert store.num_free_slots() == 1
    assert store.commit(1, new, 0, b"2")
    assert store.lookup(1) == (new, b"2")
    assert store.num_free_slots() == 4


def test_host_rewrite_never_evicts_the_same_user(ext):
    store = ext.HostStorage(num_slots=4, chunk_tokens=32)
    store.commit(1, store.reserve(1, 0, 3), 0, b"")
    with pytest.raises(ext.CacheCapacityError, match="needs 2 slots, 1 free, 0 evictable of 4 total"):
        store.reserve(1, 0, 2)


def test_host_rewrite_of_pinned_user_raises_or_commit_returns_false(ext):
    store = ext.HostStorage(num_slots=8, chunk_tokens=32)
    old = store.reserve(1, 0, 2)
    store.commit(1, old, 0, b"1")
    new = store.reserve(1, 0, 2)
    store.pin([1])
    with pytest.raises(RuntimeError, match="rewrite user 1 while an onload pins it"):
        store.reserve(1, 0, 1)
    assert store.commit(1, new, 0, b"2") is False
    assert store.lookup(1) == (old, b"1")
    appended = store.reserve(1, 2, 1)  # appending while pinned is fine
    assert store.commit(1, appended, 2, b"3")
    assert store.lookup(1) == (old + appended, b"3")


def test_host_pin_protects_slots_from_eviction(ext):
    store = ext.HostStorage(num_slots=4, chunk_tokens=32)
    store.commit(1, store.reserve(1, 0, 2), 0, b"")
    store.commit(2, store.reserve(2, 0, 2), 0, b"")
    store.pin([1])
    store.touch(1)
    store.touch(2)  # 1 is least recently used but pinned
    store.commit(3, store.reserve(3, 0, 2), 0, b"")
    assert store.contains(1) and not store.contains(2)
    before = host_state(store, [1, 2, 3])
    with pytest.raises(ext.CacheCapacityError, match="needs 3 slots, 0 free, 2 evictable of 4 total"):
        store.reserve(4, 0, 3)
    assert host_state(store, [1, 2, 3]) == before
    with pytest.raises(RuntimeError, match="user 1 is pinned"):
        store.invalidate(1)
    store.unpin([1])
    store.reserve(4, 0, 3)
    assert store.take_evicted() == [2, 1, 3]


def test_host_reserved_slots_are_never_evicted(ext):
    store = ext.HostStorage(num_slots=4, chunk_tokens=32)
    store.reserve(1, 0, 3)
    with pytest.raises(ext.CacheCapacityError, match="needs 2 slots, 1 free, 0 evictable"):
        store.reserve(2, 0, 2)


def test_host_request_larger_than_arena_raises_capacity_error(ext):
    store = ext.HostStorage(num_slots=4, chunk_tokens=32)
    with pytest.raises(ext.CacheCapacityError, match="needs 5 slots, 4 free, 0 evictable of 4 total"):
        store.reserve(1, 0, 5)
    assert store.num_free_slots() == 4


def test_host_pin_and_unpin_are_all_or_nothing(ext):
    store = ext.HostStorage(num_slots=4, chunk_tokens=32)
    store.commit(1, store.reserve(1, 0, 1), 0, b"")
    with pytest.raises(ValueError, match="user 2 has no host chunks"):
        store.pin([1, 2])
    assert store.pin_count(1) == 0
    store.pin([1, 1])
    with pytest.raises(RuntimeError, match="user 1 is not pinned"):
        store.unpin([1, 1, 1])
    assert store.pin_count(1) == 2
    store.unpin([1, 1])
    assert store.pin_count(1) == 0


# Concurrency


def check_gpu_invariants(mgr, universe) -> None:
    owned = [p for u in universe for p in mgr.pages(u)]
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert mgr.num_free_pages() + len(owned) == mgr.num_pages()
    assert all(0 <= p < mgr.num_pages() for p in owned)
    assert mgr.num_users() == sum(mgr.contains(u) for u in universe)
    assert all(mgr.lookup(u)[0] <= len(mgr.pages(u)) * mgr.page_size() for u in universe)


def test_concurrent_reserve_commit_release_keeps_page_invariants(ext):
    mgr = ext.GpuPageManager(num_pages=96, page_size=4)
    n_threads, users_per_thread, steps = 4, 24, 3000
    successes = [0] * n_threads
    failures: list[BaseException] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        own = [t * 1000 + i for i in range(users_per_thread)]
        try:
            for _ in range(steps):
                batch = rng.sample(own, rng.randint(1, 3))
                keeps = [rng.randint(0, mgr.lookup(u)[0]) for u in batch]
                targets = [k + rng.randint(1, 12) for k in keeps]
                try:
                    pages = mgr.reserve(batch, keeps, targets)
                except ext.CacheCapacityError:
                    continue
                except ValueError as err:  # a user was evicted by another thread after our lookup
                    assert "keep_len" in str(err)
                    continue
                for u, target, p in zip(batch, targets, pages):
                    assert len(p) == -(-target // 4) and len(set(p)) == len(p)
                    mgr.commit(u, rng.randint(0, target), rng.randbytes(16))
                mgr.release(batch)
                if rng.random() < 0.05:
                    mgr.invalidate(rng.choice(own))
                successes[t] += 1
        except BaseException as err:  # surfaced in the main thread below
            failures.append(err)

    run_threads(worker, n_threads, failures)
    universe = [t * 1000 + i for t in range(n_threads) for i in range(users_per_thread)]
    check_gpu_invariants(mgr, universe)
    assert all(mgr.pin_count(u) == 0 for u in universe)
    assert min(successes) > steps // 4 and mgr.evictions() > 0
    assert len(mgr.take_evicted()) == mgr.evictions()


def test_concurrent_host_reserve_commit_abort_keeps_slot_invariants(ext):
    store = ext.HostStorage(num_slots=64, chunk_tokens=16)
    n_threads, users_per_thread, steps = 4, 16, 3000
    failures: list[BaseException] = []

    def worker(t: int) -> None:
        rng = random.Random(100 + t)
        own = [t * 1000 + i for i in range(users_per_thread)]
        try:
            for _ in range(steps):
                u = rng.choice(own)
                chunks = len(store.lookup(u)[0])
                first = 0 if rng.random() < 0.3 else chunks
                try:
                    slots = store.reserve(u, first, rng.randint(1, 4))
                except ext.CacheCapacityError:
                    continue
                except ValueError as err:  # evicted by another thread after our lookup
                    assert "first_chunk" in str(err)
                    continue
                if rng.random() < 0.2:
                    store.abort(slots)
                else:
                    store.commit(u, slots, first, rng.randbytes(16))
        except BaseException as err:  # surfaced in the main thread below
            failures.append(err)

    run_threads(worker, n_threads, failures)
    universe = [t * 1000 + i for t in range(n_threads) for i in range(users_per_thread)]
    owned = [s for u in universe for s in store.lookup(u)[0]]
    assert len(owned) == len(set(owned)), "a slot is owned twice"
    assert store.num_reserved_slots() == 0
    assert store.num_free_slots() + len(owned) == store.num_slots()
    assert store.num_users() == sum(store.contains(u) for u in universe)
    assert store.evictions() > 0


def test_host_storage_with_no_slots_refuses_every_reserve(ext):
    store = ext.HostStorage(num_slots=0, chunk_tokens=32)
    with pytest.raises(ext.CacheCapacityError):
        store.reserve(1, 0, 1)
    assert store.num_free_slots() == 0


def test_shortening_a_prefix_clears_its_digest_until_the_next_commit(ext):
    mgr = ext.GpuPageManager(num_pages=8, page_size=4)
    cache_user(mgr, 1, 8, fingerprint=b"digest-of-8")
    mgr.reserve([1], [8], [12])
    assert mgr.lookup(1) == (8, b"digest-of-8"), "keeping the whole prefix keeps its digest"
    mgr.release([1])
    mgr.reserve([1], [4], [12])
    assert mgr.lookup(1) == (4, b""), "a shortened prefix is not described by the old digest"
