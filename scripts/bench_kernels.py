"""Benchmarks of the KV kernels and the Triton paged attention against measured ceilings (CUDA).

One run measures, as medians of triton.testing.do_bench (CUDA events, L2 flushed between reps):
  ceilings   device-to-device copy (bytes read + written), pinned H2D and D2H (one large copy),
             bf16 matmul 8192^3 on random data
  append     append_kvcache of many tokens, GB/s (read + written) over the D2D ceiling
  gather     gather_kvcache_all_layers, GB/s (read + written) over the D2D ceiling
  onload     onload_kvcache, both variants (HSTU_ONLOAD_IMPL=memcpy|zerocopy), pages in runs of a
             chunk or scattered, GB/s over the H2D ceiling
  offload    store_host_chunks, GB/s over the D2H ceiling
  attention  paged HSTU attention at the seed shapes (8 layers, 4 heads x 256, page 32, bf16,
             history 4096 with 3968 cached -> 128 new + 256 candidates; batch 1 and 8; then the
             re-rank of an unchanged history, 4096 cached + 256 candidates, and the uncached
             batch, 4096 new + 256 candidates, both at batch 8; and mixed5, a batch of the seed replay
             whose hits and misses share one wave): useful TFLOP/s (masked-out work
             not counted) over the matmul ceiling, timed as CUDA-graph replays of the 8 layers
             (per layer), for the default tile config, a sweep of tile configs, SiLU forms and
             thresholds of the balanced schedule (each checked against the torch
             implementation), the torch implementation, and the default's eager time (the op's
             host overhead included).
Prints a short table last and writes everything as JSON to --out.

Usage: python3 scripts/bench_kernels.py --out kernels.json [--sections ceilings attention]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import triton

from hstu.ops import kv_ops
from hstu.ops import triton_attention as ta
from hstu.ops.attention import paged_hstu_attention_torch
from hstu.ops.kvcache.metadata import KVCacheMetadata

logger = logging.getLogger("bench_kernels")

GB = 1e9
# Seed model shapes.
LAYERS, HEADS, HEAD_DIM, PAGE, DTYPE = 8, 4, 256, 32, torch.bfloat16
HISTORY, CACHED, CANDIDATES, CHUNK_TOKENS = 4096, 3968, 256, 128


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn on the current stream."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


@contextmanager
def onload_impl(name: str):
    old = os.environ.get("HSTU_ONLOAD_IMPL")
    os.environ["HSTU_ONLOAD_IMPL"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HSTU_ONLOAD_IMPL")
        else:
            os.environ["HSTU_ONLOAD_IMPL"] = old


def ceilings(nbytes: int) -> dict:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host.copy_(src.cpu())
    d2d = 2 * nbytes / (bench_ms(lambda: dst.copy_(src)) * 1e-3) / GB
    h2d = nbytes / (bench_ms(lambda: dst.copy_(host, non_blocking=True)) * 1e-3) / GB
    d2h = nbytes / (bench_ms(lambda: host.copy_(src, non_blocking=True)) * 1e-3) / GB
    del src, dst, host
    n = 8192
    a, b = (torch.randn((n, n), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mm = 2 * n**3 / (bench_ms(lambda: a @ b) * 1e-3) / 1e12
    return {"d2d_GBps": d2d, "h2d_GBps": h2d, "d2h_GBps": d2h, "bf16_matmul_TFLOPs": mm, "copy_bytes": nbytes}


def page_bytes() -> int:
    return 2 * PAGE * HEADS * HEAD_DIM * torch.finfo(DTYPE).bits // 8


def bench_append(cache: torch.Tensor, tokens: int) -> dict:
    slots = torch.randperm(cache.shape[1] * PAGE, device="cuda")[:tokens]
    page_ids, offsets = (slots // PAGE).int(), (slots % PAGE).int()
    k, v = (torch.randn((tokens, HEADS, HEAD_DIM), device="cuda", dtype=DTYPE) for _ in range(2))
    ms = bench_ms(lambda: kv_ops.append_kvcache(cache, k, v, page_ids, offsets, 3))
    moved = 4 * tokens * HEADS * HEAD_DIM * cache.element_size()
    return {"tokens": tokens, "ms": ms, "GBps": moved / (ms * 1e-3) / GB}


def bench_gather(cache: torch.Tensor, chunks: int, ppc: int) -> dict:
    page_ids = torch.randperm(cache.shape[1], device="cuda")[: chunks * ppc].int().view(chunks, ppc)
    ms = bench_ms(lambda: kv_ops.gather_kvcache_all_layers(cache, page_ids))
    moved = 2 * chunks * LAYERS * ppc * page_bytes()
    return {"chunks": chunks, "pages_per_chunk": ppc, "ms": ms, "GBps": moved / (ms * 1e-3) / GB}


def bench_onload(cache: torch.Tensor, arena: torch.Tensor, chunks: int, ppc: int, stream) -> dict:
    slots = torch.randperm(arena.shape[0])[:chunks].int()
    perm = torch.randperm(cache.shape[1] // ppc)[:chunks]
    patterns = {
        # each chunk's pages consecutive (one copy run per chunk), chunks scattered
        "chunk_runs": (perm.view(-1, 1) * ppc + torch.arange(ppc)).int(),
        # every page on its own
        "scattered": torch.randperm(cache.shape[1])[: chunks * ppc].int().view(chunks, ppc),
    }
    moved = chunks * ppc * page_bytes()
    out = {"chunks": chunks, "pages_per_chunk": ppc, "bytes_per_call": moved}
    with torch.cuda.stream(stream):
        for impl in ("memcpy", "zerocopy"):
            with onload_impl(impl):
                for name, pages in patterns.items():
                    ms = bench_ms(lambda: kv_ops.onload_kvcache(cache, arena, slots, pages, 5))
                    out[f"{impl}_{name}"] = {"ms": ms, "GBps": moved / (ms * 1e-3) / GB}
    return out


def bench_offload(arena: torch.Tensor, chunks: int, stream) -> dict:
    src = torch.randn((chunks, *arena.shape[1:]), device="cuda").to(DTYPE)
    slots = torch.randperm(arena.shape[0])[:chunks].int()
    moved = src.numel() * src.element_size()
    with torch.cuda.stream(stream):
        ms = bench_ms(lambda: kv_ops.store_host_chunks(arena, src, slots))
    return {"chunks": chunks, "ms": ms, "GBps": moved / (ms * 1e-3) / GB}


# (name, users): each user (history tokens, of them cached, candidates)
ATTENTION_SHAPES = (
    ("batch1", ((HISTORY, CACHED, CANDIDATES),)),
    ("batch8", ((HISTORY, CACHED, CANDIDATES),) * 8),
    ("rerank8", ((HISTORY, HISTORY, CANDIDATES),) * 8),
    ("uncached8", ((HISTORY, 0, CANDIDATES),) * 8),
    # a batch of the seed replay (run DA, cached pass, batch 80): hits of 1.1k, 2.6k and 3.5k keys beside two misses,
    # 104 units in one wave of 132 SMs, where the longest units are the wave's tail (scripts/schedule_model.py)
    ("mixed5", ((1128, 978, 304), (330, 0, 75), (2564, 2474, 424), (928, 0, 278), (3482, 3290, 106))),
)


def seed_metadata(users: tuple[tuple[int, int, int], ...], num_pages: int) -> KVCacheMetadata:
    """The batch's metadata: user b has users[b] = (history tokens, cached of them, candidates), its
    pages drawn at random (a seeded permutation) from the cache's."""
    rng = np.random.default_rng(len(users))
    need = [-(-n // PAGE) for n, _, _ in users]
    perm = rng.permutation(num_pages)[: sum(need)]
    ends = np.cumsum(need)
    pages = [perm[e - k : e].tolist() for k, e in zip(need, ends)]
    history, cached, candidates = (list(x) for x in zip(*users))
    return KVCacheMetadata.from_pages(pages, history, cached, candidates, PAGE).to("cuda")


def useful_flops(users: tuple[tuple[int, int, int], ...]) -> float:
    """2 matmuls x 2 FLOP per multiply-add over the keys each row sees."""
    seen = sum(sum(p + 1 for p in range(c, n)) + m * (n + 1) for n, c, m in users)
    return 4.0 * HEADS * HEAD_DIM * seen


def _sweep() -> list[ta.AttentionConfig]:
    """Tile configs with the tanh SiLU, then the default tiles with the other SiLU forms. (Run AP
    swept every tile config with each form, and Triton's warp specialisation, which changed
    nothing: benchmarks/RESULTS.md.)"""
    # ptxas (Triton 3.6, sm_90a; scripts/kernel_regs.py) on the default tiles: 255 registers and
    # 188 / 240 bytes of spill stores / loads per thread with the JIT's divisibility (152 / 200 before
    # the lane branch; ~1.5 KB without the divisibility, the figure of sessions 14-15). The QK^T
    # wgmma reads Q from shared memory and PV takes W from registers: the spills are the 128 x 256
    # float32 accumulator's beside the gather addressing (session 27's PTX).
    # (128 x 64 with 3 stages needs 256 KB of shared memory, over the H200's 227 KB: dropped)
    # (64 x 32 with 4 warps, two programs a SM, ran batch 8 in 307-352 us against 174: run CU)
    tiles = [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 8, 3),
             (128, 64, 16, 2), (128, 128, 8, 1)]
    configs = [ta.AttentionConfig(*t, silu="tanh") for t in tiles]
    # a balanced batch's units in the stream order, without lanes (the default until run CW: batch 8
    # 176 against 162 us, the re-rank 149 against 125, H100)
    configs += [ta.AttentionConfig(128, 64, 8, 2, silu="tanh", lanes_above=1.01)]
    # TMA key tiles, one page (32 keys) each: no per-thread address work; 3 and 4 stages fit (160 / 192 KB)
    configs += [ta.AttentionConfig(128, 32, 8, s, silu="tanh", tma=True) for s in (2, 3, 4)]
    configs += [ta.AttentionConfig(128, 64, 8, 2, silu=mode) for mode in ("exact", "fast")]
    # the balanced wave (stream-K) never, and for batches filling their waves less than 50% / 90%
    # (the default: 75%, batch 1, the re-rank and batch 8 balanced: run AV, 169 -> 163 us at batch 8);
    # 64-row units double the units (batch 8: 192 on 132 SMs), which the balanced wave evens out
    configs += [ta.AttentionConfig(128, 64, 8, 2, silu="tanh", balance_below=b) for b in (0.0, 0.5, 0.9)]
    return configs + [ta.AttentionConfig(64, 64, 8, 2, silu="tanh", balance_below=0.9)]


SWEEP = _sweep()
SPLITS = (0,)  # 0: the automatic choice (session 3 swept 1, 2, 4 too: benchmarks/RESULTS.md)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def bench_attention(cache: torch.Tensor, users: tuple[tuple[int, int, int], ...], sweep: list | None = None) -> dict:
    """GPU time per layer from CUDA-graph replays of all 8 layers (what the paged block runs:
    per-layer graphs), plus the eager time of one call (host overhead of the op included)."""
    meta = seed_metadata(users, cache.shape[1])
    T = int(meta.q_pos.shape[0])
    q, k, v = (torch.randn((T, HEADS, HEAD_DIM), device="cuda", dtype=DTYPE) for _ in range(3))
    flops = useful_flops(users)
    batch = len(users)
    scale_len = HISTORY + CANDIDATES
    m = meta
    ref = paged_hstu_attention_torch(
        q, k, v, cache, 0, m.page_table, m.kv_lens, m.q_batch, m.q_local, m.q_pos, m.max_q, scale_len
    )

    def attn(layer: int, cfg: ta.AttentionConfig | None = None, splits: int = 0) -> torch.Tensor:
        return ta.paged_hstu_attention_triton(q, k, v, cache, layer, meta, scale_len, config=cfg, num_splits=splits)

    def measure(cfg: ta.AttentionConfig | None, splits: int) -> dict:
        try:
            err = rel_err(attn(0, cfg, splits), ref)
            ms = float(triton.testing.do_bench_cudagraph(
                lambda: [attn(layer, cfg, splits) for layer in range(LAYERS)], rep=50, return_mode="median"
            )) / LAYERS
        except Exception as exc:  # a tile config that does not fit shared memory: reported, not fatal
            logger.warning("attention batch %d %s splits=%d failed: %s", batch, cfg, splits, exc)
            return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        return {"ms": ms, "TFLOPs": flops / (ms * 1e-3) / 1e12, "rel_err_vs_torch": err}

    out = {"batch": batch, "users": [list(u) for u in users], "rows": T, "useful_GFLOP": flops / 1e9}
    cfg = ta.default_config(HEAD_DIM)
    out["default"] = {"config": asdict(cfg), **measure(None, 0)}
    layer = [0]

    def eager_step():  # rotate layers so batch 1 (16 MB of K/V a layer) does not sit in L2
        layer[0] = (layer[0] + 1) % LAYERS
        return attn(layer[0])

    eager_ms = bench_ms(eager_step)
    out["default_eager"] = {"ms": eager_ms, "TFLOPs": flops / (eager_ms * 1e-3) / 1e12}
    sweep = SWEEP if sweep is None else sweep
    out["sweep"] = [{"config": asdict(c), "num_splits": sp, **measure(c, sp)} for c in sweep for sp in SPLITS]

    def torch_layers():
        return [paged_hstu_attention_torch(q, k, v, cache, layer, m.page_table, m.kv_lens, m.q_batch, m.q_local,
                                           m.q_pos, m.max_q, scale_len) for layer in range(LAYERS)]

    if T > 8192:  # the uncached batch: the torch implementation's score matrices would take minutes
        out["torch"] = {"skipped": f"{T} rows"}
        return out
    try:
        torch_ms = float(triton.testing.do_bench_cudagraph(torch_layers, rep=50, return_mode="median")) / LAYERS
        out["torch"] = {"ms": torch_ms, "TFLOPs": flops / (torch_ms * 1e-3) / 1e12}
    except Exception as exc:
        out["torch"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON result path")
    parser.add_argument("--copy-gib", type=float, default=1.0, help="size of the ceiling copies")
    parser.add_argument("--sections", nargs="+", choices=("copies", "attention"), default=["copies", "attention"],
                        help="what to measure besides the ceilings (always measured: the ratios need them)")
    parser.add_argument("--tiles", nargs="+", metavar="M,N,WARPS,STAGES[,LANES_ABOVE][t]",
                        help="sweep only these tile configs (tanh SiLU) instead of the whole sweep; a fifth field "
                             "sets AttentionConfig.lanes_above, a trailing t TMA key tiles (N = the page size, 32)")
    args = parser.parse_args()
    sweep = None
    if args.tiles:
        sweep = [_tile_config(t) for t in args.tiles]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.manual_seed(0)
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    res: dict = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                 "triton": triton.__version__, "cuda": torch.version.cuda}
    logger.info("ceilings on %s", props.name)
    res["ceilings"] = ceil = ceilings(int(args.copy_gib * (1 << 30)))

    num_pages = 4096  # 8 layers x 4096 pages x 128 KiB = 4 GiB
    cache = torch.randn((LAYERS, num_pages, 2, PAGE, HEADS, HEAD_DIM), device="cuda").to(DTYPE)
    if "copies" in args.sections:
        res.update(bench_copies(cache))
    if "attention" in args.sections:
        logger.info("attention")
        res["attention"] = {name: bench_attention(cache, users, sweep) for name, users in ATTENTION_SHAPES}
    res["wall_s"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(format_summary(res, props.name))


def bench_copies(cache: torch.Tensor) -> dict:
    logger.info("append / gather")
    res = {"append": bench_append(cache, 65536), "append_seed": bench_append(cache, 8 * (HISTORY - CACHED))}
    ppc = CHUNK_TOKENS // PAGE
    res["gather_all_layers"] = bench_gather(cache, 256, ppc)
    logger.info("onload / offload")
    slots = 256
    shape = (slots, LAYERS, ppc, 2, PAGE, HEADS, HEAD_DIM)
    arena = torch.empty(shape, dtype=DTYPE).pin_memory()  # 1 GiB
    arena.copy_(torch.randn(shape, device="cuda", dtype=DTYPE))
    stream = torch.cuda.Stream()
    res["onload"] = bench_onload(cache, arena, 128, ppc, stream)
    res["offload"] = bench_offload(arena, 64, stream)
    return res


def _tile_config(spec: str) -> ta.AttentionConfig:
    """M,N,WARPS,STAGES[,LANES_ABOVE][t] with the tanh SiLU; a trailing t: TMA key tiles (N must be the page size).
    The kernel is HSTU_ATTENTION_KERNEL's (gluon: its own tiles and schedule; the fields are the Triton kernel's)."""
    tma = spec.endswith("t")
    fields = spec.removesuffix("t").split(",")
    extra = {"lanes_above": float(fields[4])} if len(fields) > 4 else {}
    return ta.AttentionConfig(*(int(x) for x in fields[:4]), silu="tanh", tma=tma, kernel=ta._KERNEL, **extra)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ta.AttentionConfig) if f.default is not dataclasses.MISSING}


def _config_name(c: dict) -> str:
    """The config's tiles, then whatever departs from AttentionConfig's defaults."""
    ws = " ws" if c.get("warp_specialize") else ""
    balance_below = c.get("balance_below", _DEFAULTS["balance_below"])
    balance = f" b{balance_below:g}" if balance_below != _DEFAULTS["balance_below"] else ""
    lanes_above = c.get("lanes_above", _DEFAULTS["lanes_above"])
    lanes = " no lanes" if lanes_above > 1 else (f" lanes>{lanes_above:g}" if lanes_above != _DEFAULTS["lanes_above"] else "")
    tma = " tma" if c.get("tma") else ""
    return f"{c['block_m']}x{c['block_n']} w{c['num_warps']} s{c['num_stages']} {c.get('silu', 'exact')}{ws}{balance}{lanes}{tma}"


def format_summary(res: dict, gpu: str) -> str:
    """The short tables: every figure beside its ceiling ratio, then the attention sweep as us per
    layer by config and shape (rel_err over 1e-2 against the torch implementation marked)."""
    ceil = res["ceilings"]
    d2d, h2d, d2h, mm = ceil["d2d_GBps"], ceil["h2d_GBps"], ceil["d2h_GBps"], ceil["bf16_matmul_TFLOPs"]
    rows = [
        ("ceiling D2D copy", f"{d2d:.0f} GB/s", "1.00"),
        ("ceiling H2D pinned", f"{h2d:.1f} GB/s", "1.00"),
        ("ceiling D2H pinned", f"{d2h:.1f} GB/s", "1.00"),
        ("ceiling bf16 matmul", f"{mm:.0f} TFLOP/s", "1.00"),
    ]
    if "append" in res:
        rows += [
            (f"append {res['append']['tokens']} tok", f"{res['append']['GBps']:.0f} GB/s", f"{res['append']['GBps'] / d2d:.2f} of D2D"),
            (f"append {res['append_seed']['tokens']} tok (seed)", f"{res['append_seed']['ms'] * 1e3:.1f} us",
             f"{res['append_seed']['GBps'] / d2d:.2f} of D2D"),
            ("gather_all_layers", f"{res['gather_all_layers']['GBps']:.0f} GB/s", f"{res['gather_all_layers']['GBps'] / d2d:.2f} of D2D"),
        ]
        for key in ("memcpy_chunk_runs", "memcpy_scattered", "zerocopy_chunk_runs", "zerocopy_scattered"):
            r = res["onload"][key]
            rows.append((f"onload {key}", f"{r['GBps']:.1f} GB/s", f"{r['GBps'] / h2d:.2f} of H2D"))
        rows.append(("offload store_host_chunks", f"{res['offload']['GBps']:.1f} GB/s", f"{res['offload']['GBps'] / d2h:.2f} of D2H"))
    attention = res.get("attention", {})
    for b, a in attention.items():
        for key in ("default", "default_eager"):
            r = a[key]
            if "error" in r:
                rows.append((f"attention {b} {key}", "FAILED", r["error"][:60]))
            else:
                rows.append((f"attention {b} {key}", f"{r['TFLOPs']:.0f} TFLOP/s ({r['ms'] * 1e3:.0f} us)",
                             f"{r['TFLOPs'] / mm:.2f} of matmul"))
        ran = [s for s in a["sweep"] if "TFLOPs" in s and s["rel_err_vs_torch"] < 1e-2]
        if ran:
            best = max(ran, key=lambda s: s["TFLOPs"])
            rows.append((f"attention {b} best of sweep",
                         f"{best['TFLOPs']:.0f} TFLOP/s {_config_name(best['config'])} splits={best['num_splits']}",
                         f"{best['TFLOPs'] / mm:.2f} of matmul"))
        if "TFLOPs" in a["torch"]:
            rows.append((f"attention {b} torch", f"{a['torch']['TFLOPs']:.1f} TFLOP/s",
                         f"{a['torch']['TFLOPs'] / mm:.3f} of matmul"))
    width = max(len(r[0]) for r in rows)
    lines = [f"\n{gpu}  ({res['wall_s']:.0f} s)"] + [f"{name:<{width}}  {value:<40}  {ratio}" for name, value, ratio in rows]
    if attention:
        shapes = list(attention)
        lines.append("\nattention sweep, us per layer (x: rel_err vs torch > 1e-2; -: failed)")
        lines.append(f"{'config':<28}" + "".join(f"{s:>11}" for s in shapes))
        for k, entry in enumerate(next(iter(attention.values()))["sweep"]):
            cells = []
            for shape in shapes:
                r = attention[shape]["sweep"][k]
                cells.append("-" if "ms" not in r else f"{r['ms'] * 1e3:.0f}{'x' if r['rel_err_vs_torch'] > 1e-2 else ''}")
            lines.append(f"{_config_name(entry['config']) + ' sp' + str(entry['num_splits']):<28}" + "".join(f"{c:>11}" for c in cells))
        for mode in ta.SILU_MODES:  # the SiLU forms' accuracy, worst over every config that ran
            errs = [[r["rel_err_vs_torch"] for r in attention[s]["sweep"] if r["config"]["silu"] == mode and "ms" in r]
                    for s in shapes]
            lines.append(f"{'max rel_err, ' + mode:<28}" + "".join(f"{max(e):>11.1e}" if e else f"{'-':>11}" for e in errs))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
