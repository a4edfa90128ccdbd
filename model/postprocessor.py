"""Postprocessor and multi-task head: candidate outputs -> L2-normalised embeddings -> logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hstu.model.config import HSTUConfig


class Postprocessor(nn.Module):
    """LayerNorm (HSTUConfig.postprocessor_norm) then L2 normalisation of each candidate's output,
    as in HSTU's output stage; NVIDIA recsys-examples normalises without the LayerNorm."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.embedding_dim, eps=config.layer_norm_eps) if config.postprocessor_norm else nn.Identity()

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.norm(y), dim=-1, eps=1e-6)


class MultiTaskHead(nn.Module):
    """MLP producing one logit per task (e.g. click, like, share) for every candidate."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(config.embedding_dim, config.mlp_hidden),
            nn.ReLU() if config.head_activation == "relu" else nn.SiLU(),
            nn.Linear(config.mlp_hidden, config.num_tasks),
        )

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.mlp(y)
