"""Model configuration (a frozen dataclass so it can key caches and be logged as-is)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

_DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names; torch loads only for torch_dtype
LAYER_VARIANTS = ("nvidia", "meta_stu")
HEAD_ACTIVATIONS = ("silu", "relu")


@dataclass(frozen=True)
class HSTUConfig:
    """Shapes and vocabularies of InferenceRankingGR; the defaults are the small CPU model.

    Options that let a model trained upstream be served (each default is this runtime's own model):
      max_seq_len            longest sequence (history tokens + 1 candidate slot); sizes the
                             position table and the KV page tables.
      attn_scaling_seqlen    the attention normaliser (o = sum SiLU(qk) v / attn_scaling_seqlen);
                             None means max_seq_len. NVIDIA recsys-examples calls it scaling_seqlen;
                             set it to the training value so raising max_seq_len keeps the scores.
      output_bias            bias on each layer's output projection (upstream layers have none).
      layer_norm_eps         every LayerNorm (upstream NVIDIA 1e-5, Meta 1e-6).
      layer_variant          "nvidia": SiLU on u, v, q, k, out = W (LN(a) * u) + x;
                             "meta_stu": SiLU on u only, out = W [u, a, u * LN(a)] + x (3x wide W).
      separate_embedding_tables  one table per feature (contextual, item, action) instead of one
                             concatenated table; same lookups, keys as upstream keeps them.
      postprocessor_norm     LayerNorm before the final L2 normalisation (upstream NVIDIA: none).
      head_activation        activation between the two head layers ("silu" or "relu").
    """

    num_items: int = 100_000
    num_actions: int = 8
    num_contextual: int = 2
    num_contextual_features: int = 1_000
    embedding_dim: int = 256
    num_layers: int = 3
    num_heads: int = 4
    head_dim_qk: int = 64
    head_dim_v: int = 64
    max_seq_len: int = 4096
    num_time_buckets: int = 64
    num_tasks: int = 3
    mlp_hidden: int = 256
    layer_norm_eps: float = 1e-6
    dtype: str = "float32"
    seed: int = 0
    attn_scaling_seqlen: int | None = None
    output_bias: bool = True
    layer_variant: str = "nvidia"
    separate_embedding_tables: bool = False
    postprocessor_norm: bool = True
    head_activation: str = "silu"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("num_items", "num_actions", "embedding_dim", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.attn_scaling_seqlen is not None and self.attn_scaling_seqlen <= 0:
            raise ValueError(f"attn_scaling_seqlen must be positive or None, got {self.attn_scaling_seqlen}")
        if self.layer_variant not in LAYER_VARIANTS:
            raise ValueError(f"layer_variant must be one of {LAYER_VARIANTS}, got {self.layer_variant!r}")
        if self.head_activation not in HEAD_ACTIVATIONS:
            raise ValueError(f"head_activation must be one of {HEAD_ACTIVATIONS}, got {self.head_activation!r}")
        if self.layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps must be positive, got {self.layer_norm_eps}")

    def resolve_task_names(self, names: "Sequence[str] | None" = None) -> tuple[str, ...]:
        """One unique name per task head: `names`, else task_0 .. task_{T-1}; ValueError naming them."""
        if names is None:
            return tuple(f"task_{i}" for i in range(self.num_tasks))
        names = tuple(names)
        if len(names) != self.num_tasks or len(set(names)) != self.num_tasks:
            raise ValueError(f"need {self.num_tasks} distinct task names, got {list(names)}")
        return names

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.dtype)

    @property
    def attention_scale_len(self) -> int:
        """The attention normaliser: attn_scaling_seqlen, else max_seq_len."""
        return self.max_seq_len if self.attn_scaling_seqlen is None else self.attn_scaling_seqlen

    def history_tokens(self, num_events: int) -> int:
        """Token count of a history: contextual tokens, then one item and one action token per event."""
        return self.num_contextual + 2 * num_events

    @classmethod
    def from_json(cls, path: str | Path) -> "HSTUConfig":
        return cls(**json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
