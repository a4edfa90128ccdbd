"""Checkpoint import: a model's weights written in each upstream layout (NVIDIA recsys-examples'
fused training layer, tensor-parallel training layer and inference layer; Meta's STU) import to
the same config and the same logits; the imported files serve; bad checkpoints name the key.

The builders write the upstream key names and shapes (weights stored [in, out] where upstream
does, the per-head uvqk order of the tensor-parallel layer) from the layouts those projects define.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
import torch

from hstu.cli import main as hstu_main
from hstu.engine import RankingEngine
from hstu.model.checkpoint_import import CheckpointImportError, ImportOptions, import_state_dict
from hstu.model.config import HSTUConfig
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.serving.cli import add_parser, settings_from_args
from tests.conftest import HistoryBook, rel_err

NV_LAYERS = "_hstu_block._attention_layers"
NV_POS = "_hstu_block._preprocessor._positional_encoder"
NV_TABLES = "_embedding_collection._data_parallel_embedding_collection.embeddings"
META_LAYERS = "_hstu_transducer._stu_module._stu_layers"
META_POS = "_hstu_transducer._positional_encoder"
CONTEXTUAL = {"user_id": 30, "user_age": 20}


def _config(tiny: HSTUConfig, fmt: str, **extra) -> HSTUConfig:
    common = dict(output_bias=False, separate_embedding_tables=True, attn_scaling_seqlen=200, **extra)
    if fmt == "nvidia":
        return dataclasses.replace(tiny, layer_norm_eps=1e-5, postprocessor_norm=False, head_activation="relu", **common)
    return dataclasses.replace(tiny, layer_variant="meta_stu", head_dim_qk=8, **common)


def _native(config: HSTUConfig) -> tuple[InferenceRankingGR, dict[str, torch.Tensor]]:
    """A model with random weights and no token-type table (upstream has none)."""
    model = InferenceRankingGR(config)
    with torch.no_grad():
        model.preprocessor.embeddings.token_types.weight.zero_()
    return model, {k: v.clone() for k, v in model.state_dict().items()}


def _per_head(t: torch.Tensor, H: int, d: int) -> torch.Tensor:
    """[u; v; q; k] rows (each H*d) -> rows ordered head by head, [u_h; v_h; q_h; k_h]."""
    u, v, q, k = (p.reshape(H, d, *t.shape[1:]) for p in t.chunk(4))
    return torch.stack([u, v, q, k], dim=1).reshape(t.shape)


def _tables(state: dict) -> dict[str, torch.Tensor]:
    ctx = state["preprocessor.embeddings.contextual.weight"]
    return {
        "item": state["preprocessor.embeddings.items.weight"],
        "action": state["preprocessor.embeddings.actions.weight"],
        "user_id": ctx[: CONTEXTUAL["user_id"]],
        "user_age": ctx[CONTEXTUAL["user_id"] :],
    }


def nvidia_state_dict(state: dict, config: HSTUConfig, layout: str) -> tuple[dict, dict]:
    """(model_state_dict, exported tables) in NVIDIA's layout: fused | native_tp | inference."""
    H, d = config.num_heads, config.head_dim_v
    out: dict = {}
    for i in range(config.num_layers):
        ours, p = f"block.layers.{i}.", f"{NV_LAYERS}.{i}."
        w, b, proj = state[ours + "uvqk.weight"], state[ours + "uvqk.bias"], state[ours + "output.weight"]
        out[p + "_input_layernorm_weight"] = state[ours + "input_norm.weight"]
        out[p + "_input_layernorm_bias"] = state[ours + "input_norm.bias"]
        if layout == "fused":
            out[p + "_linear_uvqk_weight"], out[p + "_linear_uvqk_bias"] = w.T.contiguous(), b
            out[p + "_linear_proj_weight"] = proj.T.contiguous()
        else:
            if layout == "native_tp":
                w, b = _per_head(w, H, d), _per_head(b, H, d)
                out[p + "_linear_uvqk._extra_state"] = None  # Transformer Engine metadata, not a tensor
            out[p + "_linear_uvqk.weight"], out[p + "_linear_uvqk.bias"] = w, b
            out[p + "_linear_proj.weight"] = proj
        norm = "_output_ln_dropout_mul." if layout == "native_tp" else "_output_layernorm_"
        out[p + norm + "weight"] = state[ours + "attn_norm.weight"]
        out[p + norm + "bias"] = state[ours + "attn_norm.bias"]
    out[f"{NV_POS}._position_embeddings_weight"] = state["preprocessor.embeddings.positions.weight"]
    out[f"{NV_POS}._timestamp_embeddings_weight"] = state["preprocessor.embeddings.time_gaps.weight"]
    for j, ours in ((0, "head.mlp.0"), (2, "head.mlp.2")):
        out[f"_mlp._mlp.{j}.weight"], out[f"_mlp._mlp.{j}.bias"] = state[ours + ".weight"], state[ours + ".bias"]
    tables = _tables(state)
    out[f"{NV_TABLES}.item.weight"] = tables.pop("item")  # a data-parallel table; the rest are exported
    return out, tables


def meta_state_dict(state: dict, config: HSTUConfig) -> dict:
    """STU layers in Meta's layout ([in, out] weights), its positional encoder, plus the tables and
    this model's head and output norm (DlrmHSTU's encoders and head have no counterpart)."""
    out: dict = {}
    for i in range(config.num_layers):
        ours, p = f"block.layers.{i}.", f"{META_LAYERS}.{i}."
        out[p + "_uvqk_weight"] = state[ours + "uvqk.weight"].T.contiguous()
        out[p + "_uvqk_beta"] = state[ours + "uvqk.bias"]
        out[p + "_input_norm_weight"], out[p + "_input_norm_bias"] = state[ours + "input_norm.weight"], state[ours + "input_norm.bias"]
        out[p + "_output_norm_weight"], out[p + "_output_norm_bias"] = state[ours + "attn_norm.weight"], state[ours + "attn_norm.bias"]
        out[p + "_output_weight"] = state[ours + "output.weight"].T.contiguous()
    out[f"{META_POS}._position_embeddings_weight"] = state["preprocessor.embeddings.positions.weight"]
    out[f"{META_POS}._timestamp_embeddings_weight"] = state["preprocessor.embeddings.time_gaps.weight"]
    out.update({k: v for k, v in state.items() if k.startswith(("head.", "postprocessor."))})
    out.update(_tables(state))
    return out


def _options(config: HSTUConfig, fmt: str, **extra) -> ImportOptions:
    return ImportOptions(
        format=fmt,
        num_heads=config.num_heads,
        attn_scaling_seqlen=config.attn_scaling_seqlen,
        num_contextual=config.num_contextual,
        contextual_tables=tuple(CONTEXTUAL),
        **extra,
    )


def _requests(config: HSTUConfig) -> list:
    book = HistoryBook(config, seed=5)
    return [book.request(u, n) for u, n in ((1, 4), (2, 11), (3, 1))]


def _assert_same_model(config, state, imported_config, imported_state, native) -> None:
    assert imported_config == config
    model = InferenceRankingGR(imported_config)
    model.load_state_dict(imported_state)
    reqs = _requests(config)
    torch.testing.assert_close(model.forward_no_cache(reqs), native.forward_no_cache(reqs), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["fused", "native_tp", "inference"])
def test_nvidia_layouts_import_to_the_native_model(tiny_config, layout):
    config = _config(tiny_config, "nvidia")
    native, state = _native(config)
    upstream, tables = nvidia_state_dict(state, config, layout)
    imported_config, imported = import_state_dict({**upstream, **tables}, _options(config, "nvidia"))
    _assert_same_model(config, state, imported_config, imported, native)


def test_meta_stu_imports_to_the_native_model(tiny_config):
    config = _config(tiny_config, "meta")
    native, state = _native(config)
    imported_config, imported = import_state_dict(meta_state_dict(state, config), _options(config, "meta"))
    _assert_same_model(config, state, imported_config, imported, native)


def test_tensor_parallel_layout_without_reorder_gives_other_scores(tiny_config):
    config = _config(tiny_config, "nvidia")
    native, state = _native(config)
    upstream, tables = nvidia_state_dict(state, config, "native_tp")
    _, wrong = import_state_dict({**upstream, **tables}, _options(config, "nvidia", uvqk_layout="blocked"))
    model = InferenceRankingGR(config)
    model.load_state_dict(wrong)
    reqs = _requests(config)
    assert not torch.allclose(model.forward_no_cache(reqs), native.forward_no_cache(reqs))


def test_imported_files_serve_with_the_cache(tiny_config, tmp_path):
    """NVIDIA's checkpoint dir + an exported tables file -> hstu import-checkpoint -> the files
    `hstu serve --config --checkpoint` reads load into InferenceRankingGR and rank, cache == no cache."""
    config = _config(tiny_config, "nvidia")
    native, state = _native(config)
    upstream, tables = nvidia_state_dict(state, config, "fused")
    (tmp_path / "ckpt" / "torch_module").mkdir(parents=True)
    torch.save({"model_state_dict": upstream}, tmp_path / "ckpt" / "torch_module" / "model.0.pth")
    torch.save(tables, tmp_path / "tables.pt")
    dst = tmp_path / "out" / "model"
    rc = hstu_main([
        "import-checkpoint", "--format", "nvidia", str(tmp_path / "ckpt"), str(dst), "--num-heads", str(config.num_heads),
        "--scaling-seqlen", "200", "--tables", str(tmp_path / "tables.pt"), "--contextual-tables", "user_id,user_age",
        "--num-contextual", str(config.num_contextual),
    ])
    assert rc == 0
    sub = argparse.ArgumentParser().add_subparsers()
    args = add_parser(sub).parse_args(["--config", f"{dst}.json", "--checkpoint", f"{dst}.pt"])
    settings = settings_from_args(args)
    served = settings.resolve_model_config()
    assert served == config
    mgr = AsyncKVCacheManager(KVCacheConfig.for_model(served, page_size=4, num_pages=32, chunk_tokens=8))
    loaded = InferenceRankingGR(served)
    loaded.load_state_dict(torch.load(settings.checkpoint, weights_only=True))
    engine = RankingEngine(loaded, mgr)
    book = HistoryBook(served, seed=6)
    for step in range(3):
        reqs = [book.request(u, 2 + step) for u in (1, 2)]
        outputs = engine.rank(reqs)
        logits = torch.cat([o.logits for o in outputs])
        assert rel_err(logits, native.forward_no_cache(reqs)) < 1e-5
        assert np.all((outputs[0].scores > 0) & (outputs[0].scores < 1))
    assert outputs[0].cached_tokens > 0
    mgr.close()


def _nvidia_source(tiny_config) -> tuple[HSTUConfig, dict]:
    config = _config(tiny_config, "nvidia")
    _, state = _native(config)
    upstream, tables = nvidia_state_dict(state, config, "fused")
    return config, {**upstream, **tables}


def test_missing_key_is_named(tiny_config):
    config, source = _nvidia_source(tiny_config)
    del source[f"{NV_LAYERS}.1._linear_proj_weight"]
    with pytest.raises(CheckpointImportError, match=rf"missing key '{NV_LAYERS}.1._linear_proj_weight'"):
        import_state_dict(source, _options(config, "nvidia"))


def test_misshaped_key_is_named_with_both_shapes(tiny_config):
    config, source = _nvidia_source(tiny_config)
    key = f"{NV_LAYERS}.0._output_layernorm_bias"
    source[key] = source[key][:-1]
    with pytest.raises(CheckpointImportError, match=rf"key '{key}' has shape \(31,\), expected \(32,\)"):
        import_state_dict(source, _options(config, "nvidia"))


def test_missing_layer_and_missing_table_are_named(tiny_config):
    config, source = _nvidia_source(tiny_config)
    gap = {k: v for k, v in source.items() if ".0." not in k or "_attention_layers" not in k}
    with pytest.raises(CheckpointImportError, match="layer 0 missing"):
        import_state_dict(gap, _options(config, "nvidia"))
    del source["user_age"]
    with pytest.raises(CheckpointImportError, match="missing embedding table 'user_age'"):
        import_state_dict(source, _options(config, "nvidia"))


def test_head_of_other_depth_is_rejected(tiny_config):
    config, source = _nvidia_source(tiny_config)
    source["_mlp._mlp.4.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointImportError, match="the head has 3 linear layers"):
        import_state_dict(source, _options(config, "nvidia"))


def test_meta_import_needs_a_fixed_normaliser():
    with pytest.raises(ValueError, match="format 'meta' needs attn_scaling_seqlen"):
        ImportOptions(format="meta", num_heads=2)
