"""hstu.client against a real uvicorn on loopback (tiny model), and its 503 retries on a mock transport."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from hstu.client import AsyncClient, Client, HSTUClientError, RetryPolicy, rank_body, retry_after_s
from hstu.model.ranking import InferenceRankingGR
from tests.serving.conftest import TASKS, TINY, Timeline, live_server, reference_scores, tiny_settings


@pytest.fixture(scope="module")
def url() -> str:
    with live_server(tiny_settings()) as (_, _, base_url):
        yield base_url


@pytest.fixture(scope="module")
def reference() -> InferenceRankingGR:
    return InferenceRankingGR(TINY, "cpu")


def columns(payload: dict) -> dict[str, np.ndarray]:
    history = payload["history"]
    return {
        "item_ids": np.array([e["item_id"] for e in history], dtype=np.int64),
        "actions": np.array([e["action"] for e in history], dtype=np.int64),
        "timestamps": np.array([e["timestamp"] for e in history], dtype=np.int64),
    }


def assert_equals_reference(reference: InferenceRankingGR, payload: dict, scores: dict[str, list[float]]) -> None:
    assert list(scores) == list(TASKS)
    got = np.array([scores[t] for t in TASKS]).T
    want = reference_scores(reference, payload)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_rank_returns_scores_labelled_by_task_equal_to_an_in_process_rank(url, reference):
    payload = Timeline(11).payload(20, num_candidates=6)
    with Client(url) as client:
        result = client.rank(11, columns(payload), np.array(payload["candidates"]), request_id="client-1")
    assert result.request_id == "client-1" and result.item_ids == payload["candidates"]
    assert_equals_reference(reference, payload, result.scores)


def test_async_client_ranks_the_same_and_a_grown_history_reuses_the_cache(url, reference):
    timeline = Timeline(12)
    first, second = timeline.payload(10), timeline.payload(30)

    async def scenario():
        async with AsyncClient(url) as client:
            history = columns(first)
            one = await client.rank(12, [history[k].tolist() for k in history], first["candidates"])
            two = await client.rank(12, columns(second), second["candidates"])
            return one, two, await client.ready(), await client.health(), await client.model_info()

    one, two, ready, health, info = asyncio.run(scenario())
    assert_equals_reference(reference, first, one.scores)
    assert_equals_reference(reference, second, two.scores)
    assert two.cached_tokens > 0 and len(one.request_id) > 0
    assert ready is True and health == "live"
    assert info["task_names"] == list(TASKS) and info["config"]["num_items"] == TINY.num_items


def test_server_errors_become_hstu_client_error_with_status_kind_detail_and_request_id(url):
    payload = Timeline(13).payload(5)
    with Client(url) as client:
        with pytest.raises(HSTUClientError) as bad:
            client.rank(13, columns(payload), [TINY.num_items + 5], request_id="bad-item")
        assert client.ready() and client.health() == "live"
        with pytest.raises(HSTUClientError) as unequal:
            client.rank(13, {"item_ids": [1, 2], "actions": [0], "timestamps": [1, 2]}, [1])
    err = bad.value
    assert (err.status, err.error, err.request_id) == (422, "invalid_request", "bad-item")
    assert str(TINY.num_items + 5) in err.detail
    assert unequal.value.status == 422 and "equal lengths" in unequal.value.detail


def test_a_history_that_is_not_three_columns_is_refused_before_sending():
    with pytest.raises(ValueError, match="timestamps"):
        rank_body(1, {"item_ids": [1], "actions": [0]}, [1])
    with pytest.raises(ValueError, match="got 2"):
        rank_body(1, ([1], [0]), [1])


def rank_answer(candidates: list[int]) -> dict:
    scores = [{"item_id": c, "scores": {"click": 0.5}} for c in candidates]
    counts = {"cached_tokens": 0, "computed_tokens": 3, "latency_ms": 1.0}
    return {"request_id": "r", "user_id": 1, "scores": scores, **counts}


class Flaky:
    """A mock server: `failures` 503 overloaded answers with `retry_after`, then a rank answer."""

    def __init__(self, failures: int, retry_after: str | None = "0") -> None:
        self.failures, self.retry_after, self.calls = failures, retry_after, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls <= self.failures:
            headers = {} if self.retry_after is None else {"Retry-After": self.retry_after}
            body = {"error": "overloaded", "detail": "queue full", "request_id": "r"}
            return httpx.Response(503, json=body, headers=headers)
        return httpx.Response(200, json=rank_answer([7, 8]))


HISTORY = ([1, 2], [0, 1], [10, 20])


def test_503_is_retried_after_retry_after_until_it_succeeds():
    flaky = Flaky(failures=2)
    with Client(transport=httpx.MockTransport(flaky)) as client:
        result = client.rank(1, HISTORY, [7, 8])
    assert flaky.calls == 3 and result.scores == {"click": [0.5, 0.5]} and result.item_ids == [7, 8]


def test_503_retries_stop_after_max_attempts_with_the_last_error():
    flaky = Flaky(failures=10)
    with Client(retry=RetryPolicy(max_attempts=4), transport=httpx.MockTransport(flaky)) as client:
        with pytest.raises(HSTUClientError) as failed:
            client.rank(1, HISTORY, [7, 8])
    assert flaky.calls == 4 and (failed.value.status, failed.value.error) == (503, "overloaded")


def test_a_503_without_retry_after_is_not_retried():
    flaky = Flaky(failures=1, retry_after=None)
    with Client(transport=httpx.MockTransport(flaky)) as client, pytest.raises(HSTUClientError) as failed:
        client.rank(1, HISTORY, [7, 8])
    assert flaky.calls == 1 and failed.value.status == 503


def test_a_retry_after_past_the_total_wait_budget_is_not_waited_for():
    flaky = Flaky(failures=1, retry_after="30")
    started = time.monotonic()
    with Client(retry=RetryPolicy(max_wait_s=2.0), transport=httpx.MockTransport(flaky)) as client:
        with pytest.raises(HSTUClientError):
            client.rank(1, HISTORY, [7, 8])
    assert flaky.calls == 1 and time.monotonic() - started < 1.0


def test_async_client_retries_503_too_and_only_503():
    flaky = Flaky(failures=1)

    def not_found(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": "not_found", "detail": "GET /x", "request_id": None})

    async def scenario():
        async with AsyncClient(transport=httpx.MockTransport(flaky)) as client:
            result = await client.rank(1, HISTORY, [7, 8])
        async with AsyncClient(transport=httpx.MockTransport(not_found)) as client:
            with pytest.raises(HSTUClientError) as missing:
                await client.model_info()
        return result, missing.value

    result, missing = asyncio.run(scenario())
    assert flaky.calls == 2 and result.scores == {"click": [0.5, 0.5]}
    assert (missing.status, missing.error, missing.request_id) == (404, "not_found", None)


def test_retry_after_reads_seconds_and_http_dates_and_falls_back_to_the_default():
    assert retry_after_s("2", 1.0) == 2.0
    assert retry_after_s(None, 1.0) == retry_after_s("soon", 1.0) == 1.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 1.0) == 0.0


def test_a_non_json_error_body_still_becomes_hstu_client_error():
    transport = httpx.MockTransport(lambda request: httpx.Response(502, text="bad gateway"))
    with Client(transport=transport) as client, pytest.raises(HSTUClientError) as failed:
        client.model_info()
    assert (failed.value.status, failed.value.error, failed.value.detail) == (502, "http_error", "bad gateway")


def test_the_client_module_does_not_import_torch():
    code = "import sys, hstu.client; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def sent_events(client: Client) -> dict[str, float]:
    """The server's hstu_incremental_events_total by source (stored: not resent; sent)."""
    samples = {}
    for line in client.metrics().splitlines():
        if line.startswith("hstu_incremental_events_total{"):
            samples[line.split('"')[1]] = float(line.split()[-1])
    return samples


def test_incremental_rank_sends_only_new_events_and_scores_like_a_full_rank(url, reference):
    timeline = Timeline(14)
    with Client(url) as client:
        before = sent_events(client)
        for events in (10, 30, 30, 75):
            payload = timeline.payload(events, num_candidates=4)
            result = client.rank(14, columns(payload), payload["candidates"], incremental=True)
            assert_equals_reference(reference, payload, result.scores)
            assert result.history_length == events and len(result.history_digest) == 64
        after = sent_events(client)
    assert after["stored"] - before["stored"] == 10 + 30 + 30, "the client resent no event the server held"
    assert after["sent"] - before["sent"] == 20 + 0 + 45


def test_incremental_rank_after_the_server_history_changed_resends_the_full_history_once(url, reference):
    timeline = Timeline(15)
    with Client(url) as client, Client(url) as other:
        first = timeline.payload(20)
        client.rank(15, columns(first), first["candidates"], incremental=True)
        edited = timeline.payload(22)
        edited["history"][0]["item_id"] = (edited["history"][0]["item_id"] + 1) % TINY.num_items
        other.rank(15, columns(edited), edited["candidates"])  # the server now holds another history
        grown = timeline.payload(25)
        result = client.rank(15, columns(grown), grown["candidates"], incremental=True)
        assert_equals_reference(reference, grown, result.scores)
        mismatches = next(
            float(line.split()[-1]) for line in client.metrics().splitlines()
            if line.startswith('hstu_history_incomplete_total{reason="mismatch"}')
        )
    assert mismatches >= 1


def test_async_incremental_rank_falls_back_when_the_server_evicted_the_history(reference):
    store_bytes = 2 * ((2 * 41 + 2) * 16 + 256)  # room for two 41-event TINY histories in the server's store
    a, b, c = Timeline(16), Timeline(17), Timeline(18)

    async def scenario(base_url: str) -> list:
        async with AsyncClient(base_url) as client:
            for t in (a, b, c):  # c's history evicts a's
                first = t.payload(40)
                await client.rank(t.user_id, columns(first), first["candidates"], incremental=True)
            grown = [a.payload(41), c.payload(41)]
            results = [await client.rank(p["user_id"], columns(p), p["candidates"], incremental=True) for p in grown]
            return list(zip(grown, results))

    with live_server(tiny_settings(history_store_bytes=store_bytes)) as (_, _, base_url):
        answers = asyncio.run(scenario(base_url))
        metrics = httpx.get(f"{base_url}/metrics").text
    for payload, result in answers:
        assert_equals_reference(reference, payload, result.scores)
    assert 'hstu_history_incomplete_total{reason="unknown_user"} 1.0' in metrics, "a: evicted, resent in full"
    assert 'hstu_incremental_requests_total{result="hit"} 1.0' in metrics, "c: held, sent one event"
