"""Paged HSTU attention in Gluon for Hopper: the same semantics and arguments as the Triton kernel
(ops/triton_attention.py, whose docstring states them), written where Triton cannot go. The
production attention wherever `fits` holds (run FA, H100, against the Triton kernel: batch 1 38 vs
42 us a layer, batch 8 151 vs 163, re-rank 8 93 vs 126, uncached 8 718 vs 774).

Why: the Gluon probe of the twenty-eighth session (scripts/overlap_probe.py) ran the cached key
loop 1.23-1.34x faster than the production Triton kernel on the same inputs (H100, run EA: batch 8
119 against 159 us, one full wave 133 against 179 us, 0.55-0.68 of the bf16 matmul peak): Q stays
in shared memory for both wgmma, K/V tiles arrive by TMA one page at a time into two stages, and
the kernel needs 209 registers with no spills where the Triton kernel spills at 255. (The probe's
FlashAttention-3 order, the next tile's Q K^T beside this tile's W V, was slower: 8 warps are two
warpgroups, whose SiLU and wgmma already interleave.)

Three launches, all graph-safe (every decision read from the batch's metadata on the device); the
plan once a forward, at layer 0, kept on the metadata for the other layers (planned):
  _plan_kernel (Triton)   writes ITEMS[g] for each program g: (user, first row, row end, head, first
                          key, key cap, piece, pieces, piece stride), user -1 for a program with no
                          work. A unit is a row block of BLOCK_M rows of one user and one head.
                          When the units number fewer than the SMs, each unit's keys may be cut
                          into `pieces` ranges of whole tiles (at most MAX_SPLITS and the longest
                          history's key tiles, units x pieces at most WAVES x SMs): the count whose
                          waves x (longest tiles / pieces + PIECE_COST) is least, the fewest on a
                          tie (choose_pieces). WAVES = 1 fills at most one wave (batch 1); 3
                          ran batch 8's 96 units on 132 SMs as 3 waves of quarter units, slower.
                          Items run user after user, then head, then piece, then row block, last
                          row block first: a user's row blocks read the same keys side by side (L2
                          reuse) and a causal history's longest blocks start first.
  _attention_kernel       one item a program: Q tile to shared memory; the key tiles whose keys are
                          all the history's by TMA (two stages, an mbarrier each, serial Q K^T /
                          SiLU / W V; those across the causal boundary masked by each row's last
                          key); the tile across the history's end gathered by masked cp.async
                          (zeros past it, never a stale page's rows); candidates' own keys from
                          k/v. A whole unit writes out, a piece its float32 sum to PART[g].
  _sum_pieces_kernel      adds each cut unit's pieces into out (nothing for a whole unit).

Layout assumed: kv_cache [L, P, 2, page_size, H, d] contiguous (keys at index 0, values at 1), seen
by TMA as [L * P * 2 * page_size, H * d] rows; q/k/v [T, H, d] with unit stride over d; 16-bit
dtypes; d in {64, 128, 256}; page_size a power of 2 from 8 to 256 (a 64-key tile is 64 // page_size
pages, or a slice of one page). `fits` says whether a call qualifies; others take the Triton kernel.
"""

from __future__ import annotations

import math
from typing import Callable, TypeVar

import torch

from hstu.ops import knobs
from hstu.ops.triton_attention import MAX_SPLITS, _grid_programs

try:
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from hstu.ops.triton_attention import _user_blocks
except ImportError:  # no Triton or no Gluon (CPU installs, older Triton): the Triton kernel or torch serves
    gluon = None

BLOCK_M, BLOCK_N, WARPS = 128, 64, 8
FIELDS = 9  # an item: user, row0, q_end, head, key_lo, key_cap, piece, pieces, piece stride
HEAD_DIMS = (64, 128, 256)
# A piece's fixed cost in key tiles: its Q tile, and its float32 partial written and read again.
PIECE_COST = 2
# HSTU_GLUON_WAVES: how many waves of pieces a batch of fewer units than SMs may be cut into; 1 = at
# most one wave. Run FA (H100): 3 waves took batch 8 from 154 to 159 us (4 pieces a unit), so 1.
WAVES = int(knobs.number("HSTU_GLUON_WAVES", 1, "waves of pieces a batch may be cut into", minimum=1))
# The key tiles across the causal boundary by TMA too, in the pipelined loop, masked there (run FA,
# H100: 1-2% faster at every seed shape than the single-buffered gather; HSTU_GLUON_MASKED_TMA=0
# gathers them, for comparisons).
MASKED_TMA = knobs.flag("HSTU_GLUON_MASKED_TMA", default=True)
# The plan written once a forward, by layer 0 (planned); HSTU_GLUON_PLAN_ONCE=0 writes it in
# every layer's call, for comparisons.
PLAN_ONCE = knobs.flag("HSTU_GLUON_PLAN_ONCE", default=True)
# HSTU_GLUON_STREAM=1: this kernel with a stream-K schedule and the own keys by TMA
# (ops/gluon_stream_attention.py) for every launch. Opt-in: run LA (H100, its sum kernel restored)
# put it ahead at batch 8 (128 against 145 us a layer) and mixed5 (83 against 126), level at the
# re-rank (89 / 88) and uncached (702-711 / 710-716), behind at batch 1 (36 against 33).
STREAM = knobs.flag("HSTU_GLUON_STREAM", default=False)
# HSTU_GLUON_STREAM_AUTO (default on; =0 for this kernel everywhere): the stream kernel only for
# launches whose row-block units reach STREAM_FROM_SMS of the SMs (takes_stream), where run LA saw it
# win; this kernel for the rest. The default since session 44 (H100): its CUDA, pipeline and graph
# tests passed, its seed replays verified at 0 mismatches, and batch 8 ran 3.05 against 3.16 ms.
STREAM_AUTO = knobs.flag("HSTU_GLUON_STREAM_AUTO", default=True)
STREAM_FROM_SMS = 0.25


_HOPPER: dict[int, bool] = {}


def available(device: torch.device | None = None) -> bool:
    """Gluon importable and a Hopper GPU (wgmma and TMA are sm_90 instructions); memoised per device."""
    if gluon is None or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _HOPPER:
        _HOPPER[index] = torch.cuda.get_device_capability(index)[0] == 9
    return _HOPPER[index]


def fits(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether this kernel serves the call: 16-bit CUDA tensors on Hopper, a supported head dim and page size."""
    page_size, d = kv_cache.shape[3], q.shape[2]
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d in HEAD_DIMS
            and 8 <= page_size <= 256 and page_size & (page_size - 1) == 0 and available(q.device))


def choose_pieces(units: int, longest_tiles: int, num_sms: int, forced_splits: int = 0, waves: int = WAVES) -> int:
    """Pieces each unit's keys are cut into (_plan_kernel computes the same on the device): the
    count p whose ceil(units p / SMs) waves of ceil(longest / p) + PIECE_COST tiles take least, the
    fewest on a tie, with p <= MAX_SPLITS and the longest tiles and units x p <= waves x SMs. Whole
    units once they fill the SMs: their waves are left to the hardware's dispatch, which packs a
    causal history's short row blocks behind its long ones."""
    if forced_splits > 0:
        return min(forced_splits, MAX_SPLITS)
    best, best_cost = 1, -(-units // num_sms) * (longest_tiles + PIECE_COST)
    if units >= num_sms:
        return best
    for p in range(2, min(MAX_SPLITS, longest_tiles) + 1):
        if units * p > waves * num_sms:
            break
        cost = -(-units * p // num_sms) * (-(-longest_tiles // p) + PIECE_COST)
        if cost < best_cost:
            best, best_cost = p, cost
    return best


def plan_items(q_offsets: list[int], kv_lens: list[int], heads: int, num_sms: int, grid: int,
               forced_splits: int = 0, waves: int = WAVES) -> list[tuple[int, ...]]:
    """The items _plan_kernel writes, in Python: the reference its test holds the kernel to, and
    the schedule's definition (see the module docstring). Returns `grid` tuples of FIELDS ints."""
    blocks = [-(-(q_offsets[b + 1] - q_offsets[b]) // BLOCK_M) for b in range(len(kv_lens))]
    longest = max([-(-kv // BLOCK_N) for kv in kv_lens] + [1])
    splits = choose_pieces(sum(blocks) * heads, longest, num_sms, forced_splits, waves)
    items = []
    for b, (n, kv) in enumerate(zip(blocks, kv_lens)):
        tiles = max(-(-kv // BLOCK_N), 1)
        for h in range(heads):
            for p in range(splits):
                for rev in range(n):
                    block = n - 1 - rev
                    key_cap = kv if p == splits - 1 else (p + 1) * tiles // splits * BLOCK_N
                    items.append((b, q_offsets[b] + block * BLOCK_M, q_offsets[b + 1], h, p * tiles // splits * BLOCK_N,
                                  key_cap, p, splits, n))
    items = items[:grid]
    return items + [(-1, 0, 0, 0, 0, 0, 0, 1, 0)] * (grid - len(items))


Plan = TypeVar("Plan")


def planned(plans: dict | None, layer: int, key: tuple, write: Callable[[], Plan]) -> Plan:
    """A forward's schedule, for either Gluon kernel: written by layer 0's call and kept in `plans`
    (the metadata's attention_plans), which the later layers of the same forward read instead of
    launching the plan kernels again (run GA, H100: 7 us a layer at batch 1 and 8). Layer 0 always
    writes afresh: a forward (eager, a whole-forward graph, or the first of its per-layer segment
    graphs) starts there, and a graph bucket's metadata takes new contents before each replay.
    Without `plans` (a bare call) or with HSTU_GLUON_PLAN_ONCE=0, every call writes its own. `key`
    names the launch shape (and the kernel), so another shape never reads this one's plan."""
    if not PLAN_ONCE:
        plans = None
    if plans is not None and layer > 0 and key in plans:
        return plans[key]
    plan = write()
    if plans is not None:
        plans.clear()  # one plan a batch: whatever another shape wrote is not this forward's
        plans[key] = plan
    return plan


def takes_stream(rows: int, heads: int, num_sms: int) -> bool:
    """Whether a launch of `rows` query rows runs the stream kernel: always under HSTU_GLUON_STREAM,
    else under HSTU_GLUON_STREAM_AUTO when its units (at least ceil(rows / BLOCK_M) x heads: each
    user's rows start a row block, so a mixed batch has more) reach STREAM_FROM_SMS of the SMs.
    A few units are cut into pieces by this kernel's plan as well as by stream-K, and there
    stream-K's second plan kernel and item overhead lost (run LA, batch 1: 12 units, 36 against 33
    us a layer). More units leave SMs idle for a wave under this kernel, which stream-K's equal
    shares fill: batch 8 (96 units, 128 against 145 us), mixed5 (40 by this bound, 104 in fact: 83
    against 126); the re-rank (64) and uncached batches were level. A function of the launch's
    static shapes, so a CUDA graph keeps its choice."""
    if STREAM:
        return True
    return STREAM_AUTO and -(-rows // BLOCK_M) * heads >= STREAM_FROM_SMS * num_sms


def grid_programs(rows: int, users: int, heads: int, num_sms: int, forced_splits: int, waves: int = WAVES) -> int:
    """Programs a call launches (fixed for a CUDA graph's bucket): the Triton kernel's count at
    BLOCK_M rows, with room for `waves` waves of pieces."""
    return _grid_programs(rows, users, heads, BLOCK_M, num_sms * waves, forced_splits)


if gluon is not None:

    @triton.jit(do_not_specialize=["num_users", "forced_splits", "grid"])
    def _plan_kernel(
        Q_OFF, KV_LENS, ITEMS, num_users, num_heads, num_sms, forced_splits, grid,
        MAX_USERS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        WAVES: tl.constexpr, PIECE_COST: tl.constexpr, MAX_SPLITS: tl.constexpr, FIELDS: tl.constexpr,
    ):
        """ITEMS[g] for BLOCK_G programs g; plan_items (choose_pieces) is its reference."""
        users = tl.arange(0, MAX_USERS)
        q_lo, q_hi, kv, blocks = _user_blocks(Q_OFF, KV_LENS, num_users, MAX_USERS, BLOCK_M)
        units = tl.sum(blocks, axis=0) * num_heads
        longest = tl.maximum(tl.max((kv + BLOCK_N - 1) // BLOCK_N, axis=0), 1)
        splits = units * 0 + 1
        best = (units + num_sms - 1) // num_sms * (longest + PIECE_COST)
        for p in tl.static_range(2, MAX_SPLITS + 1):
            cost = (units * p + num_sms - 1) // num_sms * ((longest + p - 1) // p + PIECE_COST)
            better = (units < num_sms) & (p <= longest) & (units * p <= WAVES * num_sms) & (cost < best)
            splits = tl.where(better, p, splits)
            best = tl.where(better, cost, best)
        splits = tl.where(forced_splits > 0, tl.minimum(forced_splits, MAX_SPLITS), splits)
        count = blocks * num_heads * splits
        ends = tl.cumsum(count, axis=0)
        starts = ends - count

        g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
        b = tl.sum((ends[None, :] <= g[:, None]).to(tl.int32), axis=1)
        mine = users[None, :] == b[:, None]
        n = tl.maximum(tl.sum(tl.where(mine, blocks[None, :], 0), axis=1), 1)
        local = g - tl.sum(tl.where(mine, starts[None, :], 0), axis=1)
        kv_b = tl.sum(tl.where(mine, kv[None, :], 0), axis=1)
        block = n - 1 - local % n
        rest = local // n
        p = rest % splits
        tiles = tl.maximum((kv_b + BLOCK_N - 1) // BLOCK_N, 1)
        key_cap = tl.where(p == splits - 1, kv_b, (p + 1) * tiles // splits * BLOCK_N)
        work = g < tl.max(ends, axis=0)
        fields = (
            tl.where(work, b, -1),
            tl.where(work, tl.sum(tl.where(mine, q_lo[None, :], 0), axis=1) + block * BLOCK_M, 0),
            tl.where(work, tl.sum(tl.where(mine, q_hi[None, :], 0), axis=1), 0),
            tl.where(work, rest // splits, 0),
            tl.where(work, p * tiles // splits * BLOCK_N, 0),
            tl.where(work, key_cap, 0),
            tl.where(work, p, 0),
            tl.where(work, splits, 1),
            tl.where(work, n, 0),
        )
        in_grid = g < grid
        for i in tl.static_range(FIELDS):
            tl.store(ITEMS + g * FIELDS + i, fields[i], mask=in_grid)

    @gluon.jit
    def _silu(s):
        """SiLU by tanh.approx (one special-function op; the Triton kernel's default "tanh" form)."""
        half = 0.5 * s
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [half], dtype=gl.float32, is_pure=True,
                                      pack=1)
        return half + half * t

    @gluon.jit
    def _issue_tile(k_buf, v_buf, bar, KV_DESC, pt_row, start, layer_row0, h,
                    HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BOX: gl.constexpr, BLOCK_N: gl.constexpr):
        """TMA copies of keys start.. (< start + BLOCK_N, all in the user's pages) into one stage,
        BOX rows a copy (a page, or a slice of one), signalling `bar` when all have landed."""
        mbarrier.expect(bar, 2 * (BLOCK_N // BOX) * KV_DESC.block_type.nbytes)
        for i in gl.static_range(BLOCK_N // BOX):
            key = start + i * BOX
            row = layer_row0 + gl.load(pt_row + key // PAGE_SIZE) * (2 * PAGE_SIZE) + key % PAGE_SIZE
            tma.async_copy_global_to_shared(KV_DESC, [row, h * HEAD_DIM], bar, k_buf.slice(i * BOX, BOX))
            tma.async_copy_global_to_shared(KV_DESC, [row + PAGE_SIZE, h * HEAD_DIM], bar, v_buf.slice(i * BOX, BOX))

    @gluon.jit
    def _gathered_step(acc, q_smem, k_buf, v_buf, k_ptrs, v_ptrs, ld_mask, keep, SCALE: gl.constexpr,
                       s_layout: gl.constexpr, w_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       dtype: gl.constexpr):
        """One key tile by masked cp.async (rows outside ld_mask read as zeros), its weights kept
        only where `keep` ([BLOCK_M, BLOCK_N] in s_layout) holds."""
        async_copy.async_copy_global_to_shared(k_buf, k_ptrs, mask=ld_mask)
        async_copy.async_copy_global_to_shared(v_buf, v_ptrs, mask=ld_mask)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        w = gl.where(keep, _silu(s * SCALE), 0.0).to(dtype)
        w = gl.convert_layout(w, w_layout)
        acc = warpgroup_mma(w, v_buf, acc, is_async=True)
        acc, w = warpgroup_mma_wait(0, deps=(acc, w))
        gl.thread_barrier()  # every warp done reading the buffers before they are refilled
        return acc

    @gluon.jit
    def _gather_history(acc, q_smem, k_buf, v_buf, KV, pt_row, key_lo, key_hi, kv_len, last_key, layer_offset, h,
                        page_stride, token_stride, kv_stride, SCALE: gl.constexpr, s_layout: gl.constexpr,
                        w_layout: gl.constexpr, load: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, dtype: gl.constexpr):
        """The cache's key tiles key_lo.. (< key_hi) gathered by masked cp.async (zeros past kv_len:
        never a stale page's rows), each row keeping the keys up to its last."""
        keys_ld = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load))
        keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        dd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load))
        kv_base = KV + layer_offset + h * HEAD_DIM
        for start in range(key_lo, key_hi, BLOCK_N):
            keys = start + keys_ld
            key_ok = keys < kv_len
            page = gl.load(pt_row + keys // PAGE_SIZE, mask=key_ok, other=0).to(gl.int64)
            k_ptrs = kv_base + gl.expand_dims(page * page_stride + (keys % PAGE_SIZE) * token_stride, 1) \
                + gl.expand_dims(dd, 0)
            ld_mask = gl.expand_dims(key_ok, 1) & gl.expand_dims(dd < HEAD_DIM, 0)
            keep = gl.expand_dims(start + keys_s, 0) <= gl.expand_dims(last_key, 1)
            acc = _gathered_step(acc, q_smem, k_buf, v_buf, k_ptrs, k_ptrs + kv_stride, ld_mask, keep, SCALE, s_layout,
                                 w_layout, BLOCK_M, BLOCK_N, dtype)
        return acc

    @gluon.jit
    def _gather_own(acc, q_smem, k_buf, v_buf, K, V, own_lo, own_hi, q_end, rows_s, is_cand, h, stride_kt, stride_kh,
                    stride_vt, stride_vh, SCALE: gl.constexpr, s_layout: gl.constexpr, w_layout: gl.constexpr,
                    load: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    dtype: gl.constexpr):
        """The block's own k/v rows own_lo.. (< own_hi) as key tiles gathered by masked cp.async
        (zeros past q_end), each candidate row keeping only its own key (not in the cache)."""
        keys_ld = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load))
        keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        dd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load))
        for start in range(own_lo, own_hi, BLOCK_N):
            own = start + keys_ld
            ld_mask = gl.expand_dims(own < q_end, 1) & gl.expand_dims(dd < HEAD_DIM, 0)
            k_ptrs = K + gl.expand_dims(own * stride_kt + h * stride_kh, 1) + gl.expand_dims(dd, 0)
            v_ptrs = V + gl.expand_dims(own * stride_vt + h * stride_vh, 1) + gl.expand_dims(dd, 0)
            keep = (gl.expand_dims(start + keys_s, 0) == gl.expand_dims(rows_s, 1)) & gl.expand_dims(is_cand, 1)
            acc = _gathered_step(acc, q_smem, k_buf, v_buf, k_ptrs, v_ptrs, ld_mask, keep, SCALE, s_layout, w_layout,
                                 BLOCK_M, BLOCK_N, dtype)
        return acc

    @gluon.jit
    def _write_rows(acc, OUT, PART, slot, row0, q_end, h, pieces, stride_ot, stride_oh, INV_SCALE_LEN: gl.constexpr,
                    o_layout: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, dtype: gl.constexpr):
        """A unit's scaled sums: to out when whole, else in float32 to PART[slot] (summed later)."""
        acc = acc * INV_SCALE_LEN
        out_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        out_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        out_mask = gl.expand_dims(out_rows < q_end, 1)
        if pieces == 1:
            out_ptrs = OUT + gl.expand_dims(out_rows * stride_ot + h * stride_oh, 1) + gl.expand_dims(out_d, 0)
            gl.store(out_ptrs, acc.to(dtype), mask=out_mask)
        else:
            tile = gl.expand_dims((out_rows - row0) * HEAD_DIM, 1) + gl.expand_dims(out_d, 0)
            gl.store(PART + slot.to(gl.int64) * (BLOCK_M * HEAD_DIM) + tile, acc, mask=out_mask)

    # max_pages changes with the batch: not specialised, so a new batch never pays a JIT compile
    # (as the Triton kernel; the other integers are strides and offsets fixed by the model and cache)
    @gluon.jit(do_not_specialize=["max_pages"])
    def _attention_kernel(
        Q, K, V, KV, KV_DESC, PT, KV_LENS, Q_POS, ITEMS, OUT, PART,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        layer_offset, page_stride, token_stride, kv_stride, max_pages, layer_row0,
        SCALE: gl.constexpr, INV_SCALE_LEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BOX: gl.constexpr, FIELDS: gl.constexpr,
        MASKED_TMA: gl.constexpr = False,
    ):
        g = gl.program_id(0)
        item = ITEMS + g * FIELDS
        b = gl.load(item)
        if b < 0:  # no work for this program in this batch
            return
        row0 = gl.load(item + 1)
        q_end = gl.load(item + 2)
        h = gl.load(item + 3)
        key_lo = gl.load(item + 4)
        key_cap = gl.load(item + 5)
        piece = gl.load(item + 6)
        pieces = gl.load(item + 7)
        kv_len = gl.load(KV_LENS + b)
        dtype: gl.constexpr = Q.dtype.element_ty

        load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [gl.num_warps(), 1], [16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [gl.num_warps(), 1], [16, HEAD_DIM, 16])
        w_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_shared)
        k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], kv_shared)
        v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], kv_shared)
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bars.index(0), count=1)
        mbarrier.init(bars.index(1), count=1)

        # Each row's last key (-1 for rows past the user's): keys below lo_all every row sees.
        rows_s = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        row_ok = rows_s < q_end
        q_pos = gl.load(Q_POS + rows_s, mask=row_ok, other=0).to(gl.int32)
        is_cand = q_pos < 0
        last_key = gl.where(row_ok, gl.where(is_cand, kv_len - 1, q_pos), -1)
        key_hi = gl.minimum(key_cap, gl.max(last_key, axis=0) + 1)
        lo_all = gl.min(gl.where(row_ok, last_key, 2147483647), axis=0) + 1
        n_full = gl.maximum(gl.minimum(key_hi, lo_all) - key_lo, 0) // BLOCK_N
        if MASKED_TMA:  # also the tiles across the causal boundary, whose keys are all the history's
            n_tma = gl.maximum(gl.minimum(key_hi - key_lo + BLOCK_N - 1, kv_len - key_lo) // BLOCK_N, n_full)
        else:
            n_tma = n_full
        tma_hi = key_lo + n_tma * BLOCK_N

        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load))
        dd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load))
        q_ptrs = Q + gl.expand_dims(rows * stride_qt + h * stride_qh, 1) + gl.expand_dims(dd, 0)
        q_smem.store(gl.load(q_ptrs, mask=gl.expand_dims(rows < q_end, 1), other=0.0))
        fence_async_shared()  # every thread's Q stores ordered before the wgmma reads them
        gl.thread_barrier()

        pt_row = PT + b.to(gl.int64) * max_pages
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        # Tiles every row sees in full (with MASKED_TMA also those across the causal boundary,
        # masked by each row's last key): TMA into two stages, tile j + 2 issued once tile j is done.
        if n_tma > 0:
            _issue_tile(k_smem.index(0), v_smem.index(0), bars.index(0), KV_DESC, pt_row, key_lo, layer_row0, h,
                        HEAD_DIM, PAGE_SIZE, BOX, BLOCK_N)
        if n_tma > 1:
            _issue_tile(k_smem.index(1), v_smem.index(1), bars.index(1), KV_DESC, pt_row, key_lo + BLOCK_N,
                        layer_row0, h, HEAD_DIM, PAGE_SIZE, BOX, BLOCK_N)
        for j in range(n_tma):
            stage = j % 2
            mbarrier.wait(bars.index(stage), (j // 2) % 2)
            s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            w = _silu(s * SCALE)
            if MASKED_TMA:
                if j >= n_full:
                    keep = gl.expand_dims(key_lo + j * BLOCK_N + keys_s, 0) <= gl.expand_dims(last_key, 1)
                    w = gl.where(keep, w, 0.0)
            w = gl.convert_layout(w.to(dtype), w_layout)
            acc = warpgroup_mma(w, v_smem.index(stage), acc, is_async=True)
            acc, w = warpgroup_mma_wait(0, deps=(acc, w))
            gl.thread_barrier()  # every warp's wgmma done reading stage j before it is refilled
            if j + 2 < n_tma:
                _issue_tile(k_smem.index(stage), v_smem.index(stage), bars.index(stage), KV_DESC, pt_row,
                            key_lo + (j + 2) * BLOCK_N, layer_row0, h, HEAD_DIM, PAGE_SIZE, BOX, BLOCK_N)
        mbarrier.invalidate(bars.index(0))
        mbarrier.invalidate(bars.index(1))

        # Tiles across the causal boundary (unless MASKED_TMA) or the history's end: gathered, masked.
        acc = _gather_history(acc, q_smem, k_smem.index(0), v_smem.index(0), KV, pt_row, tma_hi, key_hi, kv_len, last_key,
                              layer_offset, h, page_stride, token_stride, kv_stride, SCALE, s_layout, w_layout, load,
                              BLOCK_M, BLOCK_N, HEAD_DIM, PAGE_SIZE, dtype)
        # Candidates also see their own key (not in the cache): the block's k/v rows as key tiles.
        if (piece == 0) & (gl.max(is_cand.to(gl.int32), axis=0) > 0):
            acc = _gather_own(acc, q_smem, k_smem.index(0), v_smem.index(0), K, V, row0, row0 + BLOCK_M, q_end, rows_s,
                              is_cand, h, stride_kt, stride_kh, stride_vt, stride_vh, SCALE, s_layout, w_layout, load,
                              BLOCK_M, BLOCK_N, HEAD_DIM, dtype)
        _write_rows(acc, OUT, PART, g, row0, q_end, h, pieces, stride_ot, stride_oh, INV_SCALE_LEN, o_layout, BLOCK_M,
                    HEAD_DIM, dtype)

    @triton.jit
    def _sum_pieces_kernel(ITEMS, PART, OUT, stride_ot, stride_oh, FIELDS: tl.constexpr, BLOCK_M: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
        """out of a cut unit's rows (BLOCK_R of them a program) = the sum of its pieces' PART tiles,
        read where its first piece's item points (its pieces sit `stride` items apart)."""
        g = tl.program_id(0) // (BLOCK_M // BLOCK_R)
        chunk = tl.program_id(0) % (BLOCK_M // BLOCK_R)
        item = ITEMS + g * FIELDS
        b = tl.load(item)
        piece = tl.load(item + 6)
        pieces = tl.load(item + 7)
        if (b >= 0) & (pieces > 1) & (piece == 0):
            row0 = tl.load(item + 1)
            q_end = tl.load(item + 2)
            h = tl.load(item + 3)
            stride = tl.load(item + 8)
            r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
            dd = tl.arange(0, HEAD_DIM)
            mask = (row0 + r < q_end)[:, None]
            offs = r[:, None] * HEAD_DIM + dd[None, :]
            acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
            for p in range(pieces):
                slot = (g + p * stride).to(tl.int64)
                acc += tl.load(PART + slot * (BLOCK_M * HEAD_DIM) + offs, mask=mask, other=0.0)
            out_ptrs = OUT + (row0 + r)[:, None] * stride_ot + h * stride_oh + dd[None, :]
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)

    def _kv_descriptor(kv_cache: torch.Tensor, box: int) -> "TensorDescriptor":
        """The cache as [L * P * 2 * page_size, H * d] rows, a [box, d] block (one page of one head, or a slice)."""
        L, P, two, page, H, d = kv_cache.shape
        dtype = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16
        layout = gl.NVMMASharedLayout.get_default_for([box, d], dtype)
        rows = L * P * two * page
        return TensorDescriptor(kv_cache.view(rows, H * d), [rows, H * d], [H * d, 1], [box, d], layout)

    def write_items(q_offsets: torch.Tensor, kv_lens: torch.Tensor, heads: int, num_sms: int, forced_splits: int,
                    grid: int, waves: int = WAVES) -> torch.Tensor:
        """ITEMS [grid, FIELDS] int32 on the metadata's device, written by _plan_kernel (plan_items' items)."""
        B = kv_lens.shape[0]
        items = torch.empty((grid, FIELDS), dtype=torch.int32, device=kv_lens.device)
        block_g = 64
        _plan_kernel[(triton.cdiv(grid, block_g),)](
            q_offsets, kv_lens, items, B, heads, num_sms, forced_splits, grid,
            MAX_USERS=max(64, triton.next_power_of_2(B + 1)), BLOCK_G=block_g, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            WAVES=waves, PIECE_COST=PIECE_COST, MAX_SPLITS=MAX_SPLITS, FIELDS=FIELDS, num_warps=4,
        )
        return items

    def launch(q, k, v, kv_cache, layer, page_table, kv_lens, q_offsets, q_pos, scale_len: int,
               num_sms: int, num_splits: int = 0, plans: dict | None = None) -> torch.Tensor:
        """The attention output [T, H, d] in q's dtype (the Triton op's contract); num_splits > 0
        cuts every unit into that many pieces (tests). plans: the metadata's attention_plans, so
        one plan serves every layer of a forward (planned)."""
        if takes_stream(q.shape[0], q.shape[1], num_sms):
            from hstu.ops import gluon_stream_attention

            return gluon_stream_attention.launch(q, k, v, kv_cache, layer, page_table, kv_lens, q_offsets, q_pos,
                                                 scale_len, num_sms, num_splits, plans)
        T, H, d = q.shape
        L, P, _, page_size, _, _ = kv_cache.shape
        B, max_pages = page_table.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if T == 0 or B == 0:
            return out
        num_splits = min(num_splits, MAX_SPLITS)
        grid = grid_programs(T, B, H, num_sms, num_splits, WAVES)
        items = planned(plans, layer, (H, num_sms, num_splits, grid, WAVES),
                        lambda: write_items(q_offsets, kv_lens, H, num_sms, num_splits, grid, WAVES))
        # only items of cut units write PART: without forced pieces they number at most WAVES waves
        slots = grid if num_splits > 0 else num_sms * WAVES
        part = torch.empty((slots, BLOCK_M, d), dtype=torch.float32, device=q.device)
        box = min(page_size, BLOCK_N)
        _attention_kernel[(grid,)](
            q, k, v, kv_cache, _kv_descriptor(kv_cache, box), page_table, kv_lens, q_pos, items, out, part,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            layer * kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(3), kv_cache.stride(2), max_pages,
            layer * P * 2 * page_size,
            SCALE=1.0 / math.sqrt(d), INV_SCALE_LEN=1.0 / scale_len, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=d,
            PAGE_SIZE=page_size, BOX=box, FIELDS=FIELDS, MASKED_TMA=MASKED_TMA, num_warps=WARPS,
        )
        block_r = 8
        _sum_pieces_kernel[(slots * (BLOCK_M // block_r),)](
            items, part, out, out.stride(0), out.stride(1), FIELDS=FIELDS, BLOCK_M=BLOCK_M, HEAD_DIM=d,
            BLOCK_R=block_r, num_warps=4,
        )
        return out
