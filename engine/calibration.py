"""The planner's compute cost, measured through the engine's own forward (start-up, ~20 forwards).

Why not the block alone (ops/kvcache/costs.py measure_compute): a recomputed token also costs its
features, embedding, metadata and launches, and the block-only fit had rows and pairs nearly
collinear. On the H200 it predicted a full recompute of batch 8 at 15.4 ms against 25 ms measured,
so the planner recomputed too much and lost to pure onload and to no cache.

Here each shape is a real ranking batch of synthetic users (ids far above any served user's, all
invalidated afterwards): misses of several history lengths and batch sizes, and extensions of a
GPU-resident prefix (few rows, many attention pairs), so rows and pairs vary independently. The
median wall time of each (device-synchronised) is fitted as L x (fixed + rows x per_row + pairs x
per_pair), non-negative, where rows and pairs are one layer's (planner.layer_work), the same
quantities the planner predicts with.
"""

from __future__ import annotations

import itertools
import statistics
import time

import numpy as np

from hstu.model.batch import RankingRequest
from hstu.ops.device_sync import sync
from hstu.ops.kvcache.planner import UserShape, layer_work

_FIRST_USER = 1 << 60  # calibration users: invalidated after, never a served id in practice


def _nonnegative_fit(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (all subsets of 3 columns: exact and tiny)."""
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


def measure_forward_costs(engine, max_users: int = 8, repeats: int = 3) -> tuple[float, float, float] | None:
    """(fixed_s, per_row_s, per_pair_s) of one layer, from whole cached forwards of this engine;
    None when the cache cannot hold even one user at the longest calibration history."""
    cache, cfg, device = engine.cache, engine.config, engine.model.device
    kv = cache.config
    candidates = 256 if device.type == "cuda" else 16
    events = max(8, min(2048 if device.type == "cuda" else 192, (cfg.max_seq_len - cfg.num_contextual - 1) // 2))
    pages_per_user = -(-cfg.history_tokens(events) // kv.page_size)
    users = min(max_users, cache.gpu.num_free_pages() // pages_per_user)
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
    ]
    rng = np.random.default_rng(0)
    ids = itertools.count(_FIRST_USER)
    rows = []
    seconds = []
    for b, e, c, m in shapes:
        times = []
        for _ in range(repeats + 1):  # the first run warms this shape up
            batch = _requests(engine, [next(ids) for _ in range(b)], e, m, rng)
            if c:
                engine.rank([r.first_events(c, cfg) for r in batch])
            cache.drain()
            sync(device)
            t0 = time.perf_counter()
            engine.rank(batch)
            sync(device)
            times.append(time.perf_counter() - t0)
            cache.drain()
            for r in batch:
                cache.invalidate(r.user_id)
        n, cached = cfg.history_tokens(e), cfg.history_tokens(c) if c else 0
        r, p = layer_work([UserShape(0, cached, n, m)] * b, [0] * b)
        rows.append((1.0, r, p))
        seconds.append(statistics.median(times[1:]) / kv.num_layers)
    fixed, per_row, per_pair = (float(v) for v in _nonnegative_fit(np.asarray(rows, dtype=np.float64), np.asarray(seconds)))
    return fixed, per_row, per_pair
