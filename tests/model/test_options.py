"""HSTUConfig's upstream-compatibility options: each keeps cache == no-cache, and each does what
its docstring says (normaliser apart from the history cap, separate tables == one table, the STU
layer's formula)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from hstu.engine import RankingEngine
from hstu.model.config import HSTUConfig
from hstu.model.hstu_layer import HSTULayer
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from tests.conftest import HistoryBook, rel_err

OPTIONS = {
    "meta_stu": dict(layer_variant="meta_stu"),
    "scaling_seqlen": dict(attn_scaling_seqlen=1000),
    "no_output_bias": dict(output_bias=False),
    "layer_norm_eps": dict(layer_norm_eps=1e-5),
    "separate_tables": dict(separate_embedding_tables=True),
    "nvidia_head": dict(postprocessor_norm=False, head_activation="relu"),
    "all_meta": dict(layer_variant="meta_stu", attn_scaling_seqlen=300, output_bias=False, separate_embedding_tables=True),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_cached_logits_equal_uncached_with_option(tiny_config, name):
    config = dataclasses.replace(tiny_config, **OPTIONS[name])
    mgr = AsyncKVCacheManager(KVCacheConfig.for_model(config, page_size=4, num_pages=48, chunk_tokens=8))
    model = RankingEngine(InferenceRankingGR(config), mgr)
    book = HistoryBook(config, seed=3)
    worst, cached = 0.0, 0
    for reqs in book.random_batches(seed=4, rounds=6, num_users=8, max_users=3, new_events=(1, 7), candidates=(1, 4)):
        outputs = model.rank(reqs)
        cached += sum(o.cached_tokens for o in outputs)
        worst = max(worst, rel_err(torch.cat([o.logits for o in outputs]), model.forward_no_cache(reqs)))
    mgr.close()
    assert worst < 1e-5, worst
    assert cached > 0


def test_scaling_seqlen_keeps_scores_when_history_cap_grows(tiny_config, book):
    short = dataclasses.replace(tiny_config, max_seq_len=64, attn_scaling_seqlen=64)
    long = dataclasses.replace(tiny_config, max_seq_len=256, attn_scaling_seqlen=64)
    a, b = InferenceRankingGR(short), InferenceRankingGR(long)
    state = a.state_dict()
    pos = b.preprocessor.embeddings.positions.weight.detach().clone()
    pos[:64] = state["preprocessor.embeddings.positions.weight"]
    b.load_state_dict({**state, "preprocessor.embeddings.positions.weight": pos})
    reqs = [book.request(1, 10), book.request(2, 20)]
    torch.testing.assert_close(b.forward_no_cache(reqs), a.forward_no_cache(reqs), rtol=0, atol=0)
    grown = dataclasses.replace(long, attn_scaling_seqlen=None)  # the old coupling: scores change
    c = InferenceRankingGR(grown)
    c.load_state_dict(b.state_dict())
    assert not torch.allclose(c.forward_no_cache(reqs), a.forward_no_cache(reqs))


def test_separate_tables_equal_one_concatenated_table(tiny_config, book):
    one = InferenceRankingGR(tiny_config)
    split_cfg = dataclasses.replace(tiny_config, separate_embedding_tables=True)
    split = InferenceRankingGR(split_cfg)
    state = dict(one.state_dict())
    table = state.pop("preprocessor.embeddings.tokens.weight")
    C, I = tiny_config.num_contextual_features, tiny_config.num_items
    state["preprocessor.embeddings.contextual.weight"] = table[:C]
    state["preprocessor.embeddings.items.weight"] = table[C : C + I]
    state["preprocessor.embeddings.actions.weight"] = table[C + I :]
    split.load_state_dict(state)
    reqs = [book.request(1, 6), book.request(2, 9)]
    torch.testing.assert_close(split.forward_no_cache(reqs), one.forward_no_cache(reqs), rtol=0, atol=0)


def test_meta_stu_layer_follows_the_stu_formula(tiny_config):
    cfg = dataclasses.replace(tiny_config, layer_variant="meta_stu", output_bias=False)
    layer = HSTULayer(cfg)
    H, dv, dqk = cfg.num_heads, cfg.head_dim_v, cfg.head_dim_qk
    assert layer.output.weight.shape == (cfg.embedding_dim, 3 * H * dv) and layer.output.bias is None
    x = torch.randn(5, cfg.embedding_dim)
    mixed = F.linear(F.layer_norm(x, (cfg.embedding_dim,), layer.input_norm.weight, layer.input_norm.bias, 1e-6),
                     layer.uvqk.weight, layer.uvqk.bias)
    u, q, k, v = layer.project(x)
    torch.testing.assert_close(u, F.silu(mixed[:, : H * dv]))
    torch.testing.assert_close(v.reshape(5, -1), mixed[:, H * dv : 2 * H * dv])  # no SiLU on v, q, k
    torch.testing.assert_close(q.reshape(5, -1), mixed[:, 2 * H * dv : 2 * H * dv + H * dqk])
    attn = torch.randn(5, H, dv)
    a = attn.reshape(5, -1)
    normed = F.layer_norm(a, (H * dv,), layer.attn_norm.weight, layer.attn_norm.bias, 1e-6)
    expected = x + torch.cat([u, a, u * normed], dim=1) @ layer.output.weight.T
    torch.testing.assert_close(layer.finish(x, attn, u), expected)


def test_layer_norm_eps_reaches_every_layer_norm(tiny_config):
    model = InferenceRankingGR(dataclasses.replace(tiny_config, layer_norm_eps=1e-5))
    eps = {m.eps for m in model.modules() if isinstance(m, torch.nn.LayerNorm)}
    assert eps == {1e-5}


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("layer_variant", "gpt", "layer_variant must be one of"),
        ("attn_scaling_seqlen", 0, "attn_scaling_seqlen must be positive"),
        ("head_activation", "tanh", "head_activation must be one of"),
        ("layer_norm_eps", 0.0, "layer_norm_eps must be positive"),
    ],
)
def test_config_rejects_bad_option_naming_it(field, value, message):
    with pytest.raises(ValueError, match=message):
        HSTUConfig(**{field: value})


def test_config_json_roundtrip_keeps_options(tmp_path):
    cfg = HSTUConfig(**OPTIONS["all_meta"], postprocessor_norm=False)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert HSTUConfig.from_json(path) == cfg
