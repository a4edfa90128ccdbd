"""Incremental rank requests over HTTP: only the new events plus the digest of the rest.

The oracle: an incremental request's scores equal those of the same request with the full
history, and the no-cache model's; every way the server can lack the prefix answers 412
history_incomplete, after which the full history ranks correctly.
"""

from __future__ import annotations

import pytest

from .conftest import TINY, Timeline, assert_error_shape, matches_reference, response_scores, serving, tiny_settings

anyio = pytest.mark.anyio


def full_columns(timeline: Timeline, events: int, candidates: list[int], **extra) -> dict:
    return {
        "user_id": timeline.user_id,
        "item_ids": timeline.items[:events],
        "actions": timeline.actions[:events],
        "timestamps": timeline.timestamps[:events],
        "candidates": candidates,
        **extra,
    }


def increment(timeline: Timeline, after: dict, events: int, candidates: list[int], **extra) -> dict:
    """The incremental body of a `events`-event history following the answer `after`."""
    k = after["history_length"]
    body = full_columns(timeline, events, candidates, **extra)
    for key in ("item_ids", "actions", "timestamps"):
        body[key] = body[key][k:]
    return {**body, "prefix_length": k, "prefix_digest": after["history_digest"]}


def as_events(body: dict) -> dict:
    """The event-form payload of a full columnar body (what the reference oracle reads)."""
    out = {k: v for k, v in body.items() if k not in ("item_ids", "actions", "timestamps")}
    out["history"] = [
        {"item_id": i, "action": a, "timestamp": t} for i, a, t in zip(body["item_ids"], body["actions"], body["timestamps"])
    ]
    return out


def metric(text: str, series: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(series + " "))
    return float(line.split()[-1])


@anyio
async def test_incremental_requests_score_like_the_full_history_and_the_no_cache_model(reference):
    """Two servers get the same sequence, one in full and one incrementally: equal answers, bit for bit."""
    timeline = Timeline(31)
    async with serving() as (_, client), serving() as (_, full_client):
        first = full_columns(timeline, 10, [1, 2, 3])
        previous = (await client.post("/v1/rank", json=first)).json()
        await full_client.post("/v1/rank", json=first)
        assert previous["history_length"] == 10 and len(previous["history_digest"]) == 64
        for step, events in enumerate((11, 30, 30, 90, 126)):
            candidates = [(7 * step + j) % TINY.num_items for j in range(3 + step)]
            r = await client.post("/v1/rank", json=increment(timeline, previous, events, candidates, request_id=f"i{step}"))
            assert r.status_code == 200, r.text
            body = r.json()
            full = full_columns(timeline, events, candidates)
            assert matches_reference(reference, as_events(full), body), f"step {step}"
            assert body["history_length"] == events and body["request_id"] == f"i{step}"
            assert body["cached_tokens"] > 0, "the held prefix's K/V are reused as for a full request"
            same = (await full_client.post("/v1/rank", json=full)).json()
            assert response_scores(same).tolist() == response_scores(body).tolist(), f"step {step}"
            assert (same["cached_tokens"], same["computed_tokens"]) == (body["cached_tokens"], body["computed_tokens"])
            assert same["history_digest"] == body["history_digest"], "the digest names the history, not the form"
            previous = body
        text = (await client.get("/metrics")).text
    assert metric(text, 'hstu_incremental_requests_total{result="hit"}') == 5
    assert metric(text, 'hstu_incremental_events_total{source="stored"}') == 10 + 11 + 30 + 30 + 90
    assert metric(text, 'hstu_incremental_events_total{source="sent"}') == 1 + 19 + 0 + 60 + 36
    assert metric(text, "hstu_history_store_users") == 1
    assert metric(text, "hstu_history_store_bytes") > 126 * 32


@anyio
async def test_an_increment_may_start_from_any_earlier_answer_of_the_held_history(reference):
    """A client that missed an answer (or sent two requests at once) names an older prefix: still held."""
    timeline = Timeline(32)
    async with serving() as (_, client):
        first = (await client.post("/v1/rank", json=full_columns(timeline, 12, [4]))).json()
        await client.post("/v1/rank", json=full_columns(timeline, 40, [5]))
        r = await client.post("/v1/rank", json=increment(timeline, first, 41, [6, 7]))
        assert r.status_code == 200, r.text
        assert matches_reference(reference, as_events(full_columns(timeline, 41, [6, 7])), r.json())


async def assert_incomplete_then_full_ranks(client, reference, body: dict, timeline: Timeline, reason: str) -> None:
    r = await client.post("/v1/rank", json=body)
    detail = assert_error_shape(r, 412, "history_incomplete", body.get("request_id"))["detail"]
    assert f"user {timeline.user_id}" in detail and "full history" in detail, detail
    events = body["prefix_length"] + len(body["item_ids"])
    full = full_columns(timeline, events, body["candidates"], contextual=body.get("contextual"))
    if full["contextual"] is None:
        del full["contextual"]
    r = await client.post("/v1/rank", json=full)
    assert r.status_code == 200 and matches_reference(reference, as_events(full), r.json()), reason


@anyio
async def test_every_prefix_the_server_does_not_hold_answers_412_history_incomplete_then_the_full_history_ranks(reference):
    async with serving() as (_, client):
        unknown = Timeline(40)
        fake = {**increment(unknown, {"history_length": 5, "history_digest": "ab" * 32}, 8, [1]), "request_id": "u"}
        await assert_incomplete_then_full_ranks(client, reference, fake, unknown, "unknown user")

        timeline = Timeline(41)
        answer = (await client.post("/v1/rank", json=full_columns(timeline, 20, [2]))).json()
        wrong_digest = {**increment(timeline, answer, 25, [3]), "prefix_digest": "0" * 64}
        await assert_incomplete_then_full_ranks(client, reference, wrong_digest, timeline, "mismatch")

        answer = (await client.post("/v1/rank", json=full_columns(timeline, 20, [2]))).json()
        too_long = increment(timeline, {**answer, "history_length": 21}, 25, [3])
        await assert_incomplete_then_full_ranks(client, reference, too_long, timeline, "shorter")

        answer = (await client.post("/v1/rank", json=full_columns(timeline, 20, [2]))).json()
        edited = Timeline(41)
        edited.items[3] = (edited.items[3] + 1) % TINY.num_items
        await client.post("/v1/rank", json=full_columns(edited, 22, [2]))  # the held history changed
        await assert_incomplete_then_full_ranks(client, reference, increment(timeline, answer, 24, [3]), timeline, "changed")

        answer = (await client.post("/v1/rank", json=full_columns(timeline, 20, [2]))).json()
        other_ctx = increment(timeline, answer, 24, [3], contextual=[1, 2])
        await assert_incomplete_then_full_ranks(client, reference, other_ctx, timeline, "contextual")
        text = (await client.get("/metrics")).text
    for reason, count in (("unknown_user", 1), ("mismatch", 2), ("shorter", 1), ("contextual", 1)):
        assert metric(text, f'hstu_history_incomplete_total{{reason="{reason}"}}') == count, reason
    assert metric(text, 'hstu_incremental_requests_total{result="history_incomplete"}') == 5
    assert metric(text, 'hstu_errors_total{kind="history_incomplete"}') == 5


@anyio
async def test_an_evicted_history_answers_412_and_the_store_stays_within_its_bytes(reference):
    entry = 2 * 40 + 2  # tokens of a 40-event TINY history
    capacity = 3 * (entry * 16 + 256)  # room for three users' histories
    async with serving(tiny_settings(history_store_bytes=capacity)) as (app, client):
        users = [Timeline(50 + u) for u in range(5)]
        answers = [(await client.post("/v1/rank", json=full_columns(t, 40, [1]))).json() for t in users]
        store = app.state.histories.store
        assert len(store) == 3 and store.nbytes <= capacity and store.evictions == 2
        await assert_incomplete_then_full_ranks(client, reference, increment(users[0], answers[0], 41, [2]), users[0], "evicted")
        r = await client.post("/v1/rank", json=increment(users[4], answers[4], 41, [2]))
        assert r.status_code == 200 and matches_reference(reference, as_events(full_columns(users[4], 41, [2])), r.json())
        text = (await client.get("/metrics")).text
    assert metric(text, "hstu_history_store_evictions_total") >= 2


@anyio
async def test_without_a_history_store_responses_carry_no_digest_and_increments_answer_412(reference):
    timeline = Timeline(60)
    async with serving(tiny_settings(history_store_bytes=0)) as (_, client):
        answer = (await client.post("/v1/rank", json=full_columns(timeline, 10, [1]))).json()
        assert answer["history_digest"] is None and answer["history_length"] == 10
        body = increment(timeline, {"history_length": 10, "history_digest": "cd" * 32}, 12, [2])
        await assert_incomplete_then_full_ranks(client, reference, body, timeline, "disabled")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prefix_length": -1}, "prefix_length"),
        ({"prefix_length": 200}, "prefix_length"),
        ({"prefix_digest": "xyz"}, "prefix_digest"),
        ({"prefix_digest": "ab" * 31}, "prefix_digest"),
        ({"prefix_digest": None}, "prefix_length needs prefix_digest"),
        ({"prefix_length": None}, "prefix_digest needs prefix_length"),
        ({"prefix_length": 121}, "prefix_length 121 + 6 new events = 127 events, at most 126"),
    ],
)
@anyio
async def test_bad_prefix_fields_get_422_naming_the_value(change, message):
    timeline = Timeline(70)
    async with serving() as (_, client):
        answer = (await client.post("/v1/rank", json=full_columns(timeline, 10, [1]))).json()
        body = {**increment(timeline, answer, 16, [2], request_id="bad"), **change}
        body = {k: v for k, v in body.items() if v is not None}
        r = await client.post("/v1/rank", json=body)
    detail = assert_error_shape(r, 422, "invalid_request", "bad")["detail"]
    assert message in detail, detail


@anyio
async def test_new_events_before_the_prefix_last_timestamp_get_422_naming_both_times():
    timeline = Timeline(71)
    async with serving() as (_, client):
        answer = (await client.post("/v1/rank", json=full_columns(timeline, 10, [1]))).json()
        body = increment(timeline, answer, 12, [2])
        last = timeline.timestamps[9]
        body["timestamps"] = [last - 1, last + 5]
        r = await client.post("/v1/rank", json=body)
        detail = assert_error_shape(r, 422, "invalid_request")["detail"]
        assert f"timestamps[0] = {last - 1}" in detail and str(last) in detail and "event 9" in detail, detail
        r = await client.post("/v1/rank", json=increment(timeline, answer, 12, [2]))
        assert r.status_code == 200, "the refused increment left the held history as it was"


@anyio
async def test_the_event_form_is_unchanged_and_its_answer_can_start_increments(reference):
    timeline = Timeline(72)
    async with serving() as (_, client):
        answer = (await client.post("/v1/rank", json=timeline.payload(15, num_candidates=3))).json()
        assert answer["history_length"] == 15
        r = await client.post("/v1/rank", json=increment(timeline, answer, 18, [9]))
        assert r.status_code == 200 and matches_reference(reference, as_events(full_columns(timeline, 18, [9])), r.json())
        events_body = {**timeline.payload(18), "prefix_length": 15, "prefix_digest": answer["history_digest"]}
        r = await client.post("/v1/rank", json=events_body)
        assert_error_shape(r, 422, "invalid_request")  # the event form has no incremental fields


@anyio
async def test_openapi_documents_the_incremental_form_and_its_412():
    async with serving() as (_, client):
        spec = (await client.get("/openapi.json")).json()
    columns = spec["components"]["schemas"]["RankRequestColumns"]
    assert {"prefix_length", "prefix_digest"} <= set(columns["properties"])
    assert any("prefix_digest" in example for example in columns["examples"][1:])
    assert "412" in spec["paths"]["/v1/rank"]["post"]["responses"]
    response = spec["components"]["schemas"]["RankResponse"]["properties"]
    assert {"history_digest", "history_length"} <= set(response)
