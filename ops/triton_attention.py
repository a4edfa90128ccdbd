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

Kernel: the work is units (a block of BLOCK_M query rows of one user, for one head), each a walk
over K/V tiles of BLOCK_N keys gathered row by row through the page table (fp32 accumulation, SiLU
weights cast to the value dtype for the second matmul; only tiles across the causal boundary are
masked), after one load of its Q tile (AttentionConfig.tma: the unmasked tiles one page each through
a TMA descriptor instead; an experiment, off: slower at page 32, run DA). Because there is no softmax, a unit's key range can be cut
into pieces whose partial outputs simply add. When the units fill their waves over the SMs well
enough (AttentionConfig.balance_below), each program runs one unit; otherwise (by default under
three quarters: at the seed shapes batch 1's 12 units on 132 SMs, the batch-8 re-rank's 64, batch
8's 96, which ran 169 -> 163 us a layer balanced on the H200, run AV) one wave of
programs takes equal shares of all the batch's tiles, cutting units where the shares end
(stream-K), and a second kernel adds the float32 pieces of every cut unit. In that wave a user's
row blocks run side by side by default (lanes, AttentionConfig.lanes_above): programs in tuples, one
a row block, take the same keys at the same time, so the L2 can serve a tile's repeated reads
(H100, run CW: batch 8 176 -> 162 us a layer, the re-rank 149 -> 125). Every program reads
this schedule from the batch's metadata on the device (_batch_plan), so a CUDA graph captured for
a row bucket still schedules each batch by its own users and rows.

SiLU: each score costs an exponential and a division on the SMs' special-function units, which
at head dim 256 is about half the tensor-core time of the two matmuls around it. Three forms
(AttentionConfig.silu): "exact" (tl.sigmoid, IEEE division), "fast" (exp2 and an approximate
division: two special-function ops, 2 ulp) and "tanh" (s/2 (1 + tanh(s/2)) with tanh.approx: one
op, ~2^-11 relative error, below bf16's rounding of the weights it feeds). A fourth, two scores
packed into one tanh.approx.f16x2, was inside the bf16 bound but no faster (H100, runs CK-CN:
batch 8 176 against 168 us), so it was removed. float32 inputs always
take "exact" (the fp32 oracle is 1e-5). 16-bit inputs default to "tanh": on the H200 at the seed
shapes it ran the kernel 1.41x faster than "exact" (fast: 1.25x) with the same error against the
torch implementation (2.6e-3) and inside the 2x bf16 bound of the tests (benchmarks/RESULTS.md,
run AP). HSTU_ATTENTION_SILU overrides the default (an experiment knob for same-call comparisons).
The tensor cores idle while the SiLU runs: Triton 3.6 waits each Q K^T right after issuing it,
and that wait also covers the W V before it, so FlashAttention-3's order (tile j + 1's SiLU while
tile j's W V runs) cannot be written here. scripts/overlap_probe.py measures that order in Gluon.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch

from hstu.ops import knobs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch implementation serves.
    triton = None


def available() -> bool:
    """True when the Triton kernel can run here: triton importable and a CUDA device present."""
    return triton is not None and torch.cuda.is_available()


SILU_MODES = ("exact", "fast", "tanh")
KERNELS = ("triton", "gluon")


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch parameters of the kernel; silu is one of SILU_MODES (16-bit inputs
    only), warp_specialize asks Triton to split the unmasked key loop into producer and consumer
    warps (Triton 3.6 does so on Blackwell only: on Hopper the compiled TTGIR keeps one partition);
    a batch whose units (row block x head) fill their waves over the SMs less than
    balance_below runs as one balanced wave instead (_batch_plan; 0: never), in lanes (a user's
    row blocks side by side over the same keys) when that keeps more than lanes_above of the
    lanes' steps busy (above 1: never). tma: the unmasked key tiles come through a TMA descriptor
    over the cache, one page a tile (block_n must equal the page size, the head dim a power of 2),
    instead of per-thread gathers (cp.async): the bytes move without the warps' address work. Off:
    at the seed shapes (page 32) it ran 12-16% slower at batch 8 and 9-13% slower uncached than the
    gathered 64-key tiles on an H100 (run DA), likely as a 32-key tile halves the work between
    barriers (not profiled). kernel: "triton" (this module's kernel) or "gluon" (ops/gluon_attention.py,
    Hopper only, 16-bit inputs, the tanh SiLU; calls it does not fit take this module's kernel; the
    tile and schedule fields above are the Triton kernel's)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    silu: str = "exact"
    warp_specialize: bool = False
    balance_below: float = 0.75
    lanes_above: float = 0.8
    tma: bool = False
    kernel: str = "triton"

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"AttentionConfig.kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.silu not in SILU_MODES:
            raise ValueError(f"AttentionConfig.silu must be one of {SILU_MODES}, got {self.silu!r}")
        if not 0.0 <= self.lanes_above <= 1.01:
            raise ValueError(f"AttentionConfig.lanes_above must be in [0, 1.01] (above 1: never), got {self.lanes_above}")


def _silu_from_env() -> str:
    mode = os.environ.get("HSTU_ATTENTION_SILU", "tanh")
    if mode not in SILU_MODES:
        raise ValueError(f"HSTU_ATTENTION_SILU must be one of {SILU_MODES}, got {mode!r}")
    return mode


def _kernel_from_env() -> str:
    kernel = os.environ.get("HSTU_ATTENTION_KERNEL", "gluon")
    if kernel not in KERNELS:
        raise ValueError(f"HSTU_ATTENTION_KERNEL must be one of {KERNELS}, got {kernel!r}")
    return kernel


def _lanes_from_env() -> float:
    return knobs.number("HSTU_ATTENTION_LANES_ABOVE", 0.8, "above 1: never in lanes")


# Module-level instances, so torch.compile sees constants rather than dataclass construction.
# HSTU_ATTENTION_LANES_ABOVE sets their lanes_above and HSTU_ATTENTION_TMA=1 their tma (experiment
# knobs for same-call comparisons). The kernel is the Gluon one where it fits (Hopper, 16-bit, the tanh
# SiLU: 6-26% less time a layer at the seed shapes and +7% seed replay requests/s, run FA, benchmarks/RESULTS.md),
# else this module's; HSTU_ATTENTION_KERNEL=triton picks this module's everywhere.
_SILU = _silu_from_env()
_KERNEL = _kernel_from_env()
_LANES_ABOVE = _lanes_from_env()
_TMA = knobs.flag("HSTU_ATTENTION_TMA")
_CONFIG_LARGE_HEAD = AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, silu=_SILU,
                                     lanes_above=_LANES_ABOVE, tma=_TMA, kernel=_KERNEL)
_CONFIG_SMALL_HEAD = AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, silu=_SILU,
                                     lanes_above=_LANES_ABOVE, tma=_TMA, kernel=_KERNEL)


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


# Forced piece counts (num_splits, for tests) are capped here. (Under the balanced schedule the
# partials of units cut between programs live in two slots per program, each one head's
# BLOCK_M x BLOCK_D tile in float32.)
MAX_SPLITS = 32


def _unit_bound(rows: int, users: int, heads: int, block_m: int) -> int:
    """The most units (row block x head) a batch of `rows` rows over `users` users can have: at most
    cdiv(rows, block_m) + users row blocks (fixed for a CUDA graph's bucket)."""
    return (-(-rows // block_m) + users) * heads


def _grid_programs(rows: int, users: int, heads: int, block_m: int, num_sms: int, num_splits: int) -> int:
    """Programs the kernel is launched with: at least one per unit (_unit_bound) and at least one
    per SM (a balanced batch runs one wave); a forced split count multiplies the units."""
    return max(num_sms, _unit_bound(rows, users, heads, block_m) * min(max(num_splits, 1), MAX_SPLITS))


def _align_tail_from_env() -> float:
    return knobs.number("HSTU_ATTENTION_ALIGN_TAIL", 0.0, "0: off", minimum=0.0)


# Triton 3.6's interpreter (TRITON_INTERPRET=1, the CPU test path) runs tl.dot on bf16's uint16
# storage; there the operands are upcast first, which computes the same products (bf16 x bf16 is
# exact in float32) with the same float32 accumulation.
if triton is not None:
    _UPCAST_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
    # HSTU_ATTENTION_ALIGN_TAIL=T > 0 (an experiment, off until measured on a GPU): a batch whose
    # units fill their waves runs one unit a program (aligned) only while its longest unit is at
    # most T x an SM's even share of the batch's iterations; else that unit is the wave's tail and
    # the batch runs balanced. Why: in the seed replay's mixed batches a miss's short causal row
    # blocks and a hit's 4k-key ones share one wave. A model of the schedule (iterations as time,
    # run DA's batches) put the cached pass's attention at 1.43x its ideal aligned and 1.15x with
    # T = 1, the uncached pass (full waves of equal users) unchanged. The same model overstated
    # the balanced schedule's gain at batch 8 (27% against 4% measured, run AV): the kernel is
    # partly bandwidth-bound, so this needs a measurement.
    _ALIGN_TAIL = tl.constexpr(_align_tail_from_env())
    # HSTU_ATTENTION_LONG_FIRST=1 (an experiment, off until measured on a GPU): in the aligned
    # schedule program g of a user's units takes them last row block first. A history's causal row
    # blocks grow in length block by block, and the GPU starts programs in order, so the longest
    # came last and made the tail of a batch of several waves: the schedule model above put the
    # uncached batch of 8 (4,354 rows a user, 8 waves) at 1.115x its ideal time, 1.002x reversed,
    # and the uncached seed replay's batches at 1.40x, 1.31x reversed.
    _LONG_FIRST = tl.constexpr(knobs.flag("HSTU_ATTENTION_LONG_FIRST"))
    # HSTU_ATTENTION_CAUSAL_SHARES=1 (an experiment, off until measured on a GPU): outside lanes,
    # iterations are counted per row block as the keys its rows see (_block_iters: a history row
    # block's last row's position, the whole history for candidates) instead of every unit of a
    # user at its whole history, so the balanced wave's shares are equal in work, not in accounted
    # tiles, and an aligned unit's span is its own. The schedule model put the balanced schedule so
    # at 1.03x / 1.01x its ideal on the seed replay's cached / uncached batches (1.43x / 1.40x as
    # the kernel chooses now).
    _CAUSAL_SHARES = tl.constexpr(knobs.flag("HSTU_ATTENTION_CAUSAL_SHARES"))

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
        """SiLU of float32 scores; MODE indexes SILU_MODES (the module docstring says why these)."""
        if MODE == 1 or (MODE >= 2 and _UPCAST_DOT):  # the interpreter has no inline PTX
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
    def _user_blocks(Q_OFF, KV_LENS, num_users, MAX_USERS: tl.constexpr, BLOCK_M: tl.constexpr):
        """Per user (vectors over MAX_USERS, zeros past num_users): first row, end row, key count
        and row blocks of BLOCK_M rows, read from the batch's metadata on the device."""
        users = tl.arange(0, MAX_USERS)
        live = users < num_users
        q_lo = tl.load(Q_OFF + users, mask=live, other=0)
        q_hi = tl.load(Q_OFF + users + 1, mask=live, other=0)
        kv = tl.load(KV_LENS + users, mask=live, other=0)
        return q_lo, q_hi, kv, tl.where(live, (q_hi - q_lo + BLOCK_M - 1) // BLOCK_M, 0)

    @triton.jit
    def _batch_plan(
        Q_OFF, KV_LENS, Q_POS, num_users, num_heads, num_sms, forced_splits, grid_programs,
        MAX_USERS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BALANCE_BELOW: tl.constexpr,
        LANES_ABOVE: tl.constexpr,
    ):
        """The batch's schedule, read from its metadata on the device, so that a CUDA graph replays
        each batch's own schedule rather than the captured one's.

        Work is counted in iterations (one BLOCK_N-key tile of one unit; a unit is one row block of
        one user and one head; a user's units take cdiv(kv_len, BLOCK_N) iterations each), numbered
        user after user, unit after unit. `programs` programs each take a contiguous equal share of
        them: one per unit (each program one whole unit) when the units fill their waves over the
        SMs at least BALANCE_BELOW full; else one wave of SMs, each program cutting through unit
        boundaries (stream-K; at the seed shapes batch 1 is 12 units on 132 SMs, batch 8 96: the
        split of run AR, 11 programs per unit at batch 1, is about what this gives);
        forced_splits > 0 cuts every unit into about that many pieces (tests).

        Lanes (a balanced batch whose lanes stay busy more than LANES_ABOVE of their steps): the
        row blocks of one user and head read the same keys, but in the numbering above they sit
        heads x unit_iters iterations apart, so the programs reading them reach a key tile at
        different times and each reads it from DRAM again (ncu, run CR: batch 8 read its K/V about
        twice, 16% L2 hits, against 85% for the uncached batch, whose units run side by side). In
        lanes, iterations count (user, head, key tile) steps without the row block; `programs`
        tuples of R programs (R: the batch's most row blocks of a user) take equal shares of those
        steps, and program r of a tuple runs row block r of each step it takes (none where the
        user has fewer blocks), so a user's row blocks read each key tile together.

        Returns per user (vectors over MAX_USERS) first row, end row, key count, row blocks,
        iterations per unit, first and end iteration and first row block (over the batch); the
        total iterations, the number of programs (tuples of `lanes` programs in lanes) that take a
        share, whether each program takes one unit whole (aligned: users' units may differ in
        length, so equal shares would cut them), and the lanes R (1: not in lanes)."""
        q_lo, q_hi, kv, blocks = _user_blocks(Q_OFF, KV_LENS, num_users, MAX_USERS, BLOCK_M)
        unit_iters = tl.where(blocks > 0, tl.maximum((kv + BLOCK_N - 1) // BLOCK_N, 1), 0)
        ends = tl.cumsum(blocks * num_heads * unit_iters, axis=0)
        starts = ends - blocks * num_heads * unit_iters
        first_block = tl.cumsum(blocks, axis=0) - blocks
        total = tl.max(ends, axis=0)
        c = kv  # (causal shares: the first new history row's position, its rows before its candidates; kv: none)
        if _CAUSAL_SHARES:  # each row block's units at the key tiles its rows see
            live = tl.arange(0, MAX_USERS) < num_users
            first_pos = tl.load(Q_POS + q_lo, mask=live & (q_hi > q_lo), other=-1).to(tl.int32)
            c = tl.where(first_pos >= 0, first_pos, kv)
            work = tl.zeros([MAX_USERS], dtype=tl.int32)
            for j in range(0, tl.max(blocks, axis=0)):
                work += tl.where(j < blocks, num_heads * _block_iters(j, c, kv, BLOCK_M, BLOCK_N), 0)
            ends = tl.cumsum(work, axis=0)
            starts = ends - work
            total = tl.max(ends, axis=0)
        units = tl.sum(blocks, axis=0) * num_heads
        waves = tl.cdiv(tl.maximum(units, 1), num_sms)
        full = units.to(tl.float32) >= BALANCE_BELOW * (waves * num_sms).to(tl.float32)
        if _ALIGN_TAIL > 0:  # the longest unit as the wave's tail (see _ALIGN_TAIL)
            full = full & (tl.max(unit_iters, axis=0).to(tl.float32) * num_sms <= _ALIGN_TAIL * total.to(tl.float32))
        aligned = full & (forced_splits <= 0)
        programs = tl.where(full, units, tl.minimum(num_sms, total))
        programs = tl.where(forced_splits > 0, tl.minimum(units * forced_splits, total), programs)
        programs = tl.maximum(tl.minimum(programs, grid_programs), 1)
        # lanes: steps (user, head, key tile) numbered without the row block
        lanes = tl.max(blocks, axis=0)
        steps = tl.where(blocks > 0, num_heads * unit_iters, 0)
        step_ends = tl.cumsum(steps, axis=0)
        total_steps = tl.max(step_ends, axis=0)
        in_lanes = (~full) & (forced_splits <= 0) & (lanes > 1) & (lanes <= num_sms)
        in_lanes = in_lanes & (total.to(tl.float32) > LANES_ABOVE * (lanes * total_steps).to(tl.float32))
        starts = tl.where(in_lanes, step_ends - steps, starts)
        ends = tl.where(in_lanes, step_ends, ends)
        total = tl.where(in_lanes, total_steps, total)
        programs = tl.where(in_lanes, tl.maximum(tl.minimum(num_sms // lanes, total_steps), 1), programs)
        lanes = tl.where(in_lanes, lanes, 1)
        return q_lo, q_hi, kv, blocks, unit_iters, starts, ends, first_block, total, programs, aligned, lanes, c

    @triton.jit
    def _block_iters(j, c, kv, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Causal shares: the key tiles row block j of a user sees, its new history starting at
        position c (c = kv: no new history), kv keys in all: through its last row's position, the
        whole history once the block holds candidates."""
        return tl.maximum((tl.minimum(kv, c + (j + 1) * BLOCK_M) + BLOCK_N - 1) // BLOCK_N, 1)

    @triton.jit
    def _block_span(j, c, kv, num_heads, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Causal shares: (the user's iterations before row block j, block j's iterations a unit)."""
        before = j * 0
        for i in range(0, j):
            before += num_heads * _block_iters(i, c, kv, BLOCK_M, BLOCK_N)
        return before, _block_iters(j, c, kv, BLOCK_M, BLOCK_N)

    @triton.jit
    def _block_at(local, c, kv, blocks, num_heads, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Causal shares: (row block holding the user's iteration `local`, the iterations before
        it, its iterations a unit)."""
        at, before, per, seen = local * 0, local * 0, local * 0 + 1, local * 0
        for j in range(0, blocks):
            span = _block_iters(j, c, kv, BLOCK_M, BLOCK_N)
            hit = (local >= seen) & (local < seen + num_heads * span)
            at = tl.where(hit, j, at)
            before = tl.where(hit, seen, before)
            per = tl.where(hit, span, per)
            seen += num_heads * span
        return at, before, per

    @triton.jit
    def _at(values, one_hot):
        """The entry of a per-user vector where the boolean vector one_hot is set (vectors cannot
        be indexed: a masked sum)."""
        return tl.sum(tl.where(one_hot, values, 0), axis=0)

    @triton.jit
    def _program_of(iteration, total, programs):
        """The program whose share [g * total // programs, (g + 1) * total // programs) holds `iteration`."""
        return (((iteration.to(tl.int64) + 1) * programs + total - 1) // total - 1).to(tl.int32)

    @triton.jit
    def _attend_block(
        Q, K, V, KV, KV_DESC, PT, Q_POS,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        layer_offset, page_stride, kv_stride, token_stride, max_pages, head_dim, layer_row0,
        b, h, row0, q_end, kv_len, key_lo, key_cap, with_self,
        SCALE: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr,
        SILU: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        """Float32 attention sums of rows row0.. (< q_end) of user b, head h, over the keys in
        [key_lo, key_cap) each row sees, plus each candidate's own key when with_self."""
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
        key_hi = tl.minimum(key_cap, hi)
        full_hi = key_lo + tl.maximum(tl.minimum(key_hi, lo_all) - key_lo, 0) // BLOCK_N * BLOCK_N

        io_mask = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + dd[None, :], mask=io_mask, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        kv_base = KV + layer_offset + h * head_dim
        pt_row = PT + b.to(tl.int64) * max_pages

        # Tiles every row sees in full: no mask.
        for start in tl.range(key_lo, full_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            if USE_TMA:  # one page a tile: rows of the [L * P * 2 * PAGE_SIZE, H * d] view, keys then values
                row = layer_row0 + tl.load(pt_row + start // PAGE_SIZE) * (2 * PAGE_SIZE)
                k_tile = KV_DESC.load([row, h * BLOCK_D])
                v_tile = KV_DESC.load([row + PAGE_SIZE, h * BLOCK_D])
            else:
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

        # Candidates also see themselves (their K/V are not in the cache): the block's own K/V rows
        # as key tiles on the tensor cores, each candidate row keeping only its own key. (An
        # elementwise q . k over the row, float32 copies of Q and K beside the accumulator, made
        # ptxas spill ~4 KB a thread at 128 x 256 tiles: Triton 3.9, sm_90a.)
        if with_self & (tl.max(is_cand.to(tl.int32), axis=0) > 0):
            for start in range(row0, row0 + BLOCK_M, BLOCK_N):
                own = start + tl.arange(0, BLOCK_N)
                own_mask = (own < q_end)[:, None] & d_ok[None, :]
                k_tile = tl.load(K + own[:, None] * stride_kt + h * stride_kh + dd[None, :], mask=own_mask, other=0.0)
                v_tile = tl.load(V + own[:, None] * stride_vt + h * stride_vh + dd[None, :], mask=own_mask, other=0.0)
                s = _dot(q, tl.trans(k_tile), IEEE) * SCALE
                mine = (own[None, :] == rows[:, None]) & is_cand[:, None]
                w = tl.where(mine, _silu(s, SILU), 0.0).to(v_tile.dtype)
                acc += _dot(w, v_tile, IEEE)
        return acc, rows, io_mask

    # The two scales are constexprs (model constants, so no extra compiles; as runtime floats,
    # Inductor once passed them as fp64, which failed to compile). Batch-dependent ints are not
    # specialised: one compiled kernel serves every batch shape, so a new batch never pays a JIT
    # compile (seen as 3 s latency spikes in the seed replay).
    @triton.jit(do_not_specialize=["max_pages", "num_users", "forced_splits", "grid_programs"])
    def _paged_hstu_attention_kernel(
        Q, K, V, KV, KV_DESC, PT, KV_LENS, Q_OFF, Q_POS, OUT, PART,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_ot, stride_oh,
        layer_offset, page_stride, kv_stride, token_stride, layer_row0,
        max_pages, head_dim, num_users, num_heads, num_sms, forced_splits, grid_programs,
        SCALE: tl.constexpr,
        INV_SCALE_LEN: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        MAX_USERS: tl.constexpr,
        BALANCE_BELOW: tl.constexpr,
        LANES_ABOVE: tl.constexpr,
        IEEE: tl.constexpr,
        SILU: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
        USE_TMA: tl.constexpr,
    ):
        # Program g (of tuple t = g // lanes, lane r = g % lanes; t = g, r = 0 outside lanes) takes
        # iterations [t * total // programs, (t + 1) * total // programs) (row block r of each step
        # in lanes): whole units go to OUT; a unit cut at the share's start or end goes to the
        # program's slot 2g or 2g + 1 of PART ([slot, BLOCK_M, BLOCK_D] float32 for one head) and
        # _sum_pieces_kernel adds its pieces.
        g = tl.program_id(0)
        q_lo, q_hi, kv, blocks, unit_iters, starts, ends, first_block, total, programs, aligned, lanes, c = _batch_plan(
            Q_OFF, KV_LENS, Q_POS, num_users, num_heads, num_sms, forced_splits, grid_programs,
            MAX_USERS, BLOCK_M, BLOCK_N, BALANCE_BELOW, LANES_ABOVE,
        )
        users = tl.arange(0, MAX_USERS)
        t = g // lanes
        r = g % lanes
        it = (t.to(tl.int64) * total // programs).to(tl.int32)
        end = ((t.to(tl.int64) + 1) * total // programs).to(tl.int32)
        if aligned:  # program g takes unit g whole (units numbered user after user, head fastest)
            at_ub = users == tl.sum(((first_block + blocks) * num_heads <= g).to(tl.int32), axis=0)
            ub_iters = _at(unit_iters, at_ub)
            local = g - _at(first_block, at_ub) * num_heads  # the unit's index within its user
            if _LONG_FIRST:  # the user's last row block (its longest causal one) first
                local = (_at(blocks, at_ub) - 1 - local // num_heads) * num_heads + local % num_heads
            if _CAUSAL_SHARES:  # the unit's own span
                before, ub_iters = _block_span(local // num_heads, _at(c, at_ub), _at(kv, at_ub), num_heads,
                                               BLOCK_M, BLOCK_N)
                it = _at(starts, at_ub) + before + (local % num_heads) * ub_iters
            else:
                it = _at(starts, at_ub) + local * ub_iters
            end = it + ub_iters
        end = tl.where(t < programs, end, it)  # programs past the batch's count take nothing
        first = g * 0 + 1
        while it < end:
            b = tl.sum((ends <= it).to(tl.int32), axis=0)
            mine = users == b
            per_unit = _at(unit_iters, mine)
            local = it - _at(starts, mine)
            unit = local // per_unit  # row block x heads + head; in lanes just the head
            ki = local % per_unit
            h = unit % num_heads
            block = unit // num_heads + r
            if _CAUSAL_SHARES:  # outside lanes, the row block's own span
                at, before, per = _block_at(local, _at(c, mine), _at(kv, mine), _at(blocks, mine), num_heads,
                                            BLOCK_M, BLOCK_N)
                outside = lanes == 1
                per_unit = tl.where(outside, per, per_unit)
                h = tl.where(outside, (local - before) // per, h)
                ki = tl.where(outside, (local - before) % per, ki)
                block = tl.where(outside, at, block)
            take = tl.minimum(end - it, per_unit - ki)
            if block < _at(blocks, mine):  # a lane past the user's row blocks has nothing here
                acc, rows, io_mask = _attend_block(
                    Q, K, V, KV, KV_DESC, PT, Q_POS,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    layer_offset, page_stride, kv_stride, token_stride, max_pages, head_dim, layer_row0,
                    b, h, _at(q_lo, mine) + block * BLOCK_M, _at(q_hi, mine), _at(kv, mine),
                    ki * BLOCK_N, (ki + take) * BLOCK_N, ki == 0,
                    SCALE, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, IEEE, SILU, WARP_SPECIALIZE, USE_TMA,
                )
                acc = acc * INV_SCALE_LEN
                dd = tl.arange(0, BLOCK_D)
                if (ki == 0) & (take == per_unit):
                    out_ptrs = OUT + rows[:, None] * stride_ot + h * stride_oh + dd[None, :]
                    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=io_mask)
                else:
                    slot = 2 * g + 1 - first
                    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_D + dd[None, :]
                    tl.store(PART + slot.to(tl.int64) * (BLOCK_M * BLOCK_D) + offs, acc, mask=io_mask)
            it += take
            first = first * 0

    @triton.jit(do_not_specialize=["num_users", "forced_splits", "grid_programs"])
    def _sum_pieces_kernel(
        PART, OUT, KV_LENS, Q_OFF, Q_POS,
        stride_ot, stride_oh,
        head_dim, num_users, num_heads, num_sms, forced_splits, grid_programs,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        MAX_USERS: tl.constexpr,
        BALANCE_BELOW: tl.constexpr,
        LANES_ABOVE: tl.constexpr,
    ):
        """One program per BLOCK_R rows of a possible unit (row block x head), so that the pieces
        of the few units of a small batch are read by many programs at once: a unit cut between
        programs gets the sum of its pieces; a whole unit, or none, returns at once."""
        q_lo, q_hi, kv, blocks, unit_iters, starts, ends, first_block, total, programs, aligned, lanes, c = _batch_plan(
            Q_OFF, KV_LENS, Q_POS, num_users, num_heads, num_sms, forced_splits, grid_programs,
            MAX_USERS, BLOCK_M, BLOCK_N, BALANCE_BELOW, LANES_ABOVE,
        )
        if aligned:
            return
        chunk = tl.program_id(0) % (BLOCK_M // BLOCK_R)
        pid = tl.program_id(0) // (BLOCK_M // BLOCK_R)
        block = pid // num_heads
        h = pid % num_heads
        if block >= tl.sum(blocks, axis=0):
            return
        mine = tl.arange(0, MAX_USERS) == tl.sum((first_block + blocks <= block).to(tl.int32), axis=0)
        per_unit = _at(unit_iters, mine)
        local_block = block - _at(first_block, mine)
        # in lanes the unit's steps are its head's, taken by lane local_block of each tuple
        unit_start = _at(starts, mine) + (tl.where(lanes > 1, 0, local_block * num_heads) + h) * per_unit
        if _CAUSAL_SHARES:  # outside lanes, the row block's own span
            before, per = _block_span(local_block, _at(c, mine), _at(kv, mine), num_heads, BLOCK_M, BLOCK_N)
            outside = lanes == 1
            unit_start = tl.where(outside, _at(starts, mine) + before + h * per, unit_start)
            per_unit = tl.where(outside, per, per_unit)
        lane = tl.where(lanes > 1, local_block, 0)
        t_first = _program_of(unit_start, total, programs)
        t_last = _program_of(unit_start + per_unit - 1, total, programs)
        if t_first == t_last:
            return
        r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of the unit's tile
        rows = _at(q_lo, mine) + local_block * BLOCK_M + r
        dd = tl.arange(0, BLOCK_D)
        mask = (rows < _at(q_hi, mine))[:, None] & (dd < head_dim)[None, :]
        offs = r[:, None] * BLOCK_D + dd[None, :]
        # t_first's piece is its program's last (slot 2g + 1) unless its share starts at the unit;
        # every later tuple's piece is its program's first (slot 2g).
        starts_here = (t_first.to(tl.int64) * total // programs).to(tl.int32) == unit_start
        slot = 2 * (t_first * lanes + lane) + 1 - starts_here.to(tl.int32)
        acc = tl.load(PART + slot.to(tl.int64) * (BLOCK_M * BLOCK_D) + offs, mask=mask, other=0.0)
        zero = t_first.to(tl.int64) * 0  # an int64 tensor: the loop index may be a plain int
        for t in range(t_first + 1, t_last + 1):
            acc += tl.load(PART + (zero + 2 * (t * lanes + lane)) * (BLOCK_M * BLOCK_D) + offs, mask=mask, other=0.0)
        tl.store(OUT + rows[:, None] * stride_ot + h * stride_oh + dd[None, :], acc.to(OUT.dtype.element_ty), mask=mask)

    def _kv_descriptor(kv_cache: torch.Tensor, block_n: int, block_d: int):
        """A TMA descriptor over the cache as [L * P * 2 * page_size, H * d] rows, one page's keys
        (or values) of one head a [block_n, block_d] box. Built per call (a host object the launch
        passes by value); its base is the cache's, which a CUDA graph keeps."""
        from triton.tools.tensor_descriptor import TensorDescriptor

        L, P, _, page_size, H, d = kv_cache.shape
        if block_n != page_size or block_d != d:
            raise ValueError(f"TMA tiles need block_n == page_size ({block_n} vs {page_size}) and a power-of-2 head dim ({d})")
        return TensorDescriptor.from_tensor(kv_cache.view(L * P * 2 * page_size, H * d), block_shape=[block_n, block_d])

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
        balance_below: float = 0.75,
        lanes_above: float = 0.8,
        tma: bool = False,
        gluon: bool = False,
    ) -> torch.Tensor:
        if gluon:  # the Gluon kernel (its own tiles and schedule; the caller checked gluon_attention.fits)
            from hstu.ops import gluon_attention

            return gluon_attention.launch(q, k, v, kv_cache, layer, page_table, kv_lens, q_offsets, q_pos, scale_len,
                                          _num_sms(q.device), num_splits)
        T, H, d = q.shape
        L, P, _, page_size, Hc, dc = kv_cache.shape
        B, max_pages = page_table.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if T == 0 or B == 0 or max_q == 0:
            return out
        sms = _num_sms(q.device)
        num_splits = min(num_splits, MAX_SPLITS)
        programs = _grid_programs(T, B, H, block_m, sms, num_splits)
        block_d = triton.next_power_of_2(d)
        # Two partial slots per program that may cut units: one wave of SMs, or the forced pieces.
        slots = 2 * (programs if num_splits > 0 else sms)
        part = torch.empty((slots, block_m, block_d), dtype=torch.float32, device=q.device)
        # the constants both kernels' _batch_plan reads: they must agree on the schedule
        plan = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BALANCE_BELOW=balance_below,
                    LANES_ABOVE=lanes_above,
                    MAX_USERS=max(64, triton.next_power_of_2(B + 1)))  # >= 64: one compile up to 63 users
        kv_desc = _kv_descriptor(kv_cache, block_n, block_d) if tma else None
        _paged_hstu_attention_kernel[(programs,)](
            q, k, v, kv_cache, kv_desc, page_table, kv_lens, q_offsets, q_pos, out, part,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            layer * kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            layer * P * 2 * page_size,
            max_pages, d, B, H, sms, num_splits, programs,
            SCALE=1.0 / math.sqrt(d),
            INV_SCALE_LEN=1.0 / scale_len,
            PAGE_SIZE=page_size,
            **plan,
            IEEE=q.dtype == torch.float32,
            SILU=0 if q.dtype == torch.float32 else silu,
            WARP_SPECIALIZE=warp_specialize,
            USE_TMA=tma,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        block_r = min(8, block_m)
        _sum_pieces_kernel[((triton.cdiv(T, block_m) + B) * H * (block_m // block_r),)](
            part, out, kv_lens, q_offsets, q_pos,
            out.stride(0), out.stride(1),
            d, B, H, sms, num_splits, programs,
            **plan,
            BLOCK_R=block_r,
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
                                   block_m, block_n, num_warps, num_stages, num_splits, silu=0, warp_specialize=False,
                                   balance_below=0.75, lanes_above=0.8, tma=False, gluon=False):
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


def _tma_fits(page_size: int, head_dim: int) -> bool:
    """TMA tiles are one page of one head: a power-of-2 page of 16-256 keys, a power-of-2 head dim <= 256."""
    return all(16 <= n <= 256 and n & (n - 1) == 0 for n in (page_size, head_dim))


@functools.lru_cache(maxsize=64)
def _tma_fitted(cfg: AttentionConfig, page_size: int, head_dim: int) -> AttentionConfig:
    """cfg with one page a key tile when TMA tiles fit the cache, else without TMA (memoised: a
    launch asks for the same few)."""
    if not _tma_fits(page_size, head_dim):
        return dataclasses.replace(cfg, tma=False)
    return cfg if cfg.block_n == page_size else dataclasses.replace(cfg, block_n=page_size)


def _asks_gluon(cfg: AttentionConfig) -> bool:
    """Whether `cfg` runs the Gluon kernel where it fits (the tanh SiLU is its only SiLU form)."""
    return cfg.kernel == "gluon" and cfg.silu == "tanh"


def kernel_in_force(device: torch.device) -> str:
    """The kernel the default configuration runs on `device` for 16-bit inputs at the head dims the
    Gluon kernel takes: "gluon" or "triton" (what a benchmark's header reports)."""
    from hstu.ops import gluon_attention

    return "gluon" if _asks_gluon(_CONFIG_LARGE_HEAD) and gluon_attention.available(device) else "triton"


def _gluon_fits(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    from hstu.ops import gluon_attention

    return gluon_attention.fits(q, kv_cache)


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
    overrides the tile configuration; num_splits > 0 cuts every unit's keys into about that many
    pieces (tests; 0: the schedule of _batch_plan). Returns [T, H, d] in q's dtype.
    """
    _check(q, k, v, kv_cache, layer)
    cfg = config or default_config(q.shape[2])
    if cfg.tma:
        cfg = _tma_fitted(cfg, kv_cache.shape[3], q.shape[2])
    gluon = _asks_gluon(cfg) and _gluon_fits(q, kv_cache)
    args = (
        q, k, v, kv_cache, layer, meta.page_table, meta.kv_lens, meta.q_offsets, meta.q_pos, meta.max_q, scale_len,
        cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, num_splits,
        SILU_MODES.index(cfg.silu), cfg.warp_specialize, cfg.balance_below, cfg.lanes_above, cfg.tma, gluon,
    )
    if torch.compiler.is_compiling():
        return torch.ops.hstu.paged_hstu_attention(*args)
    # Eager (and CUDA-graph capture): launch directly; the custom-op dispatch costs ~100 us a call,
    # more than the kernel itself at batch 1 (benchmarks/RESULTS.md).
    if gluon:  # its schedule planned once a forward, kept on the metadata (gluon_attention.planned)
        from hstu.ops import gluon_attention

        return gluon_attention.launch(q, k, v, kv_cache, layer, meta.page_table, meta.kv_lens, meta.q_offsets,
                                      meta.q_pos, scale_len, _num_sms(q.device), num_splits,
                                      plans=getattr(meta, "attention_plans", None))
    return _launch_attention(*args)
