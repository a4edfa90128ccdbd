"""The fast request parser: both body forms give the same request, errors keep their wording."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hstu.ops._build import load_extension
from hstu.serving.errors import RankError
from hstu.serving.parsing import RankBodyParser
from hstu.serving.schemas import RequestLimits, build_rank_columns_model, build_rank_request_model

from .conftest import TINY, Timeline, matches_reference, serving

anyio = pytest.mark.anyio


def columns(payload: dict) -> dict:
    """The columnar form of an event-form payload."""
    out = {k: v for k, v in payload.items() if k != "history"}
    out["item_ids"] = [e["item_id"] for e in payload["history"]]
    out["actions"] = [e["action"] for e in payload["history"]]
    out["timestamps"] = [e["timestamp"] for e in payload["history"]]
    return out


@pytest.fixture
def parser() -> RankBodyParser:
    limits = RequestLimits.for_model(TINY, 64)
    return RankBodyParser(limits, TINY, build_rank_request_model(limits), build_rank_columns_model(limits))


def test_both_forms_parse_to_the_same_request(parser):
    payload = Timeline(3).payload(40, request_id="r1", contextual=[4, 9])
    a, b = parser(json.dumps(payload).encode()), parser(json.dumps(columns(payload)).encode())
    for field in ("item_ids", "actions", "timestamps", "candidates", "contextual"):
        np.testing.assert_array_equal(getattr(a.request, field), getattr(b.request, field))
    assert (a.request.user_id, a.request_id, a.candidates) == (b.request.user_id, "r1", payload["candidates"])


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: {**c, "item_ids": c["item_ids"][:-1]}, ["equal lengths", "39, 40, 40"]),
        (lambda c: {**c, "timestamps": c["timestamps"][:-1] + [0]}, ["non-decreasing", "event 39"]),
        (lambda c: {**c, "item_ids": [-3] + c["item_ids"][1:]}, ["item_ids.0", "greater than or equal to 0", "-3"]),
        (lambda c: {**c, "actions": [True] + c["actions"][1:]}, ["actions.0"]),
        (lambda c: {**c, "actions": [1.5] + c["actions"][1:]}, ["actions.0", "1.5"]),
        (lambda c: {**c, "item_idz": []}, ["item_idz", "Extra inputs"]),
        (lambda c: {k: v for k, v in c.items() if k != "actions"}, ["actions", "Field required"]),
        (lambda c: {**c, "candidates": [10**12]}, ["candidates.0", str(10**12)]),
    ],
)
def test_columnar_errors_name_the_field_and_value(parser, change, words):
    body = change(columns(Timeline(3).payload(40, request_id="bad")))
    with pytest.raises(RankError) as info:
        parser(json.dumps(body).encode())
    assert info.value.status == 422 and info.value.request_id == "bad"
    assert all(w in info.value.detail for w in words), info.value.detail


def _outcome(parser, raw: bytes):
    try:
        r = parser(raw).request
        return tuple(getattr(r, f).tolist() for f in ("item_ids", "actions", "timestamps", "candidates", "contextual"))
    except RankError as exc:
        return (exc.status, exc.detail)


@pytest.mark.parametrize(
    "column",
    ["[ ]", "[]", "[ 7 ]", "[7,\n 8 ,\t9]", "[-1, 2]", "[-0]", "[9223372036854775807]", "[-9223372036854775808]",
     "[9223372036854775808]", "[99999999999999999999]", "[1.0]", "[1e2]", "[true]", "[null]", '["1"]', "[[1]]",
     "[1, [2]]", "{}", "3", "null"],
)
def test_the_array_fast_path_parses_a_column_exactly_as_the_typed_decoder(parser, monkeypatch, column):
    payload = columns(Timeline(3).payload(1, request_id="c"))
    payload["item_ids"], payload["timestamps"] = [0], [0]
    plain = json.dumps(payload)
    raw = plain.replace('"actions": [' + str(payload["actions"][0]) + "]", '"actions": ' + column).encode()
    assert raw != plain.encode()
    fast = _outcome(parser, raw)
    monkeypatch.setattr(RankBodyParser, "_arrays_fast", lambda self, raw, form: None)  # the typed decoder alone
    assert fast == _outcome(parser, raw)


@pytest.mark.parametrize(
    "history",
    ['[]', '[ {"timestamp": 5, "action": 1, "item_id": 2} ]', '[{"item_id": 2, "action": 1}]',
     '[{"item_id": 2, "action": 1, "timestamp": 5, "extra": 0}]', '[{"item_id": 2, "item_id": 3, "timestamp": 5}]',
     '[{"item\\u005fid": 2, "action": 1, "timestamp": 5}]', '[{"item_id": true, "action": 1, "timestamp": 5}]',
     '[{"item_id": 2.0, "action": 1, "timestamp": 5}]', '[{"item_id": 2, "action": 1, "timestamp": 99999999999999999999}]',
     '[{"item_id": -2, "action": 1, "timestamp": 5}]', '[[2, 1, 5]]', '{}', 'null'],
)
def test_the_events_fast_path_parses_a_history_exactly_as_the_typed_decoder(parser, monkeypatch, history):
    payload = Timeline(3).payload(1, request_id="e")
    raw = json.dumps({**payload, "history": "HISTORY"}).replace('"HISTORY"', history).encode()
    fast = _outcome(parser, raw)
    monkeypatch.setattr(RankBodyParser, "_arrays_fast", lambda self, raw, form: None)  # the typed decoder alone
    assert fast == _outcome(parser, raw)


def test_long_histories_of_both_forms_take_the_array_fast_path(parser):
    payload = Timeline(5).payload(60, request_id="long")
    raw = json.dumps(payload, indent=1).encode()
    assert parser._arrays_fast(raw, "events") is not None
    np.testing.assert_array_equal(parser(raw).request.item_ids, [e["item_id"] for e in payload["history"]])


def test_long_columns_take_the_array_fast_path_with_the_same_request(parser, monkeypatch):
    payload = columns(Timeline(5).payload(60, request_id="long"))
    raw = json.dumps(payload, indent=1).encode()  # whitespace and newlines inside the arrays
    assert parser._arrays_fast(raw, "columns") is not None
    fast = _outcome(parser, raw)
    assert len(fast[0]) == 60
    monkeypatch.setattr(RankBodyParser, "_arrays_fast", lambda self, raw, form: None)
    assert fast == _outcome(parser, raw)


@pytest.mark.parametrize(
    "text, values",
    [(b"[1, 2,3]", [1, 2, 3]), (b" [ ] ", []), (b"[-0]", [0]), (b"[\n7\t]", [7]),
     (b"[9223372036854775807, -9223372036854775808]", [2**63 - 1, -(2**63)]),
     (b"[9223372036854775808]", None), (b"[-9223372036854775809]", None), (b"[01]", None), (b"[1,]", None),
     (b"[1.5]", None), (b"[1e2]", None), (b"[true]", None), (b"[[1]]", None), (b"[-]", None), (b"3", None),
     (b"[1] x", None), (b"", None)],
)
def test_int_array_reads_json_integer_arrays_and_declines_everything_else(text, values):
    out = load_extension().int_array(text)
    if values is None:
        assert out is None
    else:
        assert out.dtype == np.int64 and out.tolist() == values


def test_bytes_that_are_not_json_are_400(parser):
    with pytest.raises(RankError) as info:
        parser(b'{"request_id": "x1", "user_id": 1, "item_ids": [1,')
    assert (info.value.status, info.value.kind, info.value.request_id) == (400, "invalid_json", "x1")


@anyio
async def test_columnar_and_event_forms_give_identical_scores_through_the_server(reference):
    user = Timeline(51)
    async with serving() as (_, client):
        first = user.payload(30)
        r1 = await client.post("/v1/rank", json=first)
        second = user.payload(34)
        r2 = await client.post("/v1/rank", json=columns(second))
        assert r1.status_code == r2.status_code == 200, r2.text
        assert matches_reference(reference, second, r2.json())
        assert r2.json()["cached_tokens"] > 0, "the columnar request reused the event-form request's cache"
        same = await client.post("/v1/rank", json=second)
        assert [c["scores"] for c in same.json()["scores"]] == [c["scores"] for c in r2.json()["scores"]]
