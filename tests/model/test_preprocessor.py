"""Batch features: the C++ pass equals a per-token reading of the definition, into any buffer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

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


def _requests(cfg: HSTUConfig, rng: np.random.Generator, users: int, events: int) -> list[RankingRequest]:
    return [
        RankingRequest.create(
            u, rng.integers(0, cfg.num_items, events), rng.integers(0, cfg.num_actions, events),
            np.cumsum(rng.integers(0, 1000, events)), rng.integers(0, cfg.num_items, 3), config=cfg,
        )
        for u in range(users)
    ]


def test_time_buckets_follow_the_definition_for_gaps_up_to_2_to_the_62():
    cfg = HSTUConfig(num_contextual=1, max_seq_len=512)
    gaps = [0, 1, 2, 3, 7, 8, 2**30 - 1, 2**30, 2**47 - 1, 2**53 - 1, 2**53, 2**61, 2**62]
    req = RankingRequest.create(
        0, np.zeros(len(gaps) + 1, np.int64), np.zeros(len(gaps) + 1, np.int64), np.cumsum([0, *gaps]), [1], config=cfg
    )
    got = batch_features([req], [0], cfg, ITEM_OFF, ACTION_OFF)
    assert [tuple(col) for col in got.T.tolist()] == _reference(req, cfg, 0)


def test_time_buckets_follow_the_definition_on_both_sides_of_every_power_of_two():
    """1 + gap just below, at and just above 2^k, k = 1..62: the C++ pass reads the highest set bit below
    2^40 and takes log2 of doubles above; both must give floor(log2(1.0 + gap)) of the definition (enough
    buckets that the cap masks nothing)."""
    cfg = HSTUConfig(num_contextual=1, max_seq_len=512, num_time_buckets=70)
    gaps = [2**k - 1 + d for k in range(1, 63) for d in (-1, 0, 1)]
    reqs = [RankingRequest.create(u, [0, 0], [0, 0], [0, gap], [1], config=cfg) for u, gap in enumerate(gaps)]
    got = batch_features(reqs, [0] * len(reqs), cfg, ITEM_OFF, ACTION_OFF)
    assert [tuple(col) for col in got.T.tolist()] == [row for r in reqs for row in _reference(r, cfg, 0)]


def test_features_fill_a_staging_buffer_with_candidate_rows_and_zero_padding():
    cfg = HSTUConfig(num_contextual=2, max_seq_len=512)
    reqs = _requests(cfg, np.random.default_rng(1), 3, 5)
    cached = [0, 4, 12]
    expected = batch_features(reqs, cached, cfg, ITEM_OFF, ACTION_OFF)
    T = expected.shape[1]
    out = torch.full((5, T + 7), 9, dtype=torch.int64)  # a previous, longer batch's leftovers
    assert batch_features(reqs, cached, cfg, ITEM_OFF, ACTION_OFF, out) is out
    assert torch.equal(out[:4, :T], expected) and not out[:4, T:].any()
    candidate_rows = torch.nonzero(expected[3] == TOKEN_CANDIDATE).flatten()
    M = candidate_rows.shape[0]
    assert torch.equal(out[4, :M], candidate_rows) and not out[4, M:].any()
    assert batch_features([], [], cfg, ITEM_OFF, ACTION_OFF).shape == (4, 0)


def test_features_name_the_offending_value():
    cfg = HSTUConfig(num_contextual=2, max_seq_len=512)
    reqs = _requests(cfg, np.random.default_rng(2), 2, 5)
    with pytest.raises(ValueError, match="a batch of 30 rows does not fit a buffer of 29"):
        batch_features(reqs, [0, 0], cfg, ITEM_OFF, ACTION_OFF, torch.zeros((4, 29), dtype=torch.int64))
    with pytest.raises(ValueError, match="request 1 cached length 13 outside \\[0, 12\\]"):
        batch_features(reqs, [0, 13], cfg, ITEM_OFF, ACTION_OFF)
    with pytest.raises(ValueError, match="at least 4 feature rows, got 3"):
        batch_features(reqs, [0, 0], cfg, ITEM_OFF, ACTION_OFF, torch.zeros((3, 40), dtype=torch.int64))
    with pytest.raises(ValueError, match="contiguous int64 CPU tensor"):
        batch_features(reqs, [0, 0], cfg, ITEM_OFF, ACTION_OFF, torch.zeros((4, 40), dtype=torch.int32))
    with pytest.raises(ValueError, match="every per-user list needs 2 entries"):
        batch_features(reqs, [0], cfg, ITEM_OFF, ACTION_OFF)
