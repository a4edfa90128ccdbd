"""The client's memory of answered histories: only a true extension is sent incrementally."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hstu.client import AsyncClient, Client, HSTUClientError
from hstu.client_history import HistoryMemory

HISTORY = {"item_ids": [1, 2, 3], "actions": [0, 1, 0], "timestamps": [10, 20, 30]}
DIGEST = "ab" * 32


def grown(extra: int, **changes) -> dict:
    history = {k: v + [v[-1] + i + 1 for i in range(extra)] for k, v in HISTORY.items()}
    for key, (index, value) in changes.items():
        history[key][index] = value
    return history


class Server:
    """A mock /v1/rank: records every body; answers 412 history_incomplete to the first
    `incomplete` incremental ones, and a digest of the history length to the rest."""

    def __init__(self, incomplete: int = 0, error: tuple[int, str] | None = None, digest: str | None = DIGEST) -> None:
        self.bodies: list[dict] = []
        self.incomplete, self.error, self.digest = incomplete, error, digest

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if "prefix_length" in body and (self.incomplete > 0 or self.error):
            self.incomplete -= 1
            status, kind = self.error or (412, "history_incomplete")
            return httpx.Response(status, json={"error": kind, "detail": "not held", "request_id": None})
        length = body.get("prefix_length", 0) + len(body["item_ids"])
        scores = [{"item_id": c, "scores": {"click": 0.5}} for c in body["candidates"]]
        return httpx.Response(200, json={
            "request_id": "r", "user_id": body["user_id"], "scores": scores, "cached_tokens": 0,
            "computed_tokens": 1, "latency_ms": 1.0, "history_digest": self.digest, "history_length": length,
        })


def test_an_extended_history_sends_only_the_new_events_with_the_answered_prefix():
    server = Server()
    with Client(transport=httpx.MockTransport(server)) as client:
        client.rank(1, HISTORY, [5], incremental=True)
        client.rank(1, grown(2), [6], incremental=True)
        client.rank(1, grown(2), [7], incremental=True)
    first, second, same = server.bodies
    assert "prefix_length" not in first and first["item_ids"] == [1, 2, 3]
    assert second["prefix_length"] == 3 and second["prefix_digest"] == DIGEST
    assert second["item_ids"] == [4, 5] and second["timestamps"] == [31, 32] and second["candidates"] == [6]
    assert same["prefix_length"] == 5 and same["item_ids"] == [], "an unchanged history sends no event"


@pytest.mark.parametrize(
    "history, contextual",
    [
        (grown(2, item_ids=(0, 9)), None),  # an edited past event
        (grown(2, timestamps=(2, 29)), None),
        ({k: v[:2] for k, v in HISTORY.items()}, None),  # shorter
        (grown(2), [4, 5]),  # other contextual features
    ],
)
def test_a_history_that_does_not_extend_the_answered_one_is_sent_in_full(history, contextual):
    server = Server()
    with Client(transport=httpx.MockTransport(server)) as client:
        client.rank(1, HISTORY, [5], incremental=True)
        client.rank(1, history, [6], contextual=contextual, incremental=True)
    assert "prefix_length" not in server.bodies[1] and server.bodies[1]["item_ids"] == history["item_ids"]


def test_history_incomplete_resends_the_full_history_once_and_other_errors_are_raised():
    server = Server(incomplete=1)
    with Client(transport=httpx.MockTransport(server)) as client:
        client.rank(1, HISTORY, [5], incremental=True)
        result = client.rank(1, grown(1), [6], incremental=True)
        assert result.history_length == 4
        assert [("prefix_length" in b, len(b["item_ids"])) for b in server.bodies] == [(False, 3), (True, 1), (False, 4)]
        failing = Server(error=(422, "invalid_request"))
        with Client(transport=httpx.MockTransport(failing)) as other:
            other.rank(1, HISTORY, [5], incremental=True)
            with pytest.raises(HSTUClientError) as raised:
                other.rank(1, grown(1), [6], incremental=True)
        assert raised.value.status == 422 and len(failing.bodies) == 2


def test_async_client_ranks_incrementally_and_falls_back_the_same():
    server = Server(incomplete=1)

    async def scenario() -> None:
        async with AsyncClient(transport=httpx.MockTransport(server)) as client:
            await client.rank(1, HISTORY, [5], incremental=True)
            await client.rank(1, grown(1), [6], incremental=True)
            await client.rank(1, grown(3), [6], incremental=True)

    asyncio.run(scenario())
    assert [b.get("prefix_length") for b in server.bodies] == [None, 3, None, 4]


@pytest.mark.parametrize("incremental, digest", [(False, DIGEST), (True, None)])
def test_without_incremental_or_a_server_digest_nothing_is_remembered(incremental, digest):
    server = Server(digest=digest)
    with Client(transport=httpx.MockTransport(server)) as client:
        client.rank(1, HISTORY, [5], incremental=incremental)
        client.rank(1, grown(1), [5], incremental=incremental)
        assert len(client.histories) == 0 and all("prefix_length" not in b for b in server.bodies)


def test_the_memory_keeps_at_most_max_users_least_recent_forgotten_first():
    server = Server()
    with Client(transport=httpx.MockTransport(server), history_users=2) as client:
        for user in (1, 2, 1, 3):
            client.rank(user, HISTORY, [5], incremental=True)
        assert len(client.histories) == 2
        client.rank(1, HISTORY, [5], incremental=True)
        client.rank(2, HISTORY, [5], incremental=True)
    assert server.bodies[-2]["prefix_length"] == 3
    assert "prefix_length" not in server.bodies[-1], "user 2 was the least recent: forgotten"
    with pytest.raises(ValueError, match="0"):
        HistoryMemory(0)


def test_a_failed_full_resend_leaves_the_user_forgotten_so_the_next_rank_sends_it_all():
    server, answers = Server(), iter([None, (412, "history_incomplete"), (503, "capacity"), None])

    def handler(request: httpx.Request) -> httpx.Response:
        error = next(answers)
        if error is None:
            return server(request)
        server.bodies.append(json.loads(request.content))
        return httpx.Response(error[0], json={"error": error[1], "detail": "no", "request_id": None})

    with Client(transport=httpx.MockTransport(handler)) as client:
        client.rank(1, HISTORY, [5], incremental=True)
        with pytest.raises(HSTUClientError, match="capacity"):
            client.rank(1, grown(1), [6], incremental=True)
        client.rank(1, grown(1), [6], incremental=True)
    assert [b.get("prefix_length") for b in server.bodies] == [None, 3, None, None]
