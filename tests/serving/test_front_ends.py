"""`hstu serve --engine-process --front-ends 2`: two HTTP front ends on one port, one engine.

The oracle: every answer, from whichever front end took the connection, equals the no-cache model's
(users repeat, so cache hits happen); /metrics shows both front ends and the engine; SIGTERM stops
every process; losing the further front end leaves the server answering; and when the primary
dies, the engine exits too (and so does a further front end: test_front_end_exits_with_its_engine)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import pytest

from hstu.scripts.loadtest import wait_until_ready
from hstu.serving.settings import ServerSettings

from .conftest import Timeline, free_port, matches_reference, tiny_serve_argv

START_S = 240.0  # three processes import torch on a shared 2-core machine


@contextmanager
def _front_ends(tmp_path) -> Iterator[tuple[subprocess.Popen, str, int, int]]:
    """A ready two-front-end server: (its process, base URL, further front end's pid, engine's pid);
    killed with its process group afterwards if still running."""
    port = free_port()
    server = _serve(tmp_path, port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base, lambda: server.poll() is None, timeout_s=START_S,
                         log=lambda: (tmp_path / "serve.log").read_text()[-5000:])
        yield (server, base, *_pids(tmp_path))
    finally:
        try:  # whatever of the group still runs
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _serve(tmp_path, port: int) -> subprocess.Popen:
    argv = tiny_serve_argv(tmp_path, port, "--engine-process", "--front-ends", "2")
    log = open(tmp_path / "serve.log", "w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _pids(tmp_path) -> tuple[int, int]:
    """(further front end, engine) process ids, from the server's log."""
    text = (tmp_path / "serve.log").read_text()
    front = re.search(r"2 front ends on \S+ \(pids \[(\d+)\]", text)
    engine = re.search(r"engine process (\d+) ready", text)
    assert front and engine, text[-3000:]
    return int(front.group(1)), int(engine.group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


async def _post_all(base: str, payloads: list[dict], clients: int = 8) -> list[httpx.Response]:
    """Each user's requests in order; users spread over several clients (connections), so the
    kernel hands connections to both front ends."""
    pools = [httpx.AsyncClient(base_url=base, timeout=60.0) for _ in range(clients)]
    try:
        by_user: dict[int, list[int]] = {}
        for i, p in enumerate(payloads):
            by_user.setdefault(p["user_id"], []).append(i)
        answers: list[httpx.Response | None] = [None] * len(payloads)

        async def run(user_index: int, indices: list[int]) -> None:
            client = pools[user_index % clients]
            for i in indices:
                answers[i] = await client.post("/v1/rank", json=payloads[i])

        await asyncio.gather(*(run(k, v) for k, v in enumerate(by_user.values())))
        return answers
    finally:
        for pool in pools:
            await pool.aclose()


@pytest.mark.timeout(420)
def test_two_front_ends_answer_like_the_no_cache_model_and_stop_together(tmp_path, reference):
    with _front_ends(tmp_path) as (server, base, further, engine):
        timelines = [Timeline(40_000 + u) for u in range(8)]
        payloads = [t.payload(6 + 4 * step, num_candidates=3) for step in range(3) for t in timelines]
        answers = asyncio.run(_post_all(base, payloads))
        assert [a.status_code for a in answers] == [200] * len(payloads), [a.text for a in answers if a.status_code != 200]
        assert all(matches_reference(reference, p, a.json()) for p, a in zip(payloads, answers))
        assert sum(a.json()["cached_tokens"] > 0 for a in answers[8:]) >= 8, "repeat users hit the engine's cache"
        time.sleep(1.5)  # the further front end pushes its metrics every second
        metrics = httpx.get(f"{base}/metrics").text
        counts = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'hstu_request_latency_seconds_count\{replica="(front-\d)",status="200"\} (\S+)', metrics)
        }
        assert set(counts) <= {"front-0", "front-1"} and sum(counts.values()) == len(payloads), counts
        assert all(f'hstu_ready{{replica="{front}"}} 1.0' in metrics for front in ("front-0", "front-1"))
        assert 'hstu_batch_size_count{replica="engine"}' in metrics
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=90)
        log = (tmp_path / "serve.log").read_text()
        # uvicorn re-raises the signal it handled once it has shut down: the status says SIGTERM
        assert server.returncode in (0, -signal.SIGTERM), log[-3000:]
        assert "engine process did not exit" not in log
        assert not _wait_gone([engine, further], 30.0), "the engine or the further front end outlived the server"


@pytest.mark.timeout(420)
def test_a_lost_front_end_leaves_the_server_answering_and_a_lost_primary_takes_the_engine_along(tmp_path, reference):
    with _front_ends(tmp_path) as (server, base, further, engine):
        os.kill(further, signal.SIGKILL)
        assert not _wait_gone([further], 10.0)
        payloads = [Timeline(41_000 + u).payload(12, num_candidates=2) for u in range(4)]
        answers = asyncio.run(_post_all(base, payloads, clients=4))
        assert [a.status_code for a in answers] == [200] * 4
        assert all(matches_reference(reference, p, a.json()) for p, a in zip(payloads, answers))
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        assert not _wait_gone([engine], 60.0), "the engine outlived the primary front end"


@pytest.mark.timeout(420)
def test_front_end_exits_with_its_engine(tmp_path):
    """The primary killed: its engine sees the pipe close and exits, then the further front end
    (its engine gone) exits too, so no orphan keeps the port."""
    with _front_ends(tmp_path) as (server, _, further, engine):
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        left = _wait_gone([further, engine], 60.0)
        assert not left, f"processes {left} outlived the primary front end"


def test_front_ends_need_the_engine_process_and_at_least_one():
    with pytest.raises(ValueError, match="front_ends 2 share one engine process: it needs engine_process"):
        ServerSettings(front_ends=2, engine_process=False)
    with pytest.raises(ValueError, match="front_ends must be >= 1, got 0"):
        ServerSettings(front_ends=0)
    assert ServerSettings(front_ends=3, engine_process=True).front_ends == 3
