"""Synthetic workload: deterministic from the seed, every range respected, restarts are new histories."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from hstu.model.config import HSTUConfig
from hstu.scripts.workload import (
    FRESH_USER_BASE,
    FreshUserIds,
    Workload,
    WorkloadConfig,
    as_users,
    count_restarts,
    distinct_user_batches,
    is_extension,
)
from tests.configs import WORKLOAD_MODEL

MODEL = WORKLOAD_MODEL
CONFIG = WorkloadConfig(
    num_requests=300, num_users=20, new_tokens=(8, 64), initial_tokens=(8, 128),
    max_history_tokens=400, candidates=(4, 40), seed=3,
)


def _same(a, b) -> bool:
    return a.user_id == b.user_id and all(
        np.array_equal(getattr(a, f), getattr(b, f)) for f in ("item_ids", "actions", "timestamps", "candidates", "contextual")
    )


def test_same_seed_gives_identical_requests_on_every_iteration():
    workload = Workload(CONFIG, MODEL)
    first, second = list(workload), list(Workload(CONFIG, MODEL))
    assert len(first) == CONFIG.num_requests
    assert all(_same(a, b) for a, b in zip(first, second))
    assert all(_same(a, b) for a, b in zip(first, list(workload)))


def test_other_seed_gives_other_requests():
    other = Workload(WorkloadConfig(**{**CONFIG.__dict__, "seed": 4}), MODEL)
    assert not all(_same(a, b) for a, b in zip(Workload(CONFIG, MODEL), other))


def test_first_user_shifts_the_user_ids_and_nothing_else():
    """Runs against one server with their own users (e.g. a load generator's runs) keep apart."""
    shifted = list(Workload(WorkloadConfig(**{**CONFIG.__dict__, "first_user": 1000}), MODEL))
    for a, b in zip(Workload(CONFIG, MODEL), shifted):
        assert b.user_id == a.user_id + 1000
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("item_ids", "actions", "timestamps", "candidates"))
    with pytest.raises(ValueError, match="first_user must be in"):
        WorkloadConfig(**{**CONFIG.__dict__, "first_user": FRESH_USER_BASE - 1})


def test_sessions_candidates_and_histories_stay_in_their_ranges():
    last = {}
    C = MODEL.num_contextual
    restarts = 0
    for r in Workload(CONFIG, MODEL):
        tokens = r.history_tokens(MODEL)
        assert tokens <= CONFIG.max_history_tokens
        assert CONFIG.candidates[0] <= r.candidates.shape[0] <= CONFIG.candidates[1]
        assert np.all(np.diff(r.timestamps) >= 0)
        prev = last.get(r.user_id)
        if prev is not None and is_extension(prev, r):
            added = tokens - prev.history_tokens(MODEL)
            assert CONFIG.new_tokens[0] <= added <= CONFIG.new_tokens[1]
            assert r.timestamps[prev.num_events] >= prev.timestamps[-1]
        else:
            assert CONFIG.initial_tokens[0] <= tokens - C <= CONFIG.initial_tokens[1]
            restarts += prev is not None
        last[r.user_id] = r
    assert restarts > 0, "the config is chosen so that popular users outgrow the history limit"
    assert restarts == count_restarts(Workload(CONFIG, MODEL))


def test_a_restart_happens_only_when_the_next_session_could_overflow():
    last = {}
    for r in Workload(CONFIG, MODEL):
        prev = last.get(r.user_id)
        if prev is not None and not is_extension(prev, r):
            assert prev.history_tokens(MODEL) + CONFIG.new_tokens[1] > CONFIG.max_history_tokens
        last[r.user_id] = r


def test_popularity_is_zipf_ordered():
    counts = Counter(r.user_id for r in Workload(CONFIG, MODEL))
    assert counts[0] == max(counts.values())
    assert counts[0] > 3 * counts.get(CONFIG.num_users - 1, 0)


def test_history_limit_is_bounded_by_the_model():
    model = HSTUConfig(**{**MODEL.to_dict(), "max_seq_len": 200})
    assert CONFIG.history_limit(model) == 199
    assert max(r.history_tokens(model) for r in Workload(CONFIG, model)) <= 199


@pytest.mark.parametrize(
    "overrides",
    [{"new_tokens": (7, 64)}, {"initial_tokens": (64, 8)}, {"candidates": (0, 4)}, {"num_users": 0}],
)
def test_invalid_ranges_are_rejected(overrides):
    with pytest.raises(ValueError):
        WorkloadConfig(**{**CONFIG.__dict__, **overrides})


def test_a_limit_below_the_smallest_history_is_rejected():
    with pytest.raises(ValueError, match="history limit"):
        Workload(WorkloadConfig(initial_tokens=(300, 400), max_history_tokens=256), MODEL)


def test_batches_hold_distinct_users_and_keep_each_users_order():
    requests = list(Workload(CONFIG, MODEL))
    batches = list(distinct_user_batches(requests, 6))
    assert sum(len(b) for b in batches) == len(requests)
    for b in batches:
        assert 1 <= len(b) <= 6
        assert len({r.user_id for r in b}) == len(b)
    flat = [r for b in batches for r in b]
    for user in {r.user_id for r in requests}:
        assert [id(r) for r in requests if r.user_id == user] == [id(r) for r in flat if r.user_id == user]


def test_fresh_user_ids_are_never_reused_and_above_every_workload_user():
    ids = FreshUserIds()
    first, second = ids.take(3), ids.take(2)
    assert len(set(first + second)) == 5
    assert min(first) >= FRESH_USER_BASE > CONFIG.num_users
    assert ids.take(0) == []


def test_as_users_keeps_the_request_and_changes_only_the_user():
    requests = list(Workload(CONFIG, MODEL))[:2]
    moved = as_users(requests, [101, 102])
    assert [r.user_id for r in moved] == [101, 102]
    for a, b in zip(requests, moved):
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("item_ids", "actions", "timestamps", "candidates"))
    with pytest.raises(ValueError, match="2 requests but 1 user ids"):
        as_users(requests, [1])
