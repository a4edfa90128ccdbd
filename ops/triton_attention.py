"""Paged HSTU attention in Triton, registered as the op hstu::paged_hstu_attention (triton_op).

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
so that the grid fills the GPU, and the float32 partials are summed afterwards.

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

import functools
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


def _split_keys(programs: int, max_keys: int, block_n: int, num_sms: int, num_splits: int) -> tuple[int, int]:
    """_choose_split, memoised for plain ints (it runs per layer on the eager hot path); symbolic
    sizes under a dynamic-shape compile go uncached."""
    args = (programs, max_keys, block_n, num_sms, num_splits)
    if all(type(a) is int for a in args):
        return _choose_split_cached(*args)
    return _choose_split(*args)


def _choose_split(programs: int, max_keys: int, block_n: int, num_sms: int, num_splits: int) -> tuple[int, int]:
    """(number of key splits, keys per split) for `programs` programs per split.

    num_splits > 0 is taken as asked (capped at one key block per split). Otherwise no split when
    the programs already cover half the SMs (H200, seed shapes: batch 8 = 96 programs on 132 SMs
    ran 241 us unsplit, 262-289 us split 2-4 ways, the partial sums costing more than the idle
    SMs), else the fewest splits whose waves over the SMs are at least 95% full, searching up to
    twice the count that makes one wave (batch 1 = 12 programs: 11 splits, 57 us against 228 us
    unsplit).
    """

    def split_of(want: int) -> tuple[int, int]:
        blocks_per_split = triton.cdiv(key_blocks, max(1, min(want, key_blocks)))
        return triton.cdiv(key_blocks, blocks_per_split), blocks_per_split * block_n

    key_blocks = max(1, triton.cdiv(max_keys, block_n))
    programs = max(programs, 1)
    if num_splits > 0:
        return split_of(num_splits)
    if 2 * programs >= num_sms:
        return split_of(1)
    best, best_fill = split_of(1), 0.0
    for want in range(1, 2 * triton.cdiv(num_sms, programs) + 1):
        splits, keys = split_of(want)
        fill = programs * splits / (triton.cdiv(programs * splits, num_sms) * num_sms)
        if fill > best_fill + 1e-9:
            best, best_fill = (splits, keys), fill
        if fill >= 0.95:
            break
    return best


_choose_split_cached = functools.lru_cache(maxsize=4096)(_choose_split)


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

    # The two scales are constexprs (model constants, so no extra compiles): as runtime floats,
    # Inductor passes them as fp64, which promoted the accumulator to fp64 and failed to compile.
    # Batch-dependent ints are not specialised: one compiled kernel serves every batch shape, so a
    # new batch never pays a JIT compile (seen as 3 s latency spikes in the seed replay).
    @triton.jit(do_not_specialize=["max_pages", "keys_per_split", "num_splits"])
    def _paged_hstu_attention_kernel(
        Q, K, V, KV, PT, KV_LENS, Q_OFF, Q_POS, OUT,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        stride_os, stride_ot, stride_oh,
        layer_offset, page_stride, kv_stride, token_stride,
        max_pages, head_dim, keys_per_split, num_splits,
        SCALE: tl.constexpr,
        INV_SCALE_LEN: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr,
        SILU: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
        q_end = tl.load(Q_OFF + b + 1)
        row0 = tl.load(Q_OFF + b) + pid_m * BLOCK_M
        if row0 >= q_end:
            return
        kv_len = tl.load(KV_LENS + b)
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
        pt_row = PT + b * max_pages

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

        out_ptrs = OUT + split * stride_os + rows[:, None] * stride_ot + h * stride_oh + dd[None, :]
        tl.store(out_ptrs, (acc * INV_SCALE_LEN).to(OUT.dtype.element_ty), mask=io_mask)

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
        m_blocks = triton.cdiv(max_q, block_m)
        splits, keys_per_split = _split_keys(
            m_blocks * H * B, max_pages * page_size, block_n, _num_sms(q.device), num_splits
        )
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if T == 0 or m_blocks == 0 or B == 0:
            return out
        dest = out if splits == 1 else torch.empty((splits, T, H, d), dtype=torch.float32, device=q.device)
        stride_os = 0 if splits == 1 else dest.stride(0)
        stride_ot, stride_oh = (out.stride(0), out.stride(1)) if splits == 1 else (dest.stride(1), dest.stride(2))
        grid = (m_blocks, H, B * splits)
        torch.library.wrap_triton(_paged_hstu_attention_kernel)[grid](
            q, k, v, kv_cache, page_table, kv_lens, q_offsets, q_pos, dest,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            stride_os, stride_ot, stride_oh,
            layer * kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            max_pages, d, keys_per_split, splits,
            SCALE=1.0 / math.sqrt(d),
            INV_SCALE_LEN=1.0 / scale_len,
            PAGE_SIZE=page_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=triton.next_power_of_2(d),
            IEEE=q.dtype == torch.float32,
            SILU=0 if q.dtype == torch.float32 else silu,
            WARP_SPECIALIZE=warp_specialize,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if splits == 1:
            return out
        return dest.sum(0).to(q.dtype)

    # The op torch.compile traces; eager calls use _launch_attention directly (see the caller).
    _paged_hstu_attention_op = torch.library.triton_op("hstu::paged_hstu_attention", _launch_attention, mutates_args=())


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
