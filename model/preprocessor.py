"""Preprocessor: turns requests into the jagged token batch the HSTU block consumes.

Only tokens that are not cached are built: for each user the rows are its new history tokens
(positions cached_len .. history_len-1), then its candidates. All index arithmetic is numpy on the
host (one transfer per feature); the embedding lookup runs on the model's device.
"""

from __future__ import annotations

import numpy as np
import torch

from hstu.model.batch import TOKEN_ACTION, TOKEN_CANDIDATE, TOKEN_CONTEXTUAL, TOKEN_ITEM, RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.embeddings import TokenEmbeddings
from hstu.ops.kvcache.layout import JaggedLayout


def _time_buckets(gaps: np.ndarray, num_buckets: int) -> np.ndarray:
    """Bucket of an event's gap to the previous event: 1 + floor(log2(1 + gap)), capped."""
    return 1 + np.minimum(np.floor(np.log2(1.0 + gaps)).astype(np.int64), num_buckets - 3)


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def batch_features(
    requests: list[RankingRequest], cached_lens: list[int], config: HSTUConfig, item_offset: int, action_offset: int
) -> np.ndarray:
    """[4, T] int64 (table index, position, time bucket, type) of the batch's rows in JaggedLayout
    order: per user its history tokens cached_len.. then its candidates.

    Vectorised over the batch: per user only slices of the events the new tokens touch are taken
    (never the whole history), then one pass of array arithmetic builds every row."""
    C, nb = config.num_contextual, config.num_time_buckets
    B = len(requests)
    start = np.asarray(cached_lens, dtype=np.int64)
    end = np.asarray([r.history_tokens(config) for r in requests], dtype=np.int64)
    n_cand = np.asarray([r.candidates.shape[0] for r in requests], dtype=np.int64)
    n_hist = end - start
    # Events the new tokens touch, per user: [lo, hi); the time gap also reads event lo - 1.
    lo = np.maximum(start - C, 0) // 2
    hi = np.maximum(end - C + 1, 0) // 2
    first = np.maximum(lo - 1, 0)
    items, actions, stamps, seg = [], [], [], [0]
    for r, f, h in zip(requests, first.tolist(), hi.tolist()):
        items.append(r.item_ids[f:h])
        actions.append(r.actions[f:h])
        stamps.append(r.timestamps[f:h])
        seg.append(seg[-1] + (h - f))
    items, actions, stamps = _concat(items), _concat(actions), _concat(stamps)
    contextual = _concat([r.contextual for r in requests])

    user = np.repeat(np.arange(B), n_hist)
    hist_off = np.concatenate([[0], np.cumsum(n_hist)])
    local = np.arange(int(hist_off[-1])) - hist_off[user]
    pos = start[user] + local
    is_ctx = pos < C
    is_action = ~is_ctx & ((pos - C) % 2 == 1)
    event = np.maximum(pos - C, 0) // 2  # event of an item/action token (0 for contextual ones)
    at = np.asarray(seg[:-1], dtype=np.int64)[user] + np.clip(event - first[user], 0, None)
    at = np.minimum(at, max(items.shape[0] - 1, 0))
    if items.shape[0]:
        prev = np.where(event > first[user], at - 1, at)
        table = np.where(is_action, action_offset + actions[at], item_offset + items[at])
        time = _time_buckets(stamps[at] - stamps[prev], nb)
    else:
        table, time = np.zeros_like(pos), np.zeros_like(pos)
    if C:
        table = np.where(is_ctx, contextual[user * C + np.minimum(pos, C - 1)], table)
    time = np.where(is_ctx, 0, time)
    ttype = np.where(is_ctx, TOKEN_CONTEXTUAL, np.where(is_action, TOKEN_ACTION, TOKEN_ITEM))

    rows = n_hist + n_cand
    q_off = np.concatenate([[0], np.cumsum(rows)])
    out = np.empty((4, int(q_off[-1])), dtype=np.int64)
    hist_dest = q_off[:-1][user] + local
    out[:, hist_dest] = np.stack([table, pos, time, ttype])
    cand_user = np.repeat(np.arange(B), n_cand)
    cand_off = np.concatenate([[0], np.cumsum(n_cand)])
    cand_dest = q_off[:-1][cand_user] + n_hist[cand_user] + np.arange(int(cand_off[-1])) - cand_off[cand_user]
    out[0, cand_dest] = item_offset + _concat([r.candidates for r in requests])
    out[1, cand_dest] = end[cand_user]
    out[2, cand_dest] = nb - 1
    out[3, cand_dest] = TOKEN_CANDIDATE
    return out


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

    def features(self, requests: list[RankingRequest], cached_lens: list[int]) -> np.ndarray:
        """[4, T] int64 features (batch_features) of the rows JaggedLayout.build gives."""
        emb = self.embeddings
        return batch_features(requests, cached_lens, self.config, emb.item_offset, emb.action_offset)

    def embed(self, requests: list[RankingRequest], cached_lens: list[int]) -> torch.Tensor:
        """Inputs [T, D] of the rows JaggedLayout.build gives for these cached lengths (new history
        tokens, then candidates, user by user), for callers that build the layout themselves."""
        emb = self.embeddings
        f = torch.from_numpy(self.features(requests, cached_lens))
        device = emb.device
        if device.type == "cuda":
            f = f.pin_memory().to(device, non_blocking=True)
        return emb(f[0], f[1], f[2], f[3])
