"""Import a model trained with NVIDIA recsys-examples or Meta generative-recommenders.

`import_state_dict(source, options)` maps an upstream state dict onto InferenceRankingGR and
returns (HSTUConfig, state_dict); `import_checkpoint(src, dst, options)` reads the upstream
files and writes DST.pt (the state dict) and DST.json (the config) for
`hstu serve --config DST.json --checkpoint DST.pt`.

Upstream layer keys are found by layer index under any prefix (`..._attention_layers.<i>.` for
NVIDIA, `..._stu_layers.<i>.` for Meta); "W^T" marks a weight stored [in, out], transposed here.

NVIDIA (checkpoint <dir>/torch_module/model.0.pth, key model_state_dict), per layer:
  _linear_uvqk_weight (W^T) or _linear_uvqk.weight   -> block.layers.<i>.uvqk.weight
  _linear_uvqk_bias or _linear_uvqk.bias (optional)  -> block.layers.<i>.uvqk.bias
  _input_layernorm_weight / _bias (optional)         -> block.layers.<i>.input_norm.*
  _output_layernorm_weight / _bias, or
  _output_ln_dropout_mul.weight / .bias              -> block.layers.<i>.attn_norm.*
  _linear_proj_weight (W^T) or _linear_proj.weight   -> block.layers.<i>.output.weight (no bias)
  The tensor-parallel training layer (the one with _output_ln_dropout_mul) orders the uvqk
  columns head by head ([u_h, v_h, q_h, k_h] for each head h); it is reordered to [u, v, q, k]
  (uvqk_layout="auto" detects it; "per_head" / "blocked" force either).
  Head: [<prefix>.]_mlp._mlp.<j>.weight / .bias, two Linear layers -> head.mlp.0 / head.mlp.2 (ReLU).
Meta (a state dict file), per layer:
  _uvqk_weight (W^T), _uvqk_beta                     -> uvqk.weight, uvqk.bias
  _input_norm_weight / _bias                         -> input_norm.*
  _output_norm_weight / _bias                        -> attn_norm.* (group norm is not supported)
  _output_weight (W^T, [3 H d_v, D])                 -> output.weight (layer_variant meta_stu)
  The ranking head and the contextual/item encoders of DlrmHSTU have no counterpart here: pass
  this model's head (head.mlp.0.weight, ...) in the source or the tables file.
Both: _positional_encoder._position_embeddings_weight -> positions (its rows set max_seq_len),
  _positional_encoder._timestamp_embeddings_weight -> time_gaps; embedding tables by name (see
  ImportOptions.*_table): a key equal to the name, or ending in "<name>.weight" or ".<name>".
Tensors upstream does not have are neutral: zero token-type (and, when absent, position and
time) tables, unit input norms, zero uvqk/head biases. Any key already named as in this model is
taken as it is (e.g. token_types, or a head for Meta). Anything else missing or mis-shaped raises
CheckpointImportError naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from hstu.model.config import HSTUConfig

logger = logging.getLogger(__name__)

FORMATS = ("nvidia", "meta")
UVQK_LAYOUTS = ("auto", "blocked", "per_head")
_LAYER_RE = {"nvidia": re.compile(r"^(.*?_attention_layers)\.(\d+)\.(.+)$"), "meta": re.compile(r"^(.*?_stu_layers)\.(\d+)\.(.+)$")}
_POSITIONS = "_positional_encoder._position_embeddings_weight"
_TIMESTAMPS = "_positional_encoder._timestamp_embeddings_weight"
_HEAD_RE = re.compile(r"^((?:.*\.)?_mlp\._mlp)\.(\d+)\.weight$")  # not _item_mlp / _contextual_mlp


class CheckpointImportError(ValueError):
    """The upstream checkpoint does not fit: names the first missing or mis-shaped key."""


@dataclass(frozen=True)
class ImportOptions:
    """What the upstream files do not say. num_heads is required (shapes give only H * d);
    attn_scaling_seqlen is required for Meta, whose training normalises by the batch's longest
    sequence (a user's scores would depend on the batch): give the fixed value to serve with."""

    format: str
    num_heads: int
    attn_scaling_seqlen: int | None = None
    layer_norm_eps: float | None = None
    num_contextual: int = 0
    item_table: str = "item"
    action_table: str = "action"
    contextual_tables: tuple[str, ...] = ()
    uvqk_layout: str = "auto"
    head_activation: str | None = None
    max_seq_len: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.uvqk_layout not in UVQK_LAYOUTS:
            raise ValueError(f"uvqk_layout must be one of {UVQK_LAYOUTS}, got {self.uvqk_layout!r}")
        if self.num_heads <= 0:
            raise ValueError(f"num_heads must be positive, got {self.num_heads}")
        if self.format == "meta" and self.attn_scaling_seqlen is None:
            raise ValueError(
                "format 'meta' needs attn_scaling_seqlen: Meta's model divides attention by the batch's longest "
                "sequence, which makes a user's scores depend on the batch; serve with a fixed normaliser "
                "(e.g. the training max_seq_len)"
            )
        if self.num_contextual > 0 and not self.contextual_tables:
            raise ValueError(f"num_contextual={self.num_contextual} needs at least one contextual table name")


class _Source:
    """The upstream tensors, with lookups that name what they tried and remember what was used."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
        self.used: set[str] = set()

    def get(self, *keys: str) -> tuple[str, torch.Tensor] | None:
        for key in keys:
            if key in self.tensors:
                self.used.add(key)
                return key, self.tensors[key]
        return None

    def need(self, *keys: str) -> tuple[str, torch.Tensor]:
        found = self.get(*keys)
        if found is None:
            raise CheckpointImportError(f"missing key {keys[0]!r}" + (f" (also tried {list(keys[1:])})" if keys[1:] else ""))
        return found

    def suffix(self, suffix: str) -> tuple[str, torch.Tensor] | None:
        hits = sorted(k for k in self.tensors if k == suffix or k.endswith("." + suffix))
        if len(hits) > 1:
            raise CheckpointImportError(f"key suffix {suffix!r} is ambiguous: {hits}")
        return self.get(*hits) if hits else None

    def table(self, name: str, dim: int) -> torch.Tensor:
        """Embedding table `name` [rows, dim]."""
        hits = sorted(k for k in self.tensors if k in (name, f"{name}.weight") or k.endswith(f".{name}.weight") or k.endswith(f".{name}"))
        if not hits:
            raise CheckpointImportError(f"missing embedding table {name!r} (no key {name!r}, '*.{name}.weight' or '*.{name}')")
        if len(hits) > 1:
            raise CheckpointImportError(f"embedding table name {name!r} is ambiguous: {hits}")
        key, t = self.need(hits[0])
        return _shape(key, t, (t.shape[0] if t.dim() == 2 else -1, dim))


def _shape(key: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointImportError(f"key {key!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    return t


def _layers(src: _Source, fmt: str) -> tuple[str, int]:
    """(key prefix of the layer list, number of layers); layers must be numbered 0..L-1."""
    found: dict[str, set[int]] = {}
    for key in src.tensors:
        m = _LAYER_RE[fmt].match(key)
        if m:
            found.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not found:
        what = "_attention_layers.<i>." if fmt == "nvidia" else "_stu_layers.<i>."
        raise CheckpointImportError(f"no HSTU layer keys ('*{what}*') in the {fmt} checkpoint")
    if len(found) > 1:
        raise CheckpointImportError(f"more than one layer stack in the checkpoint: {sorted(found)}")
    prefix, idx = next(iter(found.items()))
    missing = sorted(set(range(max(idx) + 1)) - idx)
    if missing:
        raise CheckpointImportError(f"layer {missing[0]} missing under {prefix!r} (found {sorted(idx)})")
    return prefix, max(idx) + 1


def _per_head_to_blocked(t: torch.Tensor, H: int, dv: int, dqk: int) -> torch.Tensor:
    """Rows ordered [u_h, v_h, q_h, k_h] head by head -> [u (all heads), v, q, k]."""
    per_head = t.reshape(H, 2 * dv + 2 * dqk, *t.shape[1:])
    parts = torch.split(per_head, [dv, dv, dqk, dqk], dim=1)
    return torch.cat([p.reshape(H * p.shape[1], *t.shape[1:]) for p in parts])


def _linear_weight(src: _Source, transposed: str, plain: str, fan_in: int, fan_out: int) -> torch.Tensor:
    """[out, in] weight from `transposed` (stored [in, out]) or `plain` (stored [out, in])."""
    key, t = src.need(transposed, plain)
    return _shape(key, t, (fan_in, fan_out)).T if key == transposed else _shape(key, t, (fan_out, fan_in))


def _layer_nvidia(src: _Source, p: str, dims: dict, layout: str) -> dict[str, torch.Tensor]:
    D, H, dv, dqk = dims["D"], dims["H"], dims["dv"], dims["dqk"]
    width = H * (2 * dv + 2 * dqk)
    w = _linear_weight(src, f"{p}._linear_uvqk_weight", f"{p}._linear_uvqk.weight", D, width)
    bias = src.get(f"{p}._linear_uvqk_bias", f"{p}._linear_uvqk.bias")
    b = _shape(*bias, (width,)) if bias else torch.zeros(width)
    native = f"{p}._output_ln_dropout_mul.weight" in src.tensors
    if layout == "per_head" or (layout == "auto" and native):
        w, b = _per_head_to_blocked(w, H, dv, dqk), _per_head_to_blocked(b, H, dv, dqk)
    in_w, in_b = src.get(f"{p}._input_layernorm_weight"), src.get(f"{p}._input_layernorm_bias")
    out_w = src.need(f"{p}._output_layernorm_weight", f"{p}._output_ln_dropout_mul.weight")
    out_b = src.need(f"{p}._output_layernorm_bias", f"{p}._output_ln_dropout_mul.bias")
    pw = _linear_weight(src, f"{p}._linear_proj_weight", f"{p}._linear_proj.weight", H * dv, D)
    return {
        "uvqk.weight": w,
        "uvqk.bias": b,
        "input_norm.weight": _shape(*in_w, (D,)) if in_w else torch.ones(D),
        "input_norm.bias": _shape(*in_b, (D,)) if in_b else torch.zeros(D),
        "attn_norm.weight": _shape(*out_w, (H * dv,)),
        "attn_norm.bias": _shape(*out_b, (H * dv,)),
        "output.weight": pw,
    }


def _layer_meta(src: _Source, p: str, dims: dict, layout: str) -> dict[str, torch.Tensor]:
    D, H, dv, dqk = dims["D"], dims["H"], dims["dv"], dims["dqk"]
    width = H * (2 * dv + 2 * dqk)
    norm_key, norm_w = src.need(f"{p}._output_norm_weight")
    if norm_w.shape == (H,) and H != H * dv:
        raise CheckpointImportError(f"key {norm_key!r} is a group norm over {H} heads; only the layer norm STU is supported")
    return {
        "uvqk.weight": _shape(*src.need(f"{p}._uvqk_weight"), (D, width)).T,
        "uvqk.bias": _shape(*src.need(f"{p}._uvqk_beta"), (width,)),
        "input_norm.weight": _shape(*src.need(f"{p}._input_norm_weight"), (D,)),
        "input_norm.bias": _shape(*src.need(f"{p}._input_norm_bias"), (D,)),
        "attn_norm.weight": _shape(norm_key, norm_w, (H * dv,)),
        "attn_norm.bias": _shape(*src.need(f"{p}._output_norm_bias"), (H * dv,)),
        "output.weight": _shape(*src.need(f"{p}._output_weight"), (3 * H * dv, D)).T,
    }


def _dims(src: _Source, fmt: str, p: str, H: int) -> dict:
    """D, H, d_v, d_qk from layer 0's uvqk weight and output norm."""
    if fmt == "meta":
        _, uvqk = src.need(f"{p}._uvqk_weight")
        D, width = uvqk.shape
        _, norm = src.need(f"{p}._output_norm_weight")
    else:
        fused = src.get(f"{p}._linear_uvqk_weight")
        D, width = fused[1].shape if fused else src.need(f"{p}._linear_uvqk.weight")[1].shape[::-1]
        _, norm = src.need(f"{p}._output_layernorm_weight", f"{p}._output_ln_dropout_mul.weight")
    hv = norm.shape[0]
    if hv % H or (width - 2 * hv) % (2 * H) or width <= 2 * hv:
        raise CheckpointImportError(f"layer 0: uvqk width {width} and output norm {hv} do not split over num_heads={H}")
    return {"D": int(D), "H": H, "dv": hv // H, "dqk": (width - 2 * hv) // (2 * H)}


def _head(src: _Source, fmt: str, D: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """Head tensors, hidden width and task count; NVIDIA's <prefix>_mlp.<j>, else this model's keys."""
    mine = src.get("head.mlp.0.weight")
    if mine is None and fmt == "nvidia":
        linear = sorted({(m.group(1), int(m.group(2))) for k in src.tensors if (m := _HEAD_RE.match(k))})
        if len(linear) != 2:
            raise CheckpointImportError(
                f"the head has {len(linear)} linear layers ({[f'{a}.{i}' for a, i in linear]}); this runtime's head has 2"
            )
        (p0, i0), (p1, i1) = linear
        names = (f"{p0}.{i0}.weight", f"{p0}.{i0}.bias", f"{p1}.{i1}.weight", f"{p1}.{i1}.bias")
    elif mine is None:
        raise CheckpointImportError("missing key 'head.mlp.0.weight' (Meta's head has no counterpart: supply this model's head)")
    else:
        names = ("head.mlp.0.weight", "head.mlp.0.bias", "head.mlp.2.weight", "head.mlp.2.bias")
    (k0, w0), (k1, w1) = src.need(names[0]), src.need(names[2])
    b0, b1 = src.get(names[1]), src.get(names[3])
    hidden, tasks = int(w0.shape[0]), int(w1.shape[0])
    return {
        "head.mlp.0.weight": _shape(k0, w0, (hidden, D)),
        "head.mlp.0.bias": _shape(*b0, (hidden,)) if b0 else torch.zeros(hidden),
        "head.mlp.2.weight": _shape(k1, w1, (tasks, hidden)),
        "head.mlp.2.bias": _shape(*b1, (tasks,)) if b1 else torch.zeros(tasks),
    }, hidden, tasks


def import_state_dict(source: Mapping[str, torch.Tensor], options: ImportOptions) -> tuple[HSTUConfig, dict[str, torch.Tensor]]:
    """Map an upstream state dict (plus exported embedding tables) onto InferenceRankingGR."""
    from hstu.model.ranking import InferenceRankingGR

    fmt, src = options.format, _Source(source)
    prefix, num_layers = _layers(src, fmt)
    dims = _dims(src, fmt, f"{prefix}.0", options.num_heads)
    D = dims["D"]
    layer_fn = _layer_meta if fmt == "meta" else _layer_nvidia
    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        for name, t in layer_fn(src, f"{prefix}.{i}", dims, options.uvqk_layout).items():
            out[f"block.layers.{i}.{name}"] = t

    emb = "preprocessor.embeddings."
    items, actions = src.table(options.item_table, D), src.table(options.action_table, D)
    ctx_parts = [src.table(n, D) for n in options.contextual_tables]
    contextual = torch.cat(ctx_parts) if ctx_parts else torch.zeros(1, D)
    out.update({emb + "items.weight": items, emb + "actions.weight": actions, emb + "contextual.weight": contextual})

    positions = src.suffix(_POSITIONS)
    max_seq_len = options.max_seq_len or (int(positions[1].shape[0]) if positions else None)
    if max_seq_len is None:
        raise CheckpointImportError(f"no position table ('*{_POSITIONS}'): give max_seq_len")
    if positions is not None:
        out[emb + "positions.weight"] = _shape(*positions, (max_seq_len, D))
    times = src.suffix(_TIMESTAMPS)
    num_time_buckets = int(times[1].shape[0]) if times else HSTUConfig.num_time_buckets
    if times is not None:
        out[emb + "time_gaps.weight"] = _shape(*times, (num_time_buckets, D))

    head, hidden, tasks = _head(src, fmt, D)
    out.update(head)
    config = HSTUConfig(
        num_items=int(items.shape[0]),
        num_actions=int(actions.shape[0]),
        num_contextual=options.num_contextual,
        num_contextual_features=int(contextual.shape[0]),
        embedding_dim=D,
        num_layers=num_layers,
        num_heads=dims["H"],
        head_dim_qk=dims["dqk"],
        head_dim_v=dims["dv"],
        max_seq_len=max_seq_len,
        num_time_buckets=num_time_buckets,
        num_tasks=tasks,
        mlp_hidden=hidden,
        layer_norm_eps=options.layer_norm_eps or (1e-6 if fmt == "meta" else 1e-5),
        dtype=options.dtype,
        attn_scaling_seqlen=options.attn_scaling_seqlen,
        output_bias=False,
        layer_variant="meta_stu" if fmt == "meta" else "nvidia",
        separate_embedding_tables=True,
        postprocessor_norm="postprocessor.norm.weight" in src.tensors,
        head_activation=options.head_activation or ("relu" if fmt == "nvidia" else "silu"),
    )
    with torch.device("meta"):  # shapes only, nothing allocated
        target = InferenceRankingGR(dataclasses.replace(config, dtype="float32"), device="meta").state_dict()
    return config, _complete(out, src, target, config)


def _complete(out: dict, src: _Source, target: dict, config: HSTUConfig) -> dict[str, torch.Tensor]:
    """Fill what upstream lacks (this model's own keys first, else neutral values), check shapes."""
    neutral = {"preprocessor.embeddings.token_types.weight", "preprocessor.embeddings.positions.weight",
               "preprocessor.embeddings.time_gaps.weight"}
    result = {}
    for key, ref in target.items():
        own = src.get(key)
        if own is not None:
            t = own[1]
        elif key in out:
            t = out[key]
        elif key in neutral:
            logger.info("%s: not in the checkpoint, zeros", key)
            t = torch.zeros(ref.shape)
        else:
            raise CheckpointImportError(f"missing key {key!r} for this model")
        result[key] = _shape(key, t, tuple(ref.shape)).detach().to(config.torch_dtype).contiguous()
    unused = sorted(set(src.tensors) - src.used)
    if unused:
        logger.warning("%d checkpoint tensors not used (first: %s)", len(unused), unused[:5])
    return result


def load_upstream(path: str | Path, fmt: str) -> dict[str, torch.Tensor]:
    """The upstream state dict: NVIDIA's <dir>/torch_module/model.0.pth, or a .pt/.pth file;
    a top-level 'model_state_dict' or 'state_dict' entry is unwrapped."""
    path = Path(path)
    if path.is_dir():
        path = path / "torch_module" / "model.0.pth"
    if not path.is_file():
        raise FileNotFoundError(f"{fmt} checkpoint {path} does not exist")
    obj = torch.load(path, map_location="cpu", weights_only=False)
    for key in ("model_state_dict", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise CheckpointImportError(f"{path} holds a {type(obj).__name__}, not a state dict")
    return obj


def import_checkpoint(
    src: str | Path, dst: str | Path, options: ImportOptions, tables: str | Path | None = None
) -> tuple[Path, Path]:
    """Read an upstream checkpoint (+ exported tables file), write DST.json and DST.pt."""
    source = load_upstream(src, options.format)
    if tables is not None:
        exported = torch.load(tables, map_location="cpu", weights_only=True)
        clash = sorted(set(exported) & set(source))
        if clash:
            raise CheckpointImportError(f"tables file {tables} repeats checkpoint keys: {clash[:5]}")
        source = {**source, **exported}
    config, state = import_state_dict(source, options)
    dst = Path(dst)
    stem = dst.with_suffix("") if dst.suffix in (".pt", ".json") else dst
    stem.parent.mkdir(parents=True, exist_ok=True)
    config_path, ckpt_path = Path(f"{stem}.json"), Path(f"{stem}.pt")
    config_path.write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    torch.save(state, ckpt_path)
    logger.info("wrote %s and %s (%d layers, %d tensors)", config_path, ckpt_path, config.num_layers, len(state))
    return config_path, ckpt_path
