"""Shared pieces of the serving tests: a tiny model, a small page pool, an in-process client."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import threading
import time
from collections import defaultdict
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Iterator

import httpx
import numpy as np
import pytest

from hstu.model.batch import RankingRequest
from hstu.model.ranking import InferenceRankingGR
from hstu.scripts.loadtest import wait_until_ready
from hstu.serving.app import create_app
from hstu.serving.runtime import ServingRuntime
from hstu.serving.server import DrainingServer, draining_server
from hstu.serving.settings import ServerSettings
from tests.configs import SERVING_TINY

TINY = SERVING_TINY
TASKS = ("click", "like", "share")
TIMELINE_EVENTS = 126  # the most a TINY history can hold: (256 - 1 - 2) // 2


# Below the kernel's ephemeral range and above Ray's worker ports (10002-19999): a port the OS hands
# out for bind(0) or an outgoing connection (Ray's processes make many while a server starts) could
# be taken between picking it and the server binding it, seconds later.
_PICKED_PORTS = (20_000, 32_768)
_handed_out: set[int] = set()  # never the same port twice in one test process (a server may not have bound it yet)


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _PICKED_PORTS[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a server started next), outside the ranges the
    OS and Ray allocate from, so nothing else takes it before the server binds it."""
    low, high = _PICKED_PORTS[0], min(_PICKED_PORTS[1], _ephemeral_floor())
    for port in random.sample(range(low, high), min(64, max(high - low, 0))):
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # no such range on this machine: any free port
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_serve_argv(tmp_path, port: int, *flags: str) -> list[str]:
    """`hstu serve` on the CPU at TINY's shapes (its config written under tmp_path) on 127.0.0.1:port,
    512 pages of 8 tokens, 16-token host chunks, TASKS, then `flags`."""
    config = tmp_path / "model.json"
    config.write_text(json.dumps(TINY.to_dict()))
    return [sys.executable, "-m", "hstu.cli", "serve", "--device", "cpu", "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--num-pages", "512", "--page-size", "8", "--chunk-tokens", "16",
            "--task-names", ",".join(TASKS), *flags]


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


@contextmanager
def live_server(settings: ServerSettings | None = None) -> Iterator[tuple[object, DrainingServer, str]]:
    """(app, server, base URL): the app under a real DrainingServer (uvicorn) on loopback, in a
    thread, ready; leaving the block asks it to exit and joins the thread."""
    app = create_app(settings or tiny_settings())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = draining_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        wait_until_ready(url, thread.is_alive, timeout_s=60)
        yield app, server, url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"


class SlowModel:
    """Patches ServingRuntime._rank: each batch takes at least `delay_s`; records the users ranked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
        self.delay_s = delay_s
        self.users: list[int] = []
        rank = ServingRuntime._rank
        model = self

        def slow_rank(runtime, requests):
            model.users.extend(r.user_id for r in requests)
            time.sleep(model.delay_s)
            return rank(runtime, requests)

        monkeypatch.setattr(ServingRuntime, "_rank", slow_rank)


def assert_error_shape(response: httpx.Response, status: int, kind: str, request_id: str | None = None) -> dict:
    """`response` is `status` with the one error body {error, detail, request_id}."""
    assert response.status_code == status, response.text
    body = response.json()
    assert {"error", "detail", "request_id"} <= set(body), body
    assert body["error"] == kind and isinstance(body["detail"], str) and body["detail"], body
    assert body["request_id"] == request_id, body
    return body


async def http_request(
    url: str, method: str, path: str, body: dict | None = None, timeout_s: float = 30.0
) -> tuple[int, dict[str, str], dict]:
    """One HTTP/1.1 exchange on its own connection: (status, lower-cased headers, JSON body).

    For bursts: httpx's async pool spends seconds of client CPU on 500 concurrent connections."""
    host, port = url.removeprefix("http://").split(":")
    payload = b"" if body is None else json.dumps(body).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    try:
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload
        )
        data = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    head, _, content = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return int(status_line.split()[1]), headers, json.loads(content)
