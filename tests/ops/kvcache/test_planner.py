"""Compute or load: the planner's split, and the oracle at every split point."""

from __future__ import annotations

import pytest

from hstu.engine import RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.ops.kvcache.planner import CostModel, FixedSplit, UserShape, plan, predict
from tests.conftest import rel_err

CHUNK, LAYERS = 128, 8
# One 4k-token user in the host tier, 128 new tokens and 256 candidates (the seed's shape).
SEED_USERS = [UserShape(host_tokens=3968, gpu_tokens=0, history_tokens=4096, candidates=256)] * 8


def _cost(h2d_gb_s: float) -> CostModel:
    # Per-row and per-pair costs of the order the H200 shows at the seed shapes (bf16).
    return CostModel(h2d_bytes_per_s=h2d_gb_s * 1e9, bytes_per_token_layer=4096, per_row_s=2e-8, per_pair_s=4e-12)


def test_a_fast_link_onloads_everything():
    chosen = plan(SEED_USERS, _cost(10_000), LAYERS, CHUNK)
    assert chosen.onload_tokens == [3968] * 8


def test_a_slow_link_recomputes_everything():
    chosen = plan(SEED_USERS, _cost(0.01), LAYERS, CHUNK)
    assert chosen.onload_tokens == [0] * 8


def test_a_link_in_between_splits_on_chunk_boundaries_and_beats_both_ends():
    cost = _cost(55)
    chosen = plan(SEED_USERS, cost, LAYERS, CHUNK)
    p = chosen.onload_tokens[0]
    assert 0 < p < 3968 and p % CHUNK == 0 and len(set(chosen.onload_tokens)) == 1
    for end in ([0] * 8, [3968] * 8):
        assert chosen.predicted_s < predict(SEED_USERS, end, cost, LAYERS)[0]


def test_more_bandwidth_never_onloads_less():
    shares = [plan(SEED_USERS, _cost(gb), LAYERS, CHUNK).onload_tokens[0] for gb in (1, 10, 30, 55, 100, 400, 4000)]
    assert shares == sorted(shares)


def test_gpu_resident_prefixes_and_misses_are_left_alone():
    users = [UserShape(0, 2048, 2176, 64), UserShape(0, 0, 512, 64), UserShape(1024, 0, 1100, 64)]
    chosen = plan(users, _cost(55), LAYERS, CHUNK)
    assert chosen.onload_tokens[:2] == [0, 0] and chosen.onload_tokens[2] % CHUNK == 0


def test_cost_model_rejects_nonsense():
    with pytest.raises(ValueError, match="h2d_bytes_per_s must be positive, got 0"):
        CostModel(h2d_bytes_per_s=0, bytes_per_token_layer=1, per_row_s=0, per_pair_s=0)


def _engine(config, **kv):
    cfg = KVCacheConfig.for_model(config, **{"page_size": 4, "num_pages": 128, "chunk_tokens": 8, **kv})
    return RankingEngine(InferenceRankingGR(config), AsyncKVCacheManager(cfg))


@pytest.mark.parametrize("onload_chunks", [0, 1, 2, 3])
def test_every_split_point_matches_the_no_cache_model(tiny_config, book, onload_chunks):
    engine = _engine(tiny_config)
    mgr = engine.cache
    engine.rank([book.request(1, 11)])  # 24 tokens: three full 8-token chunks in the host tier
    mgr.evict_gpu([1])
    mgr.cost_model = FixedSplit(onload_chunks / 3)
    req = book.request(1, 2)
    (out,) = engine.rank([req])
    assert out.cached_tokens == onload_chunks * 8
    assert rel_err(out.logits, engine.forward_no_cache([req])) < 1e-5
    stats = mgr.stats.snapshot()
    assert (stats["tokens_onloaded"], stats["tokens_recomputed"]) == (onload_chunks * 8, 24 - onload_chunks * 8)
    mgr.drain()
    assert mgr.host.pin_count(1) == 0 and mgr.gpu.pin_count(1) == 0
    engine.close()


def test_costs_measured_through_the_engine_drive_the_planner_and_leave_no_trace(tiny_config):
    """calibrate() times whole forwards of synthetic users: a positive compute cost, and every
    calibration user gone from both tiers afterwards (nothing served is evicted by them)."""
    engine = _engine(tiny_config)
    empty = engine.cache.occupancy()
    cost = engine.calibrate()
    assert cost is not None and engine.cache.cost_model is cost
    assert cost.h2d_bytes_per_s > 0 and cost.per_row_s + cost.per_pair_s > 0
    assert engine.cache.occupancy() == empty
    users = [UserShape(64, 0, 80, 8)]
    chosen = plan(users, cost, tiny_config.num_layers, 8)
    assert 0 <= chosen.onload_tokens[0] <= 64 and chosen.predicted_s > 0
    engine.close()


def test_the_fit_recovers_known_costs_and_never_goes_negative():
    import numpy as np

    from hstu.engine.calibration import _nonnegative_fit

    rng = np.random.default_rng(0)
    a = np.column_stack([np.ones(6), rng.uniform(1e3, 4e4, 6), rng.uniform(1e5, 1e8, 6)])
    y = a @ np.array([1e-4, 2e-8, 3e-12])
    assert np.allclose(_nonnegative_fit(a, y), [1e-4, 2e-8, 3e-12], rtol=1e-6)
    # Costs that fall with the pairs would fit a negative per-pair cost: clamped to a plain fit.
    y_bad = a @ np.array([1e-4, 2e-8, 0.0]) - a[:, 2] * 1e-13
    assert (_nonnegative_fit(a, y_bad) >= 0).all()


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_a_fixed_split_onloads_that_share_in_whole_chunks(fraction):
    chosen = FixedSplit(fraction).choose(SEED_USERS[:2] + [UserShape(100, 0, 300, 4)], LAYERS, CHUNK)
    whole = 3968 // CHUNK
    expected = [int(whole * fraction) * CHUNK] * 2 + [100 if fraction == 1.0 else 0]
    assert chosen.onload_tokens == expected
    with pytest.raises(ValueError, match="fraction must be in"):
        FixedSplit(1.5)


def test_with_graphs_no_split_runs_past_the_largest_bucket():
    """A split whose rows exceed the largest CUDA-graph bucket would run eagerly: skipped, while
    pure onload and pure recompute stay candidates whatever their rows."""
    cost = _cost(55)
    free = plan(SEED_USERS, cost, LAYERS, CHUNK)
    rows = lambda p: 8 * (4096 - p + 256)  # noqa: E731
    assert 0 < free.onload_tokens[0] < 3968
    limit = rows(free.onload_tokens[0]) - 1  # the unconstrained choice no longer fits
    bound = plan(SEED_USERS, cost, LAYERS, CHUNK, max_rows=limit)
    p = bound.onload_tokens[0]
    assert p in (0, 3968) or rows(p) <= limit
    assert p != free.onload_tokens[0]
    slow = plan(SEED_USERS, _cost(0.01), LAYERS, CHUNK, max_rows=1)
    assert slow.onload_tokens == [0] * 8, "pure recompute stays a candidate past the limit"


def test_a_cache_too_small_to_calibrate_with_leaves_the_planner_off(tiny_config):
    engine = _engine(tiny_config, num_pages=16)  # 64 tokens: not one calibration user of ~250 tokens
    assert engine.calibrate() is None and engine.cache.cost_model is None
    engine.close()
