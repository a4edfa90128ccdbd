"""Deterministic synthetic ranking workload: Zipf-popular users whose histories grow by sessions.

Model of the traffic (every draw comes from one numpy Generator seeded by WorkloadConfig.seed, so
the same config and model config always give the same requests, byte for byte):
  - N users; each request picks a user with probability proportional to 1 / (rank + 1)^alpha
    (user id = popularity rank, 0 the most popular).
  - A user seen for the first time starts a history with `initial_tokens` tokens; every later
    request is a session that appends `new_tokens` tokens (2 tokens per event: item + action).
  - A session that would push the history past the max (max_history_tokens, bounded by the
    model's max_seq_len - 1) restarts the user: a brand-new history of `initial_tokens`, which
    the cache must detect and invalidate (shorter history, different tokens).
  - Each request ranks `candidates` items; items and actions are uniform, timestamps never
    decrease within a history.
Token counts include the model's contextual tokens: history tokens = num_contextual + 2 * events.

Invariants: requests come out in arrival order; a user's successive requests either extend its
previous history exactly (same prefix) or are a restart; every request passes RankingRequest.validate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the traffic. Ranges are inclusive (low, high); token ranges must be even."""

    num_requests: int = 200
    num_users: int = 64
    zipf_alpha: float = 1.1
    new_tokens: tuple[int, int] = (8, 256)
    initial_tokens: tuple[int, int] = (8, 2048)
    max_history_tokens: int = 4096
    candidates: tuple[int, int] = (64, 512)
    seed: int = 0
    first_user: int = 0  # user ids are first_user .. first_user + num_users - 1

    def __post_init__(self) -> None:
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {self.num_requests}")
        if self.num_users <= 0:
            raise ValueError(f"num_users must be positive, got {self.num_users}")
        if not 0 <= self.first_user <= FRESH_USER_BASE - self.num_users:
            raise ValueError(
                f"first_user must be in [0, {FRESH_USER_BASE - self.num_users}] (below the fresh ids), got {self.first_user}"
            )
        if self.zipf_alpha < 0:
            raise ValueError(f"zipf_alpha must be >= 0, got {self.zipf_alpha}")
        for name in ("new_tokens", "initial_tokens"):
            lo, hi = getattr(self, name)
            if lo < 2 or hi < lo or lo % 2 or hi % 2:
                raise ValueError(f"{name} must be an even range 2 <= low <= high (2 tokens per event), got {(lo, hi)}")
        lo, hi = self.candidates
        if lo < 1 or hi < lo:
            raise ValueError(f"candidates must be a range 1 <= low <= high, got {(lo, hi)}")

    def history_limit(self, model: HSTUConfig) -> int:
        """Most history tokens a request may carry: the configured max, bounded by the model."""
        return min(self.max_history_tokens, model.max_seq_len - 1)

    def check_model(self, model: HSTUConfig) -> None:
        """Raise ValueError when the smallest session cannot fit under the history limit."""
        limit = self.history_limit(model)
        smallest = model.num_contextual + self.initial_tokens[0]
        if smallest > limit:
            raise ValueError(
                f"history limit is {limit} tokens (max_history_tokens={self.max_history_tokens}, "
                f"max_seq_len={model.max_seq_len}) but the smallest new history has {smallest} tokens"
            )
        if model.num_contextual + self.new_tokens[1] > limit:
            raise ValueError(
                f"a session of {self.new_tokens[1]} tokens cannot fit under the history limit of {limit} tokens"
            )


@dataclass
class _UserState:
    item_ids: np.ndarray
    actions: np.ndarray
    timestamps: np.ndarray


class Workload:
    """Iterable of RankingRequests in arrival order; every iteration replays the same requests."""

    def __init__(self, config: WorkloadConfig, model: HSTUConfig) -> None:
        config.check_model(model)
        self.config = config
        self.model = model
        ranks = np.arange(1, config.num_users + 1, dtype=np.float64)
        weights = ranks**-config.zipf_alpha
        self.popularity = weights / weights.sum()

    def __len__(self) -> int:
        return self.config.num_requests

    def __iter__(self) -> Iterator[RankingRequest]:
        cfg, model = self.config, self.model
        rng = np.random.default_rng(cfg.seed)
        limit = cfg.history_limit(model)
        users: dict[int, _UserState] = {}
        clock = 0
        for _ in range(cfg.num_requests):
            clock += int(rng.integers(1, 2_000))
            user = int(rng.choice(cfg.num_users, p=self.popularity))
            state = users.get(user)
            grow = _events(rng, cfg.new_tokens)
            if state is None or model.history_tokens(state.item_ids.shape[0] + grow) > limit:
                initial_hi = min(cfg.initial_tokens[1], limit - model.num_contextual)
                events = _events(rng, (cfg.initial_tokens[0], initial_hi))
                start = clock if state is None else max(clock, int(state.timestamps[-1]))
                state = _UserState(*_session(rng, model, events, start))
            else:
                items, actions, stamps = _session(rng, model, grow, max(clock, int(state.timestamps[-1])))
                state = _UserState(
                    np.concatenate([state.item_ids, items]),
                    np.concatenate([state.actions, actions]),
                    np.concatenate([state.timestamps, stamps]),
                )
            users[user] = state
            num_candidates = int(rng.integers(cfg.candidates[0], cfg.candidates[1] + 1))
            candidates = rng.integers(0, model.num_items, num_candidates)
            yield RankingRequest.create(
                cfg.first_user + user, state.item_ids, state.actions, state.timestamps, candidates, config=model
            )


def _events(rng: np.random.Generator, token_range: tuple[int, int]) -> int:
    """Event count of a session whose token count is uniform over the even values in the range."""
    return int(rng.integers(token_range[0] // 2, token_range[1] // 2 + 1))


def _session(
    rng: np.random.Generator, model: HSTUConfig, events: int, start: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    items = rng.integers(0, model.num_items, events)
    actions = rng.integers(0, model.num_actions, events)
    stamps = start + np.cumsum(rng.integers(1, 600, events))
    return items, actions, stamps


def is_extension(previous: RankingRequest, current: RankingRequest) -> bool:
    """True when `current`'s history strictly extends `previous`'s (same events, then more)."""
    n = previous.num_events
    return (
        current.num_events > n
        and np.array_equal(current.item_ids[:n], previous.item_ids)
        and np.array_equal(current.actions[:n], previous.actions)
        and np.array_equal(current.timestamps[:n], previous.timestamps)
    )


def count_restarts(requests: Iterable[RankingRequest]) -> int:
    """Requests whose history does not extend the same user's previous history."""
    last: dict[int, RankingRequest] = {}
    restarts = 0
    for r in requests:
        prev = last.get(r.user_id)
        if prev is not None and not is_extension(prev, r):
            restarts += 1
        last[r.user_id] = r
    return restarts


def distinct_user_batches(
    requests: Iterable[RankingRequest], max_batch: int, window: int | None = None
) -> Iterator[list[RankingRequest]]:
    """Batches of up to max_batch distinct users, like a server queue; each user's order is kept.

    Each batch takes, in arrival order, the first request of every user not yet in the batch among
    the oldest `window` pending requests (default 4 * max_batch). A request is skipped only when
    an earlier request of its user is in the batch, so a user's requests run one after the other.
    """
    if max_batch <= 0:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    window = 4 * max_batch if window is None else window
    if window < max_batch:
        raise ValueError(f"window {window} must be >= max_batch {max_batch}")
    pending: list[RankingRequest] = []
    source = iter(requests)
    exhausted = False
    while True:
        while not exhausted and len(pending) < window:
            nxt = next(source, None)
            if nxt is None:
                exhausted = True
            else:
                pending.append(nxt)
        if not pending:
            return
        batch: list[RankingRequest] = []
        users: set[int] = set()
        rest: list[RankingRequest] = []
        for r in pending:
            if len(batch) < max_batch and r.user_id not in users:
                batch.append(r)
                users.add(r.user_id)
            else:
                rest.append(r)
        pending = rest
        yield batch


FRESH_USER_BASE = 1 << 40
"""Never-reused user ids start here: above every workload user, so they are never in a cache."""


class FreshUserIds:
    """Never-reused user ids, so every request given one starts from an empty cache entry."""

    def __init__(self, start: int = FRESH_USER_BASE) -> None:
        self._next = start

    def take(self, count: int) -> list[int]:
        """`count` ids no earlier call returned."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        ids = list(range(self._next, self._next + count))
        self._next += count
        return ids


def as_users(requests: list[RankingRequest], user_ids: list[int]) -> list[RankingRequest]:
    """The same requests (history, contextual features, candidates) under other user ids, still
    validated (RankingRequest.for_user)."""
    if len(requests) != len(user_ids):
        raise ValueError(f"{len(requests)} requests but {len(user_ids)} user ids")
    return [r.for_user(u) for r, u in zip(requests, user_ids)]
