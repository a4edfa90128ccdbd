"""Preprocessor: turns requests into the jagged token batch the HSTU block consumes.

Only tokens that are not cached are built: for each user the rows are its new history tokens
(positions cached_len .. history_len-1), then its candidates. The index arithmetic is one C++ pass
on the host (csrc/batch_features.cpp; one transfer for all features); the embedding lookup runs on
the model's device.
"""

from __future__ import annotations

import torch

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.embeddings import TokenEmbeddings
from hstu.ops._build import load_extension
from hstu.ops.kvcache.layout import JaggedLayout


_ext = load_extension()


def batch_features(
    requests: list[RankingRequest],
    cached_lens: list[int],
    config: HSTUConfig,
    item_offset: int,
    action_offset: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[4, T] int64 (table index, position, time bucket, type) of the batch's rows in JaggedLayout
    order: per user its history tokens cached_len.. then its candidates.

    One C++ pass (csrc/batch_features.cpp) reading only the events the new tokens touch. `out`
    [F >= 4, R >= T] (a CUDA-graph bucket's staging) receives them, zero past T, and in its row 4,
    when it has one, the candidate rows; returns the tensor written."""
    return _ext.batch_features(
        [r.item_ids for r in requests],
        [r.actions for r in requests],
        [r.timestamps for r in requests],
        [r.contextual for r in requests],
        [r.candidates for r in requests],
        [int(c) for c in cached_lens],
        config.num_contextual,
        config.num_time_buckets,
        item_offset,
        action_offset,
        out,
    )


class Preprocessor(torch.nn.Module):
    """Requests + cached lengths -> (jagged inputs [T, D], layout)."""

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = TokenEmbeddings(config)

    def forward(self, requests: list[RankingRequest], cached_lens: list[int]) -> tuple[torch.Tensor, JaggedLayout]:
        hist = [r.history_tokens(self.config) for r in requests]
        layout = JaggedLayout.build(hist, cached_lens, [r.candidates.shape[0] for r in requests])
        return self.embed(requests, cached_lens), layout

    def features(
        self, requests: list[RankingRequest], cached_lens: list[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[4, T] int64 features (batch_features) of the rows JaggedLayout.build gives (into `out`)."""
        emb = self.embeddings
        return batch_features(requests, cached_lens, self.config, emb.item_offset, emb.action_offset, out)

    def embed(self, requests: list[RankingRequest], cached_lens: list[int]) -> torch.Tensor:
        """Inputs [T, D] of the rows JaggedLayout.build gives for these cached lengths (new history
        tokens, then candidates, user by user), for callers that build the layout themselves."""
        emb = self.embeddings
        f = self.features(requests, cached_lens)
        device = emb.device
        if device.type == "cuda":
            f = f.pin_memory().to(device, non_blocking=True)
        return emb(f[0], f[1], f[2], f[3])
