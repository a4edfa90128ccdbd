"""Batch features: the vectorised rows equal a per-token reading of the definition."""

from __future__ import annotations

import math

import numpy as np

from hstu.model.batch import TOKEN_ACTION, TOKEN_CANDIDATE, TOKEN_CONTEXTUAL, TOKEN_ITEM, RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.preprocessor import batch_features

ITEM_OFF, ACTION_OFF = 1_000, 101_000


def _reference(req: RankingRequest, cfg: HSTUConfig, start: int) -> list[tuple[int, int, int, int]]:
    """Row by row: contextual tokens, then item and action token per event, then candidates."""
    C, nb, rows = cfg.num_contextual, cfg.num_time_buckets, []
    for pos in range(start, req.history_tokens(cfg)):
        if pos < C:
            rows.append((int(req.contextual[pos]), pos, 0, TOKEN_CONTEXTUAL))
            continue
        e, is_action = divmod(pos - C, 2)
        gap = int(req.timestamps[e] - req.timestamps[e - 1]) if e else 0
        bucket = 1 + min(math.floor(math.log2(1.0 + gap)), nb - 3)
        value = ACTION_OFF + int(req.actions[e]) if is_action else ITEM_OFF + int(req.item_ids[e])
        rows.append((value, pos, bucket, TOKEN_ACTION if is_action else TOKEN_ITEM))
    end = req.history_tokens(cfg)
    rows += [(ITEM_OFF + int(c), end, nb - 1, TOKEN_CANDIDATE) for c in req.candidates]
    return rows


def test_batch_features_match_the_per_token_definition():
    cfg = HSTUConfig(num_contextual=3, max_seq_len=512)
    rng = np.random.default_rng(0)
    for trial in range(40):
        reqs, cached = [], []
        for u in range(int(rng.integers(1, 6))):
            events = int(rng.integers(0, 40))
            stamps = np.cumsum(rng.integers(0, 10 ** int(rng.integers(1, 12)), events))
            req = RankingRequest.create(
                u, rng.integers(0, cfg.num_items, events), rng.integers(0, cfg.num_actions, events), stamps,
                rng.integers(0, cfg.num_items, int(rng.integers(1, 5))), config=cfg,
            )
            reqs.append(req)
            cached.append(int(rng.integers(0, req.history_tokens(cfg) + 1)))  # up to all cached
        expected = [row for r, c in zip(reqs, cached) for row in _reference(r, cfg, c)]
        got = batch_features(reqs, cached, cfg, ITEM_OFF, ACTION_OFF)
        assert [tuple(col) for col in got.T.tolist()] == expected, f"trial {trial}"
