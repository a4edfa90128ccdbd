"""Where a cached forward spends its time: host work per forward (cProfile) and GPU busy share
(torch.profiler trace), at the bench shapes (seed preset by default; --tiny on CPU).

    python -m hstu.scripts.profile_forward --device cuda --cuda-graphs --batch 1 --out out/profile

For each batch size: N cached forwards (GPU-resident prefix, new tokens + candidates), each after
an untimed prefill, measured three times: the engine's own per-phase host timings, cProfile
(host functions by own time; the model thread's Python work) and torch.profiler (union of
compute kernel time over the wall time until every stream is idle, its offload included = GPU busy
share; the compute stream's kernels over the time until the logits are ready = forward busy share,
also over that time measured without the profiler, whose host tracing slows the work the GPU
waits for; the top kernels and copies by device time). `--cached-tokens` shortens the GPU-resident
prefix (the forward recomputes the rest); `--onload-fraction F` puts the prefix in the host tier and
onloads its share F; `--rerank` ranks the whole cached history again with its candidates (the
unchanged-history re-rank: candidates only); `--pipelined N` also launches N cached batches back to
back as the server does (rank_async, two in flight) and reports the GPU's busy share over them;
`--trace` writes the last profiled forward's Chrome trace. Prints a short table last and writes
profile.json.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import gzip
import logging
import pstats
import shutil
import statistics
import time
from pathlib import Path

import torch

from hstu.engine import ForwardTiming, RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import HOST_FORMAT_HELP, HOST_FORMATS, HOST_SPLIT_HELP, HOST_SPLITS
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.ops.kvcache.planner import FixedSplit, front_tokens
from hstu.scripts import report
from hstu.scripts.bench_shapes import TINY_SHAPE, BenchShape, make_requests
from hstu.scripts.timing import sync
from hstu.scripts.workload import FreshUserIds, as_users

logger = logging.getLogger(__name__)
_IDS = FreshUserIds()  # never-reused users across every profiled pass


def profile_engine(
    shape: BenchShape, device: torch.device, batch: int, cuda_graphs: bool, onload_fraction: float | None = None,
    resident_batches: int = 2, capture: bool = True,
) -> RankingEngine:
    """An engine holding `resident_batches` batches of `batch` users on the GPU (and, with an
    onload split, in the host tier), with graph buckets
    for the cached forward, the re-rank and the split's batch when `cuda_graphs` (captured unless
    `capture` is False: the same padded path replayed eagerly, on a CPU too)."""
    cfg = shape.model_config()
    # A host tier for every resident batch: their prefills offload each user's prefix there, so a
    # profiled batch offloads only its new chunk, as a returning user's request does. Sized for one
    # batch, the pipelined batches' users had lost their host copies and each batch offloaded its
    # users' whole histories (1.07 GB at batch 8 of the seed shapes, ~19 ms of D2H: the batch's
    # wall time, H100 run CL), which measured the link, not the forward.
    kv = shape.cache_config(cfg, resident_batches)
    kv = dataclasses.replace(kv, num_pages=max(kv.num_pages, resident_batches * batch * shape.pages_per_user))
    engine = RankingEngine(InferenceRankingGR(cfg, device), AsyncKVCacheManager(kv, device))
    if cuda_graphs:  # the cached forward's rows, the re-rank's (candidates only) and a split's
        rows = {batch * (shape.new_tokens + shape.num_candidates), batch * shape.num_candidates}
        if onload_fraction is not None:
            onload = int(shape.cached_tokens // shape.chunk_tokens * onload_fraction) * shape.chunk_tokens
            if shape.host_split == "compute_front" and 0 < onload < shape.cached_tokens:  # its front pass
                rows.add(batch * front_tokens(shape.cached_tokens, onload, shape.chunk_tokens))
            else:  # the prefix's recomputed back with the batch
                rows.add(batch * (shape.history_tokens - onload + shape.num_candidates))
        rows = sorted(rows)
        engine.enable_cuda_graphs(max_batch=batch, buckets=tuple(rows), capture=capture)
    return engine


def as_front_end(engine: RankingEngine, requests: list) -> list:
    """`requests` validated and their whole histories hashed, where the server does that: in its
    front end, off the model thread."""
    for r in requests:
        r.validate(engine.config)
        r.identity(engine.model.identity).prefix(r.history_tokens(engine.config))
    return requests


def _forwards(
    engine: RankingEngine, shape: BenchShape, batch: int, n: int, device: torch.device, rerank: bool = False,
    cold: bool = False,
):
    """Yield n times: prefill (untimed), then the caller times one cached forward. With the
    engine's cache given an onload split (FixedSplit), the prefix is evicted to the host tier
    first, so the forward onloads that share of it and recomputes the rest. rerank: the prefill
    is the full requests themselves, so the forward computes the candidates only. cold: the
    requests reach the timed forward validated (by create(), as an in-process caller's do) but not
    hashed, as `hstu bench` times them; by default hashing happens before too, where the server
    does it: off the model thread)."""
    prefix, full = make_requests(shape, engine.config, batch)
    split = engine.cache.cost_model
    for _ in range(n):
        users = _IDS.take(len(full))
        engine.cache.cost_model = None
        engine.rank(as_users(full if rerank else prefix, users))
        engine.cache.cost_model = split
        engine.cache.drain()
        if split is not None:
            engine.cache.evict_gpu(users)
        requests = as_users(full, users)
        if not cold:
            as_front_end(engine, requests)
        sync(device)
        yield requests


_PHASES = ForwardTiming.field_names()


def phase_profile(engine, shape, batch, n, device, rerank=False, cold=False) -> dict:
    """Median host ms per phase of the model thread (RankingEngine.timings), no profiler attached;
    total is the engine's whole batch, wall adds the device sync after it."""
    walls, forward_walls, timings = [], [], []
    for requests in _forwards(engine, shape, batch, n, device, rerank, cold):
        t0 = time.perf_counter()
        engine.rank(requests)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the logits are ready
        forward_walls.append(time.perf_counter() - t0)
        sync(device)
        walls.append(time.perf_counter() - t0)
        timings.append(engine.timings[-1])  # the timed forward's, not the untimed prefill's
    out = {p.removesuffix("_s") + "_ms": statistics.median(getattr(t, p) for t in timings) * 1e3 for p in _PHASES}
    out["wall_ms"] = statistics.median(walls) * 1e3
    out["forward_wall_ms"] = statistics.median(forward_walls) * 1e3
    return out


def host_profile(engine, shape, batch, n, device, rerank=False, cold=False) -> dict:
    prof, wall = cProfile.Profile(), 0.0
    for requests in _forwards(engine, shape, batch, n, device, rerank, cold):
        t0 = time.perf_counter()
        prof.enable()
        engine.rank(requests)
        prof.disable()
        sync(device)
        wall += time.perf_counter() - t0
    stats = pstats.Stats(prof)
    top = [
        {"function": fn, "calls_per_forward": calls / n, "own_ms_per_forward": own / n * 1e3}
        for fn, calls, own, _ in report.top_own_time(stats, 25)
    ]
    total_own = sum(c[2] for c in stats.stats.values()) / n * 1e3
    return {"wall_ms_per_forward": wall / n * 1e3, "profiled_host_ms_per_forward": total_own, "top_own_time": top}


def kernel_busy_us(events) -> float:
    """Union of the compute kernels' intervals (streams may overlap; copies are not compute)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if not e.name.startswith(("Memcpy", "Memset")))
    merged, end = 0.0, None
    for s, e in spans:
        if end is None or s > end:
            merged += e - s
            end = e
        elif e > end:
            merged += e - end
            end = e
    return merged


def compute_stream_busy_us(events) -> float:
    """Union of the kernels on the stream that ran the most kernel time: the forward's compute
    stream. The offload's gather and the tiers' copies run on streams of their own."""
    by_stream: dict[str, list] = {}
    for e in events:
        by_stream.setdefault(_stream_of(e), []).append(e)
    return max((kernel_busy_us(stream_events) for stream_events in by_stream.values()), default=0.0)


def _stream_of(event) -> str:
    return str(getattr(event, "device_resource_id", None) or event.thread)


def is_runtime_call(event) -> bool:
    """A CUDA runtime/driver call on the host (cudaLaunchKernel, cudaGraphLaunch, ...), not a device event."""
    return event.device_type != torch.autograd.DeviceType.CUDA and event.name.startswith("cu")


def pipelined_profile(engine, shape, batch, n, device, depth: int = 2) -> dict:
    """The GPU's busy share while n cached batches run back to back as the server runs them:
    rank_async launches a batch while up to depth - 1 earlier ones still run on the device, so
    the host work of one overlaps the kernels of another (the single forwards above cannot show
    that: each starts on an idle GPU). Every batch's users are prefilled first (all stay on the
    GPU: the engine's cache holds n + 1 batches, its host tier their prefixes, so a batch offloads
    only the chunk its new tokens filled, as a returning user's request does) and its requests
    validated and hashed, as the server's front end does. With an onload split on the cache
    (--onload-fraction), every batch's prefixes are evicted to the host tier after the prefill, so each batch onloads that share while
    the one before it still runs (finish's and the onload's waits are what this shows)."""
    prefix, full = make_requests(shape, engine.config, batch)
    split = engine.cache.cost_model
    batches, prefilled = [], []
    engine.cache.cost_model = None  # the prefills onload nothing
    for _ in range(n):
        users = _IDS.take(len(full))
        engine.rank(as_users(prefix, users))
        prefilled += users
        batches.append(as_front_end(engine, as_users(full, users)))
    engine.cache.cost_model = split
    engine.cache.drain()
    if split is not None:
        engine.cache.evict_gpu(prefilled)
    sync(device)
    cuda = device.type == "cuda"
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        recorder = profile(activities=[ProfilerActivity.CUDA])
    else:
        recorder = contextlib.nullcontext()
    before = engine.cache.stats.snapshot()
    with recorder:
        t0 = time.perf_counter()
        pending: collections.deque = collections.deque()
        for requests in batches:
            pending.append(engine.rank_async(requests))
            if len(pending) >= depth:
                pending.popleft().result()
        while pending:
            pending.popleft().result()
        sync(device)
        wall = time.perf_counter() - t0
    engine.cache.drain()  # the last batches' offloads, counted when they finish
    after = engine.cache.stats.snapshot()
    out = {"batches": n, "depth": depth, "wall_ms_per_batch": wall / n * 1e3,
           "host_hits": after["host_hits"] - before["host_hits"],
           "bytes_offloaded_per_batch": (after["bytes_offloaded"] - before["bytes_offloaded"]) / n}
    if cuda:
        events = [e for e in recorder.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = kernel_busy_us(events) / 1e6
        out.update(kernel_ms_per_batch=busy / n * 1e3, gpu_busy_share=busy / wall)
    return out


def stream_timeline(
    events, max_gap_us: float = 2.0, max_segments: int = 400, origin: float | None = None
) -> dict[str, list[list]]:
    """One forward's device activity per stream, relative to `origin` (the profiler's clock; by
    default its first device event): runs of events of one kind (kernel or copy) merged while the
    gap between them stays under max_gap_us, as [start_us, end_us, kind, events]. Enough to see
    what overlapped what (an onload's copies against the layers waiting for them) without shipping
    the whole trace."""
    if not events:
        return {}
    t0 = min(e.time_range.start for e in events) if origin is None else origin
    streams: dict[str, list[list]] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        stream = _stream_of(e)
        kind = "copy" if e.name.startswith(("Memcpy", "Memset")) else "kernel"
        start, end = e.time_range.start - t0, e.time_range.end - t0
        runs = streams.setdefault(stream, [])
        if runs and runs[-1][2] == kind and start - runs[-1][1] <= max_gap_us:
            runs[-1][1] = max(runs[-1][1], end)
            runs[-1][3] += 1
        elif len(runs) < max_segments:
            runs.append([start, end, kind, 1])
    return {s: [[round(a, 1), round(b, 1), k, c] for a, b, k, c in runs] for s, runs in streams.items()}


def device_profile(engine, shape, batch, n, device, rerank=False, cold=False, trace: Path | None = None) -> dict:
    """GPU busy share and top kernels over n forwards; the last forward's timeline per stream, and
    with `trace` its Chrome trace (gzipped) for a closer look."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    busy, wall, forward_busy, forward_wall = 0.0, 0.0, 0.0, 0.0
    by_kernel: dict[str, float] = {}
    by_runtime: dict[str, list[float]] = {}  # CUDA runtime/driver calls on the host: [ms, calls]
    timeline: dict = {}
    for requests in _forwards(engine, shape, batch, n, device, rerank, cold):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.rank(requests)
            torch.cuda.current_stream(device).synchronize()  # the forward's logits are ready
            forward_wall += time.perf_counter() - t0
            torch.cuda.synchronize(device)  # and its offload has landed
            wall += time.perf_counter() - t0
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        for e in events:
            by_kernel[e.name] = by_kernel.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
        busy += kernel_busy_us(events) / 1e3
        forward_busy += compute_stream_busy_us(events) / 1e3
        for e in prof.events():
            if is_runtime_call(e):
                total = by_runtime.setdefault(e.name, [0.0, 0])
                total[0] += (e.time_range.end - e.time_range.start) / 1e3
                total[1] += 1
        timeline = stream_timeline(events)
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        raw = trace.with_suffix("")  # export_chrome_trace writes plain JSON
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    top = sorted(by_kernel.items(), key=lambda kv: kv[1], reverse=True)[:12]
    return {
        "timeline_us": timeline,
        "kernel_busy_ms_per_forward": busy / n,
        "wall_ms_per_forward": wall / n * 1e3,
        "gpu_busy_share": busy / wall / 1e3,
        # the forward alone: the compute stream's kernels over the time until its logits were ready
        # (the share above also waits out the offload that follows on its own stream)
        "forward_wall_ms": forward_wall / n * 1e3,
        "forward_busy_share": forward_busy / forward_wall / 1e3 if forward_wall else 0.0,
        "compute_stream_busy_ms_per_forward": forward_busy / n,
        "top_kernels": [{"kernel": name[:120], "ms_per_forward": ms / n} for name, ms in top],
        # host time inside CUDA calls (launches, syncs, allocations, event waits): where a model
        # thread's time goes that no Python function owns
        "top_runtime_calls": [
            {"call": name, "ms_per_forward": ms / n, "calls_per_forward": calls / n}
            for name, (ms, calls) in sorted(by_runtime.items(), key=lambda kv: kv[1][0], reverse=True)[:8]
        ],
    }


def main(args: argparse.Namespace) -> int:
    shape = TINY_SHAPE if args.tiny else BenchShape()
    shape = dataclasses.replace(
        shape, prepare_worker=args.prepare_worker, host_split=args.host_split, host_format=args.host_format
    )
    if args.cached_tokens is not None:
        shape = dataclasses.replace(shape, cached_tokens=args.cached_tokens)
    if args.host_only:
        from hstu.scripts import profile_host

        return profile_host.main(shape, args.batch, args.forwards, args.out, rerank=args.rerank,
                                 onload_fraction=args.onload_fraction, cold=args.cold_requests)
    device = torch.device(args.device)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "shape": dataclasses.asdict(shape), "cuda_graphs": args.cuda_graphs,
           "onload_fraction": args.onload_fraction, "rerank": args.rerank, "cold_requests": args.cold_requests}
    for batch in args.batch:
        engine = profile_engine(
            dataclasses.replace(shape, batch_sizes=(batch,)), device, batch, args.cuda_graphs, args.onload_fraction,
            resident_batches=max(2, args.pipelined + 1),
        )
        if args.onload_fraction is not None:
            engine.cache.cost_model = FixedSplit(args.onload_fraction)
        for _ in _forwards(engine, shape, batch, 3, device, args.rerank):  # warm-up: compiles, allocator
            pass
        doc[str(batch)] = {
            "phases": phase_profile(engine, shape, batch, args.forwards, device, args.rerank, args.cold_requests),
            "host": host_profile(engine, shape, batch, args.forwards, device, args.rerank, args.cold_requests),
            "device": device_profile(
                engine, shape, batch, args.forwards, device, args.rerank, args.cold_requests,
                args.out / f"trace_b{batch}.json.gz" if args.trace else None,
            ),
        }
        entry = doc[str(batch)]
        if entry["device"]:
            # The profiler's host tracing slows the host work the GPU waits for (run IC, batch 8: a
            # 4.85 ms forward under it, 2.93 ms without), so its forward busy share reads low. The
            # kernels' own durations are the device's: their time over the same forwards' wall
            # without the profiler is the share a served forward has.
            entry["forward_busy_share_unprofiled_wall"] = (
                entry["device"]["compute_stream_busy_ms_per_forward"] / entry["phases"]["forward_wall_ms"]
            )
        if args.pipelined:
            doc[str(batch)]["pipelined"] = pipelined_profile(engine, shape, batch, args.pipelined, device)
        engine.close()
    report.write_json(args.out / "profile.json", doc)
    print(format_table(doc, args.batch))
    return 0


def format_table(doc: dict, batches: list[int]) -> str:
    """Per batch: wall, profiled host and GPU busy time per forward; then its top own-time functions."""
    rows = [["batch", "wall ms", "profiled host ms", "GPU busy", "forward ms", "forward busy",
             "forward ms (no profiler)", "forward busy (no profiler)"]]
    for batch in batches:
        entry = doc[str(batch)]
        h, d = entry["host"], entry["device"]
        busy = f"{100 * d['gpu_busy_share']:.0f}% ({d['kernel_busy_ms_per_forward']:.2f} ms)" if d else "-"
        forward = [f"{d['forward_wall_ms']:.2f}", f"{100 * d['forward_busy_share']:.0f}%",
                   f"{entry['phases']['forward_wall_ms']:.2f}",
                   f"{100 * entry['forward_busy_share_unprofiled_wall']:.0f}%"] if d else ["-"] * 4
        rows.append([str(batch), f"{h['wall_ms_per_forward']:.2f}", f"{h['profiled_host_ms_per_forward']:.2f}", busy,
                     *forward])
    parts = [report.format_table(rows)]
    piped = [(b, doc[str(b)].get("pipelined")) for b in batches]
    if any(p for _, p in piped):
        rows = [["batch", "batches", "wall ms per batch", "kernels ms per batch", "GPU busy", "MB offloaded per batch"]] + [
            [str(b), str(p["batches"]), f"{p['wall_ms_per_batch']:.2f}",
             f"{p['kernel_ms_per_batch']:.2f}" if "kernel_ms_per_batch" in p else "-",
             f"{100 * p['gpu_busy_share']:.0f}%" if "gpu_busy_share" in p else "-",
             f"{p['bytes_offloaded_per_batch'] / 2**20:.1f}"]
            for b, p in piped if p
        ]
        parts.append("batches launched back to back (rank_async, two in flight):\n" + report.format_table(rows))
    phases = [["batch", *(p.removesuffix("_s") for p in _PHASES), "wall"]] + [
        [str(b), *(f"{doc[str(b)]['phases'][k]:.3f}" for k in [p.removesuffix("_s") + "_ms" for p in _PHASES] + ["wall_ms"])]
        for b in batches
    ]
    parts.append("model thread ms per forward, medians by phase (no profiler):\n" + report.format_table(phases))
    for batch in batches:
        top = [["function", "own ms per forward", "calls per forward"]] + [
            [row["function"], f"{row['own_ms_per_forward']:.3f}", f"{row['calls_per_forward']:.1f}"]
            for row in doc[str(batch)]["host"]["top_own_time"][:12]
        ]
        parts.append(f"batch {batch}, top own time:\n" + report.format_table(top))
        kernels = doc[str(batch)]["device"].get("top_kernels")
        if kernels:
            rows = [["kernel", "device ms per forward"]] + [[k["kernel"][:80], f"{k['ms_per_forward']:.3f}"] for k in kernels]
            parts.append(f"batch {batch}, top kernels:\n" + report.format_table(rows))
        calls = doc[str(batch)]["device"].get("top_runtime_calls")
        if calls:
            rows = [["CUDA call (host)", "ms per forward", "calls per forward"]] + [
                [c["call"][:60], f"{c['ms_per_forward']:.3f}", f"{c['calls_per_forward']:.1f}"] for c in calls
            ]
            parts.append(f"batch {batch}, host time in CUDA calls:\n" + report.format_table(rows))
    return "\n\n".join(parts)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="host and device profile of cached forwards", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--forwards", type=int, default=20)
    p.add_argument(
        "--cached-tokens", type=int, default=None,
        help="tokens of the history on the GPU (default the shape's; fewer: the forward recomputes the rest)",
    )
    p.add_argument(
        "--onload-fraction", type=float, default=None, metavar="F",
        help="the cached prefix in the host tier instead: onload its share F, recompute the rest",
    )
    p.add_argument("--cold-requests", action="store_true",
                   help="requests not hashed before the timed forward (as hstu bench times them)")
    p.add_argument("--host-split", choices=HOST_SPLITS, default="auto", help=HOST_SPLIT_HELP)
    p.add_argument("--host-format", choices=HOST_FORMATS, default="kv", help=HOST_FORMAT_HELP)
    p.add_argument("--prepare-worker", action="store_true",
                   help="each batch's prepare job on the cache's prepare worker instead of the model thread")
    p.add_argument("--rerank", action="store_true",
                   help="re-rank the unchanged history (the whole history cached, candidates computed)")
    p.add_argument("--pipelined", type=int, default=0, metavar="N",
                   help="also N cached batches launched back to back (rank_async, two in flight, as the server "
                   "runs them) under the profiler: the GPU's busy share when host work overlaps kernels")
    p.add_argument("--host-only", action="store_true",
                   help="only the model thread's host phases, the forward left out (runs on a CPU at the "
                   "seed layout, narrow model; scripts/profile_host.py)")
    p.add_argument("--trace", action="store_true",
                   help="also write the last profiled forward's Chrome trace per batch (OUT/trace_bB.json.gz)")
    p.add_argument("--out", type=Path, default=Path("out/profile"))
    p.set_defaults(func=main)
    return p
