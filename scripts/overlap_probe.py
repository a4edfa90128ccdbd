"""A probe, not a product kernel: does FlashAttention-3's overlap inside one warpgroup speed up
the paged HSTU attention's key loop at the seed shapes?

Why this exists: ncu put the tensor pipe of the production kernel (ops/triton_attention.py)
active 32-46% of its time, with neither DRAM nor the pipe the limit (RESULTS.md, run CR). Its
key loop runs Q K^T, waits, SiLU on the special-function units, then W V: the tensor cores idle
through every SiLU. FA3 issues tile j + 1's Q K^T and tile j's W V back to back and computes tile
j + 1's SiLU while W V runs. Triton 3.6 cannot express that order: its wgmma pipeliner waits every
dot whose result the loop itself uses right after issuing it (WGMMAPipeline.cpp, rule 2), and
the wait counts groups in order, so the W V before it is waited too (checked in the TTGIR of such
a loop, twenty-eighth session). Gluon (triton.experimental.gluon, in Triton 3.6) exposes
warpgroup_mma and warpgroup_mma_wait(num_outstanding) directly, so both orders can be written.

Kernels over the same work, the cached part of the production kernel's unmasked loop: each
program takes one unit (a 128-row block of one user and head), every row seeing the user's first
kv_len // 64 * 64 cached keys (no causal mask, no candidate self keys), K/V gathered through the
page table with cp.async into two stages, float32 accumulation, SiLU by tanh.approx as the
production default:
  serial   Q K^T, wait, SiLU, W V, wait (the production kernel's order);
  overlap  Q K^T of tile j + 1 and W V of tile j issued together, tile j + 1's SiLU while W V runs;
and each again with K/V by TMA (serial_tma, overlap_tma): two one-page copies a 64-key tile, one
mbarrier a stage, instead of the warps' cp.async gathers and their address work. (The production
kernel's TMA option tiles one page, 32 keys, and lost: run DA.)
Layout assumed: kv_cache [L, P, 2, page_size, H, d] contiguous (K at 0, V at 1), q [T, H, d] with
unit stride over d, head dim 256, page size 32 (a 64-key tile spans two pages), bf16.

    python -m hstu.scripts.overlap_probe                 (on a Hopper GPU: checks, then times each)
    python -m hstu.scripts.overlap_probe --compile-only  (any machine with Triton: ptxas registers/spills)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from hstu.ops.gluon_attention import _issue_tile, _kv_descriptor, _silu
except ImportError:  # no Triton (or no Gluon): the probe cannot run here
    gluon = None

BLOCK_M, BLOCK_N, HEAD_DIM, PAGE_SIZE, WARPS = 128, 64, 256, 32, 8

if gluon is not None:

    @gluon.jit
    def _issue_kv(k_buf, v_buf, kv_base, pt_row, start, page_stride, token_stride, kv_stride,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, load: gl.constexpr):
        """cp.async of the K and V tiles of keys start.. (< start + BLOCK_N) into one stage, one group."""
        keys = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, load))
        dd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load))
        page = gl.load(pt_row + keys // PAGE_SIZE).to(gl.int64)
        rows = page * page_stride + (keys % PAGE_SIZE) * token_stride
        ptrs = kv_base + gl.expand_dims(rows, 1) + gl.expand_dims(dd, 0)
        async_copy.async_copy_global_to_shared(k_buf, ptrs)
        async_copy.async_copy_global_to_shared(v_buf, ptrs + kv_stride)
        async_copy.commit_group()

    @gluon.jit
    def _issue(k_smem, v_smem, bars, stage, KV_DESC, kv_base, pt_row, start, layer_row0, h, page_stride,
               token_stride, kv_stride, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
               load: gl.constexpr, TMA: gl.constexpr):
        """Tile `start`'s K and V into stage `stage`: TMA (two pages a tile) or gathered cp.async."""
        if TMA:
            _issue_tile(k_smem.index(stage), v_smem.index(stage), bars.index(stage), KV_DESC, pt_row, start,
                        layer_row0, h, HEAD_DIM, PAGE_SIZE, PAGE_SIZE, BLOCK_N)
        else:
            _issue_kv(k_smem.index(stage), v_smem.index(stage), kv_base, pt_row, start, page_stride, token_stride,
                      kv_stride, BLOCK_N, HEAD_DIM, PAGE_SIZE, load)

    @gluon.jit
    def _wait_tile(bars, tile, outstanding: gl.constexpr, TMA: gl.constexpr):
        """Tile `tile` landed in its stage and is visible to every warp's wgmma: its stage's barrier at
        the tile's phase (TMA), or at most `outstanding` cp.async groups left, fenced and synced."""
        if TMA:
            mbarrier.wait(bars.index(tile % 2), (tile // 2) % 2)
        else:
            async_copy.wait_group(outstanding)
            fence_async_shared()
            gl.thread_barrier()

    @gluon.jit
    def _probe_kernel(
        Q, KV, KV_DESC, PT, UNITS, OUT,
        stride_qt, stride_qh, stride_ot, stride_oh, layer_offset, page_stride, token_stride, kv_stride, max_pages,
        layer_row0,
        SCALE: gl.constexpr, INV_SCALE_LEN: gl.constexpr, OVERLAP: gl.constexpr, TMA: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr,
    ):
        # UNITS[g] = (user, first row, row end, head, full key tiles)
        g = gl.program_id(0)
        b = gl.load(UNITS + g * 5)
        row0 = gl.load(UNITS + g * 5 + 1)
        q_end = gl.load(UNITS + g * 5 + 2)
        h = gl.load(UNITS + g * 5 + 3)
        n = gl.load(UNITS + g * 5 + 4)

        load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [gl.num_warps(), 1], [16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [gl.num_warps(), 1], [16, HEAD_DIM, 16])
        w_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
        kv_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], q_shared)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], kv_shared)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HEAD_DIM], kv_shared)
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        if TMA:
            gl.static_assert(BLOCK_N == 2 * PAGE_SIZE, "a TMA tile is two pages")
            mbarrier.init(bars.index(0), count=1)
            mbarrier.init(bars.index(1), count=1)

        kv_base = KV + layer_offset + h * HEAD_DIM
        pt_row = PT + b.to(gl.int64) * max_pages
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load))
        dd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load))
        q_ptrs = Q + gl.expand_dims(rows * stride_qt + h * stride_qh, 1) + gl.expand_dims(dd, 0)
        q_smem.store(gl.load(q_ptrs, mask=gl.expand_dims(rows < q_end, 1), other=0.0))
        fence_async_shared()  # each thread's Q stores ordered before the wgmma reads (async proxy)
        gl.thread_barrier()

        _issue(k_smem, v_smem, bars, 0, KV_DESC, kv_base, pt_row, 0, layer_row0, h, page_stride, token_stride,
               kv_stride, BLOCK_N, HEAD_DIM, PAGE_SIZE, load, TMA)
        if n > 1:
            _issue(k_smem, v_smem, bars, 1, KV_DESC, kv_base, pt_row, BLOCK_N, layer_row0, h, page_stride,
                   token_stride, kv_stride, BLOCK_N, HEAD_DIM, PAGE_SIZE, load, TMA)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        if OVERLAP:
            # tile 0's scores first; then per tile j: Q K^T of j + 1 and W V of j in flight together,
            # SiLU of j + 1 while W V runs, stage j refilled with tile j + 2 once W V is done
            if n > 1:
                _wait_tile(bars, 0, 1, TMA)
            else:
                _wait_tile(bars, 0, 0, TMA)
            s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            w = gl.convert_layout(_silu(s * SCALE).to(gl.bfloat16), w_layout)
            for j in range(n):
                stage = j % 2
                if j + 1 < n:
                    _wait_tile(bars, j + 1, 0, TMA)
                    s_tok = warpgroup_mma(q_smem, k_smem.index(1 - stage).permute((1, 0)), zero_s, use_acc=False,
                                          is_async=True)
                    acc_tok = warpgroup_mma(w, v_smem.index(stage), acc, is_async=True)
                    s = warpgroup_mma_wait(1, deps=(s_tok,))
                    w_next = gl.convert_layout(_silu(s * SCALE).to(gl.bfloat16), w_layout)
                    # w is W V's register operand: kept live (a dep) until W V is done
                    acc, w = warpgroup_mma_wait(0, deps=(acc_tok, w))
                    w = w_next
                else:
                    acc_tok = warpgroup_mma(w, v_smem.index(stage), acc, is_async=True)
                    acc, w = warpgroup_mma_wait(0, deps=(acc_tok, w))
                gl.thread_barrier()  # every warp's wgmma done reading stage j before it is refilled
                if j + 2 < n:
                    _issue(k_smem, v_smem, bars, stage, KV_DESC, kv_base, pt_row, (j + 2) * BLOCK_N, layer_row0, h,
                           page_stride, token_stride, kv_stride, BLOCK_N, HEAD_DIM, PAGE_SIZE, load, TMA)
        else:
            for j in range(n):
                stage = j % 2
                if j + 1 < n:
                    _wait_tile(bars, j, 1, TMA)
                else:
                    _wait_tile(bars, j, 0, TMA)
                s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False,
                                      is_async=True)
                s = warpgroup_mma_wait(0, deps=(s_tok,))
                w = gl.convert_layout(_silu(s * SCALE).to(gl.bfloat16), w_layout)
                acc_tok = warpgroup_mma(w, v_smem.index(stage), acc, is_async=True)
                acc, w = warpgroup_mma_wait(0, deps=(acc_tok, w))
                gl.thread_barrier()
                if j + 2 < n:
                    _issue(k_smem, v_smem, bars, stage, KV_DESC, kv_base, pt_row, (j + 2) * BLOCK_N, layer_row0, h,
                           page_stride, token_stride, kv_stride, BLOCK_N, HEAD_DIM, PAGE_SIZE, load, TMA)
        if TMA:
            mbarrier.invalidate(bars.index(0))
            mbarrier.invalidate(bars.index(1))

        out_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        out_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        out_ptrs = OUT + gl.expand_dims(out_rows * stride_ot + h * stride_oh, 1) + gl.expand_dims(out_d, 0)
        gl.store(out_ptrs, acc * INV_SCALE_LEN, mask=gl.expand_dims(out_rows < q_end, 1))


def units_of(rows_per_user: list[int], kv_lens: list[int], heads: int) -> torch.Tensor:
    """[units, 5] int32: (user, first row, row end, head, full key tiles), row blocks of 128."""
    out, start = [], 0
    for b, (rows, kv) in enumerate(zip(rows_per_user, kv_lens)):
        for r in range(0, rows, BLOCK_M):
            for h in range(heads):
                out.append((b, start + r, start + rows, h, kv // BLOCK_N))
        start += rows
    return torch.tensor(out, dtype=torch.int32)


def reference(q, kv_cache, page_table, units, layer, scale_len):
    """float32 torch of the probe's semantics."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    scale = q.shape[-1] ** -0.5
    for b, row0, q_end, h, tiles in units.tolist():
        keys = torch.arange(tiles * BLOCK_N, device=q.device)
        pages = page_table[b, keys // PAGE_SIZE].long()
        k = kv_cache[layer, pages, 0, keys % PAGE_SIZE, h].float()
        v = kv_cache[layer, pages, 1, keys % PAGE_SIZE, h].float()
        rows = slice(row0, min(row0 + BLOCK_M, q_end))
        s = q[rows, h].float() @ k.T * scale
        out[rows, h] = torch.nn.functional.silu(s) @ v / scale_len
    return out


def kv_descriptor(kv_cache: torch.Tensor) -> "TensorDescriptor":
    """A TMA descriptor over the cache as [L * P * 2 * page_size, H * d] rows, one page of one head a block."""
    return _kv_descriptor(kv_cache, kv_cache.shape[3])


def launch(q, kv_cache, page_table, units, layer, scale_len, overlap: bool, tma_loads: bool = False,
           out: torch.Tensor | None = None, desc=None):
    """The probe kernel's output [T, H, d] float32 (into `out` when given); tma_loads: K/V by TMA."""
    if out is None:
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if tma_loads and desc is None:
        desc = kv_descriptor(kv_cache)
    L, P, _, page, H, D = kv_cache.shape
    _probe_kernel[(units.shape[0],)](
        q, kv_cache, desc if tma_loads else None, page_table, units, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        layer * kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(3), kv_cache.stride(2), page_table.shape[1],
        layer * P * 2 * page,
        D**-0.5, 1.0 / scale_len, overlap, tma_loads, BLOCK_M, BLOCK_N, HEAD_DIM, PAGE_SIZE, num_warps=WARPS,
    )
    return out


VARIANTS = {"serial": (False, False), "overlap": (True, False), "serial_tma": (False, True),
            "overlap_tma": (True, True)}  # name: (overlap, tma_loads)


# (rows of each user's block of new rows and candidates, cached keys of each user): the seed's
# cached batch 8 and re-rank batch 8 shapes, cached part only; wave132 is 11 such users, 132 units,
# one full wave of an H100's SMs (the others leave SMs idle, which the production kernel's balanced
# schedule would not: their times compare the variants, not the production kernel)
SHAPES = {"batch8": ([384] * 8, [3968] * 8), "rerank8": ([256] * 8, [4096] * 8), "batch1": ([384], [3968]),
          "wave132": ([384] * 11, [3968] * 11)}


def _production(q, kv_cache, rows, kvs, scale_len, flops, repeats) -> dict:
    """The production kernel (ops/triton_attention.py, its default config and schedule) on the same
    cache, queries and keys: every row a candidate over its user's cached keys, so it also reads
    each row's own key (2 tiles beside ~62 a row block, ~3% more work than the probe counts)."""
    from hstu.ops import triton_attention as ta
    from hstu.scripts.bench_kernels import seed_metadata

    meta = seed_metadata(tuple((kv, kv, r) for r, kv in zip(rows, kvs)), kv_cache.shape[1])
    k, v = torch.randn_like(q), torch.randn_like(q)
    median = 1e3 * float(triton.testing.do_bench_cudagraph(
        lambda: ta.paged_hstu_attention_triton(q, k, v, kv_cache, 1, meta, scale_len), rep=repeats,
        return_mode="median"))
    return {"median_us": median, "tflop_per_s": flops / median / 1e6}


def run(device: torch.device, repeats: int) -> dict:
    """Per shape: each variant's error against the reference, median time (us) and TFLOP/s, and the
    production kernel's time on the same inputs."""
    torch.manual_seed(0)
    heads, layers, scale_len = 4, 2, 4352
    results = {}
    for name, (rows, kvs) in SHAPES.items():
        pages_per_user = max(kvs) // PAGE_SIZE + 1
        P = pages_per_user * len(rows) + 1
        kv_cache = torch.randn(layers, P, 2, PAGE_SIZE, heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
        page_table = torch.randperm(P - 1, device=device)[: pages_per_user * len(rows)].view(len(rows), -1)
        page_table = page_table.to(torch.int32).contiguous()
        q = torch.randn(sum(rows), heads, HEAD_DIM, device=device, dtype=torch.bfloat16)
        units = units_of(rows, kvs, heads).to(device)
        ref = reference(q, kv_cache, page_table, units.cpu(), 1, scale_len)
        flops = sum((min(r0 + BLOCK_M, end) - r0) * tiles * BLOCK_N * HEAD_DIM * 4
                    for _, r0, end, _, tiles in units.tolist())
        entry = {"units": units.shape[0], "gflop": flops / 1e9}
        desc = kv_descriptor(kv_cache)
        for variant, (overlap, tma_loads) in VARIANTS.items():
            def call(out=None, overlap=overlap, tma_loads=tma_loads):
                return launch(q, kv_cache, page_table, units, 1, scale_len, overlap, tma_loads, out, desc)

            try:
                out = call()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                # as bench_kernels times the production kernel: CUDA-graph replays, median
                median = 1e3 * float(triton.testing.do_bench_cudagraph(lambda: call(out), rep=repeats,
                                                                       return_mode="median"))
            except Exception as exc:  # one variant failing to compile or launch: reported, the others still run
                entry[variant] = {"median_us": float("nan"), "tflop_per_s": float("nan"), "rel_err": float("nan"),
                                  "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                continue
            entry[variant] = {"median_us": median, "tflop_per_s": flops / median / 1e6, "rel_err": err}
        try:
            entry["production"] = _production(q, kv_cache, rows, kvs, scale_len, flops, repeats)
        except Exception as exc:  # reported like a failing variant
            entry["production"] = {"median_us": float("nan"), "tflop_per_s": float("nan"),
                                   "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        entry["serial_over_overlap"] = entry["serial"]["median_us"] / entry["overlap"]["median_us"]
        entry["serial_over_overlap_tma"] = entry["serial"]["median_us"] / entry["overlap_tma"]["median_us"]
        results[name] = entry
    return results


def compile_only(arch: int = 90) -> dict:
    """Each variant compiled for sm_<arch>a as the JIT would at the probe's shapes (pointers and
    strides divisible by 16): ptxas registers and spills, and the PTX's wgmma waits (the overlap
    kernels wait with one group outstanding: W V still running during the SiLU). No GPU needed."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from hstu.scripts.kernel_regs import compile_ahead, kernel_report

    pointers = {"Q": "*bf16", "KV": "*bf16", "PT": "*i32", "UNITS": "*i32", "OUT": "*fp32"}
    divisible = ("Q", "KV", "PT", "OUT", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "layer_offset",
                 "page_stride", "token_stride", "kv_stride", "layer_row0")
    desc_layout = gl.NVMMASharedLayout.get_default_for([PAGE_SIZE, HEAD_DIM], gl.bfloat16)
    out = {}
    for variant, (overlap, tma_loads) in VARIANTS.items():
        constants = dict(SCALE=HEAD_DIM**-0.5, INV_SCALE_LEN=1 / 4352, OVERLAP=overlap, TMA=tma_loads,
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE)
        typed = dict(pointers)
        if tma_loads:
            typed["KV_DESC"] = f"tensordesc<bf16[{PAGE_SIZE}, {HEAD_DIM}],{desc_layout!r}>"
        else:
            constants["KV_DESC"] = None
        kernel = compile_ahead(_probe_kernel, typed, constants, divisible, {"num_warps": WARPS}, arch, GluonASTSource)
        out[variant] = {
            **kernel_report(kernel, arch),
            "wgmma_waits": [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", kernel.asm["ptx"])],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="ptxas registers and spills, no GPU")
    parser.add_argument("--repeats", type=int, default=50, help="ms of graph replays a kernel (do_bench_cudagraph)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if gluon is None:
        raise SystemExit("the probe needs Triton with Gluon (triton.experimental.gluon)")
    doc = compile_only() if args.compile_only else run(torch.device("cuda"), args.repeats)
    text = json.dumps(doc, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if args.compile_only:
        print(text)
        return
    print(f"{'shape':<10}{'kernel':<13}{'us':>9}{'TFLOP/s':>9}{'rel err':>10}")  # a table short enough for a log's tail
    for shape, entry in doc.items():
        for kernel in (*VARIANTS, "production"):
            r = entry[kernel]
            err = r.get("rel_err", float("nan"))  # the production kernel's is its own tests' business
            print(f"{shape:<10}{kernel:<13}{r['median_us']:>9.1f}{r['tflop_per_s']:>9.1f}{err:>10.2e}")


if __name__ == "__main__":
    main()
