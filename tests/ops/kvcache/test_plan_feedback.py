"""The planner's measured feedback: a kind of plan that measured slower than predicted stops being
chosen where recomputing is cheaper, and what it measures through the engine."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from hstu.engine import RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.ops.kvcache.plan_feedback import PlanFeedback, plan_kind, reprice
from hstu.ops.kvcache.planner import CostModel, UserShape, plan, predict
from tests.conftest import rel_err

CHUNK, LAYERS = 128, 8
SEED_USERS = [UserShape(host_tokens=3968, gpu_tokens=0, history_tokens=4096, candidates=256)] * 8
# a link in between: the planner splits (test_planner's test_a_link_in_between...)
SPLITTING = CostModel(h2d_bytes_per_s=100e9, bytes_per_token_layer=4096, per_row_s=2e-8, per_pair_s=4e-12)


def test_a_plans_kind_is_read_from_its_host_tier_users_only():
    assert plan_kind([0, 5], [0, 128]) == "split"
    assert plan_kind([0, 128], [0, 128]) == "onload"
    assert plan_kind([0, 0], [0, 128]) == "recompute"
    assert plan_kind([128, 0], [128, 128]) == "split"  # one whole, one recomputed: a mix
    assert plan_kind([0, 5], [0, 128], front=True) == "front"  # fronts recomputed in a pass of their own
    assert plan_kind([128, 0], [128, 128], front=True) == "split"  # (no user split within its prefix)


def test_factors_average_measured_over_predicted_within_bounds_and_start_over_for_a_new_model():
    fb = PlanFeedback(alpha=0.5, low=0.5, high=4.0)
    assert fb.factor("split", 1) == 1.0
    fb.observe("split", 1, 1.0, 2.0)
    assert fb.factor("split", 1) == 2.0 and fb.factor("split", 8) == 1.0  # per batch size
    fb.observe("split", 1, 1.0, 3.0)
    assert fb.factor("split", 1) == pytest.approx(2.5)
    fb.observe("split", 1, 1.0, 100.0)
    assert fb.factor("split", 1) == pytest.approx(3.25)  # the ratio bounded to 4 first
    assert fb.as_dict() == {"split@1": {"factor": pytest.approx(3.25), "batches": 3}}
    fb.follow(SPLITTING)
    assert fb.factor("split", 1) == 1.0
    fb.observe("onload", 1, 1.0, 0.7)
    fb.follow(dataclasses.replace(SPLITTING))  # an equal model keeps what was measured
    assert fb.factor("onload", 1) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="kind must be one of"):
        fb.observe("half", 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="alpha"):
        PlanFeedback(alpha=0.0)


def test_a_split_measured_slower_than_predicted_gives_way_to_recomputing():
    chosen = plan(SEED_USERS, SPLITTING, LAYERS, CHUNK)
    assert plan_kind(chosen.onload_tokens, [3968] * 8) == "split"
    fb = PlanFeedback()
    assert reprice(chosen, "split", SEED_USERS, SPLITTING, fb, LAYERS, CHUNK) == (chosen, "split")  # nothing measured
    fb.observe("split", 8, 1.0, 1.05)  # within the planner's margin: its choice stands
    assert reprice(chosen, "split", SEED_USERS, SPLITTING, fb, LAYERS, CHUNK)[1] == "split"
    fb.observe("split", 8, 1.0, 3.0)
    fb.observe("recompute", 8, 1.0, 1.0)
    repriced, kind = reprice(chosen, "split", SEED_USERS, SPLITTING, fb, LAYERS, CHUNK)
    assert kind == "recompute" and repriced.onload_tokens == [0] * 8
    assert repriced.predicted_s == pytest.approx(predict(SEED_USERS, [0] * 8, SPLITTING, LAYERS)[0])


def test_a_split_slower_than_predicted_probes_recomputing_once_then_compares_both_measured():
    """Recomputing never measured: the batch recomputes to measure it; then the comparison uses
    both factors (here recomputing measured as slow as the split: the split stands)."""
    chosen = plan(SEED_USERS, SPLITTING, LAYERS, CHUNK)
    fb = PlanFeedback(alpha=1.0)
    fb.observe("split", 8, 1.0, 1.3)
    probe, kind = reprice(chosen, "split", SEED_USERS, SPLITTING, fb, LAYERS, CHUNK)
    assert kind == "recompute" and probe.onload_tokens == [0] * 8
    fb.observe("recompute", 8, 1.0, 1.3)
    assert reprice(chosen, "split", SEED_USERS, SPLITTING, fb, LAYERS, CHUNK)[1] == "split"
    fb.observe("recompute", 8, 1.0, 0.9)  # recomputing ran faster than predicted: priced by both, the split loses
    assert reprice(chosen, "split", SEED_USERS, SPLITTING, fb, LAYERS, CHUNK)[1] == "recompute"


def test_a_vetoed_split_falls_to_a_whole_onload_that_measured_well():
    chosen = plan(SEED_USERS, SPLITTING, LAYERS, CHUNK)
    fb = PlanFeedback(alpha=1.0)
    fb.observe("split", 8, 1.0, 3.0)
    fb.observe("recompute", 8, 1.0, 1.0)
    fb.observe("onload", 8, 1.0, 0.5)  # onloading whole measured twice as fast as predicted
    assert reprice(chosen, "split", SEED_USERS, SPLITTING, fb, LAYERS, CHUNK)[1] == "onload"


def test_recomputing_slower_than_predicted_keeps_the_split():
    chosen = plan(SEED_USERS, SPLITTING, LAYERS, CHUNK)
    fb = PlanFeedback(alpha=1.0)
    fb.observe("split", 8, 1.0, 1.5)
    fb.observe("recompute", 8, 1.0, 1.5)  # both missed alike: the planner's comparison stands
    assert reprice(chosen, "split", SEED_USERS, SPLITTING, fb, LAYERS, CHUNK)[1] == "split"


def _engine(config) -> RankingEngine:
    cfg = KVCacheConfig.for_model(config, page_size=4, num_pages=128, chunk_tokens=8, host_split="load_front")
    return RankingEngine(InferenceRankingGR(config), AsyncKVCacheManager(cfg))


def test_the_engine_measures_planned_batches_and_serves_the_repriced_plan_correctly(tiny_config, book):
    """A host-tier user under a cost model that splits its prefix: the batch is measured (its
    factor leaves 1.0), and once splits measured 4x their prediction the next host-tier batch
    recomputes, counted as overridden, with the no-cache model's answer."""
    engine = _engine(tiny_config)
    mgr = engine.cache
    # a link in between for a tiny model: onloading a token costs about as much as computing it
    mgr.cost_model = CostModel(h2d_bytes_per_s=1e7, bytes_per_token_layer=1024, per_row_s=1e-4, per_pair_s=0.0)
    for user in (1, 2):
        engine.rank([book.request(user, 11)])  # 24 tokens: three 8-token chunks in the host tier
        mgr.drain()
        mgr.evict_gpu([user])
    (first,) = engine.rank([book.request(1, 2)])
    assert 0 < first.cached_tokens < 24, "the cost model was meant to split"
    assert mgr.plan_feedback.as_dict()["split@1"]["batches"] == 1
    mgr.plan_feedback.observe("split", 1, 1.0, 4.0)
    mgr.plan_feedback.observe("split", 1, 1.0, 4.0)
    req = book.request(2, 2)
    (second,) = engine.rank([req])
    assert second.cached_tokens == 0
    assert rel_err(second.logits, engine.forward_no_cache([req])) < 1e-5
    stats = mgr.stats.snapshot()
    assert (stats["plans_split"], stats["plans_recompute"], stats["plans_overridden"]) == (1, 1, 1)
    engine.close()


@pytest.mark.parametrize("from_plan", [True, False])
def test_a_planned_batch_is_measured_from_before_its_plan(tiny_config, book, monkeypatch, from_plan):
    """The measured span of a host-tier batch includes its plan (HSTU_FEEDBACK_FROM_PLAN, on): a
    kind of plan whose planning is slow is charged for it; off, only the forward is measured."""
    from hstu.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "_FEEDBACK_FROM_PLAN", from_plan)
    engine = _engine(tiny_config)
    mgr = engine.cache
    mgr.cost_model = CostModel(h2d_bytes_per_s=1e7, bytes_per_token_layer=1024, per_row_s=1e-4, per_pair_s=0.0)
    engine.rank([book.request(1, 11)])
    mgr.drain()
    mgr.evict_gpu([1])
    seen, observe, plan = [], mgr.plan_feedback.observe, engine._plan
    monkeypatch.setattr(mgr.plan_feedback, "observe", lambda *a: seen.append(a[3]) or observe(*a))
    monkeypatch.setattr(engine, "_plan", lambda requests: (time.sleep(0.2), plan(requests))[1])
    engine.rank([book.request(1, 2)])
    assert len(seen) == 1 and (seen[0] >= 0.2) == from_plan
    engine.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events")
def test_a_cuda_batch_is_measured_by_its_events_once_they_complete():
    fb = PlanFeedback(alpha=1.0)
    device = torch.device("cuda")
    pending = fb.begin("split", 1, 1e-3, device)
    x = torch.randn(2048, 2048, device=device)
    for _ in range(4):
        x = x @ x.T / 2048
    fb.end(pending, 0.0)
    torch.cuda.synchronize()
    assert fb.as_dict()["split@1"]["batches"] == 1 and fb.factor("split", 1) != 1.0


def _rank_from_the_host_tier(engine: RankingEngine, book, user: int) -> None:
    """Prefill `user` with 24 tokens (three 8-token chunks in the host tier), evict it from the GPU,
    rank two new events from there and check the no-cache model's answer."""
    engine.rank([book.request(user, 11)])
    engine.cache.drain()
    engine.cache.evict_gpu([user])
    req = book.request(user, 2)
    (out,) = engine.rank([req])
    assert rel_err(out.logits, engine.forward_no_cache([req])) < 1e-5


def test_a_front_split_is_measured_and_counted_as_its_own_kind(tiny_config, book):
    """host_split "auto" choosing compute_front's order for a host-tier user: the batch is measured
    and counted as a "front" plan, apart from load_front's splits, with the no-cache model's answer;
    once front splits measured 4x their prediction, the next batch takes load_front's split."""
    cfg = KVCacheConfig.for_model(tiny_config, page_size=4, num_pages=128, chunk_tokens=8, host_split="auto")
    engine = RankingEngine(InferenceRankingGR(tiny_config), AsyncKVCacheManager(cfg))
    mgr = engine.cache
    # onloading a token costs about what computing one does, and a front pass nothing extra: a front split
    mgr.cost_model = CostModel(h2d_bytes_per_s=1e7, bytes_per_token_layer=1024, per_row_s=1e-4, per_pair_s=0.0,
                               min_gain=0.0)
    _rank_from_the_host_tier(engine, book, 1)
    stats = mgr.stats.snapshot()
    assert (stats["plans_front"], stats["plans_split"]) == (1, 0)
    assert stats["tokens_onloaded"] > 0 and stats["tokens_recomputed"] > 0
    assert mgr.plan_feedback.as_dict()["front@1"]["batches"] == 1
    mgr.plan_feedback.observe("front", 1, 1.0, 4.0)
    mgr.plan_feedback.observe("front", 1, 1.0, 4.0)
    _rank_from_the_host_tier(engine, book, 2)
    stats = mgr.stats.snapshot()
    assert (stats["plans_front"], stats["plans_split"], stats["plans_overridden"]) == (1, 1, 0)
    engine.close()
