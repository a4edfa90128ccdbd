"""Shared pieces of the serving tests: a tiny model, a small page pool, an in-process client."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx
import numpy as np
import pytest

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.ranking import InferenceRankingGR
from hstu.serving.app import create_app
from hstu.serving.settings import ServerSettings

TINY = HSTUConfig(
    num_items=1000,
    num_actions=4,
    num_contextual=2,
    num_contextual_features=50,
    embedding_dim=32,
    num_layers=2,
    num_heads=2,
    head_dim_qk=16,
    head_dim_v=16,
    max_seq_len=256,
    num_time_buckets=16,
    num_tasks=3,
    mlp_hidden=32,
    seed=3,
)
TASKS = ("click", "like", "share")
TIMELINE_EVENTS = 126  # the most a TINY history can hold: (256 - 1 - 2) // 2


def tiny_settings(**overrides) -> ServerSettings:
    """64 pages of 8 tokens (512 tokens) on the device tier, 16-token host chunks."""
    base = dict(
        model_config=TINY,
        page_size=8,
        num_pages=64,
        chunk_tokens=16,
        host_cache_bytes=1 << 20,
        max_batch_size=8,
        max_wait_ms=2.0,
        max_candidates=64,
        task_names=TASKS,
    )
    base.update(overrides)
    return ServerSettings(**base)


def eviction_workload(first_user: int, **overrides) -> tuple[ServerSettings, list[dict]]:
    """20 users x 10 growing requests on 64 pages (512 tokens) and 40 host chunks: both tiers evict.

    Payloads are in round order (every user's k-th request before anyone's k+1-th); the longest
    history is 64 events (130 tokens, 17 pages), so a batch of 8 users needs more pages than exist.
    """
    chunk_bytes = tiny_settings().kv_config(TINY).chunk_bytes
    settings = tiny_settings(num_pages=64, host_cache_bytes=40 * chunk_bytes, max_batch_size=8, **overrides)
    users = [Timeline(first_user + u) for u in range(20)]
    payloads = [
        users[u].payload(6 + 6 * step + u % 5, num_candidates=1 + (u + step) % 6)
        for step in range(10)
        for u in range(20)
    ]
    return settings, payloads


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def reference() -> InferenceRankingGR:
    """The in-process model without a cache (same seeded weights as the server's)."""
    return InferenceRankingGR(TINY, "cpu")


class Timeline:
    """A user's whole (deterministic) event stream; requests send growing prefixes of it."""

    def __init__(self, user_id: int, events: int = TIMELINE_EVENTS) -> None:
        rng = np.random.default_rng(1000 + user_id)
        self.user_id = user_id
        self.items = rng.integers(0, TINY.num_items, events).tolist()
        self.actions = rng.integers(0, TINY.num_actions, events).tolist()
        self.timestamps = np.cumsum(rng.integers(0, 500, events)).tolist()
        self._rng = rng

    def payload(self, events: int, num_candidates: int = 5, **extra) -> dict:
        history = [
            {"item_id": i, "action": a, "timestamp": t}
            for i, a, t in zip(self.items[:events], self.actions[:events], self.timestamps[:events])
        ]
        candidates = self._rng.integers(0, TINY.num_items, num_candidates).tolist()
        return {"user_id": self.user_id, "history": history, "candidates": candidates, **extra}


def reference_scores(model: InferenceRankingGR, payload: dict) -> np.ndarray:
    """[M, num_tasks] probabilities of the no-cache model for a request payload."""
    h = payload["history"]
    request = RankingRequest.create(
        payload["user_id"],
        [e["item_id"] for e in h],
        [e["action"] for e in h],
        [e["timestamp"] for e in h],
        payload["candidates"],
        contextual=payload.get("contextual"),
        config=TINY,
    )
    logits = model.forward_no_cache([request])
    return 1.0 / (1.0 + np.exp(-logits.double().cpu().numpy()))


def response_scores(body: dict) -> np.ndarray:
    return np.array([[c["scores"][t] for t in TASKS] for c in body["scores"]], dtype=np.float64)


def matches_reference(model: InferenceRankingGR, payload: dict, body: dict, rtol: float = 1e-5) -> bool:
    """Server scores equal the no-cache model's within relative error `rtol` (fp32 on CPU: 1e-5)."""
    got, want = response_scores(body), reference_scores(model, payload)
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= rtol * np.abs(want)))


async def wait_ready(client: httpx.AsyncClient, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (await client.get("/v2/health/ready")).status_code != 200:
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"server not ready after {timeout_s}s")
        await asyncio.sleep(0.01)


@asynccontextmanager
async def serving(settings: ServerSettings | None = None, ready: bool = True) -> AsyncIterator[tuple]:
    """(app, client): the app's lifespan running, an ASGI client on it, optionally ready."""
    app = create_app(settings or tiny_settings())
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=60.0) as client:
            if ready:
                await wait_ready(client)
            yield app, client


async def post_per_user_in_order(
    client: httpx.AsyncClient, payloads: list[dict], concurrency: int
) -> list[httpx.Response]:
    """POST every payload to /v1/rank, at most `concurrency` in flight; one user's payloads go one
    after another in list order (each extends the previous history), different users concurrently."""
    by_user: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(payloads):
        by_user[p["user_id"]].append(i)
    responses: list[httpx.Response | None] = [None] * len(payloads)
    gate = asyncio.Semaphore(concurrency)

    async def chain(indices: list[int]) -> None:
        for i in indices:
            async with gate:
                responses[i] = await client.post("/v1/rank", json=payloads[i])

    await asyncio.gather(*(chain(indices) for indices in by_user.values()))
    return responses
