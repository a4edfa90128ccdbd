"""CUDA impls of the hstu KV ops (csrc/kernels/kv_kernels.cu) and the Triton paged attention,
each against its reference on random data. Outputs are poisoned (NaN) first so an unwritten
element fails; sizes include rows whose byte size is not a multiple of 16 (the 4- and 2-byte
paths) and strided inputs."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import threading

import pytest
import torch

from hstu.ops._build import cuda_build_enabled

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not cuda_build_enabled(), reason="needs CUDA and the CUDA build"),
]

if torch.cuda.is_available() and cuda_build_enabled():
    from hstu.ops import kv_ops
    from tests.ops.paged_cases import make_paged_case, padded_like_graph_bucket, reference_fp64, rel_err

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
# (heads, head_dim): row bytes multiple of 16 in bf16 and fp32; of 8 only in bf16 (-> 4-byte
# path); odd element count (2-byte path in bf16, 4-byte in fp32).
ROW_SHAPES = [(4, 64), (3, 36), (1, 37)]


def poison_allocator(nbytes: int) -> None:
    """Leave NaN-filled blocks in the caching allocator so fresh outputs start as NaN."""
    blocks = [torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda") for _ in range(2)]
    del blocks


def rand_cache(L, P, ps, H, d, dtype):
    return torch.randn((L, P, 2, ps, H, d), device="cuda").to(dtype)


def distinct(n: int, upper: int, *, run: int = 0) -> torch.Tensor:
    """n distinct ints in [0, upper), random order, the first `run` of them consecutive."""
    start = int(torch.randint(0, upper - run + 1, (1,)))
    head = list(range(start, start + run))
    rest = [x for x in torch.randperm(upper).tolist() if x not in set(head)][: n - run]
    return torch.tensor(head + rest, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", ROW_SHAPES)
@pytest.mark.parametrize("strided", [False, True])
def test_append_writes_rows_to_their_slots(dtype, heads, head_dim, strided):
    L, P, ps, T, layer = 3, 11, 8, 37, 2
    cache = rand_cache(L, P, ps, heads, head_dim, dtype)
    slots = distinct(T, P * ps)
    page_ids, offsets = (slots // ps).int().cuda(), (slots % ps).int().cuda()
    if strided:  # k, v as column slices of one [T, 2, H*d + 8] tensor, as after a fused projection
        fused = torch.randn((T, 2, heads * head_dim + 8), device="cuda").to(dtype)
        k = fused[:, 0, : heads * head_dim].view(T, heads, head_dim)
        v = fused[:, 1, : heads * head_dim].view(T, heads, head_dim)
    else:
        k, v = (torch.randn((T, heads, head_dim), device="cuda").to(dtype) for _ in range(2))
    expected = cache.clone()
    kv_ops.append_kvcache_reference(expected, k, v, page_ids, offsets, layer)
    kv_ops.append_kvcache(cache, k, v, page_ids, offsets, layer)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_from_rows_of_a_strided_projection_skipping_a_page(dtype):
    """As the paged layer appends: token t from row rows[t] of k, v (column slices of one fused
    projection), tokens bound for skip_page (a graph bucket's padding) not written."""
    L, P, ps, heads, head_dim, n, layer = 3, 11, 8, 4, 64, 29, 1
    cache = rand_cache(L, P, ps, heads, head_dim, dtype)
    slots = distinct(n, (P - 1) * ps)
    page_ids, offsets = (slots // ps).int().cuda(), (slots % ps).int().cuda()
    page_ids[::3] = P - 1  # padding: the scratch page
    rows = torch.randperm(50)[:n].cuda()
    fused = torch.randn((50, 2, heads * head_dim + 8), device="cuda").to(dtype)
    k = fused[:, 0, : heads * head_dim].view(50, heads, head_dim)
    v = fused[:, 1, : heads * head_dim].view(50, heads, head_dim)
    expected = cache.clone()
    kv_ops.append_kvcache_reference(expected, k, v, page_ids, offsets, layer, rows=rows, skip_page=P - 1)
    kv_ops.append_kvcache(cache, k, v, page_ids, offsets, layer, rows=rows, skip_page=P - 1)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected)


def test_append_with_no_tokens_leaves_cache_untouched():
    cache = rand_cache(2, 4, 8, 2, 64, torch.bfloat16)
    before = cache.clone()
    empty = torch.zeros((0, 2, 64), device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(0, dtype=torch.int32, device="cuda")
    kv_ops.append_kvcache(cache, empty, empty, idx, idx, 1)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", ROW_SHAPES)
def test_gather_kvcache_matches_reference(dtype, heads, head_dim):
    L, P, ps, layer = 2, 23, 8, 1
    cache = rand_cache(L, P, ps, heads, head_dim, dtype)
    counts = [3, 0, 1, 5]
    pages = distinct(sum(counts), P).cuda()
    indptr = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32).cuda()
    last = torch.tensor([5, 1, 8, 2], dtype=torch.int32).cuda()
    poison_allocator(2 * 64 * P * ps * heads * head_dim)
    k, v = kv_ops.gather_kvcache(cache, layer, pages, indptr, last)
    k_ref, v_ref = kv_ops.gather_kvcache_reference(cache, layer, pages, indptr, last)
    assert k.shape == (2 * ps + 5 + 8 + 4 * ps + 2, heads, head_dim)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", ROW_SHAPES)
def test_gather_all_layers_matches_reference(dtype, heads, head_dim):
    L, P, ps, n, ppc = 3, 40, 8, 5, 4
    cache = rand_cache(L, P, ps, heads, head_dim, dtype)
    page_ids = distinct(n * ppc, P, run=ppc).view(n, ppc).cuda()
    poison_allocator(4 * n * L * ppc * 2 * ps * heads * head_dim)
    out = kv_ops.gather_kvcache_all_layers(cache, page_ids)
    assert out.shape == (n, L, ppc, 2, ps, heads, head_dim)
    assert torch.equal(out, kv_ops.gather_kvcache_all_layers_reference(cache, page_ids))


def test_few_large_pages_split_over_blocks(monkeypatch):
    """Two 256 KiB pages: each page is copied by several blocks (grid.y split)."""
    L, P, ps, H, d = 2, 6, 64, 4, 256
    cache = rand_cache(L, P, ps, H, d, torch.bfloat16)
    page_ids = torch.tensor([[4, 1]], dtype=torch.int32)
    poison_allocator(2 * cache.numel())
    out = kv_ops.gather_kvcache_all_layers(cache, page_ids.cuda())
    assert torch.equal(out, kv_ops.gather_kvcache_all_layers_reference(cache, page_ids.cuda()))
    monkeypatch.setenv("HSTU_ONLOAD_IMPL", "zerocopy")
    arena = out.cpu().pin_memory()
    dst = torch.full_like(cache, float("nan"))
    for layer in range(L):
        kv_ops.onload_kvcache(dst, arena, torch.tensor([0], dtype=torch.int32), torch.tensor([[2, 5]], dtype=torch.int32), layer)
    torch.cuda.synchronize()
    assert torch.equal(dst[:, [2, 5]], cache[:, [4, 1]])


def make_arena(S, L, ppc, ps, H, d, dtype, pinned=True):
    return torch.randn((S, L, ppc, 2, ps, H, d)).to(dtype).pin_memory() if pinned else torch.randn(
        (S, L, ppc, 2, ps, H, d)
    ).to(dtype)


@pytest.mark.parametrize("impl", ["memcpy", "zerocopy"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", ROW_SHAPES)
@pytest.mark.parametrize("on_side_stream", [False, True])
def test_onload_copies_host_chunks_into_pages(monkeypatch, impl, dtype, heads, head_dim, on_side_stream):
    monkeypatch.setenv("HSTU_ONLOAD_IMPL", impl)
    L, P, ps, S, ppc, n, layer = 3, 50, 8, 9, 3, 6, 1
    cache = torch.full((L, P, 2, ps, heads, head_dim), float("nan"), device="cuda", dtype=dtype)
    arena = make_arena(S, L, ppc, ps, heads, head_dim, dtype)
    slots = distinct(n, S, run=2)
    pages = distinct(n * ppc, P, run=2 * ppc).view(n, ppc)
    expected = cache.clone()
    kv_ops.onload_kvcache_reference(expected, arena, slots, pages, layer)
    stream = torch.cuda.Stream() if on_side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        kv_ops.onload_kvcache(cache, arena, slots, pages, layer)
    stream.synchronize()
    assert torch.equal(cache.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_onload_memcpy_accepts_pageable_arena(monkeypatch):
    monkeypatch.setenv("HSTU_ONLOAD_IMPL", "memcpy")
    cache = torch.full((2, 10, 2, 8, 2, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    arena = make_arena(4, 2, 2, 8, 2, 64, torch.bfloat16, pinned=False)
    slots, pages = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([[4, 5], [1, 9]], dtype=torch.int32)
    expected = cache.clone()
    kv_ops.onload_kvcache_reference(expected, arena, slots, pages, 0)
    kv_ops.onload_kvcache(cache, arena, slots, pages, 0)
    torch.cuda.synchronize()
    assert torch.equal(cache.nan_to_num(7.0), expected.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", ROW_SHAPES)
def test_store_host_chunks_writes_only_their_slots(dtype, heads, head_dim):
    L, ps, S, ppc, n = 2, 8, 11, 3, 5
    arena = torch.full((S, L, ppc, 2, ps, heads, head_dim), float("nan"), dtype=dtype).pin_memory()
    chunks = torch.randn((n, L, ppc, 2, ps, heads, head_dim), device="cuda").to(dtype)
    slots = distinct(n, S, run=3)
    kv_ops.store_host_chunks(arena, chunks, slots)
    torch.cuda.synchronize()
    assert torch.equal(arena[slots.long()], chunks.cpu())
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots.long()] = False
    assert arena[untouched].isnan().all()


def test_store_host_chunks_from_noncontiguous_chunks():
    L, ps, S, ppc, H, d = 2, 8, 6, 2, 2, 64
    arena = torch.full((S, L, ppc, 2, ps, H, d), float("nan"), dtype=torch.bfloat16).pin_memory()
    wide = torch.randn((4, L, ppc, 2, ps, H, 2 * d), device="cuda").to(torch.bfloat16)
    chunks = wide[..., :d]
    slots = torch.tensor([5, 0, 1, 3], dtype=torch.int32)
    kv_ops.store_host_chunks(arena, chunks, slots)
    torch.cuda.synchronize()
    assert torch.equal(arena[slots.long()], chunks.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_chunks_store_then_onload_layer_by_layer(dtype):
    """store_hidden_chunks (D2H) then onload_hidden (H2D) of each layer, on a side stream, over a
    pinned view whose slots are wider than their hidden blocks (as the manager's)."""
    L, S, ct, dim, n = 3, 9, 16, 64, 4
    flat = torch.full((S, L * ct * dim * 2), float("nan"), dtype=dtype).pin_memory()
    arena = flat[:, : L * ct * dim].view(S, L, ct, dim)
    chunks = torch.randn((n, L, ct, dim), device="cuda").to(dtype)
    slots = distinct(n, S, run=2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kv_ops.store_hidden_chunks(arena, chunks, slots)
        outs = []
        for layer in range(L):
            out = torch.empty((n, ct, dim), device="cuda", dtype=dtype)
            kv_ops.onload_hidden(out, arena, slots, layer)
            outs.append(out)
    stream.synchronize()
    assert torch.equal(arena[slots.long()], chunks.cpu())
    for layer, out in enumerate(outs):
        assert torch.equal(out, chunks[:, layer])
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots.long()] = False
    assert flat[untouched].isnan().all() and flat[:, L * ct * dim :].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_pinned_lands_beside_a_bulk_copy_to_the_host(dtype):
    """write_pinned (a kernel through dst's mapped address) on the current stream while another
    stream's 256 MiB D2H is in flight: the values land exactly, an odd element count included, and
    dst's block is not handed out again before the kernel completed (the host allocator saw it)."""
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    big_host = torch.empty(big.shape, dtype=torch.uint8).pin_memory()
    side = torch.cuda.Stream()
    for n in (1, 37, 2048 * 3):
        src = torch.randn(n, device="cuda").to(dtype)
        dst = torch.full((n,), float("nan"), dtype=dtype).pin_memory()
        with torch.cuda.stream(side):
            big_host.copy_(big, non_blocking=True)
        kv_ops.write_pinned(dst, src)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        assert torch.equal(dst, src.cpu())
        side.synchronize()
    ptr, src = dst.data_ptr(), torch.randn(dst.shape, device="cuda").to(dtype)
    torch.cuda._sleep(50_000_000)  # the stream busy, so the kernel is still pending when dst is dropped
    kv_ops.write_pinned(dst, src)
    del dst
    again = torch.empty(2048 * 3, dtype=dtype, pin_memory=True)
    assert again.data_ptr() != ptr, "the host allocator handed out a block a pending kernel still writes"
    torch.cuda.synchronize()


def test_offload_roundtrip_gather_store_onload(monkeypatch):
    """gather_all_layers -> store_host_chunks -> onload of every layer restores the pages."""
    L, P, ps, H, d, ppc, n = 4, 30, 16, 2, 128, 2, 3
    cache = rand_cache(L, P, ps, H, d, torch.bfloat16)
    arena = torch.zeros((5, L, ppc, 2, ps, H, d), dtype=torch.bfloat16).pin_memory()
    src_pages = distinct(n * ppc, P).view(n, ppc)
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    kv_ops.store_host_chunks(arena, kv_ops.gather_kvcache_all_layers(cache, src_pages.cuda()), slots)
    for impl in ("memcpy", "zerocopy"):
        monkeypatch.setenv("HSTU_ONLOAD_IMPL", impl)
        dst = torch.full_like(cache, float("nan"))
        dst_pages = distinct(n * ppc, P).view(n, ppc)
        for layer in range(L):
            kv_ops.onload_kvcache(dst, arena, slots, dst_pages, layer)
        torch.cuda.synchronize()
        assert torch.equal(dst[:, dst_pages.flatten().long()], cache[:, src_pages.flatten().long()])


# Triton paged attention.

ATTN_CASES = [
    # history, cached, candidates, page_size, heads, head_dim
    ([300, 45, 1000], [260, 0, 990], [40, 7, 64], 16, 2, 64),
    ([1100, 64], [1000, 64], [30, 129], 32, 4, 128),
    ([700], [640], [96], 64, 2, 256),
    ([4096, 1, 333], [3968, 0, 300], [256, 3, 0], 32, 4, 256),
]


@functools.lru_cache(maxsize=None)
def attention_case(case_idx: int):
    """(case, float64 reference, relative error of the bf16 torch implementation), built once."""
    from hstu.ops.attention import paged_hstu_attention_torch

    hist, cached, cand, ps, H, d = ATTN_CASES[case_idx]
    c = make_paged_case(hist, cached, cand, page_size=ps, heads=H, head_dim=d, dtype=torch.bfloat16, device="cuda",
                        seed=case_idx)
    m = c.meta
    ref = paged_hstu_attention_torch(
        c.q, c.k, c.v, c.kv_cache, c.layer, m.page_table, m.kv_lens, m.q_batch, m.q_local, m.q_pos, m.max_q, c.scale_len
    )
    exact = reference_fp64(c)
    return c, exact, rel_err(ref, exact)


@pytest.mark.parametrize("case_idx", range(len(ATTN_CASES)))
@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("silu", ["exact", "fast", "tanh"])
def test_triton_attention_bf16_within_2x_of_torch_reference_error(case_idx, num_splits, silu):
    import dataclasses

    from hstu.ops.triton_attention import default_config, paged_hstu_attention_triton

    c, exact, ref_err = attention_case(case_idx)
    poison_allocator(4 * c.q.numel() * 16)
    config = dataclasses.replace(default_config(c.q.shape[2]), silu=silu, kernel="triton")
    out = paged_hstu_attention_triton(
        c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=config, num_splits=num_splits
    )
    err = rel_err(out, exact)
    assert out.dtype == torch.bfloat16
    assert err <= 2 * ref_err, f"triton {err:.2e} vs bf16 torch reference {ref_err:.2e}"


@pytest.mark.parametrize("case_idx", range(len(ATTN_CASES)))
def test_triton_attention_in_lanes_within_2x_of_torch_reference_error(case_idx):
    """The lane schedule (AttentionConfig.lanes_above: a balanced batch's row blocks side by side
    over the same keys) on every case, forced on wherever a batch is balanced."""
    import dataclasses

    from hstu.ops.triton_attention import default_config, paged_hstu_attention_triton

    c, exact, ref_err = attention_case(case_idx)
    poison_allocator(4 * c.q.numel() * 16)
    config = dataclasses.replace(default_config(c.q.shape[2]), lanes_above=0.0, kernel="triton")
    out = paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=config)
    err = rel_err(out, exact)
    assert err <= 2 * ref_err, f"triton in lanes {err:.2e} vs bf16 torch reference {ref_err:.2e}"


@pytest.mark.parametrize("case_idx", range(len(ATTN_CASES)))
@pytest.mark.parametrize("stages", [2, 3])
def test_triton_attention_tma_tiles_within_2x_of_torch_reference_error(case_idx, stages):
    """TMA key tiles (AttentionConfig.tma: one page a tile through a descriptor over the cache) on
    every case, with block_n the case's page size."""
    import dataclasses

    from hstu.ops.triton_attention import default_config, paged_hstu_attention_triton

    c, exact, ref_err = attention_case(case_idx)
    poison_allocator(4 * c.q.numel() * 16)
    page_size = c.kv_cache.shape[3]
    if page_size * c.q.shape[2] * 4 * stages + 128 * c.q.shape[2] * 2 > 227 * 1024:
        pytest.skip(f"{stages} stages of {page_size}-key tiles at head dim {c.q.shape[2]} exceed shared memory")
    config = dataclasses.replace(default_config(c.q.shape[2]), block_n=page_size, num_stages=stages, tma=True,
                                 kernel="triton")
    out = paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=config)
    err = rel_err(out, exact)
    assert err <= 2 * ref_err, f"triton with TMA tiles {err:.2e} vs bf16 torch reference {ref_err:.2e}"


def needs_hopper():
    from hstu.ops import gluon_attention

    if not gluon_attention.available():
        pytest.skip("the Gluon kernel needs Triton's Gluon and a Hopper GPU")


def gluon_config(head_dim: int):
    import dataclasses

    from hstu.ops.triton_attention import default_config

    return dataclasses.replace(default_config(head_dim), silu="tanh", kernel="gluon")


# The Gluon kernels' knobs (HSTU_GLUON_MASKED_TMA, HSTU_GLUON_WAVES, HSTU_GLUON_STREAM(_AUTO) and the stream
# kernel's HSTU_GLUON_LANES, HSTU_GLUON_OWN_TMA) as test variants; "default" is the modules' settings.
GLUON_VARIANTS = {
    "default": {}, "gathered": {"MASKED_TMA": False}, "waves3": {"WAVES": 3},
    "stream": {"STREAM": True}, "stream_plain": {"STREAM": True, "stream.LANES": False},
    "stream_gathered": {"STREAM": True, "stream.OWN_TMA": False, "MASKED_TMA": False},
    "stream_auto": {"STREAM_AUTO": True},  # the stream kernel where a launch's units reach a quarter of the SMs
}


def spy_gluon(monkeypatch, variant: str = "default") -> list:
    """Calls that reached the Gluon launch (so a test cannot pass on the Triton kernel), with the
    variant's knobs set ("stream." names: ops/gluon_stream_attention.py's)."""
    from hstu.ops import gluon_attention, gluon_stream_attention

    for name, value in GLUON_VARIANTS[variant].items():
        if name.startswith("stream."):
            monkeypatch.setattr(gluon_stream_attention, name.removeprefix("stream."), value)
        else:
            monkeypatch.setattr(gluon_attention, name, value)
    calls, real = [], gluon_attention.launch
    monkeypatch.setattr(gluon_attention, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("case_idx", range(len(ATTN_CASES)))
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("variant", ["default", "gathered", "stream", "stream_plain", "stream_gathered", "stream_auto"])
def test_gluon_attention_bf16_within_2x_of_torch_reference_error(monkeypatch, case_idx, num_splits, variant):
    """ops/gluon_attention.py on every case: whole units, and every unit cut into pieces."""
    from hstu.ops.triton_attention import paged_hstu_attention_triton

    needs_hopper()
    calls = spy_gluon(monkeypatch, variant)
    c, exact, ref_err = attention_case(case_idx)
    poison_allocator(4 * c.q.numel() * 16)
    out = paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len,
                                      config=gluon_config(c.q.shape[2]), num_splits=num_splits)
    err = rel_err(out, exact)
    assert calls and out.dtype == torch.bfloat16
    assert err <= 2 * ref_err, f"gluon {err:.2e} vs bf16 torch reference {ref_err:.2e}"


def gluon_seed_errors(c) -> tuple[torch.Tensor, float, float]:
    """The Gluon kernel's output on case c (head dim 256) and its error and the 16-bit torch
    implementation's, both against the torch implementation from float32 inputs on the GPU (the
    float64 loop would take minutes at these sizes; float32's error is ~1e-6 against bf16's ~3e-3)."""
    from hstu.ops.attention import paged_hstu_attention_torch
    from hstu.ops.triton_attention import paged_hstu_attention_triton

    m = c.meta

    def torch_attention(*tensors):
        return paged_hstu_attention_torch(*tensors, c.layer, m.page_table, m.kv_lens, m.q_batch, m.q_local, m.q_pos,
                                          m.max_q, c.scale_len)

    exact = torch_attention(*(t.float() for t in (c.q, c.k, c.v, c.kv_cache)))
    ref = torch_attention(c.q, c.k, c.v, c.kv_cache)
    out = paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len,
                                      config=gluon_config(256))
    return out, rel_err(out, exact), rel_err(ref, exact)


@pytest.mark.parametrize("users,page_size", [(8, 32), (1, 32), (3, 64), (2, 8)])
@pytest.mark.parametrize("variant", list(GLUON_VARIANTS))
def test_gluon_attention_at_seed_shapes_and_page_sizes(monkeypatch, users, page_size, variant):
    """Seed-like users (a 3,968-key prefix, 128 new rows, 256 candidates; one user new) at the
    schedule's whole-unit and cut-unit sizes, fp16 too, within 2x of the 16-bit torch error."""
    needs_hopper()
    calls = spy_gluon(monkeypatch, variant)
    dtype = torch.float16 if page_size == 64 else torch.bfloat16
    c = make_paged_case([4096] * users, [3968] * (users - 1) + [0], [256] * users, page_size=page_size, heads=4,
                        head_dim=256, dtype=dtype, device="cuda", seed=users)
    out, err, ref_err = gluon_seed_errors(c)
    assert calls and out.dtype == dtype
    assert err <= 2 * ref_err


@pytest.mark.parametrize("users,candidates", [(8, 256), (1, 256), (8, 200), (5, 256)])
@pytest.mark.parametrize("variant", ["stream", "stream_plain", "stream_gathered", "stream_auto"])
def test_gluon_stream_attention_at_cached_seed_shapes(monkeypatch, users, candidates, variant):
    """The stream kernel where stream-K runs: every user cached (3,968 keys, 128 new rows and the
    candidates), fewer units than SMs (batch 8 in lanes of 3; 200 candidates: a last own tile
    across the user's rows, gathered), within 2x of the bf16 torch error. stream_auto: batches 8 and
    5 (96 and 60 units) take the stream kernel, batch 1 (12 units) the default one (takes_stream)."""
    needs_hopper()
    calls = spy_gluon(monkeypatch, variant)
    c = make_paged_case([4096] * users, [3968] * users, [candidates] * users, page_size=32, heads=4, head_dim=256,
                        dtype=torch.bfloat16, device="cuda", seed=users + candidates)
    _, err, ref_err = gluon_seed_errors(c)
    assert calls and err <= 2 * ref_err


@pytest.mark.parametrize("lanes", [True, False])
def test_gluon_stream_plan_kernel_on_the_gpu_writes_the_reference_items(monkeypatch, lanes):
    from hstu.ops import gluon_stream_attention as gs

    needs_hopper()
    monkeypatch.setattr(gs, "LANES", lanes)
    for offs, kv in (([0, 384, 768, 769, 1153], [3968, 4096, 1, 0]), ([384 * b for b in range(9)], [4096] * 8)):
        for forced, sms in ((0, 132), (2, 132), (0, 8)):
            grid = gs.grid_programs(offs[-1], len(kv), 4, sms, forced)
            cap = gs.plan_capacity(offs[-1], len(kv), 4, grid)
            slots = gs.plan_slots(cap, sms, forced)
            items, starts = gs.write_items(torch.tensor(offs, dtype=torch.int32, device="cuda"),
                                           torch.tensor(kv, dtype=torch.int32, device="cuda"), 4, sms, forced, grid,
                                           cap, slots)
            want_items, want_starts = gs.plan_items(offs, kv, 4, sms, grid, cap, forced, lanes)
            used = want_starts[0]
            rows = max(want_starts[1 + used], slots)
            assert starts.tolist()[: used + 2] == want_starts[: used + 2]
            assert [tuple(r) for r in items.tolist()[:rows]] == want_items[:rows]


def test_gluon_plan_kernel_on_the_gpu_writes_the_reference_items():
    from hstu.ops import gluon_attention as ga

    needs_hopper()
    offs, kv, H, sms = [0, 384, 768, 769, 1153], [3968, 4096, 1, 0], 4, 132
    for forced, waves in ((0, 1), (2, 1), (0, 3)):
        grid = ga.grid_programs(offs[-1], 4, H, sms, forced, waves)
        items = ga.write_items(torch.tensor(offs, dtype=torch.int32, device="cuda"),
                               torch.tensor(kv, dtype=torch.int32, device="cuda"), H, sms, forced, grid, waves)
        assert [tuple(r) for r in items.tolist()] == ga.plan_items(offs, kv, H, sms, grid, forced, waves)


@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("kernel", ["triton", "gluon", "gluon_stream"])
def test_triton_attention_padded_like_a_graph_bucket_matches_the_batch(monkeypatch, kernel, num_splits):
    """A CUDA graph runs the batch padded to its bucket (rows past T, user slots past B with
    kv_len 0 and q_offsets at T): each kernel plans from the metadata on the device, so the padded
    call computes the same rows bit for bit, a lone user's key split included."""
    import dataclasses

    from hstu.ops.triton_attention import default_config, paged_hstu_attention_triton

    calls = None
    if kernel.startswith("gluon"):
        needs_hopper()
        calls = spy_gluon(monkeypatch, "stream" if kernel == "gluon_stream" else "default")
        cfg = gluon_config(256)
    else:
        cfg = dataclasses.replace(default_config(256), kernel="triton")
    c = make_paged_case([700], [640], [96], page_size=32, heads=2, head_dim=256, dtype=torch.bfloat16,
                        device="cuda", seed=11)
    T = c.q.shape[0]
    q, k, v, padded = padded_like_graph_bucket(c, rows=1024, user_slots=8)
    want = paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=cfg,
                                       num_splits=num_splits)
    got = paged_hstu_attention_triton(q, k, v, c.kv_cache, c.layer, padded, c.scale_len, config=cfg,
                                      num_splits=num_splits)
    assert calls is None or len(calls) == 2
    assert torch.equal(got[:T], want)
    assert rel_err(want, reference_fp64(c)) < 1e-2


def test_triton_attention_fp32_matches_fp64_reference():
    from hstu.ops.triton_attention import paged_hstu_attention_triton

    c = make_paged_case([500, 70], [450, 0], [33, 5], page_size=32, heads=2, head_dim=128, dtype=torch.float32,
                        device="cuda", seed=7)
    out = paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len)
    assert rel_err(out, reference_fp64(c)) < 1e-5


def test_paged_attention_dispatch_uses_triton_on_cuda(monkeypatch):
    from hstu.ops import attention, triton_attention

    calls = []
    real = triton_attention.paged_hstu_attention_triton
    monkeypatch.setattr(triton_attention, "paged_hstu_attention_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = make_paged_case([100], [64], [8], page_size=16, heads=2, head_dim=64, dtype=torch.bfloat16, device="cuda")
    out = attention.paged_hstu_attention(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len)
    assert calls and rel_err(out, reference_fp64(c)) < 1e-2


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_attention_opcheck(num_splits):
    from hstu.ops.triton_attention import default_config

    c = make_paged_case([200, 40], [150, 0], [16, 3], page_size=16, heads=2, head_dim=64, dtype=torch.bfloat16,
                        device="cuda", seed=3)
    m, cfg = c.meta, default_config(64)
    args = (c.q, c.k, c.v, c.kv_cache, c.layer, m.page_table, m.kv_lens, m.q_offsets, m.q_pos, m.max_q, c.scale_len,
            cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, num_splits)
    torch.library.opcheck(torch.ops.hstu.paged_hstu_attention.default, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_attention_under_torch_compile_matches_eager(dtype):
    """A torch.compile'd layer calls the attention through its custom op and must agree with the
    eager launch (as a triton_op, Inductor's own build of the kernel once failed to compile and
    later returned rows the kernel had not written)."""
    from hstu.ops.triton_attention import paged_hstu_attention_triton

    c = make_paged_case([300, 50], [256, 0], [20, 4], page_size=32, heads=2, head_dim=128, dtype=dtype,
                        device="cuda", seed=5)

    def layer(q, k, v, cache):
        return paged_hstu_attention_triton(q * 2, k, v, cache, c.layer, c.meta, c.scale_len) + 1

    torch._dynamo.reset()
    eager = layer(c.q, c.k, c.v, c.kv_cache)
    compiled = torch.compile(layer, fullgraph=True)(c.q, c.k, c.v, c.kv_cache)
    assert compiled.dtype == dtype
    torch.testing.assert_close(compiled, eager, atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    assert math.isfinite(float(compiled.float().abs().sum()))


# Rejections. Each runs in a child process, so a crash fails one test instead of the session: on the
# H200 image (2026-12-02) an error message that formatted an integer once segfaulted inside the
# extension (then built with -std=c++17 against torch's C++20 headers; fixed, see kv_checks.h).

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_pinned_lands_beside_a_bulk_copy_to_the_device(dtype):
    """read_pinned (a kernel through src's mapped address) on the current stream while another
    stream's 256 MiB H2D is in flight: the values land exactly (odd element counts included), and
    src's block is not handed out again before the kernel read it (the host allocator saw it)."""
    big_host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    big = torch.empty(big_host.shape, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    for n in (1, 37, 2048 * 3 + 5):
        src = torch.randn(n).to(dtype).pin_memory()
        dst = torch.full((n,), float("nan"), dtype=dtype, device="cuda")
        with torch.cuda.stream(side):
            big.copy_(big_host, non_blocking=True)
        kv_ops.read_pinned(dst, src)
        assert torch.equal(dst.cpu(), src)
        side.synchronize()
    ptr = src.data_ptr()
    torch.cuda._sleep(50_000_000)  # the stream busy, so the kernel is still pending when src is dropped
    kv_ops.read_pinned(dst, src)
    del src
    again = torch.empty(2048 * 3 + 5, dtype=dtype, pin_memory=True)
    assert again.data_ptr() != ptr, "the host allocator handed out a block a pending kernel still reads"
    torch.cuda.synchronize()


def _first_cuda_call_on_a_new_thread(op) -> None:
    """op() on a fresh thread, where it is the thread's first CUDA call (no context current yet)."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            op()
        except BaseException as exc:  # re-raised on the test's thread
            failures.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]


def test_pinned_copies_as_a_threads_first_cuda_call(monkeypatch):
    """read_pinned, write_pinned and the zerocopy onload as the first CUDA call of a new thread: the
    engine process's event-loop thread made none before its first graph batch staged its inputs by
    read_pinned, whose pointer query then found no device address (run HD, a 500)."""
    src = torch.arange(4099, dtype=torch.float32).pin_memory()
    dst = torch.zeros(4099, device="cuda")
    _first_cuda_call_on_a_new_thread(lambda: kv_ops.read_pinned(dst, src))
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)
    back = torch.zeros(4099).pin_memory()
    _first_cuda_call_on_a_new_thread(lambda: kv_ops.write_pinned(back, dst))
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    cache = torch.zeros((2, 10, 2, 8, 2, 64), device="cuda", dtype=torch.bfloat16)
    arena = torch.randn((4, 2, 2, 2, 8, 2, 64)).to(torch.bfloat16).pin_memory()
    slots, pages = torch.tensor([1], dtype=torch.int32), torch.tensor([[3, 4]], dtype=torch.int32)
    monkeypatch.setenv("HSTU_ONLOAD_IMPL", "zerocopy")
    _first_cuda_call_on_a_new_thread(lambda: kv_ops.onload_kvcache(cache, arena, slots, pages, 0))
    torch.cuda.synchronize()
    assert torch.equal(cache[0, 3:5].cpu(), arena[1, 0])


_REJECT_PRELUDE = """
import os, torch
from hstu.ops import kv_ops
cache = torch.zeros((2, 10, 2, 8, 2, 64), device="cuda", dtype=torch.bfloat16)
arena = torch.randn((4, 2, 2, 2, 8, 2, 64)).to(torch.bfloat16).pin_memory()
slots, pages = torch.tensor([1], dtype=torch.int32), torch.tensor([[3, 4]], dtype=torch.int32)
"""

REJECTIONS = {
    "zerocopy_pageable_arena": (
        "os.environ['HSTU_ONLOAD_IMPL'] = 'zerocopy'; kv_ops.onload_kvcache(cache, arena.clone(), slots, pages, 0)",
        "pinned",
    ),
    "write_pinned_pageable_dst": (
        "kv_ops.write_pinned(torch.zeros(8), torch.ones(8, device='cuda'))",
        "write_pinned needs dst in pinned memory",
    ),
    "read_pinned_pageable_src": (
        "kv_ops.read_pinned(torch.zeros(8, device='cuda'), torch.ones(8))",
        "read_pinned needs src in pinned memory",
    ),
    "unknown_onload_impl": (
        "os.environ['HSTU_ONLOAD_IMPL'] = 'dma'; kv_ops.onload_kvcache(cache, arena, slots, pages, 0)",
        "HSTU_ONLOAD_IMPL must be",
    ),
    "onload_page_out_of_range": (
        "kv_ops.onload_kvcache(cache, arena, slots, torch.tensor([[3, 10]], dtype=torch.int32), 0)",
        "page_ids values must lie in [0, 10)",
    ),
    "onload_slot_out_of_range": (
        "kv_ops.onload_kvcache(cache, arena, torch.tensor([4], dtype=torch.int32), pages, 0)",
        "slot_ids values must lie in [0, 4)",
    ),
    "store_slot_out_of_range": (
        "kv_ops.store_host_chunks(arena, torch.zeros((1, 2, 2, 2, 8, 2, 64), device='cuda', dtype=torch.bfloat16), "
        "torch.tensor([4], dtype=torch.int32))",
        "slot_ids values must lie in [0, 4)",
    ),
}


@pytest.mark.parametrize("name", list(REJECTIONS))
def test_rejects_bad_arguments_with_a_message(name):
    call, message = REJECTIONS[name]
    code = _REJECT_PRELUDE + f"""
try:
    {call}
except RuntimeError as e:
    print("RAISED:", str(e).splitlines()[0])
else:
    print("NO RAISE")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child exited with {proc.returncode}: {proc.stderr[-2000:]}"
    assert "RAISED:" in proc.stdout and message in proc.stdout, proc.stdout
