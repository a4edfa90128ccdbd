"""Large bodies parsed in worker processes (settings.parse_processes) answer exactly as in-process parsing.

The inline threshold is set to 0 here so the tiny model's bodies (a few KiB) take the pool path."""

from __future__ import annotations

import os
import signal

import pytest

from hstu.serving import app as app_module

from .conftest import Timeline, matches_reference, serving, tiny_settings
from .test_incremental import as_events, full_columns, increment

anyio = pytest.mark.anyio


@pytest.fixture
def every_body_off_the_loop(monkeypatch):
    monkeypatch.setattr(app_module, "_INLINE_PARSE_BYTES", 0)


@anyio
async def test_bodies_parsed_by_workers_rank_like_bodies_parsed_in_process(reference, every_body_off_the_loop):
    timeline = Timeline(41)
    async with serving(tiny_settings(parse_processes=1)) as (app, pooled), serving() as (_, inline):
        assert app.state.parse_pool is not None
        answers = []
        previous = None
        for events in (20, 60, 126):
            body = full_columns(timeline, events, [3, 4, 5]) if previous is None else increment(timeline, previous, events, [3, 4, 5])
            got = await pooled.post("/v1/rank", json=body)
            want = await inline.post("/v1/rank", json=body)
            assert got.status_code == want.status_code == 200, (got.text, want.text)
            got, want = got.json(), want.json()
            for key in ("scores", "cached_tokens", "computed_tokens", "history_digest", "history_length"):
                assert got[key] == want[key], key
            answers.append(got)
            previous = got
        assert answers[-1]["cached_tokens"] > 0, "the pooled server's digests let the cache hit"
        assert matches_reference(reference, _event_payload(timeline, 126), answers[-1])


def _event_payload(timeline: Timeline, events: int) -> dict:
    return as_events(full_columns(timeline, events, [3, 4, 5]))


@anyio
async def test_a_worker_refusing_a_body_gives_the_same_422_naming_the_value(every_body_off_the_loop):
    timeline = Timeline(42)
    body = full_columns(timeline, 10, [3, 10**9], request_id="bad-candidate")
    async with serving(tiny_settings(parse_processes=1)) as (_, client):
        answer = await client.post("/v1/rank", json=body)
    assert answer.status_code == 422
    doc = answer.json()
    assert doc["error"] == "invalid_request" and "1000000000" in doc["detail"] and doc["request_id"] == "bad-candidate"


@anyio
async def test_a_dead_parse_worker_falls_back_to_in_process_parsing(reference, every_body_off_the_loop):
    timeline = Timeline(43)
    async with serving(tiny_settings(parse_processes=1)) as (app, client):
        pool = app.state.parse_pool
        for pid in list(pool._pool._processes):
            os.kill(pid, signal.SIGKILL)
        answers = [await client.post("/v1/rank", json=full_columns(timeline, n, [3, 4, 5])) for n in (30, 31)]
    assert [a.status_code for a in answers] == [200, 200]
    assert matches_reference(reference, _event_payload(timeline, 31), answers[-1].json())
