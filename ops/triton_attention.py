"""Paged HSTU attention in Triton, registered as the custom op hstu::paged_hstu_attention.

Semantics are those of hstu.ops.attention (see its docstring): no softmax,
o_r = sum_j SiLU(q_r . k_j / sqrt(d)) v_j / scale_len over the keys row r sees: a history row at
position p sees the user's cached keys 0..p, a candidate row (q_pos == -1) sees all kv_lens[b]
history keys plus its own k_r, v_r. Accumulated in float32, returned in q's dtype.

Shapes and dtypes:
  q, k, v    [T, H, d] (any token/head strides, unit stride over d), bf16 / fp16 / fp32
  kv_cache   [L, P, 2, page_size, H, d] contiguous, same dtype; keys of user b, position j, live at
             kv_cache[layer, page_table[b, j // page_size], 0, j % page_size] (values at index 1)
  page_table [B, max_pages] int32; kv_lens [B] int32; q_offsets [B+1] int32; q_pos [T] int64
  returns    [T, H, d] in q's dtype

Kernel: one program per (block of BLOCK_M query rows of one user, head, key split). It loads its
Q tile once, walks K/V tiles of BLOCK_N keys gathered row by row through the page table (fp32
accumulation, SiLU weights cast to the value dtype for the second matmul), and masks only the tiles
that cross the causal boundary. Because there is no softmax, the key range can be split over
several programs whose partial outputs simply add: with few users (batch 1) the key range is split
so that the grid fills the GPU, and the float32 partials are summed by a second kernel.
Every program reads the batch's plan (each user's row blocks, the split count) from the metadata
on the device (_batch_plan): the grid depends on the row count and the users' capacity only, so a
CUDA graph captured for a row bucket still splits a batch of one user and does not launch a
program per (user slot, row block of the whole bucket).

SiLU: each score costs an exponential and a division on the SMs' special-function units, which
at head dim 256 is about half the tensor-core time of the two matmuls around it. Three forms
(AttentionConfig.silu): "exact" (tl.sigmoid, IEEE division), "fast" (exp2 and an approximate
division: two special-function ops, 2 ulp) and "tanh" (s/2 (1 + tanh(s/2)) with tanh.approx: one
op, ~2^-11 relative error, below bf16's rounding of the weights it feeds). float32 inputs always
take "exact" (the fp32 oracle is 1e-5). 16-bit inputs default to "tanh": on the H200 at the seed
shapes it ran the kernel 1.41x faster than "exact" (fast: 1.25x) with the same error against the
torch implementation (2.6e-3) and inside the 2x bf16 bound of the tests (benchmarks/RESULTS.md,
run AP). HSTU_ATTENTION_SILU overrides the default (an experiment knob for same-call comparisons).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch implementation serves.
    triton = None


def available() -> bool:
    """True when the Triton kernel can run here: triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()


SILU_MODES = ("exact", "fast", "tanh")


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch parameters of the kernel; silu is one of SILU_MODES (16-bit inputs
    only), warp_specialize asks Triton to split the unmasked key loop into producer and consumer
    warps."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    silu: str = "exact"
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        if self.silu not in SILU_MODES:
            raise ValueError(f"AttentionConfig.silu must be one of {SILU_MODES}, got {self.silu!r}")


def _silu_from_env() -> str:
    mode = os.environ.get("HSTU_ATTENTION_SILU", "tanh")
    if mode not in SILU_MODES:
        raise ValueError(f"HSTU_ATTENTION_SILU must be one of {SILU_MODES}, got {mode!r}")
    return mode


# Module-level instances, so torch.compile sees constants rather than dataclass construction.
_SILU = _silu_from_env()
_CONFIG_LARGE_HEAD = AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, silu=_SILU)
_CONFIG_SMALL_HEAD = AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, silu=_SILU)


def default_config(head_dim: int) -> AttentionConfig:
    """Tile configuration for a head dim. Head dims > 128: the fastest of an 8-config sweep on
    H200 at the seed shapes (benchmarks/RESULTS.md); <= 128: not tuned yet (tested only)."""
    return _CONFIG_LARGE_HEAD if head_dim > 128 else _CONFIG_SMALL_HEAD


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# Key splits: at most this many per batch (batch 1 at the seed shapes wants 11), and the float32
# partials of a split batch live in one buffer of rows (split, row), bounded below.
MAX_SPLITS = 32


def _partial_rows(rows: int, heads: int, block_m: int, num_sms: int, num_splits: int):
    """Rows of the float32 partial buffer. A forced split count may split any batch. The automatic
    rule splits only while the programs (row blocks x heads, P) cover under half the SMs, into at
    most 2 cdiv(SMs, P) splits, so splits x row blocks < 3 SMs / heads; the kernel never splits
    past what the buffer holds either way."""
    if num_splits > 0:
        return rows * min(num_splits, MAX_SPLITS)
    return min(rows * MAX_SPLITS, 3 * triton.cdiv(num_sms, heads) * block_m)


def _extra_programs(row_programs: int, heads: int, num_sms: int, num_splits: int) -> int:
    """Programs per head beyond the row blocks, for the key splits >= 1 of a split batch: row blocks
    x (splits - 1), bounded as in _partial_rows. They return at once when the batch is not split."""
    if num_splits > 0:
        return row_programs * (min(num_splits, MAX_SPLITS) - 1)
    return 3 * triton.cdiv(num_sms, heads)


# Triton 3.6's interpreter (TRITON_INTERPRET=1, the CPU test path) runs tl.dot on bf16's uint16
# storage; there the operands are upcast first, which computes the same products (bf16 x bf16 is
# exact in float32) with the same float32 accumulation.
if triton is not None:
    _UPCAST_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b accumulated in float32; IEEE: exact float32 products (no tf32) for fp32 inputs."""
        if _UPCAST_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _silu(s, MODE: tl.constexpr):
        """SiLU of float32 scores; MODE indexes SILU_MODES (the module docstring says why three)."""
        if MODE == 1 or (MODE == 2 and _UPCAST_DOT):  # the interpreter has no inline PTX
            return tl.fdiv(s, 1.0 + tl.exp2(s * -1.4426950408889634), ieee_rounding=False)
        elif MODE == 2:
            half = 0.5 * s
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [half], dtype=tl.float32, is_pure=True, pack=1
            )
            return half + half * t
        else:
            return s * tl.sigmoid(s)

    @triton.jit
    def _batch_plan(
        Q_OFF, KV_LENS, num_users, num_heads, num_sms, forced_splits, part_rows, extra_programs,
        MAX_USERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
    ):
        """The batch's work, read from its metadata on the device, so that a CUDA graph replays
        each batch's own decision rather than the captured one's: per user its first row, end row,
        key count, row blocks and the running sum of blocks; the key splits, key blocks per split
        and the batch's rows.

        Splits (forced_splits > 0 takes that many): none when the programs P (row blocks x heads)
        cover half the SMs (H200, seed shapes: batch 8 = 96 programs on 132 SMs ran 241 us unsplit,
        262-289 us split 2-4 ways), else SMs // P, so that one wave holds them all (batch 1 = 12
        programs: 11 splits, 57 us against 228 us unsplit); never more than the key blocks, the
        partial buffer's part_rows hold, or the grid's extra_programs run (row blocks x (splits - 1))."""
        users = tl.arange(0, MAX_USERS)
        live = users < num_users
        q_lo = tl.load(Q_OFF + users, mask=live, other=0)
        q_hi = tl.load(Q_OFF + users + 1, mask=live, other=0)
        kv = tl.load(KV_LENS + users, mask=live, other=0)
        blocks = tl.where(live, (q_hi - q_lo + BLOCK_M - 1) // BLOCK_M, 0)
        ends = tl.cumsum(blocks, axis=0)
        programs = tl.sum(blocks, axis=0) * num_heads
        key_blocks = tl.maximum((tl.max(tl.where(blocks > 0, kv, 0), axis=0) + BLOCK_N - 1) // BLOCK_N, 1)
        # As many splits as whole copies of the programs fit on the SMs: at least half full.
        best = tl.minimum(tl.minimum(num_sms // tl.maximum(programs, 1), key_blocks), MAX_SPLITS)
        best = tl.where(2 * programs >= num_sms, 1, best)
        forced = tl.cdiv(key_blocks, tl.cdiv(key_blocks, tl.maximum(tl.minimum(tl.minimum(forced_splits, MAX_SPLITS), key_blocks), 1)))
        splits = tl.where(forced_splits > 0, forced, best)
        total_rows = tl.max(tl.where(live, q_hi, 0), axis=0)
        total_blocks = tl.maximum(tl.max(ends, axis=0), 1)
        splits = tl.minimum(splits, tl.minimum(part_rows // tl.maximum(total_rows, 1), 1 + extra_programs // total_blocks))
        splits = tl.maximum(splits, 1)
        blocks_per_split = tl.cdiv(key_blocks, splits)
        return q_lo, q_hi, kv, blocks, ends, splits, blocks_per_split, total_rows

    # The two scales are constexprs (model constants, so no extra compiles; as runtime floats,
    # Inductor once passed them as fp64, which failed to compile). Batch-dependent ints are not specialised: one compiled kernel serves every batch shape, so a
    # new batch never pays a JIT compile (seen as 3 s latency spikes in the seed replay).
    @triton.jit(do_not_specialize=["max_pages", "num_users", "forced_splits", "part_rows", "row_programs", "extra_programs"])
    def _paged_hstu_attention_kernel(
        Q, K, V, KV, PT, KV_LENS, Q_OFF, Q_POS, OUT, PART,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_pt, stride_ph,
        layer_offset, page_stride, kv_stride, token_stride,
        max_pages, head_dim, num_users, num_heads, num_sms, forced_splits, part_rows, row_programs, extra_programs,
        SCALE: tl.constexpr,
        INV_SCALE_LEN: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        MAX_USERS: tl.constexpr,
        MAX_SPLITS: tl.constexpr,
        IEEE: tl.constexpr,
        SILU: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
    ):
        # Program (i, head), head fastest: the first row_programs take row block i, key split 0 (row
        # blocks are numbered user after user); the extra_programs after them take split >= 1 of a
        # split batch. The programs with work come first, so the GPU starts them first.
        pid = tl.program_id(0) // num_heads
        h = tl.program_id(0) % num_heads
        q_lo, q_hi, kv, blocks, ends, num_splits, blocks_per_split, total_rows = _batch_plan(
            Q_OFF, KV_LENS, num_users, num_heads, num_sms, forced_splits, part_rows, extra_programs,
            MAX_USERS, BLOCK_M, BLOCK_N, MAX_SPLITS,
        )
        in_rows = pid < row_programs
        if (pid >= row_programs) & (num_splits == 1):
            return
        extra = tl.maximum(pid - row_programs, 0)
        per_block = tl.maximum(num_splits - 1, 1)
        pid_m = tl.where(in_rows, pid, extra // per_block)
        split = tl.where(in_rows, 0, 1 + extra % per_block)
        if pid_m >= tl.max(ends, axis=0):
            return
        users = tl.arange(0, MAX_USERS)
        b = tl.sum((ends <= pid_m).to(tl.int32), axis=0)
        mine = users == b
        first_block = tl.sum(tl.where(mine, ends - blocks, 0), axis=0)
        q_end = tl.sum(tl.where(mine, q_hi, 0), axis=0)
        row0 = tl.sum(tl.where(mine, q_lo, 0), axis=0) + (pid_m - first_block) * BLOCK_M
        kv_len = tl.sum(tl.where(mine, kv, 0), axis=0)
        keys_per_split = blocks_per_split * BLOCK_N
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_end
        dd = tl.arange(0, BLOCK_D)
        d_ok = dd < head_dim
        q_pos = tl.load(Q_POS + rows, mask=row_ok, other=0).to(tl.int32)
        is_cand = q_pos < 0
        # Last key each row sees; -1 for padding rows. Keys < lo_all are seen by every row.
        last_key = tl.where(row_ok, tl.where(is_cand, kv_len - 1, q_pos), -1)
        hi = tl.max(last_key, axis=0) + 1
        lo_all = tl.min(tl.where(row_ok, last_key, 2147483647), axis=0) + 1
        key_lo = split * keys_per_split
        key_hi = tl.minimum(key_lo + keys_per_split, hi)
        full_hi = key_lo + tl.maximum(tl.minimum(key_hi, lo_all) - key_lo, 0) // BLOCK_N * BLOCK_N

        io_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + dd[None, :], mask=io_mask, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        kv_base = KV + layer_offset + h * head_dim
        pt_row = PT + b.to(tl.int64) * max_pages

        # Tiles every row sees in full: no mask.
        for start in tl.range(key_lo, full_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            keys = start + tl.arange(0, BLOCK_N)
            page = tl.load(pt_row + keys // PAGE_SIZE).to(tl.int64)
            ptrs = kv_base + page[:, None] * page_stride + (keys % PAGE_SIZE)[:, None] * token_stride + dd[None, :]
            k_tile = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
            v_tile = tl.load(ptrs + kv_stride, mask=d_ok[None, :], other=0.0)
            s = _dot(q, tl.trans(k_tile), IEEE) * SCALE
            w = _silu(s, SILU).to(v_tile.dtype)
            acc += _dot(w, v_tile, IEEE)

        # Tiles across the causal boundary (or the end of the history): masked.
        for start in range(full_hi, key_hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < kv_len
            page = tl.load(pt_row + keys // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
            ptrs = kv_base + page[:, None] * page_stride + (keys % PAGE_SIZE)[:, None] * token_stride + dd[None, :]
            tile_mask = key_ok[:, None] & d_ok[None, :]
            k_tile = tl.load(ptrs, mask=tile_mask, other=0.0)
            v_tile = tl.load(ptrs + kv_stride, mask=tile_mask, other=0.0)
            s = _dot(q, tl.trans(k_tile), IEEE) * SCALE
            w = tl.where(keys[None, :] <= last_key[:, None], _silu(s, SILU), 0.0).to(v_tile.dtype)
            acc += _dot(w, v_tile, IEEE)

        # Candidates also see themselves (their K/V are not in the cache).
        if split == 0:
            k_self = tl.load(K + rows[:, None] * stride_kt + h * stride_kh + dd[None, :], mask=io_mask, other=0.0)
            v_self = tl.load(V + rows[:, None] * stride_vt + h * stride_vh + dd[None, :], mask=io_mask, other=0.0)
            s_self = tl.sum(q.to(tl.float32) * k_self.to(tl.float32), axis=1) * SCALE
            w_self = tl.where(is_cand & row_ok, _silu(s_self, SILU), 0.0)
            acc += w_self[:, None] * v_self.to(tl.float32)

        acc = acc * INV_SCALE_LEN
        if num_splits == 1:
            out_ptrs = OUT + rows[:, None] * stride_ot + h * stride_oh + dd[None, :]
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=io_mask)
        else:  # a float32 partial at row (split, row); _sum_splits_kernel adds them
            part_rows_at = split * total_rows + rows
            part_ptrs = PART + part_rows_at[:, None].to(tl.int64) * stride_pt + h * stride_ph + dd[None, :]
            tl.store(part_ptrs, acc, mask=io_mask)

    @triton.jit(do_not_specialize=["num_users", "forced_splits", "part_rows", "extra_programs"])
    def _sum_splits_kernel(
        PART, OUT, KV_LENS, Q_OFF,
        stride_pt, stride_ph, stride_ot, stride_oh,
        head_dim, num_users, num_heads, num_sms, forced_splits, part_rows, extra_programs,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        MAX_USERS: tl.constexpr,
        MAX_SPLITS: tl.constexpr,
    ):
        """OUT rows = the sum of their float32 partials, when the batch was split (else nothing:
        the attention kernel wrote OUT itself)."""
        _, _, _, _, _, num_splits, _, total_rows = _batch_plan(
            Q_OFF, KV_LENS, num_users, num_heads, num_sms, forced_splits, part_rows, extra_programs,
            MAX_USERS, BLOCK_M, BLOCK_N, MAX_SPLITS,
        )
        if num_splits == 1:
            return
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        h = tl.program_id(1)
        dd = tl.arange(0, BLOCK_D)
        mask = (rows < total_rows)[:, None] & (dd < head_dim)[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for s0 in range(0, num_splits, 4):  # four independent loads per round trip
            for j in tl.static_range(4):
                split = rows * 0 + s0 + j  # as a tensor: the interpreter takes no scalar mask
                at = (split * total_rows + rows).to(tl.int64)
                acc += tl.load(PART + at[:, None] * stride_pt + h * stride_ph + dd[None, :],
                               mask=mask & (split < num_splits)[:, None], other=0.0)
        tl.store(OUT + rows[:, None] * stride_ot + h * stride_oh + dd[None, :], acc.to(OUT.dtype.element_ty), mask=mask)

    def _launch_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        layer: int,
        page_table: torch.Tensor,
        kv_lens: torch.Tensor,
        q_offsets: torch.Tensor,
        q_pos: torch.Tensor,
        max_q: int,
        scale_len: int,
        block_m: int,
        block_n: int,
        num_warps: int,
        num_stages: int,
        num_splits: int,
        silu: int = 0,
        warp_specialize: bool = False,
    ) -> torch.Tensor:
        T, H, d = q.shape
        L, P, _, page_size, Hc, dc = kv_cache.shape
        B, max_pages = page_table.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if T == 0 or B == 0 or max_q == 0:
            return out
        sms = _num_sms(q.device)
        part_rows = _partial_rows(T, H, block_m, sms, num_splits)
        if num_splits == 1:  # never split: the kernel writes no partials (one row keeps the pointer valid)
            part_rows = 1
        part = torch.empty((part_rows, H, d), dtype=torch.float32, device=q.device)
        max_users = max(64, triton.next_power_of_2(B + 1))  # >= 64: one compile for batches of up to 63 users
        row_programs = triton.cdiv(T, block_m) + B  # >= the batch's row blocks, users padded or not
        extra_programs = _extra_programs(row_programs, H, sms, num_splits)
        grid = ((row_programs + extra_programs) * H,)
        # the constants both kernels' _batch_plan reads: they must agree on the plan
        plan = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d), MAX_USERS=max_users,
                    MAX_SPLITS=MAX_SPLITS)
        _paged_hstu_attention_kernel[grid](
            q, k, v, kv_cache, page_table, kv_lens, q_offsets, q_pos, out, part,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), part.stride(0), part.stride(1),
            layer * kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            max_pages, d, B, H, sms, num_splits, part_rows, row_programs, extra_programs,
            SCALE=1.0 / math.sqrt(d),
            INV_SCALE_LEN=1.0 / scale_len,
            PAGE_SIZE=page_size,
            **plan,
            IEEE=q.dtype == torch.float32,
            SILU=0 if q.dtype == torch.float32 else silu,
            WARP_SPECIALIZE=warp_specialize,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        block_r = 8  # a split batch has at most part_rows // 2 rows
        if num_splits == 1:  # never split: the attention kernel wrote `out`
            return out
        _sum_splits_kernel[(triton.cdiv(min(T, part_rows // 2), block_r), H)](
            part, out, kv_lens, q_offsets,
            part.stride(0), part.stride(1), out.stride(0), out.stride(1),
            d, B, H, sms, num_splits, part_rows, extra_programs,
            BLOCK_R=block_r,
            **plan,
            num_warps=4,
        )
        return out

    # The op torch.compile traces; eager calls use _launch_attention directly (see the caller). An
    # opaque custom op: as a triton_op, whose kernels Inductor analyses and builds itself, the
    # compiled layer returned an output the kernels had not written (runs AQ and AR: the kernels'
    # writes lost once they read the batch's plan on the device), so Inductor now calls the same
    # launch as eager code.
    _paged_hstu_attention_op = torch.library.custom_op("hstu::paged_hstu_attention", _launch_attention, mutates_args=())

    @_paged_hstu_attention_op.register_fake
    def _paged_hstu_attention_fake(q, k, v, kv_cache, layer, page_table, kv_lens, q_offsets, q_pos, max_q, scale_len,
                                   block_m, block_n, num_warps, num_stages, num_splits, silu=0, warp_specialize=False):
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must all be [T, H, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if kv_cache.dim() != 6 or kv_cache.shape[4:] != q.shape[1:] or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [L, P, 2, ps, H={q.shape[1]}, d={q.shape[2]}], got {tuple(kv_cache.shape)}")
    if not 0 <= layer < kv_cache.shape[0]:
        raise ValueError(f"layer {layer} out of range [0, {kv_cache.shape[0]})")
    if len({q.dtype, k.dtype, v.dtype, kv_cache.dtype}) != 1:
        raise ValueError(f"q/k/v/kv_cache dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}, {kv_cache.dtype}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k, v need unit stride over the head dim")


def paged_hstu_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta,
    scale_len: int,
    *,
    config: AttentionConfig | None = None,
    num_splits: int = 0,
) -> torch.Tensor:
    """Paged HSTU attention of the jagged batch `meta` (a KVCacheMetadata) through the Triton op.

    Reads meta.page_table, meta.kv_lens, meta.q_offsets, meta.q_pos and meta.max_q. `config`
    overrides the tile configuration; num_splits > 0 fixes the number of key splits (0: chosen to
    fill the GPU). Returns [T, H, d] in q's dtype.
    """
    _check(q, k, v, kv_cache, layer)
    cfg = config or default_config(q.shape[2])
    args = (
        q, k, v, kv_cache, layer, meta.page_table, meta.kv_lens, meta.q_offsets, meta.q_pos, meta.max_q, scale_len,
        cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, num_splits,
        SILU_MODES.index(cfg.silu), cfg.warp_specialize,
    )
    if torch.compiler.is_compiling():
        return torch.ops.hstu.paged_hstu_attention(*args)
    # Eager (and CUDA-graph capture): launch directly; the custom-op dispatch costs ~100 us a call,
    # more than the kernel itself at batch 1 (benchmarks/RESULTS.md).
    return _launch_attention(*args)
