"""Model configuration (a frozen dataclass so it can key caches and be logged as-is)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HSTUConfig:
    """Shapes and vocabularies of InferenceRankingGR; the defaults are the small CPU model."""

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

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        for name in ("num_items", "num_actions", "embedding_dim", "num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def history_tokens(self, num_events: int) -> int:
        """Token count of a history: contextual tokens, then one item and one action token per event."""
        return self.num_contextual + 2 * num_events

    @classmethod
    def from_json(cls, path: str | Path) -> "HSTUConfig":
        return cls(**json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
