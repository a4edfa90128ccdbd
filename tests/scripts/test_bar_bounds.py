"""The bar-bounds report: the cost model's ratios, the factor search and the CLI (predictions only)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hstu.ops.kvcache.planner import CostModel, UserShape
from hstu.scripts import bar_bounds
from hstu.scripts.bench_shapes import BenchShape
from hstu.scripts.workload import WorkloadConfig

COST = CostModel(h2d_bytes_per_s=50e9, bytes_per_token_layer=4096, per_row_s=3.5e-8, per_pair_s=9e-12, forward_s=6e-4)


def test_forward_bar_prices_the_computed_rows_and_pairs_of_both_sides():
    cost = dataclasses.replace(COST, per_pair_s=0.0, forward_s=0.0)
    bar = bar_bounds.forward_bar("b2", 12, 3.0, [UserShape(0, 96, 128, 32)] * 2, layers=2, buckets=None)
    cached, uncached = bar.times(cost, 1.0)
    assert cached == pytest.approx(2 * 2 * (128 - 96 + 32) * cost.per_row_s)
    assert uncached == pytest.approx(2 * 2 * (128 + 32) * cost.per_row_s)
    assert bar.ratio(cost) == pytest.approx(160 / 64)


def test_cheaper_cached_attention_raises_only_the_cached_side():
    bar = bar_bounds.forward_bar("b1", 12, 3.0, [UserShape(0, 960, 1024, 64)], layers=4, buckets=None)
    cached, uncached = bar.times(COST, 1.0)
    cheaper, same = bar.times(COST, 0.5)
    assert cheaper < cached and same == uncached


def test_needed_factor_finds_where_the_ratio_meets_the_target():
    ratio = lambda k: 4.0 - 2.0 * k  # noqa: E731  falls from 4 at k = 0 to 2 at k = 1
    assert bar_bounds.needed_factor(ratio, 1.5) == 1.0
    assert bar_bounds.needed_factor(ratio, 5.0) is None
    k = bar_bounds.needed_factor(ratio, 3.0)
    assert k == pytest.approx(0.5, abs=1e-3) and ratio(k) >= 3.0


def test_replay_batches_reuse_a_users_previous_history_only_when_it_is_extended():
    config = BenchShape().model_config()
    workload = WorkloadConfig(num_requests=40, num_users=6, max_history_tokens=1024, initial_tokens=(8, 256), seed=3)
    batches = bar_bounds.replay_batches(config, workload, max_batch=4)
    users = [u for b in batches for u in b]
    assert len(users) == 40 and max(len(b) for b in batches) <= 4
    assert all(0 <= u.gpu_tokens <= u.history_tokens and u.host_tokens == 0 for u in users)
    assert sum(u.gpu_tokens == 0 for u in users) >= 6  # every user's first request computes everything
    assert any(u.gpu_tokens > 0 for u in users)


def test_bounds_report_every_open_bar_and_the_cli_writes_json(tmp_path, capsys):
    rows = bar_bounds.bounds(COST, bar_bounds.open_bars())
    assert [r["bar"] for r in rows] == [
        "b1 GPU-resident", "b8 GPU-resident", "b8 re-rank", "b1 host tier", "b8 host tier", "seed replay",
    ]
    for r in rows:
        assert r["ratio"] == pytest.approx(r["uncached_ms"] / r["cached_ms"])
        assert r["ceiling"] >= r["ratio"]  # no per-forward cost can only help the cached side's ratio
        assert r["forward_factor"] is None or 0.0 <= r["forward_factor"] <= 1.0
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"e2e": {"1": {"cost_model": COST.as_dict(), "speedup": 3.1},
                                         "8": {"speedup_rerank": 8.5}}}))
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps({"speedup": {"speedup req/s (cached/uncached)": 2.4}}))
    out = tmp_path / "bounds.json"
    assert bar_bounds.main([str(bench), "--no-padding", "--replay-json", str(replay), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["padded"] is False and len(doc["bars"]) == 6
    got = {r["bar"]: r["measured"] for r in doc["bars"]}
    assert got == {"b1 GPU-resident": 3.1, "b8 GPU-resident": None, "b8 re-rank": 8.5, "b1 host tier": None,
                   "b8 host tier": None, "seed replay": 2.4}, "the same call's figures where the JSONs hold them"
    assert "seed replay" in capsys.readouterr().out


def test_a_bench_json_without_a_cost_model_is_refused(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"e2e": {"1": {"cached_gpu": {}}}}))
    with pytest.raises(ValueError, match="no cost_model"):
        bar_bounds.load_cost(bench)
