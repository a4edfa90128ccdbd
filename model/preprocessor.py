"""Preprocessor: turns requests into the jagged token batch the HSTU block consumes.

Only tokens that are not cached are built: for each user the rows are its new history tokens
(positions cached_len .. history_len-1), then its candidates. All index arithmetic is numpy on the
host (one transfer per feature); the embedding lookup runs on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hstu.model.batch import TOKEN_ACTION, TOKEN_CANDIDATE, TOKEN_CONTEXTUAL, TOKEN_ITEM, RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.embeddings import TokenEmbeddings


@dataclass
class JaggedLayout:
    """Row layout of one batch. q_pos = absolute position of history rows, -1 for candidates."""

    history_lens: list[int]
    cached_lens: list[int]
    num_candidates: list[int]
    q_offsets: np.ndarray
    q_batch: np.ndarray
    q_local: np.ndarray
    q_pos: np.ndarray
    history_rows: np.ndarray
    candidate_rows: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.history_lens)

    @property
    def num_rows(self) -> int:
        return int(self.q_offsets[-1])

    @property
    def max_q(self) -> int:
        return int(np.diff(self.q_offsets).max()) if self.batch_size else 0

    @classmethod
    def build(cls, history_lens: list[int], cached_lens: list[int], num_candidates: list[int]) -> "JaggedLayout":
        new = np.asarray(history_lens, dtype=np.int64) - np.asarray(cached_lens, dtype=np.int64)
        cand = np.asarray(num_candidates, dtype=np.int64)
        rows = new + cand
        offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        q_batch = np.repeat(np.arange(len(rows)), rows)
        q_local = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], rows)
        is_hist = q_local < np.repeat(new, rows)
        q_pos = np.where(is_hist, q_local + np.repeat(np.asarray(cached_lens, dtype=np.int64), rows), -1)
        return cls(
            history_lens=list(history_lens),
            cached_lens=list(cached_lens),
            num_candidates=list(num_candidates),
            q_offsets=offsets,
            q_batch=q_batch,
            q_local=q_local,
            q_pos=q_pos,
            history_rows=np.flatnonzero(is_hist),
            candidate_rows=np.flatnonzero(~is_hist),
        )


def _time_buckets(timestamps: np.ndarray, num_buckets: int) -> np.ndarray:
    """Bucket of each event's gap to the previous event: 1 + floor(log2(1 + gap)), capped."""
    gaps = np.diff(timestamps, prepend=timestamps[:1]) if timestamps.size else timestamps
    return 1 + np.minimum(np.floor(np.log2(1.0 + gaps)).astype(np.int64), num_buckets - 3)


def token_features(req: RankingRequest, config: HSTUConfig, start: int, item_offset: int, action_offset: int) -> np.ndarray:
    """[4, n] int64 (table index, position, time bucket, type) for history tokens start.. and candidates."""
    C, end = config.num_contextual, req.history_tokens(config)
    pos = np.arange(start, end, dtype=np.int64)
    is_ctx = pos < C
    event = np.maximum(pos - C, 0) // 2
    is_action = (~is_ctx) & ((pos - C) % 2 == 1)
    ev = np.minimum(event, max(req.num_events - 1, 0))
    item_idx = item_offset + (req.item_ids[ev] if req.num_events else np.zeros_like(ev))
    act_idx = action_offset + (req.actions[ev] if req.num_events else np.zeros_like(ev))
    ctx_idx = req.contextual[np.minimum(pos, C - 1)] if C else np.zeros_like(pos)
    table = np.where(is_ctx, ctx_idx, np.where(is_action, act_idx, item_idx))
    buckets = _time_buckets(req.timestamps, config.num_time_buckets) if req.num_events else np.zeros(1, np.int64)
    time = np.where(is_ctx, 0, buckets[ev] if req.num_events else 0)
    ttype = np.where(is_ctx, TOKEN_CONTEXTUAL, np.where(is_action, TOKEN_ACTION, TOKEN_ITEM))
    M = req.candidates.shape[0]
    cand = np.stack(
        [
            item_offset + req.candidates,
            np.full(M, end, dtype=np.int64),
            np.full(M, config.num_time_buckets - 1, dtype=np.int64),
            np.full(M, TOKEN_CANDIDATE, dtype=np.int64),
        ]
    )
    return np.concatenate([np.stack([table, pos, time, ttype]), cand], axis=1)


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

    def embed(self, requests: list[RankingRequest], cached_lens: list[int]) -> torch.Tensor:
        """Inputs [T, D] of the rows JaggedLayout.build gives for these cached lengths (new history
        tokens, then candidates, user by user), for callers that build the layout themselves."""
        cfg, emb = self.config, self.embeddings
        feats = np.concatenate(
            [token_features(r, cfg, c, emb.item_offset, emb.action_offset) for r, c in zip(requests, cached_lens)], axis=1
        )
        f = torch.from_numpy(feats)
        device = emb.device
        if device.type == "cuda":
            f = f.pin_memory().to(device, non_blocking=True)
        return emb(f[0], f[1], f[2], f[3])
