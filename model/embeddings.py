"""Token embeddings: one table for contextual features, items and actions, plus position, time-gap
and token-type tables. Sum of the four, scaled by sqrt(D) like the HSTU reference."""

from __future__ import annotations

import math

import torch
from torch import nn

from hstu.model.config import HSTUConfig


class TokenEmbeddings(nn.Module):
    """Maps token features (table index, position, time bucket, token type) to [T, D] inputs."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        D = config.embedding_dim
        self.item_offset = config.num_contextual_features
        self.action_offset = self.item_offset + config.num_items
        self.tokens = nn.Embedding(self.action_offset + config.num_actions, D)
        self.positions = nn.Embedding(config.max_seq_len, D)
        self.time_gaps = nn.Embedding(config.num_time_buckets, D)
        self.token_types = nn.Embedding(4, D)
        self.scale = math.sqrt(D)

    def forward(self, token_index: torch.Tensor, position: torch.Tensor, time_bucket: torch.Tensor, token_type: torch.Tensor) -> torch.Tensor:
        x = self.tokens(token_index) * self.scale
        return x + self.positions(position) + self.time_gaps(time_bucket) + self.token_types(token_type)
