"""The planner's compute cost, measured through the engine's own forward (start-up, ~20 forwards).

Why not the block alone (ops/kvcache/costs.py measure_compute): a recomputed token also costs its
features, embedding, metadata and launches, and the block-only fit had rows and pairs nearly
collinear. On the H200 it predicted a full recompute of batch 8 at 15.4 ms against 25 ms measured,
so the planner recomputed too much and lost to pure onload and to no cache.

Here each shape is a real ranking batch of synthetic users (ids far above any served user's, all
invalidated afterwards): misses of several history lengths and batch sizes, and extensions of a
GPU-resident prefix (few rows, many attention pairs), so rows and pairs vary independently. The
median wall time of each (device-synchronised) is fitted as forward + L x (rows x per_row + pairs x
per_pair), rows as the CUDA-graph bucket runs them (padded), non-negative and by relative error (a
batch-1 forward weighs as much as a batch-8 miss), where rows and pairs are one layer's (planner.layer_work), the same quantities the planner
predicts with. The per-forward cost stays out of the layers: folded into them (the fit before),
it made every layer look ~0.3 ms dearer on the H200, so the planner believed an onload hidden
behind compute that was not there and onloaded at batch 1 where recomputing was faster.

Then the onload itself: host-tier batches of one and of all calibration users onload their whole
prefix, each beside the same batch with its prefix on the GPU, and what the onload added beyond the
model's prediction of that difference, at the copy's measured bandwidth, is fitted as a start
latency plus a per-byte excess (planner.CostModel onload_start_s, and a lower effective
bandwidth): the host work of a host-tier batch and the copies as the cache issues them. (Fitted
against the whole time instead, run AZ, an overestimated forward cost absorbed the onload's start.)
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import numpy as np

from hstu.model.batch import RankingRequest
from hstu.ops.device_sync import sync
from hstu.ops.kvcache.host_tier import prefilled_host_user
from hstu.ops.kvcache.planner import (
    CostModel, FixedSplit, UserShape, front_tokens, layer_work, padded_rows, predict, predict_front,
)

_FIRST_USER = 1 << 60  # calibration users: invalidated after, never a served id in practice


def _nonnegative_fit(a: np.ndarray, y: np.ndarray, relative: bool = False) -> np.ndarray:
    """Least squares with every coefficient >= 0 (all subsets of 3 columns: exact and tiny);
    relative: each row weighed by 1 / y (errors as shares of each measurement)."""
    if relative:
        a, y = a / y[:, None], np.ones_like(y)
    best, best_err = np.zeros(a.shape[1]), float(np.sum(y**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(coef < 0):
                continue
            err = float(np.sum((a[:, cols] @ coef - y) ** 2))
            if err < best_err:
                best, best_err = np.zeros(a.shape[1]), err
                best[list(cols)] = coef
    return best


def _requests(engine, users: list[int], events: int, candidates: int, rng: np.random.Generator) -> list[RankingRequest]:
    cfg = engine.config
    return [
        RankingRequest.create(
            u, rng.integers(0, cfg.num_items, events), rng.integers(0, cfg.num_actions, events),
            np.arange(events), rng.integers(0, cfg.num_items, candidates), config=cfg,
        )
        for u in users
    ]


def _shape(engine) -> tuple[int, int]:
    """(history events, candidates) of the calibration's longest users on this device."""
    cfg, device = engine.config, engine.model.device
    candidates = 256 if device.type == "cuda" else 16
    events = max(8, min(2048 if device.type == "cuda" else 192, (cfg.max_seq_len - cfg.num_contextual - 1) // 2))
    return events, candidates


def _max_users(engine, max_users: int) -> int:
    """Calibration users the free GPU pages hold at the longest history."""
    events, _ = _shape(engine)
    pages_per_user = -(-engine.config.history_tokens(events) // engine.cache.config.page_size)
    return min(max_users, engine.cache.gpu.num_free_pages() // pages_per_user)


def measure_forward_costs(engine, max_users: int = 8, repeats: int = 3) -> tuple[float, float, float] | None:
    """(forward_s, per_row_s, per_pair_s): a forward's fixed cost and one layer's per row and pair,
    from whole cached forwards of this engine; None when the cache cannot hold even one user at the
    longest calibration history."""
    cfg, kv = engine.config, engine.cache.config
    events, candidates = _shape(engine)
    users = _max_users(engine, max_users)
    if users < 1:
        return None
    half = max(1, users // 2)
    shapes = [  # (users, history events, events already on the GPU, candidates)
        (users, events, 0, candidates),
        (users, events // 4, 0, candidates),
        (half, events // 2, 0, candidates // 4),
        (users, events, events - events // 32, candidates),
        (users, events, events // 2, candidates),
        (1, events, 0, candidates),
        # one user extending a cached prefix: almost nothing but the per-forward cost. Without it
        # the fit put that cost at 1.4-1.6 ms on the H200, above a whole batch-1 cached forward
        # (1.1-1.2 ms), and over-predicted batch 1's onloads by 0.6-0.8 ms (runs BC, BF)
        (1, events, events - events // 32, candidates),
    ]
    rng = np.random.default_rng(0)
    ids = itertools.count(_FIRST_USER)
    rows = []
    seconds = []
    for b, e, c, m in shapes:
        times = []
        for _ in range(repeats + 1):  # the first run warms this shape up
            batch = _requests(engine, [next(ids) for _ in range(b)], e, m, rng)
            times.append(_time_batch(engine, batch, c)[0])
        n, cached = cfg.history_tokens(e), cfg.history_tokens(c) if c else 0
        r, p = layer_work([UserShape(0, cached, n, m)] * b, [0] * b)
        rows.append((1.0, kv.num_layers * padded_rows(r, engine.graph_buckets), kv.num_layers * p))
        seconds.append(statistics.median(times[1:]))
    fit = _nonnegative_fit(np.asarray(rows, dtype=np.float64), np.asarray(seconds), relative=True)
    forward, per_row, per_pair = (float(v) for v in fit)
    return forward, per_row, per_pair


def _host_prefix(engine, max_users: int) -> tuple[int, int, int, int, int, int, int] | None:
    """(users, history events, candidates, prefix events, history tokens, prefix tokens, the
    prefix's whole chunks in tokens) of the calibration's host-tier batches: users with the longest
    history whose prefix, all but its last 1/32, went to the host tier; None when the GPU pages or
    the host tier cannot hold them."""
    cfg, kv = engine.config, engine.cache.config
    events, candidates = _shape(engine)
    users = _max_users(engine, max_users)
    prefix_events = events - max(1, events // 32)
    n, gpu_tokens = cfg.history_tokens(events), cfg.history_tokens(prefix_events)
    host_tokens = gpu_tokens // kv.chunk_tokens * kv.chunk_tokens
    if users < 1 or kv.host_slots < users * (host_tokens // kv.chunk_tokens) or host_tokens == 0:
        return None
    return users, events, candidates, prefix_events, n, gpu_tokens, host_tokens


def measure_onload(engine, cost: CostModel, max_users: int = 8, repeats: int = 3) -> CostModel:
    """`cost` with the onload as this engine runs it: batches of one and of all calibration users
    whose prefix is in the host tier (onloaded whole, no planner), each beside the same batch with
    its prefix on the GPU. What the onload added beyond the model's prediction of that difference
    becomes onload_start_s plus a per-byte excess (a lower h2d_bytes_per_s). A difference, so the
    per-forward costs, and any error in their fit, cancel out. `cost` unchanged when there is no
    host tier or its users did not reach it."""
    kv = engine.cache.config
    prefix = _host_prefix(engine, max_users)
    if prefix is None:
        return cost
    users, events, candidates, prefix_events, n, gpu_tokens, host_tokens = prefix
    rng = np.random.default_rng(1)
    ids = itertools.count(_FIRST_USER + (1 << 20))

    def timed(b: int, from_host: bool) -> float | None:
        """Seconds of one batch of b users extending a prefix on the GPU or in the host tier;
        None when the prefix was not where it should be (host capacity, admission)."""
        batch = _requests(engine, [next(ids) for _ in range(b)], events, candidates, rng)
        seconds, outputs = _time_batch(engine, batch, prefix_events, from_host, admit=True)  # both offload alike
        expected = host_tokens if from_host else gpu_tokens
        return seconds if all(o.cached_tokens == expected for o in outputs) else None

    points = []  # (onloaded bytes, seconds the onload added beyond the prediction)
    for b in sorted({1, users}):
        onload, resident = [], []
        for i in range(repeats + 1):  # the first round warms both shapes up
            t_host, t_gpu = timed(b, True), timed(b, False)
            if t_host is None or t_gpu is None:
                return cost
            if i:
                onload.append(t_host)
                resident.append(t_gpu)
        predicted_host = predict([prefilled_host_user(kv, host_tokens, n, candidates)] * b, [host_tokens] * b, cost,
                                 kv.num_layers, engine.graph_buckets, kv.chunk_tokens)[0]
        predicted_gpu = predict([UserShape(0, gpu_tokens, n, candidates)] * b, [0] * b, cost, kv.num_layers,
                                engine.graph_buckets)[0]
        token_bytes = cost.hidden_bytes_per_token_layer if kv.host_format == "hidden" else cost.bytes_per_token_layer
        nbytes = b * host_tokens * token_bytes * kv.num_layers
        added = statistics.median(onload) - statistics.median(resident)
        points.append((nbytes, added - (predicted_host - predicted_gpu)))
    start, per_byte = _line(points)
    return dataclasses.replace(
        cost, onload_start_s=start, h2d_bytes_per_s=1.0 / (1.0 / cost.h2d_bytes_per_s + per_byte)
    )


def measure_front(engine, cost: CostModel, max_users: int = 8, repeats: int = 3, fraction: float = 0.5) -> CostModel:
    """`cost` with front_s: under host_split "compute_front" (or "auto"), what a batch of all calibration users
    whose prefixes are in the host tier, `fraction` onloaded and the rest recomputed in a front pass,
    took beyond predict_front's figure for it. Why: the front pass is a forward of its own (features,
    metadata, a second graph launch, rows with no candidates) that the per-layer fit, measured on
    single-pass batches, does not see; on the H200 a batch of 8 ran its fronts 1.3-4.4 ms slower than
    predicted (session 17), and the planner chose a split that measured 1.04x of recomputing where
    half the prefix measured 1.27x. `cost` unchanged without a host tier, or when its users did not
    reach it."""
    kv, cache = engine.cache.config, engine.cache
    prefix = _host_prefix(engine, max_users)
    if prefix is None:
        return cost
    users, events, candidates, prefix_events, n, _, host_tokens = prefix
    split = FixedSplit(fraction, order="compute_front")  # (its own order under host_split "auto")
    shapes = [prefilled_host_user(kv, host_tokens, n, candidates)] * users
    onload = split.choose(shapes, kv.num_layers, kv.chunk_tokens).onload_tokens
    reused = host_tokens - front_tokens(host_tokens, onload[0], kv.chunk_tokens)
    rng = np.random.default_rng(2)
    ids = itertools.count(_FIRST_USER + (2 << 20))
    times = []
    previous, cache.cost_model = cache.cost_model, split
    try:
        for i in range(repeats + 1):  # the first round warms the shapes up
            batch = _requests(engine, [next(ids) for _ in range(users)], events, candidates, rng)
            seconds, outputs = _time_batch(engine, batch, prefix_events, from_host=True, admit=True)
            if any(o.cached_tokens != reused for o in outputs):
                return cost
            if i:
                times.append(seconds)
    finally:
        cache.cost_model = previous
    predicted = predict_front(shapes, onload, cost, kv.num_layers, kv.chunk_tokens, engine.graph_buckets)[0]
    return dataclasses.replace(cost, front_s=max(0.0, statistics.median(times) - predicted))


def _time_batch(
    engine, batch: list[RankingRequest], prefix_events: int, from_host: bool = False, admit: bool = False
) -> tuple[float, list]:
    """(seconds, outputs) of ranking `batch` (device-synchronised) after its first `prefix_events`
    events were ranked (none: 0) and, from_host, moved to the host tier; admit: its users admitted
    to the host tier first, so their chunks are offloaded. Every user invalidated after."""
    cache, device = engine.cache, engine.model.device
    if admit:
        for r in batch:  # admitted to the host tier at their first offload
            for _ in range(cache.config.offload_min_seen):
                cache.admission.see(r.user_id)
    if prefix_events:
        engine.rank([r.first_events(prefix_events, engine.config) for r in batch])
    cache.drain()
    if from_host:
        cache.evict_gpu([r.user_id for r in batch])
    sync(device)
    t0 = time.perf_counter()
    outputs = engine.rank(batch)
    sync(device)
    seconds = time.perf_counter() - t0
    cache.drain()
    for r in batch:
        cache.invalidate(r.user_id)
    return seconds, outputs


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) >= 0 through (x, y) points: the excess of an onload over its prediction."""
    a = np.asarray([(1.0, x) for x, _ in points])
    y = np.asarray([y for _, y in points])
    if not np.any(y > 0):
        return 0.0, 0.0
    start, slope = (float(v) for v in _nonnegative_fit(a, y))
    return start, slope
