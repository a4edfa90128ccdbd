"""Token embeddings: contextual features, items and actions, plus position, time-gap and token-type
tables. Sum of the four, the feature term scaled by sqrt(D) like the HSTU reference.

Feature indices live in one space: contextual features [0, C), items [C, C + I), actions after
that (item_offset, action_offset). By default one table holds that whole space; with
HSTUConfig.separate_embedding_tables each feature has its own table (as upstream trainers keep
them), looked up without a host sync: each token gathers from all three tables (clamped indices)
and keeps the row of its own feature.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hstu.model.config import HSTUConfig


class TokenEmbeddings(nn.Module):
    """Maps token features (feature index, position, time bucket, token type) to [T, D] inputs."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        D = config.embedding_dim
        self.item_offset = config.num_contextual_features
        self.action_offset = self.item_offset + config.num_items
        self.separate = config.separate_embedding_tables
        if self.separate:
            self.contextual = nn.Embedding(config.num_contextual_features, D)
            self.items = nn.Embedding(config.num_items, D)
            self.actions = nn.Embedding(config.num_actions, D)
        else:
            self.tokens = nn.Embedding(self.action_offset + config.num_actions, D)
        self.positions = nn.Embedding(config.max_seq_len, D)
        self.time_gaps = nn.Embedding(config.num_time_buckets, D)
        self.token_types = nn.Embedding(4, D)
        self.scale = math.sqrt(D)

    @property
    def device(self) -> torch.device:
        return self.positions.weight.device

    def features(self, index: torch.Tensor) -> torch.Tensor:
        """[T] feature indices (the one index space above) -> [T, D] feature embeddings."""
        if not self.separate:
            return self.tokens(index)
        ctx = self.contextual(index.clamp(0, self.contextual.num_embeddings - 1))
        items = self.items((index - self.item_offset).clamp(0, self.items.num_embeddings - 1))
        actions = self.actions((index - self.action_offset).clamp(0, self.actions.num_embeddings - 1))
        col = index.unsqueeze(-1)
        return torch.where(col < self.item_offset, ctx, torch.where(col < self.action_offset, items, actions))

    def forward(self, token_index: torch.Tensor, position: torch.Tensor, time_bucket: torch.Tensor, token_type: torch.Tensor) -> torch.Tensor:
        x = self.features(token_index) * self.scale
        return x + self.positions(position) + self.time_gaps(time_bucket) + self.token_types(token_type)
