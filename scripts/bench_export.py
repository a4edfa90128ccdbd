"""The AOTInductor package's cached end-to-end time against the Python engine's (issue 19).

    python -m hstu.scripts.bench_export [--device cuda] [--batch 8] [--cuda-graphs] [--tiny]
        [--out out/bench_export.json]

Same weights, same cache sizes (bench_shapes' seed shape, or TINY_SHAPE with --tiny), same
requests: each timed forward ranks `batch` users whose first cached_tokens are in the GPU tier,
computing their new history tokens and the candidates. Three paths:
  python    RankingEngine (async prepare/onload/offload, the Triton attention on CUDA, optional
            CUDA graphs), the path `hstu serve` runs;
  exported  engine/exported.py's ExportableRanker run eagerly (the graph torch.export captures);
  aoti      that graph compiled by AOTInductor (`hstu export`'s package) and loaded in process,
            which runs the same .so a C++ program (tools/aoti_runner) does.
Every path's logits are checked against the Python engine's (bf16 or fp32 tolerance). Reports
medians and the ratios python/aoti and python/exported, all from this one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from hstu.engine import RankingEngine
from hstu.engine.exported import ExportableRanker, batch_inputs, load_package, package_ranker
from hstu.model.batch import RankingRequest
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.scripts.bench_shapes import TINY_SHAPE, BenchShape, make_requests
from hstu.scripts.compare import compare_logits
from hstu.scripts.timing import Timer, summarize
from hstu.scripts.workload import FreshUserIds, as_users

Forward = Callable[[list[RankingRequest]], torch.Tensor]


def _timed_cached(
    forward: Forward,
    settle: Callable[[], None],
    prefix: list[RankingRequest],
    full: list[RankingRequest],
    timer: Timer,
    warmup: int,
    repeats: int,
) -> tuple[list[float], torch.Tensor]:
    """Times of `forward` on `full` under fresh user ids whose `prefix` was ranked (untimed) first,
    so that each timed forward reuses the prefix from the GPU tier; the last forward's logits.
    settle() runs untimed around the prefix forward: it finishes the previous forward's
    asynchronous work (the Python engine's offloads), which a server overlaps with the next batch."""
    ids = FreshUserIds()
    state: dict[str, list[RankingRequest]] = {}

    def setup() -> None:
        settle()
        users = ids.take(len(full))
        forward(as_users(prefix, users))
        settle()
        state["requests"] = as_users(full, users)

    return timer.measure(lambda: forward(state["requests"]), setup, warmup, repeats)


def measure(
    shape: BenchShape, batch: int, device: torch.device, cuda_graphs: bool, warmup: int, repeats: int, package_dir: str
) -> dict[str, Any]:
    """{path: timing summary}, the ratios and the logit checks; see the module docstring."""
    config = shape.model_config()
    cache_config = shape.cache_config(config, host_batches=1)
    model = InferenceRankingGR(config, device)
    manager = AsyncKVCacheManager(cache_config, device)
    engine = RankingEngine(model, manager)
    if cuda_graphs:
        engine.enable_cuda_graphs(max_batch=batch, buckets=(batch * (shape.new_tokens + shape.num_candidates),))
    prefix, full = make_requests(shape, config, batch)

    def python_path(requests: list[RankingRequest]) -> torch.Tensor:
        return torch.cat([o.logits for o in engine.rank(requests)])

    try:
        # One exportable ranker serves both: exporting traces the fakes and leaves its cache
        # untouched, so the eager path starts from an empty cache like the loaded package.
        exported = ExportableRanker(model, cache_config)
        started = time.monotonic()
        package = package_ranker(exported, str(Path(package_dir) / "model.pt2"))
        compile_s = time.monotonic() - started
        aoti = load_package(package)
        synchronous = lambda: None  # noqa: E731  (the exported flow's copies complete inside forward)
        paths: dict[str, tuple[Forward, Callable[[], None]]] = {
            "python": (python_path, manager.drain),
            "exported": (lambda requests: exported(*batch_inputs(requests, device)), synchronous),
            "aoti": (lambda requests: aoti(*batch_inputs(requests, device)), synchronous),
        }
        timer = Timer(device)
        out: dict[str, Any] = {}
        logits: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            for name, (forward, settle) in paths.items():
                times, logits[name] = _timed_cached(forward, settle, prefix, full, timer, warmup, repeats)
                out[name] = summarize(times)
    finally:
        manager.close()
    checks = {name: compare_logits(logits[name], logits["python"], config.dtype) for name in ("exported", "aoti")}
    for name in checks:
        out[f"python_over_{name}"] = out["python"]["median_ms"] / out[name]["median_ms"]
    out["logits_vs_python"] = {n: {"ok": c.ok, "max_abs_diff": c.max_abs_diff, "tolerance": c.tolerance} for n, c in checks.items()}
    out["aoti_compile_s"] = compile_s
    out["ok"] = all(c.ok for c in checks.values())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=8, help="users per forward (default %(default)s)")
    p.add_argument("--cuda-graphs", action="store_true", help="the Python engine replays CUDA graphs")
    p.add_argument("--tiny", action="store_true", help="TINY_SHAPE instead of the seed shape (CPU-sized)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("out/bench_export.json"))
    args = p.parse_args(argv)
    shape = dataclasses.replace(TINY_SHAPE if args.tiny else BenchShape(), batch_sizes=(args.batch,))
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as package_dir:
        result = measure(shape, args.batch, device, args.cuda_graphs, args.warmup, args.repeats, package_dir)
    doc = {"device": str(device), "batch": args.batch, "cuda_graphs": args.cuda_graphs, "shape": dataclasses.asdict(shape), **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    summary = {k: (v["median_ms"] if isinstance(v, dict) and "median_ms" in v else v) for k, v in result.items()}
    json.dump(summary, sys.stdout, indent=1)
    print()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
