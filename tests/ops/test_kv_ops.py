"""Each hstu KV op against its readable reference on random data, opcheck, and input errors."""

from __future__ import annotations

import pytest
import torch

from hstu.ops import kv_ops

L, P, PS, H, D = 3, 12, 4, 2, 8


def _cache(dtype=torch.float32):
    return torch.randn(L, P, 2, PS, H, D).to(dtype)


def _append_args(dtype=torch.float32):
    T = 7
    perm = torch.randperm(P * PS)[:T]
    return (
        _cache(dtype),
        torch.randn(T, H, D).to(dtype),
        torch.randn(T, H, D).to(dtype),
        (perm // PS).to(torch.int32),
        (perm % PS).to(torch.int32),
        1,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_matches_reference(dtype):
    cache, k, v, pages, offs, layer = _append_args(dtype)
    expected = cache.clone()
    kv_ops.append_kvcache_reference(expected, k, v, pages, offs, layer)
    kv_ops.append_kvcache(cache, k, v, pages, offs, layer)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_from_rows_skipping_a_page_matches_reference(dtype):
    """Tokens taken from rows of a larger k, v (a layer's whole projection), and the tokens bound
    for skip_page (a graph bucket's padding) left unwritten: that page keeps its old contents."""
    cache, _, _, pages, offs, layer = _append_args(dtype)
    k, v = torch.randn(20, H, D).to(dtype), torch.randn(20, H, D).to(dtype)
    rows = torch.randperm(20)[: pages.shape[0]]
    skip = int(pages[2])
    before, expected = cache.clone(), cache.clone()
    kv_ops.append_kvcache_reference(expected, k, v, pages, offs, layer, rows=rows, skip_page=skip)
    kv_ops.append_kvcache(cache, k, v, pages, offs, layer, rows=rows, skip_page=skip)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[:, skip], before[:, skip])
    kv_ops.append_kvcache_reference(before, k, v, pages, offs, layer, rows=rows)  # without the skip
    assert not torch.equal(cache, before)


def test_append_rejects_rows_out_of_range_or_not_int64():
    cache, _, _, pages, offs, layer = _append_args()
    k = v = torch.randn(5, H, D)
    with pytest.raises(RuntimeError, match=r"rows values must lie in \[0, 5\)"):
        kv_ops.append_kvcache(cache, k, v, pages, offs, layer, rows=torch.arange(7) + 1)
    with pytest.raises(RuntimeError, match="rows must be a contiguous 1-d int64"):
        kv_ops.append_kvcache(cache, k, v, pages, offs, layer, rows=torch.arange(7, dtype=torch.int32))


def _csr():
    pages = torch.randperm(P)[:7].to(torch.int32)
    indptr = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    last = torch.tensor([2, 1, 4], dtype=torch.int32)
    return pages, indptr, last


def test_gather_matches_reference():
    cache = _cache()
    pages, indptr, last = _csr()
    k, v = kv_ops.gather_kvcache(cache, 2, pages, indptr, last)
    rk, rv = kv_ops.gather_kvcache_reference(cache, 2, pages, indptr, last)
    assert k.shape == (2 * PS + 2 + 3 * PS + 4, H, D)
    assert torch.equal(k, rk) and torch.equal(v, rv)


def test_gather_all_layers_matches_reference():
    cache = _cache()
    page_ids = torch.randperm(P)[:6].to(torch.int32).reshape(3, 2)
    out = kv_ops.gather_kvcache_all_layers(cache, page_ids)
    assert out.shape == (3, L, 2, 2, PS, H, D)
    assert torch.equal(out, kv_ops.gather_kvcache_all_layers_reference(cache, page_ids))


def _onload_args():
    S, ppc = 5, 2
    arena = torch.randn(S, L, ppc, 2, PS, H, D)
    slots = torch.tensor([4, 1], dtype=torch.int32)
    page_ids = torch.randperm(P)[:4].to(torch.int32).reshape(2, ppc)
    return _cache(), arena, slots, page_ids, 2


def test_onload_matches_reference():
    cache, arena, slots, page_ids, layer = _onload_args()
    expected = cache.clone()
    kv_ops.onload_kvcache_reference(expected, arena, slots, page_ids, layer)
    kv_ops.onload_kvcache(cache, arena, slots, page_ids, layer)
    assert torch.equal(cache, expected)


def test_store_host_chunks_then_onload_round_trips():
    cache = _cache()
    arena = torch.full((4, L, 2, 2, PS, H, D), float("nan"))
    page_ids = torch.tensor([[3, 7], [0, 11]], dtype=torch.int32)
    slots = torch.tensor([2, 0], dtype=torch.int32)
    kv_ops.store_host_chunks(arena, kv_ops.gather_kvcache_all_layers(cache, page_ids), slots)
    assert torch.equal(arena[2, :, 1], cache[:, 7]) and torch.equal(arena[0, :, 0], cache[:, 0])
    fresh = torch.zeros_like(cache)
    for layer in range(L):
        kv_ops.onload_kvcache(fresh, arena, slots, page_ids, layer)
    assert torch.equal(fresh[:, page_ids.flatten().long()], cache[:, page_ids.flatten().long()])


def _hidden_arena(slots=5, ct=4, dim=6, fill=float("nan")):
    """A hidden-state view [S, L, ct, dim] over a wider slot arena, as the manager makes it."""
    flat = torch.full((slots, L * ct * dim + 5), fill)
    return flat[:, : L * ct * dim].view(slots, L, ct, dim)


def test_store_hidden_chunks_then_onload_round_trips():
    arena = _hidden_arena()
    chunks = torch.randn(2, L, 4, 6)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    kv_ops.store_hidden_chunks(arena, chunks, slots)
    assert torch.equal(arena[3], chunks[0]) and torch.equal(arena[1], chunks[1])
    assert arena[0].isnan().all() and arena[2].isnan().all() and arena[4].isnan().all()
    for layer in range(L):
        out, expected = torch.zeros(2, 4, 6), torch.zeros(2, 4, 6)
        kv_ops.onload_hidden(out, arena, slots, layer)
        kv_ops.onload_hidden_reference(expected, arena, slots, layer)
        assert torch.equal(out, expected) and torch.equal(out, chunks[:, layer])


def test_hidden_ops_reject_bad_inputs():
    arena = _hidden_arena()
    with pytest.raises(RuntimeError, match=r"slot_ids values must lie in \[0, 5\)"):
        kv_ops.onload_hidden(torch.zeros(1, 4, 6), arena, torch.tensor([5], dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match=f"layer {L} out of range"):
        kv_ops.onload_hidden(torch.zeros(1, 4, 6), arena, torch.tensor([0], dtype=torch.int32), L)
    with pytest.raises(RuntimeError, match=r"out must be \[n_chunks=1, chunk_tokens=4, D=6\]"):
        kv_ops.onload_hidden(torch.zeros(1, 4, 5), arena, torch.tensor([0], dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match="blocks must be contiguous"):
        kv_ops.onload_hidden(torch.zeros(1, 4, 6), arena.transpose(2, 3).contiguous().transpose(2, 3),
                             torch.tensor([0], dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match="chunks must be"):
        kv_ops.store_hidden_chunks(arena, torch.zeros(1, L, 4, 5), torch.tensor([0], dtype=torch.int32))


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_opcheck_append():
    _opcheck(torch.ops.hstu.append_kvcache.default, _append_args())
    cache, _, _, pages, offs, layer = _append_args()
    k, v = torch.randn(9, H, D), torch.randn(9, H, D)
    _opcheck(torch.ops.hstu.append_kvcache.default, (cache, k, v, pages, offs, layer, torch.arange(7) + 2, int(pages[0])))


def test_opcheck_gather():
    pages, indptr, last = _csr()
    torch.library.opcheck(
        torch.ops.hstu.gather_kvcache.default,
        (_cache(), 0, pages, indptr, last),
        test_utils=("test_schema", "test_autograd_registration"),
    )


def test_opcheck_gather_all_layers():
    _opcheck(torch.ops.hstu.gather_kvcache_all_layers.default, (_cache(), torch.tensor([[1, 2]], dtype=torch.int32)))


def test_opcheck_onload():
    _opcheck(torch.ops.hstu.onload_kvcache.default, _onload_args())


def test_opcheck_store_host_chunks():
    chunks = torch.randn(2, L, 2, 2, PS, H, D)
    _opcheck(torch.ops.hstu.store_host_chunks.default, (torch.zeros(4, L, 2, 2, PS, H, D), chunks, torch.tensor([3, 1], dtype=torch.int32)))


def test_opcheck_hidden_ops():
    arena = _hidden_arena(fill=0.0)
    slots = torch.tensor([3, 1], dtype=torch.int32)
    _opcheck(torch.ops.hstu.store_hidden_chunks.default, (arena, torch.randn(2, L, 4, 6), slots))
    _opcheck(torch.ops.hstu.onload_hidden.default, (torch.zeros(2, 4, 6), arena, slots, 1))


@pytest.mark.parametrize("name", ["write_pinned", "read_pinned"])
def test_pinned_copies_copy_and_name_a_mismatch(name):
    copy = getattr(kv_ops, name)
    src, dst = torch.randn(6, 3).to(torch.bfloat16), torch.zeros(6, 3, dtype=torch.bfloat16)
    copy(dst, src)
    assert torch.equal(dst, src)
    with pytest.raises(RuntimeError, match="dst holds 17 elements but src 18"):
        copy(torch.zeros(17), torch.zeros(18))
    with pytest.raises(RuntimeError, match="dst dtype Float must equal src dtype BFloat16"):
        copy(torch.zeros(18), src)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        copy(torch.zeros(3, 6).t(), torch.zeros(6, 3))
    _opcheck(getattr(torch.ops.hstu, name).default, (torch.zeros(4, 2), torch.randn(4, 2)))


def test_append_rejects_page_out_of_range():
    cache, k, v, pages, offs, layer = _append_args()
    pages[0] = P + 3
    with pytest.raises(RuntimeError, match=rf"page_ids values must lie in \[0, {P}\).*max {P + 3}"):
        kv_ops.append_kvcache(cache, k, v, pages, offs, layer)


def test_append_rejects_bad_layer_and_dtype():
    cache, k, v, pages, offs, _ = _append_args()
    with pytest.raises(RuntimeError, match=f"layer {L} out of range"):
        kv_ops.append_kvcache(cache, k, v, pages, offs, L)
    with pytest.raises(RuntimeError, match="dtype"):
        kv_ops.append_kvcache(cache, k.double(), v.double(), pages, offs, 0)
    with pytest.raises(RuntimeError, match="int32"):
        kv_ops.append_kvcache(cache, k, v, pages.long(), offs, 0)


def test_onload_rejects_slot_out_of_range():
    cache, arena, slots, page_ids, layer = _onload_args()
    slots[1] = 9
    with pytest.raises(RuntimeError, match=r"slot_ids values must lie in \[0, 5\)"):
        kv_ops.onload_kvcache(cache, arena, slots, page_ids, layer)


def test_gather_rejects_bad_last_page_len():
    pages, indptr, last = _csr()
    last[0] = PS + 1
    with pytest.raises(RuntimeError, match=rf"last_page_len\[0\]={PS + 1}"):
        kv_ops.gather_kvcache(_cache(), 0, pages, indptr, last)
