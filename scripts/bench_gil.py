"""How much a thread running Python slows the engine: why `hstu serve --engine-process` exists.

    python -m hstu.scripts.bench_gil [--device cpu] [--batches 30] [--out out/bench_gil.json]

Re-ranks one batch of 8 cached users (bench_shapes' TINY_SHAPE) alone, then while a second thread
of this process runs pure Python (what a busy event loop does), at Python's default switch
interval and at a short one. The ratio busy/alone is the price of sharing the GIL with the front end: every torch call
drops the GIL and the other thread keeps it up to the switch interval. Reports ratios only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

from hstu.engine import RankingEngine
from hstu.model.batch import RankingRequest
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.scripts.bench_shapes import TINY_SHAPE, make_requests

SHAPE = dataclasses.replace(TINY_SHAPE, batch_sizes=(8,))


def _ms_per_batch(engine: RankingEngine, batches: list[list[RankingRequest]]) -> float:
    started = time.perf_counter()
    for batch in batches:
        engine.rank(batch)
    return (time.perf_counter() - started) / len(batches) * 1e3


def measure(device: str = "cpu", batches: int = 30, intervals_s: tuple[float, ...] = (0.005, 0.0005)) -> dict:
    """{switch interval ms: {alone_ms, busy_ms, slowdown}} over `batches` re-ranks of one batch of
    8 unchanged cached histories (bench_shapes' TINY_SHAPE): the host-bound case the server sees
    on a GPU."""
    model = SHAPE.model_config()
    cache = AsyncKVCacheManager(SHAPE.cache_config(model, host_batches=0), device)
    engine = RankingEngine(InferenceRankingGR(model, device), cache)
    _, full = make_requests(SHAPE, model, max(SHAPE.batch_sizes))
    engine.rank(full)  # the miss; every timed rank reuses all cached tokens
    work = [full] * batches
    previous = sys.getswitchinterval()
    results = {}
    try:
        for interval in intervals_s:
            sys.setswitchinterval(interval)
            alone = _ms_per_batch(engine, work)
            stop = threading.Event()
            spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
            spinner.start()
            try:
                busy = _ms_per_batch(engine, work)
            finally:
                stop.set()
                spinner.join()
            results[f"{interval * 1e3:g}"] = {"alone_ms": alone, "busy_ms": busy, "slowdown": busy / alone}
    finally:
        sys.setswitchinterval(previous)
        engine.close()
    return results


def _spin(stop: threading.Event) -> None:
    total = 0
    while not stop.is_set():
        for i in range(1000):
            total += i


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("out/bench_gil.json"))
    args = p.parse_args(argv)
    results = measure(args.device, args.batches)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": args.device, "switch_interval_ms": results}, indent=1))
    for interval, r in results.items():
        print(f"switch interval {interval} ms: {r['alone_ms']:.2f} ms/batch alone, {r['busy_ms']:.2f} with a "
              f"Python-busy thread ({r['slowdown']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
