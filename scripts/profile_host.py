"""`hstu profile --host-only`: the model thread's host work per cached batch without the model's
kernels, so a machine with no GPU can time it at the seed layout.

Why: issue 12 asks <= 0.3 ms of host work per cached forward at batch 1 and <= 0.6 ms at batch 8.
On a CPU the full profile is all CPU forward; here the forward is left out entirely. Each batch
runs the engine's host phases as a graph-bucket batch does (RankingEngine._rank_batch, buckets
built with capture=False): plan (lookup, layout, prepare job packing the metadata into the
bucket's staging slot), inputs (the rows' features after it), wait, finish (commit, offload
started) and the outputs' split. Nothing else differs from a served batch: the page manager,
host tier, identities and admission are the real ones at the shape's layout (layers, page size,
chunk, history, cached and candidate tokens); only the model is narrow, since no kernel reads
its width and the seed's K/V table would take GBs of host memory. The K/V pages hold whatever
they held (no kernel wrote them). Not timed here: the graph replay and the logits' copy out
(GPU launches; `hstu profile --device cuda` times them), nor the offload worker's chunk gather and
store (a kernel and a DMA on a GPU: here they are left out, the worker's Python still runs). On a
CPU those copies move megabytes a batch through the caches beside the model thread, which tripled
its host time at batch 8 (0.75-0.88 against 0.28 ms: benchmarks/RESULTS.md, twenty-fifth session).

Each profiled batch follows an untimed one that commits the users' cached prefix (a GPU hit
extending it, as in `hstu profile`); requests are validated and hashed first, as the server's
front end does (--cold-requests: validated only, as RankingRequest.create hands them to an
in-process caller's rank() and `hstu bench` times them, so the batch's plan hashes them).
Medians over --forwards batches per phase, then cProfile's top functions.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import pstats
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

import hstu.ops.kvcache.transfers as transfers
from hstu.engine import RankingEngine
from hstu.engine.graphs import ForwardGraphs
from hstu.model.batch import RankingRequest
from hstu.ops.kvcache.planner import FixedSplit
from hstu.scripts import report
from hstu.scripts.bench_shapes import BenchShape, make_requests
from hstu.scripts.profile_forward import as_front_end, profile_engine
from hstu.scripts.workload import FreshUserIds, as_users

HOST_PHASES = ("validate", "plan", "inputs", "wait", "onload", "finish", "split")
# No kernel reads the model's width here: the narrowest model that keeps the layout.
_NARROW = dict(embedding_dim=32, num_heads=2, head_dim=16, mlp_hidden=32, dtype="float32")


def narrow(shape: BenchShape) -> BenchShape:
    """`shape`'s cache layout and request shapes with a narrow model."""
    return dataclasses.replace(shape, **_NARROW)


def host_engine(shape: BenchShape, batch: int, onload_fraction: float | None = None) -> RankingEngine:
    """A CPU engine whose graph buckets (uncaptured, nothing recorded) fit the cached batch, its
    re-rank and, given an onload fraction, the host-tier split's batch."""
    with forwards_not_recorded():
        return profile_engine(shape, torch.device("cpu"), batch, cuda_graphs=True, onload_fraction=onload_fraction,
                              capture=False)


@contextlib.contextmanager
def forwards_not_recorded():
    """ForwardGraphs' buckets made without running their forwards (staging slots, pads and
    layouts only; a replay raises). Why: an uncaptured bucket records by running its forward once
    on the CPU, whose padded attention at the seed layout scores every bucket row against every
    user's 4k keys (GBs a layer): 7 minutes to build the engine, for replays this profile never runs."""

    def not_recorded(self, fn, keep_graph=False):
        def replay() -> None:
            raise RuntimeError("a host-only profile's graphs hold no recorded forward")

        return replay, None, None

    with mock.patch.object(ForwardGraphs, "_record", not_recorded):
        yield


@contextlib.contextmanager
def device_copies_left_out():
    """The offload's chunk gather and host stores, and the onload's copies, as no-ops (GPU work: kernels
    and DMAs); what enqueues them still runs."""
    names = ("gather_kvcache_all_layers", "store_host_chunks", "store_hidden_chunks", "onload_kvcache")
    saved = [getattr(transfers, name) for name in names]
    transfers.gather_kvcache_all_layers = lambda kv_pages, page_ids: page_ids.new_empty(0)
    transfers.store_host_chunks = transfers.store_hidden_chunks = lambda arena, chunks, slot_ids: None
    transfers.onload_kvcache = lambda kv_cache, host_arena, slot_ids, page_ids, layer: None
    try:
        yield
    finally:
        for name, fn in zip(names, saved):
            setattr(transfers, name, fn)


def run_host_phases(engine: RankingEngine, requests: list[RankingRequest]) -> dict[str, float]:
    """One batch's host phases (seconds), the forward left out; a host-tier batch's onload enqueued
    layer by layer where the segment replays enqueue it (PreparedBatch.ready before each layer)."""
    cache, model = engine.cache, engine.model
    logits = torch.zeros(sum(r.candidates.shape[0] for r in requests), len(engine.task_names))  # the graph's output
    tv = time.perf_counter()
    model.validate(requests)  # as rank() does first (a front end's validated requests: a lookup each)
    t0 = time.perf_counter()
    plan = engine._plan(requests)
    t1 = time.perf_counter()
    if plan.pad is not None:
        model.static_inputs(requests, plan.layout, engine.graphs.inputs_of(plan.pad))
    t2 = time.perf_counter()
    prepared = cache.wait(plan)
    if plan.hidden_chunks and plan.pad is not None:  # host_format "hidden": what the replay hands finish
        plan.layer_inputs = engine.graphs.layer_inputs()
    t3 = time.perf_counter()
    if prepared.onload_users:
        for layer in range(engine.config.num_layers):
            prepared.ready(layer)
    t4 = time.perf_counter()
    cache.finish(plan)
    t5 = time.perf_counter()
    engine._split(requests, logits, plan.cached_lens)
    t6 = time.perf_counter()
    return dict(zip(HOST_PHASES, (t0 - tv, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)))


def _batches(
    engine: RankingEngine, shape: BenchShape, batch: int, n: int, ids: FreshUserIds, rerank: bool = False,
    onload_fraction: float | None = None, cold: bool = False,
):
    """n times: commit fresh users' prefixes (untimed; rerank: their full histories, so the batch
    re-ranks them unchanged; onload_fraction: then evicted to the host tier, so the batch onloads
    that share of them, FixedSplit, and recomputes the rest), then yield their full requests,
    validated and hashed (cold: validated only, as `hstu bench` and an in-process caller hand them over)."""
    prefix, full = make_requests(shape, engine.config, batch)
    cache = engine.cache
    split = FixedSplit(onload_fraction) if onload_fraction is not None else None
    for _ in range(n):
        users = ids.take(batch)
        for r in (requests := as_users(full if rerank else prefix, users)):
            r.validate(engine.config)
        cache.cost_model = None
        run_host_phases(engine, requests)
        cache.drain()
        if split is not None:
            cache.evict_gpu(users)
            cache.cost_model = split
        requests = as_users(full, users)
        yield requests if cold else as_front_end(engine, requests)
        cache.drain()


def profile_host(
    shape: BenchShape, batch: int, n: int, top: int = 20, rerank: bool = False, onload_fraction: float | None = None,
    cold: bool = False,
) -> dict:
    """Median ms per phase over n batches, then cProfile's top `top` functions by own time over
    another n (the profiler's overhead kept out of the medians)."""
    ids = FreshUserIds()
    engine = host_engine(shape, batch, onload_fraction)
    with device_copies_left_out(), contextlib.closing(engine):
        for requests in _batches(engine, shape, batch, 3, ids, rerank, onload_fraction, cold):  # warm-up
            run_host_phases(engine, requests)
        timed = _batches(engine, shape, batch, n, ids, rerank, onload_fraction, cold)
        times = [run_host_phases(engine, r) for r in timed]
        prof = cProfile.Profile()
        for requests in _batches(engine, shape, batch, n, ids, rerank, onload_fraction, cold):
            prof.enable()
            run_host_phases(engine, requests)
            prof.disable()
    phases = {f"{p}_ms": statistics.median(t[p] for t in times) * 1e3 for p in HOST_PHASES}
    phases["total_ms"] = statistics.median(sum(t.values()) for t in times) * 1e3
    return {
        "phases": phases,
        "top_own_time": [
            {"function": fn, "calls_per_batch": calls / n, "own_ms_per_batch": own / n * 1e3,
             "cumulative_ms_per_batch": cumulative / n * 1e3}
            for fn, calls, own, cumulative in report.top_own_time(pstats.Stats(prof), top)
        ],
    }


def main(
    shape: BenchShape, batches: list[int], n: int, out: Path, rerank: bool = False, onload_fraction: float | None = None,
    cold: bool = False,
) -> int:
    shape = narrow(shape)
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "host_only": True, "rerank": rerank,
           "onload_fraction": onload_fraction, "cold_requests": cold, "shape": dataclasses.asdict(shape),
           "environment": report.environment(torch.device("cpu"))}
    for batch in batches:
        doc[str(batch)] = profile_host(
            dataclasses.replace(shape, batch_sizes=(batch,)), batch, n, rerank=rerank, onload_fraction=onload_fraction,
            cold=cold,
        )
    report.write_json(out / "profile_host.json", doc)
    print(format_table(doc, batches))
    return 0


def format_table(doc: dict, batches: list[int]) -> str:
    keys = [f"{p}_ms" for p in HOST_PHASES] + ["total_ms"]
    rows = [["batch", *(k.removesuffix("_ms") for k in keys)]] + [
        [str(b), *(f"{doc[str(b)]['phases'][k]:.3f}" for k in keys)] for b in batches
    ]
    parts = ["host ms per cached batch without kernels, medians by phase:\n" + report.format_table(rows)]
    for b in batches:
        top = [["function", "own ms", "cumulative ms", "calls"]] + [
            [r["function"], f"{r['own_ms_per_batch']:.3f}", f"{r['cumulative_ms_per_batch']:.3f}", f"{r['calls_per_batch']:.1f}"]
            for r in doc[str(b)]["top_own_time"][:12]
        ]
        parts.append(f"batch {b}, top own time per batch:\n" + report.format_table(top))
    return "\n\n".join(parts)
