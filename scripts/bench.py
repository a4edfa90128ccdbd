"""`hstu bench`: cached vs uncached HSTU block and end-to-end forward at the seed's shapes.

Seed shapes (the defaults): 8 layers, hidden 1024, 4 heads x 256 head dim, page 32, bf16; a user
with a 4096-token history of which 3968 are cached, so a request adds 128 history tokens and
ranks 256 candidates; batch 1 and 8. `--tiny` swaps in small shapes that run on CPU in seconds.

Measurements per batch size B (median of --repeats after --warmup, torch.cuda.Event on CUDA,
perf_counter on CPU):
  block/cached      HSTUBlock.forward_paged on B x (128 new + 256 candidate) rows, 4096 keys each
  block/uncached    the same block on B x (4096 + 256) rows: the whole history through the same
                    paged kernels (append + paged attention), nothing reused
  e2e/uncached      InferenceRankingGR.rank of B requests whose users were never seen (a fresh id
                    per user and repeat), so every lookup misses and 4096 + 256 tokens per user are
                    computed through the cached pipeline's own kernels
  e2e/cached_gpu    rank of B requests adding 128 tokens to 3968 tokens that a first (untimed)
                    request left in GPU pages
  e2e/cached_host   the same, but the users' GPU pages are dropped after the first request, so the
                    3968 tokens come from the host tier: the onload is real
Exposed cache time = cached_host - cached_gpu (median), and its share of cached_host: the part of
the onload the per-layer pipelining does not hide. Also recorded: host time the model thread
blocked on the prepare job and on the per-layer onload waits per forward, and each pass's host
phases (plan, inputs, forward launch, finish, total; RankingEngine.timings). `--trace` runs each
e2e pass once more under torch.profiler after the timed ones and records that forward's host
span, CUDA runtime calls and per-stream device activity on one clock (scripts/forward_trace.py).

Self-checks (a failure is recorded in the JSON and makes the exit status 1): every timed request
reports the expected cached length and tier; cached logits equal uncached logits (and, at batch 1,
the dense forward_no_cache reference) within the dtype's tolerance relative to the logit scale
(scripts/compare.py). Each section runs on its own so one failure does not lose the others; the
JSON is rewritten after every section.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from hstu.ops.attention import ATTENTION_BACKENDS, use_attention_backend
from hstu.ops.kvcache.config import HOST_FORMAT_HELP, HOST_FORMATS, HOST_SPLIT_HELP, HOST_SPLITS
from hstu.scripts import report
from hstu.scripts.bench_e2e import SPLIT_FRACTIONS, EndToEnd, split_sweep
from hstu.scripts.block_bench import bench_block
from hstu.scripts.bench_shapes import TINY_SHAPE, BenchShape, check_memory, make_requests, memory_plan
from hstu.scripts.timing import Timer
from hstu.serving.gc_policy import freeze_startup_objects

__all__ = ["TINY_SHAPE", "BenchShape", "make_requests", "memory_plan", "run_bench", "format_table", "add_parser"]

logger = logging.getLogger(__name__)

SEED_REFERENCE = {
    "source": "seed project's published figures (NVIDIA L20, 256 candidates)",
    "block_speedup": (3.0, 8.0),
    "e2e_speedup": (1.3, 2.6),
}


def run_bench(
    shape: BenchShape,
    device: torch.device,
    warmup: int,
    repeats: int,
    out_dir: Path,
    sections: tuple[str, ...] = ("block", "e2e"),
    attention: str = "auto",
    cuda_graphs: bool = False,
    compile_layers: bool = False,
    planner: bool = True,
    trace: bool = False,
    split_fractions: tuple[float, ...] = SPLIT_FRACTIONS,
) -> dict[str, Any]:
    """Run the sections for every batch size; write bench.json (after each section) and bench.md.

    cuda_graphs: the end-to-end models replay per-layer CUDA graphs (RankingEngine.enable_cuda_graphs);
    compile_layers: those graphs capture torch.compile'd layers. The block section always runs the
    eager block. trace: each e2e pass once more under the profiler (EndToEnd).
    """
    with use_attention_backend(attention):
        return _run_bench(
            shape, device, warmup, repeats, out_dir, sections, cuda_graphs, compile_layers, planner, trace,
            split_fractions,
        )


def _run_bench(
    shape: BenchShape,
    device: torch.device,
    warmup: int,
    repeats: int,
    out_dir: Path,
    sections: tuple[str, ...],
    cuda_graphs: bool,
    compile_layers: bool,
    planner: bool,
    trace: bool = False,
    split_fractions: tuple[float, ...] = SPLIT_FRACTIONS,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = memory_plan(shape)
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "shape": dataclasses.asdict(shape),
        "model_config": shape.model_config().to_dict(),
        "warmup": warmup,
        "repeats": repeats,
        "cuda_graphs": cuda_graphs,
        "compile_layers": compile_layers,
        "environment": report.environment(device),
        "memory_plan_bytes": plan,
        "seed_reference": SEED_REFERENCE,
        "block": {},
        "e2e": {},
        "split": {},
        "errors": [],
    }
    path = out_dir / "bench.json"

    def save() -> None:
        if device.type == "cuda":
            doc["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        report.write_json(path, doc)

    def section(name: str, batch: int, fn: Callable[[], dict]) -> None:
        logger.info("%s, batch %d ...", name, batch)
        t0 = time.perf_counter()
        try:
            result = doc[name][str(batch)] = fn()
        except Exception as exc:  # recorded; the other sections still run
            logger.exception("%s at batch %d failed", name, batch)
            doc["errors"].append({"section": name, "batch": batch, "error": f"{type(exc).__name__}: {exc}"})
        else:
            for failure in result["check_failures"]:
                logger.error("check failed: %s", failure)
                doc["errors"].append({"section": name, "batch": batch, "error": f"check failed: {failure}"})
        logger.info("%s, batch %d took %.1fs", name, batch, time.perf_counter() - t0)
        save()

    timer = Timer(device)
    try:
        check_memory(shape, device, plan)
        e2e = EndToEnd(shape, device, cuda_graphs, compile_layers, planner, trace)
        freeze_startup_objects("bench")  # as a serving process and the replay's passes do once ready
    except Exception as exc:
        logger.exception("setup failed")
        doc["errors"].append({"section": "setup", "batch": None, "error": f"{type(exc).__name__}: {exc}"})
        save()
        return doc
    try:
        for batch in shape.batch_sizes:
            if "block" in sections:
                section("block", batch, lambda: bench_block(shape, e2e.cached.model, batch, timer, warmup, repeats, device))
            if "e2e" in sections:
                section("e2e", batch, lambda: e2e.run(batch, timer, warmup, repeats))
            if "split" in sections:
                section("split", batch, lambda: split_sweep(e2e, batch, timer, warmup, repeats, split_fractions))
    finally:
        e2e.close()
    save()
    (out_dir / "bench.md").write_text(markdown_table(doc) + "\n")
    return doc


def _cell(doc: dict, section: str, batch: int, *keys: str) -> Any:
    value: Any = doc[section].get(str(batch))
    for k in keys:
        if not isinstance(value, dict) or k not in value:
            return None
        value = value[k]
    return value


def table_rows(doc: dict) -> list[list[str]]:
    """Header, block rows, end-to-end rows, then the re-rank rows, one per batch size each."""
    ref, batches = doc["seed_reference"], doc["shape"]["batch_sizes"]
    ms = lambda section, batch, *keys: report.fmt(_cell(doc, section, batch, *keys), ".2f")  # noqa: E731
    times = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    rows = [["measure", "batch", "cached ms", "uncached ms", "speedup", "seed (L20)", "host-tier ms", "exposed cache"]]
    for b in batches:
        rows.append(["HSTU block", str(b), ms("block", b, "cached", "median_ms"), ms("block", b, "uncached", "median_ms"),
                     times(_cell(doc, "block", b, "speedup")), "{:g}-{:g}x".format(*ref["block_speedup"]), "", ""])
    for b in batches:
        exposed, share = _cell(doc, "e2e", b, "exposed_cache_ms"), _cell(doc, "e2e", b, "exposed_cache_share")
        rows.append(["end-to-end", str(b), ms("e2e", b, "cached_gpu", "median_ms"), ms("e2e", b, "uncached", "median_ms"),
                     times(_cell(doc, "e2e", b, "speedup")), "{:g}-{:g}x".format(*ref["e2e_speedup"]),
                     ms("e2e", b, "cached_host", "median_ms"),
                     "-" if exposed is None else f"{exposed:.2f} ms ({100 * share:.0f}%)"])
    for b in batches:
        if _cell(doc, "e2e", b, "cached_host_planned", "median_ms") is not None:
            rows.append(["host tier + planner", str(b), ms("e2e", b, "cached_host_planned", "median_ms"),
                         ms("e2e", b, "uncached", "median_ms"), times(_cell(doc, "e2e", b, "speedup_host_tier_planned")),
                         "", "", ""])
    for b in batches:
        rows.append(["re-rank, same history", str(b), ms("e2e", b, "cached_rerank", "median_ms"),
                     ms("e2e", b, "uncached", "median_ms"), times(_cell(doc, "e2e", b, "speedup_rerank")), "", "", ""])
    return rows


def format_table(doc: dict) -> str:
    """The table, the run's setup in one line, then one FAILED line per error."""
    lines = [report.format_table(table_rows(doc), left=2)]
    s, env = doc["shape"], doc["environment"]
    lines.append(
        f"{env.get('gpu', env['device'])}, attention {env['attention']}, {s['num_layers']} layers, "
        f"hidden {s['embedding_dim']}, "
        f"{s['num_heads']}x{s['head_dim']} heads, page {s['page_size']}, {s['dtype']}; history {s['history_tokens']} "
        f"({s['cached_tokens']} cached), {s['num_candidates']} candidates; median of {doc['repeats']}"
        + ("; e2e with CUDA graphs" if doc["cuda_graphs"] else "")
        + (" of compiled layers" if doc.get("compile_layers") else "")
    )
    for err in doc["errors"]:
        lines.append(f"FAILED {err['section']} batch {err['batch']}: {err['error']}")
    return "\n".join(lines)


def markdown_table(doc: dict) -> str:
    return report.markdown_table(table_rows(doc))


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = BenchShape()
    p = subparsers.add_parser(
        "bench",
        help="cached vs uncached HSTU block and end-to-end benchmark (seed shapes; --tiny for CPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true", help="small shapes that run on CPU in seconds (shape flags override)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for flag, field in (
        ("--layers", "num_layers"),
        ("--hidden", "embedding_dim"),
        ("--heads", "num_heads"),
        ("--head-dim", "head_dim"),
        ("--page-size", "page_size"),
        ("--chunk-tokens", "chunk_tokens"),
        ("--history-tokens", "history_tokens"),
        ("--cached-tokens", "cached_tokens"),
        ("--candidates", "num_candidates"),
    ):
        p.add_argument(flag, dest=field, type=int, default=None, help=f"default {getattr(d, field)}")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help=f"default {' '.join(map(str, d.batch_sizes))}")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=f"default {d.dtype}")
    p.add_argument(
        "--sections", nargs="+", choices=["block", "e2e", "split"], default=["block", "e2e"],
        help="split: the host-tier batch at fixed onload/recompute splits against the cost model's predictions",
    )
    p.add_argument("--split-fractions", type=float, nargs="+", default=list(SPLIT_FRACTIONS), metavar="F",
                   help="the split section's onloaded shares of each prefix, each in [0, 1] (whole chunks, rounded "
                        f"down; default {' '.join(map(str, SPLIT_FRACTIONS))})")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="auto", help="torch: bypass the Triton kernel")
    p.add_argument("--cuda-graphs", action="store_true", help="end-to-end models replay per-layer CUDA graphs (CUDA only)")
    p.add_argument("--compile", action="store_true", help="those graphs capture torch.compile'd layers (implies --cuda-graphs)")
    p.add_argument("--no-planner", action="store_true", help="skip the host-tier pass with the compute-or-load planner")
    p.add_argument("--prepare-worker", action="store_true", default=None,
                   help="each batch's prepare job on the cache's prepare worker instead of the model thread")
    p.add_argument("--host-split", choices=HOST_SPLITS, default=None, help=HOST_SPLIT_HELP)
    p.add_argument("--host-format", choices=HOST_FORMATS, default=None, help=HOST_FORMAT_HELP)
    p.add_argument("--trace", action="store_true",
                   help="e2e: one more forward of each pass under torch.profiler, after the timed ones; its host "
                        "span, CUDA runtime calls and per-stream device activity go into bench.json (CUDA only)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    p.set_defaults(func=main)
    return p


def shape_from_args(args: argparse.Namespace) -> BenchShape:
    base = TINY_SHAPE if args.tiny else BenchShape()
    overrides = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(BenchShape) if getattr(args, f.name, None) is not None
    }
    if args.batch_sizes:
        overrides["batch_sizes"] = tuple(args.batch_sizes)
    if args.dtype:
        overrides["dtype"] = args.dtype
    return dataclasses.replace(base, **overrides)


def main(args: argparse.Namespace) -> int:
    if args.warmup < 0 or args.repeats <= 0:
        raise ValueError(f"need warmup >= 0 and repeats > 0, got {args.warmup}, {args.repeats}")
    outside = [f for f in args.split_fractions if not 0.0 <= f <= 1.0]
    if outside:
        raise ValueError(f"--split-fractions must each be in [0, 1], got {outside}")
    args.cuda_graphs = args.cuda_graphs or args.compile
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise ValueError(f"--cuda-graphs/--compile need a CUDA device, got --device {args.device}")
    doc = run_bench(
        shape_from_args(args),
        torch.device(args.device),
        args.warmup,
        args.repeats,
        args.out,
        tuple(args.sections),
        args.attention,
        args.cuda_graphs,
        args.compile,
        not args.no_planner,
        args.trace,
        tuple(args.split_fractions),
    )
    logger.info("wrote %s and %s", args.out / "bench.json", args.out / "bench.md")
    print(format_table(doc))
    return 1 if doc["errors"] else 0
