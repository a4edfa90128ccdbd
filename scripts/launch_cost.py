"""`python -m hstu.scripts.launch_cost`: the model thread's cost of planning and launching one graph
batch, piece by piece, at the seed shapes (CUDA only).

Why: with the device launch on, `hstu bench`'s forward phase (ForwardGraphs.run on the host) still
took 0.13 ms at batch 1 and 0.19 ms at batch 8 (run ME, H100), where one launch of a one-kernel
graph should cost ~10 us; at batch 1 that phase is most of the gap to issue 12's 3x. This times
each piece of the phase alone on a warm engine, many times over: the whole run(), the device
launcher's launch, torch's host launch of the same forward (its staging copy, its replay), the
slot's event record and the logits' clone. Each timed call repeats the batch the engine last ran
(the same inputs, so the same K/V appended again: harmless), and the device is synchronised
between calls, untimed, so no queue builds up.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from hstu.scripts import report
from hstu.scripts.bench_shapes import BenchShape, make_requests
from hstu.scripts.profile_forward import profile_engine


def _median_us(fn: Callable[[], object], iters: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync()
    return statistics.median(times) * 1e6


def launch_costs(
    batch: int, iters: int, shape: BenchShape | None = None, device: str = "cuda"
) -> tuple[dict[str, float], list[dict]]:
    """(median host microseconds of each piece of one graph batch's plan and launch at `batch`
    users, cProfile's top functions of the plan) (on a CPU, for tests: the same pieces uncaptured,
    no event)."""
    shape = shape or BenchShape()
    cuda = device == "cuda"
    engine = profile_engine(shape, torch.device(device), batch, cuda_graphs=True, capture=cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    graphs = engine.graphs
    calls = []
    run = graphs.run
    graphs.run = lambda *args, **kwargs: calls.append((args, kwargs)) or run(*args, **kwargs)
    prefix, full = make_requests(shape, engine.config, batch)
    engine.rank(prefix)
    engine.cache.drain()  # the prefixes' offloads settled: no worker holds the GIL during the plans
    plans, plan_top = _plan_costs(engine, shape, batch, iters, sync)
    engine.rank(full)  # a GPU-resident cached batch: one whole replay
    graphs.run = run
    args, kwargs = calls[-1]
    pad, meta, num_candidates = args[:3]
    before_layer = args[3] if len(args) > 3 else kwargs.get("before_layer")
    if before_layer is not None or kwargs.get("onload") is not None:
        raise RuntimeError("the cached batch onloaded: it replays in segments, not as one whole forward")
    bucket = graphs._buckets[pad.rows]
    with torch.inference_mode():  # as the engine replays: the graphs' buffers are inference tensors
        costs = {
            "run": _median_us(lambda: run(pad, meta, num_candidates), iters, sync),
            "host stage + replay": _median_us(lambda: (graphs.stage(pad, meta), bucket.whole()), iters, sync),
            "host replay": _median_us(bucket.whole, iters, sync),
            "logits clone": _median_us(lambda: bucket.whole_logits[:num_candidates].clone(), iters, sync),
        }
        if cuda:
            costs["event record"] = _median_us(torch.cuda.Event().record, iters, sync)
            costs["current stream"] = _median_us(lambda: torch.cuda.current_stream().cuda_stream, iters, sync)
        if bucket.launchers:
            launcher = bucket.launchers[pad.slot]
            costs["device launch"] = _median_us(lambda: graphs.device_launch.launch(launcher), iters, sync)
    costs["device launches"] = float(graphs.device_launches)
    costs.update(plans)
    engine.close()
    return costs, plan_top


def _plan_costs(engine, shape: BenchShape, batch: int, iters: int, sync: Callable[[], None]) -> tuple[dict, list]:
    """Median us of the plan of the batch extending the users' cached prefixes by the shape's new
    tokens (pages reserved and metadata packed included; each plan aborted, untimed, so the next
    finds the same cache): with requests validated and hashed before (as the server's front ends
    hand them over), and cold (fresh request objects, as `hstu bench` times them); then cProfile's
    top functions of the prepared plan."""
    times: dict[str, list[float]] = {"plan": [], "plan, cold requests": []}
    profiler, profiled = cProfile.Profile(), 0
    _, warm = make_requests(shape, engine.config, batch)
    for r in warm:
        r.validate(engine.config)
    for i in range(3 * iters):
        kind = "plan, cold requests" if i % 3 == 1 else "plan"
        requests = make_requests(shape, engine.config, batch)[1] if kind != "plan" else warm
        profiling = i >= 2 * iters and kind == "plan"  # the medians first; the profile's overhead kept out
        sync()
        t0 = time.perf_counter()
        if profiling:
            profiler.enable()
        plan = engine._plan(requests)
        engine.cache.wait(plan)
        if profiling:
            profiler.disable()
            profiled += 1
        elif i < 2 * iters:
            times[kind].append(time.perf_counter() - t0)
        engine.cache.abort(plan)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}, _top_functions(profiler, profiled)


def _top_functions(profiler: cProfile.Profile, calls: int, top: int = 12) -> list[dict]:
    """cProfile's `top` functions by own time, per profiled call (us)."""
    return [{"function": fn, "own_us": own / calls * 1e6, "cumulative_us": cumulative / calls * 1e6}
            for fn, _, own, cumulative in report.top_own_time(pstats.Stats(profiler), top)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--iters", type=int, default=200, help="timed calls per piece (median reported)")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the medians per batch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_cost times CUDA graph launches: it needs a CUDA GPU")
    results = {str(b): launch_costs(b, args.iters) for b in args.batch}
    doc = {b: costs for b, (costs, _) in results.items()}
    pieces = sorted({k for costs in doc.values() for k in costs if k != "device launches"})
    print(f"{'host us (median)':<22}" + "".join(f"{'batch ' + b:>12}" for b in doc))
    for piece in pieces:
        print(f"{piece:<22}" + "".join(f"{doc[b].get(piece, float('nan')):>12.1f}" for b in doc))
    for b, (_, top) in results.items():
        print(f"batch {b}, the plan's top functions by own time (us a plan, under cProfile):")
        for row in top:
            print(f"  {row['function']:<60}{row['own_us']:>8.1f}{row['cumulative_us']:>10.1f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "iters": args.iters, "us": doc,
                                        "plan_top_functions": {b: top for b, (_, top) in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
