"""The exportable cached forward (engine/exported.py): eager, torch.export'ed and AOTInductor
packaged, each equal to the no-cache oracle over a sequence of batches with cache hits, an
invalidated history and evictions."""

from __future__ import annotations

import pytest
import torch

from hstu.engine.exported import ExportableRanker, batch_inputs, export_ranker
from hstu.model.batch import RankingRequest
from hstu.model.ranking import InferenceRankingGR
from tests.conftest import HistoryBook, rel_err

# 16 pages of 8 tokens: six returning users outgrow the pool, so later batches evict.
NUM_PAGES, PAGE_SIZE = 16, 8


def _sequence(config) -> list[list[RankingRequest]]:
    """Seeded batches of 1-3 of six users, growing histories, then one user's shortened history."""
    book = HistoryBook(config, seed=1)
    batches = list(book.random_batches(seed=2, rounds=8, num_users=6, max_users=3, new_events=(1, 6), candidates=(1, 4)))
    items, actions, times = book.histories[batches[-1][0].user_id]
    shorter = RankingRequest.create(batches[-1][0].user_id, items[:2], actions[:2], times[:2], [1, 2], config=config)
    return batches + [[shorter]]


def _assert_matches_oracle(run, model, ranker, config) -> None:
    with torch.inference_mode():
        for requests in _sequence(config):
            got = run(*batch_inputs(requests))
            assert rel_err(got, model.forward_no_cache(requests)) < 1e-5
    cache = ranker.cache
    assert cache.reused_tokens() > 0 and cache.evictions() > 0 and cache.invalidations() > 0


@pytest.fixture
def model(tiny_config) -> InferenceRankingGR:
    return InferenceRankingGR(tiny_config)


def test_eager_cached_forward_equals_no_cache_oracle(model, tiny_config):
    ranker = ExportableRanker(model, NUM_PAGES, PAGE_SIZE)
    _assert_matches_oracle(ranker, model, ranker, tiny_config)


def test_exported_program_equals_no_cache_oracle(model, tiny_config):
    ranker = ExportableRanker(model, NUM_PAGES, PAGE_SIZE)
    program = export_ranker(ranker)
    flow = [n.target.__name__.split(".")[0] for n in program.graph.nodes if str(n.target).startswith("hstu.")]
    layers = ["cache_append", "cache_gather"] * tiny_config.num_layers
    assert flow == ["cache_lookup", "cache_allocate", *layers, "cache_commit"]  # one graph, no breaks
    _assert_matches_oracle(program.module(), model, ranker, tiny_config)


def test_exporting_leaves_the_cache_untouched(model):
    ranker = ExportableRanker(model, NUM_PAGES, PAGE_SIZE)
    export_ranker(ranker)
    assert ranker.cache.num_users() == 0 and ranker.cache.num_free_pages() == NUM_PAGES


def test_ranker_needs_one_head_dim_for_the_page_table(tiny_config):
    import dataclasses

    with pytest.raises(ValueError, match="head_dim_qk 16 != head_dim_v 8"):
        ExportableRanker(InferenceRankingGR(dataclasses.replace(tiny_config, head_dim_v=8)), NUM_PAGES, PAGE_SIZE)
