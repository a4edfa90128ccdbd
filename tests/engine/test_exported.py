"""The exportable cached forward (engine/exported.py): eager, torch.export'ed and AOTInductor
packaged, each equal to the no-cache oracle over a sequence of batches with cache hits, an
invalidated history and evictions."""

from __future__ import annotations

import pytest
import torch

from hstu.engine.exported import ExportableRanker, batch_inputs, export_ranker
from hstu.model.ranking import InferenceRankingGR
from tests.conftest import EXPORT_PAGE_SIZE, EXPORT_PAGES, export_sequence, rel_err


def _assert_matches_oracle(run, model, ranker, config) -> None:
    with torch.inference_mode():
        for requests in export_sequence(config):
            got = run(*batch_inputs(requests))
            assert rel_err(got, model.forward_no_cache(requests)) < 1e-5
    cache = ranker.cache
    assert cache.reused_tokens() > 0 and cache.evictions() > 0 and cache.invalidations() > 0


@pytest.fixture
def model(tiny_config) -> InferenceRankingGR:
    return InferenceRankingGR(tiny_config)


def test_eager_cached_forward_equals_no_cache_oracle(model, tiny_config):
    ranker = ExportableRanker(model, EXPORT_PAGES, EXPORT_PAGE_SIZE)
    _assert_matches_oracle(ranker, model, ranker, tiny_config)


def test_exported_program_equals_no_cache_oracle(model, tiny_config):
    ranker = ExportableRanker(model, EXPORT_PAGES, EXPORT_PAGE_SIZE)
    program = export_ranker(ranker)
    flow = [n.target.__name__.split(".")[0] for n in program.graph.nodes if str(n.target).startswith("hstu.")]
    layers = ["cache_append", "cache_gather"] * tiny_config.num_layers
    assert flow == ["cache_lookup", "cache_allocate", *layers, "cache_commit"]  # one graph, no breaks
    _assert_matches_oracle(program.module(), model, ranker, tiny_config)


def test_exporting_leaves_the_cache_untouched(model):
    ranker = ExportableRanker(model, EXPORT_PAGES, EXPORT_PAGE_SIZE)
    export_ranker(ranker)
    assert ranker.cache.num_users() == 0 and ranker.cache.num_free_pages() == EXPORT_PAGES


def test_ranker_needs_one_head_dim_for_the_page_table(tiny_config):
    import dataclasses

    with pytest.raises(ValueError, match="head_dim_qk 16 != head_dim_v 8"):
        ExportableRanker(InferenceRankingGR(dataclasses.replace(tiny_config, head_dim_v=8)), EXPORT_PAGES, EXPORT_PAGE_SIZE)


def test_aoti_package_equals_no_cache_oracle_with_its_own_cache(aoti_package, model, tiny_config):
    from torch._inductor import aoti_load_package

    compiled = aoti_load_package(aoti_package)
    with torch.inference_mode():
        for requests in export_sequence(tiny_config):
            got = compiled(*batch_inputs(requests))
            assert rel_err(got, model.forward_no_cache(requests)) < 1e-5
    (cache,) = compiled.loader.get_custom_objs().values()
    assert cache.reused_tokens() > 0 and cache.evictions() > 0 and cache.invalidations() > 0
    assert compiled.loader.get_metadata()["num_contextual"] == str(tiny_config.num_contextual)
