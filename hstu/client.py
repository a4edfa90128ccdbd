"""HTTP client of the ranking server (httpx): `Client` (sync) and `AsyncClient`, the same methods.

    rank(user_id, history, candidates)  POST /v1/rank in the columnar form (the fastest to parse)
    rank(..., incremental=True)         the same, sending only the events after the user's last
                                        answered history (hstu/client_history.py); when the server
                                        answers 412 history_incomplete it sends the full history once
    model_info()                        GET /v2/models/hstu: config, limits, task names, fingerprint
    health() / ready()                  GET /v2/health/live and /v2/health/ready

Every non-2xx answer becomes HSTUClientError with the server's {error, detail, request_id} body.
A 503 with Retry-After (overloaded, not ready, shutting down) is sent again after that wait, within
RetryPolicy's attempts and time; other answers, a 503 `capacity` among them, are not retried.
Transport failures (connection refused, timeouts) surface as httpx's own exceptions. No torch
here: a client process needs only httpx.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import httpx

from hstu.client_history import DEFAULT_MAX_USERS, HISTORY_COLUMNS, HistoryMemory, PlannedRank

DEFAULT_URL = "http://127.0.0.1:8000"
History = Union[Mapping[str, Sequence[int]], Sequence[Sequence[int]]]
"""{"item_ids", "actions", "timestamps"} or the three columns in that order; lists or numpy arrays."""


class HSTUClientError(Exception):
    """A non-2xx answer: HTTP status, the server's error kind and detail, the request's id."""

    def __init__(self, status: int, error: str, detail: str, request_id: str | None = None) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status, self.error, self.detail, self.request_id = status, error, detail, request_id


@dataclass(frozen=True)
class RankResult:
    """Scores of one rank call: scores[task][i] is candidate item_ids[i]'s probability for task."""

    request_id: str
    item_ids: list[int]
    scores: dict[str, list[float]]
    cached_tokens: int
    computed_tokens: int
    latency_ms: float
    history_digest: str | None = None
    """The server's digest of the ranked history (None: it keeps no histories, or predates them)."""
    history_length: int | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """When to send a request again after a 503: at most `max_attempts` sends, and a retry only
    while its wait ends within `max_wait_s` of the first send (so a long Retry-After fails fast)."""

    max_attempts: int = 3
    max_wait_s: float = 5.0
    default_delay_s: float = 1.0
    """The wait when a 503's Retry-After is neither seconds nor a date."""

    def delay(self, response: httpx.Response, attempt: int, waited_s: float) -> float | None:
        """Seconds to sleep before attempt `attempt + 1`, or None to give `response` back as it is."""
        header = response.headers.get("Retry-After")
        if response.status_code != 503 or header is None or attempt >= self.max_attempts:
            return None  # the server marks the 503s that pass with Retry-After; `capacity` does not
        wait = retry_after_s(header, self.default_delay_s)
        return wait if waited_s + wait <= self.max_wait_s else None


NO_RETRY = RetryPolicy(max_attempts=1)


def retry_after_s(value: str | None, default_s: float) -> float:
    """A Retry-After header (delta-seconds or HTTP-date) in seconds from now; `default_s` if unreadable."""
    if not value:
        return default_s
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return default_s


def _ints(values: Any) -> list[int]:
    """A list of Python ints from a list, tuple or numpy array (numpy ints are not JSON)."""
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]


def rank_body(
    user_id: int,
    history: History,
    candidates: Sequence[int],
    request_id: str | None = None,
    contextual: Sequence[int] | None = None,
) -> dict:
    """The columnar POST /v1/rank body; ValueError when `history` is not three columns."""
    if isinstance(history, Mapping):
        missing = [k for k in HISTORY_COLUMNS if k not in history]
        if missing:
            raise ValueError(f"history lacks columns {missing}; it needs {list(HISTORY_COLUMNS)}")
        columns = [history[k] for k in HISTORY_COLUMNS]
    else:
        columns = list(history)
        if len(columns) != 3:
            raise ValueError(f"history needs 3 columns {list(HISTORY_COLUMNS)}, got {len(columns)}")
    body: dict[str, Any] = {"user_id": int(user_id), "candidates": _ints(candidates)}
    body.update(zip(HISTORY_COLUMNS, map(_ints, columns)))
    if contextual is not None:
        body["contextual"] = _ints(contextual)
    if request_id is not None:
        body["request_id"] = request_id
    return body


def rank_result(body: dict) -> RankResult:
    """A /v1/rank response body as a RankResult (task order as the server sent it)."""
    entries = body["scores"]
    tasks = list(entries[0]["scores"]) if entries else []
    return RankResult(
        request_id=body["request_id"],
        item_ids=[e["item_id"] for e in entries],
        scores={t: [e["scores"][t] for e in entries] for t in tasks},
        cached_tokens=body["cached_tokens"],
        computed_tokens=body["computed_tokens"],
        latency_ms=body["latency_ms"],
        history_digest=body.get("history_digest"),
        history_length=body.get("history_length"),
    )


def raise_for_error(response: httpx.Response) -> None:
    """HSTUClientError from a non-2xx answer's {error, detail, request_id} body; nothing for a 2xx."""
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "error" not in body:
        raise HSTUClientError(response.status_code, "http_error", response.text[:500] or response.reason_phrase)
    raise HSTUClientError(response.status_code, str(body["error"]), str(body.get("detail", "")), body.get("request_id"))


def decoded(response: httpx.Response) -> dict:
    """The JSON body of a 2xx answer; HSTUClientError from the error body otherwise."""
    raise_for_error(response)
    return response.json()


def _text(response: httpx.Response) -> str:
    """The text body of a 2xx answer; HSTUClientError from the error body otherwise."""
    raise_for_error(response)
    return response.text


def full_history_body(memory: HistoryMemory, plan: PlannedRank, exc: HSTUClientError) -> dict:
    """The body to send after an incremental rank failed with `exc`: the full history when the
    server lacks the prefix (412 history_incomplete; the user's remembered history is forgotten);
    any other error is raised again."""
    if not plan.incremental or exc.error != "history_incomplete":
        raise exc
    memory.forget(plan.user_id)
    return plan.full_body


class _Connection:
    """The settings both clients share; `transport` replaces the network (httpx.MockTransport in tests).
    `history_users` bounds how many users' last histories incremental ranks remember."""

    _pool: type = httpx.Client

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        timeout_s: float = 30.0,
        retry: RetryPolicy = RetryPolicy(),
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        history_users: int = DEFAULT_MAX_USERS,
    ) -> None:
        self.retry = retry
        self.histories = HistoryMemory(history_users)
        self._http = self._pool(base_url=base_url, timeout=timeout_s, transport=transport)


class Client(_Connection):
    """Blocking client; one connection pool, closed by close() or leaving a `with` block."""

    def _call(self, method: str, path: str, body: dict | None = None, retry: RetryPolicy | None = None) -> dict:
        policy, started, attempt = retry or self.retry, time.monotonic(), 1
        while True:
            response = self._http.request(method, path, json=body)
            wait = policy.delay(response, attempt, time.monotonic() - started)
            if wait is None:
                return decoded(response)
            time.sleep(wait)
            attempt += 1

    def rank(self, user_id: int, history: History, candidates: Sequence[int], request_id: str | None = None,
             contextual: Sequence[int] | None = None, incremental: bool = False) -> RankResult:
        """Scores of `candidates` for the user with this whole `history` (oldest event first);
        `incremental` sends only the events after the user's last answered history when this one
        extends it (the scores are the same)."""
        body = rank_body(user_id, history, candidates, request_id, contextual)
        if not incremental:
            return rank_result(self._call("POST", "/v1/rank", body))
        plan = self.histories.plan(body)
        try:
            answer = self._call("POST", "/v1/rank", plan.body)
        except HSTUClientError as exc:
            answer = self._call("POST", "/v1/rank", full_history_body(self.histories, plan, exc))
        return rank_result(self.histories.answered(plan, answer))

    def model_info(self) -> dict:
        return self._call("GET", "/v2/models/hstu")

    def health(self) -> str:
        """The liveness status ("live"); HSTUClientError 503 when the server failed to load its model."""
        return self._call("GET", "/v2/health/live", retry=NO_RETRY)["status"]

    def ready(self) -> bool:
        """Whether the server takes rank requests now (model loaded and warmed up)."""
        return self._http.get("/v2/health/ready").status_code == 200

    def metrics(self) -> str:
        """The server's Prometheus exposition text (GET /metrics)."""
        return _text(self._http.get("/metrics"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Connection):
    """The same client for asyncio; close with `await aclose()` or `async with`."""

    _pool = httpx.AsyncClient

    async def _call(self, method: str, path: str, body: dict | None = None, retry: RetryPolicy | None = None) -> dict:
        policy, started, attempt = retry or self.retry, time.monotonic(), 1
        while True:
            response = await self._http.request(method, path, json=body)
            wait = policy.delay(response, attempt, time.monotonic() - started)
            if wait is None:
                return decoded(response)
            await asyncio.sleep(wait)
            attempt += 1

    async def rank(self, user_id: int, history: History, candidates: Sequence[int], request_id: str | None = None,
                   contextual: Sequence[int] | None = None, incremental: bool = False) -> RankResult:
        """Scores of `candidates` for the user with this whole `history` (oldest event first);
        `incremental` as in Client.rank."""
        body = rank_body(user_id, history, candidates, request_id, contextual)
        if not incremental:
            return rank_result(await self._call("POST", "/v1/rank", body))
        plan = self.histories.plan(body)
        try:
            answer = await self._call("POST", "/v1/rank", plan.body)
        except HSTUClientError as exc:
            answer = await self._call("POST", "/v1/rank", full_history_body(self.histories, plan, exc))
        return rank_result(self.histories.answered(plan, answer))

    async def model_info(self) -> dict:
        return await self._call("GET", "/v2/models/hstu")

    async def health(self) -> str:
        """The liveness status ("live"); HSTUClientError 503 when the server failed to load its model."""
        return (await self._call("GET", "/v2/health/live", retry=NO_RETRY))["status"]

    async def ready(self) -> bool:
        """Whether the server takes rank requests now (model loaded and warmed up)."""
        return (await self._http.get("/v2/health/ready")).status_code == 200

    async def metrics(self) -> str:
        """The server's Prometheus exposition text (GET /metrics)."""
        return _text(await self._http.get("/metrics"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
