"""Shared fixtures: small model/cache configs so the CPU suite stays fast."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
import torch

from hstu.engine import device_launch
from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from tests.configs import TINY


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _device_launch_unprofiled(monkeypatch):
    """Each test's new launchers start unaffected by an earlier test's profiler (the flag is
    process-wide; a launcher that saw one keeps the host launch whatever the flag says)."""
    monkeypatch.setattr(device_launch, "_PROFILED_IN_PROCESS", False)


@pytest.fixture
def tiny_config() -> HSTUConfig:
    return TINY


class HistoryBook:
    """Grows per-user histories and builds requests, so tests can replay returning users."""

    def __init__(self, config: HSTUConfig, seed: int = 0) -> None:
        self.config = config
        self.rng = np.random.default_rng(seed)
        self.histories: dict[int, tuple[list[int], list[int], list[int]]] = {}

    def request(self, user: int, new_events: int, num_candidates: int = 3) -> RankingRequest:
        items, actions, times = self.histories.setdefault(user, ([], [], []))
        for _ in range(new_events):
            items.append(int(self.rng.integers(0, self.config.num_items)))
            actions.append(int(self.rng.integers(0, self.config.num_actions)))
            times.append((times[-1] if times else 1_000) + int(self.rng.integers(0, 5_000)))
        cands = self.rng.integers(0, self.config.num_items, size=num_candidates)
        return RankingRequest.create(user, items, actions, times, cands, config=self.config)

    def random_batches(
        self, seed: int, rounds: int, num_users: int, max_users: int, new_events: tuple[int, int], candidates: tuple[int, int]
    ) -> Iterator[list[RankingRequest]]:
        """`rounds` batches of 1..max_users distinct users out of `num_users`, each growing by
        [low, high) new events and ranking [low, high) candidates; a seeded mix of returning users."""
        rng = np.random.default_rng(seed)
        for _ in range(rounds):
            users = rng.choice(num_users, size=int(rng.integers(1, max_users + 1)), replace=False)
            yield [self.request(int(u), int(rng.integers(*new_events)), int(rng.integers(*candidates))) for u in users]


@pytest.fixture
def book(tiny_config) -> HistoryBook:
    return HistoryBook(tiny_config)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# The exported-ranker tests (tests/engine/test_exported.py, tests/tools/test_aoti_runner.py):
# 16 pages of 8 tokens, so six returning users outgrow the pool and later batches evict, and a
# host tier of 64 KiB (8 chunks of 16 tokens of TINY) that evicted users return from.
EXPORT_CACHE = dict(num_pages=16, page_size=8, chunk_tokens=16, host_capacity_bytes=1 << 16)


def export_sequence(config: HSTUConfig) -> list[list[RankingRequest]]:
    """Seeded batches of 1-3 of six users, growing histories, then one user's shortened history
    with one candidate (a batch of size 1 in every dimension)."""
    book = HistoryBook(config, seed=1)
    batches = list(book.random_batches(seed=2, rounds=8, num_users=6, max_users=3, new_events=(1, 6), candidates=(1, 4)))
    items, actions, times = book.histories[batches[-1][0].user_id]
    shorter = RankingRequest.create(batches[-1][0].user_id, items[:2], actions[:2], times[:2], [1], config=config)
    return batches + [[shorter]]


@pytest.fixture(scope="session")
def aoti_package(tmp_path_factory) -> str:
    """`hstu export` of the tiny model (AOTInductor compile: about a minute on 2 cores)."""
    import json

    from hstu.cli import main

    folder = tmp_path_factory.mktemp("export")
    config = folder / "model.json"
    config.write_text(json.dumps(TINY.to_dict()))
    out = folder / "model.pt2"
    c = EXPORT_CACHE
    sizes = ["--num-pages", c["num_pages"], "--page-size", c["page_size"], "--chunk-tokens", c["chunk_tokens"]]
    argv = ["export", "--out", out, "--config", config, *sizes, "--host-cache-mb", c["host_capacity_bytes"] / 2**20]
    assert main([str(a) for a in argv]) == 0
    return str(out)
