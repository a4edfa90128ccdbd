"""REST schemas of the ranking server (pydantic v2).

The request model is built per served model (`build_rank_request_model`), so its limits are the
model's: item ids in [0, num_items), actions in [0, num_actions), contextual features in
[0, num_contextual_features) and exactly num_contextual of them, at most `max_events` history events
(num_contextual + 2 * events + 1 <= max_seq_len) and at most `max_candidates` candidates. The
limits appear in the OpenAPI schema at /docs. Models are strict (no "5" -> 5 or true -> 1
coercion) and reject unknown fields, so a typo is a 422 and not a silently ignored field.

json_parser(model) is the step from raw body bytes to a validated request: 400 when the bytes are
not JSON, 422 when the JSON does not fit the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from hstu.model.config import HSTUConfig
from hstu.serving.errors import RankError

MAX_USER_ID = 2**63 - 1
MAX_TIMESTAMP = 2**62
MAX_REQUEST_ID_LEN = 128
EVENT_BODY_BYTES = 256
"""Room for one history event in a body: three ids of up to 20 digits with their keys, pretty-printed."""
ITEM_BODY_BYTES = 32
BODY_HEADROOM_BYTES = 64 << 10
DIGEST_HEX_CHARS = 64
_DIGEST_HEX = re.compile(r"[0-9a-fA-F]{%d}" % DIGEST_HEX_CHARS)
_REQUEST_ID = re.compile(rb'"request_id"\s*:\s*("(?:[^"\\]|\\.){1,%d}")' % MAX_REQUEST_ID_LEN)


@dataclass(frozen=True)
class RequestLimits:
    """The bounds a request must satisfy, derived from the model config and the server settings."""

    num_items: int
    num_actions: int
    num_contextual: int
    num_contextual_features: int
    max_events: int
    max_candidates: int
    max_body_bytes: int

    @classmethod
    def for_model(cls, cfg: HSTUConfig, max_candidates: int, max_body_bytes: int | None = None) -> "RequestLimits":
        """Limits of `cfg`; max_body_bytes None sizes the body for the longest valid request."""
        max_events = (cfg.max_seq_len - 1 - cfg.num_contextual) // 2
        if max_events < 1:
            raise ValueError(
                f"max_seq_len {cfg.max_seq_len} leaves no room for one event after "
                f"{cfg.num_contextual} contextual tokens"
            )
        return cls(
            num_items=cfg.num_items,
            num_actions=cfg.num_actions,
            num_contextual=cfg.num_contextual,
            num_contextual_features=cfg.num_contextual_features,
            max_events=max_events,
            max_candidates=max_candidates,
            max_body_bytes=max_body_bytes or body_bytes_for(max_events, max_candidates, cfg.num_contextual),
        )


def body_bytes_for(max_events: int, max_candidates: int, num_contextual: int) -> int:
    """A body size that holds the longest valid request with generous formatting."""
    return EVENT_BODY_BYTES * max_events + ITEM_BODY_BYTES * (max_candidates + num_contextual) + BODY_HEADROOM_BYTES


def describe_validation_error(exc: ValidationError) -> str:
    """Every problem as "location: message (got value)", joined by "; "."""
    problems = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body") or "body"
        got = err.get("input")
        shown = f" (got {got!r})" if isinstance(got, (int, float, str, bool)) and len(repr(got)) <= 64 else ""
        problems.append(f"{loc}: {err.get('msg', 'invalid')}{shown}")
    return "; ".join(problems)


def prefix_problem(prefix_length: int | None, prefix_digest: str | None, new_events: int, max_events: int) -> str | None:
    """What is wrong with an incremental request's prefix fields (naming the value), or None.
    Shared by the fast parser and the pydantic model so both word it the same."""
    if (prefix_length is None) != (prefix_digest is None):
        given, missing = ("prefix_length", "prefix_digest") if prefix_digest is None else ("prefix_digest", "prefix_length")
        return f"{given} needs {missing}: an incremental request sends both (the length and digest a response returned)"
    if prefix_length is None:
        return None
    if not 0 <= prefix_length <= max_events:
        return f"prefix_length: {prefix_length} outside [0, {max_events}]"
    if not _DIGEST_HEX.fullmatch(prefix_digest):
        shown = prefix_digest if len(prefix_digest) <= 80 else prefix_digest[:80] + "..."
        return f"prefix_digest: {shown!r} is not {DIGEST_HEX_CHARS} hex characters (a history_digest the server returned)"
    if prefix_length + new_events > max_events:
        return (
            f"history: prefix_length {prefix_length} + {new_events} new events = {prefix_length + new_events} "
            f"events, at most {max_events}"
        )
    return None


def sniff_request_id(raw: bytes) -> str | None:
    """The client's request_id from a body that may be invalid, truncated or not JSON (best effort)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        value = doc.get("request_id")
        return value if isinstance(value, str) and 0 < len(value) <= MAX_REQUEST_ID_LEN else None
    match = _REQUEST_ID.search(raw)
    if match is None:
        return None
    try:
        return json.loads(match.group(1))
    except ValueError:
        return None


def json_parser(model: type[BaseModel]) -> Callable[[bytes], BaseModel]:
    """bytes -> validated `model`; RankError 400 invalid_json or 422 invalid_request otherwise."""

    def parse(raw: bytes) -> BaseModel:
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            errors = exc.errors()
            if errors and errors[0]["type"] == "json_invalid":
                detail = f"body is not valid JSON: {errors[0]['msg']}"
                raise RankError(400, "invalid_json", detail, request_id=sniff_request_id(raw)) from exc
            raise RankError(
                422, "invalid_request", describe_validation_error(exc), request_id=sniff_request_id(raw)
            ) from exc

    return parse


_STRICT = ConfigDict(strict=True, extra="forbid")


def _example_columns(limits: RequestLimits) -> dict:
    """A valid body for these limits, so the docs' "Try it out" sends a request that ranks."""
    ids = [i % limits.num_items for i in (12, 7, 31)]
    return {
        "user_id": 42,
        "item_ids": ids,
        "actions": [i % limits.num_actions for i in (0, 1, 0)],
        "timestamps": [1_700_000_000, 1_700_000_060, 1_700_000_300],
        "candidates": [i % limits.num_items for i in (5, 9, 17)],
    }


def _example_increment(limits: RequestLimits) -> dict:
    """The incremental form of a next request after `_example_columns`: its 3 events sent before
    (their history_length and history_digest, as a response returned them), then one new event."""
    return {
        "user_id": 42,
        "prefix_length": 3,
        "prefix_digest": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "item_ids": [21 % limits.num_items],
        "actions": [1 % limits.num_actions],
        "timestamps": [1_700_000_420],
        "candidates": [i % limits.num_items for i in (5, 9, 17)],
    }


def _with_example(*examples: dict) -> ConfigDict:
    """Strict config with OpenAPI examples; the first is what the docs' "Try it out" sends."""
    return ConfigDict(strict=True, extra="forbid", json_schema_extra={"examples": list(examples)})


def build_rank_request_model(limits: RequestLimits) -> type[BaseModel]:
    """The POST /v1/rank body model for these limits (class names are stable for OpenAPI)."""
    cols = _example_columns(limits)
    example = {
        "user_id": cols["user_id"],
        "history": [
            {"item_id": i, "action": a, "timestamp": t}
            for i, a, t in zip(cols["item_ids"], cols["actions"], cols["timestamps"])
        ],
        "candidates": cols["candidates"],
    }
    item_id = Annotated[int, Field(ge=0, lt=limits.num_items, description=f"item id in [0, {limits.num_items})")]
    history_event = create_model(
        "HistoryEvent",
        __config__=_STRICT,
        __doc__="One past interaction of the user; events are oldest first.",
        item_id=(item_id, ...),
        action=(int, Field(ge=0, lt=limits.num_actions, description=f"action id in [0, {limits.num_actions})")),
        timestamp=(int, Field(ge=0, le=MAX_TIMESTAMP, description="event time (any unit); non-decreasing")),
    )

    def timestamps_non_decreasing(cls, history: list) -> list:
        for i in range(1, len(history)):
            if history[i].timestamp < history[i - 1].timestamp:
                raise ValueError(
                    f"timestamps must be non-decreasing: event {i} has timestamp {history[i].timestamp} "
                    f"after {history[i - 1].timestamp}"
                )
        return history

    n_ctx = limits.num_contextual
    contextual = Annotated[
        int, Field(ge=0, lt=limits.num_contextual_features, description="contextual feature id")
    ]
    return create_model(
        "RankRequest",
        __config__=_with_example(example),
        __doc__="Score `candidates` for `user_id` given the user's full history (oldest first).",
        __validators__={"_timestamps": field_validator("history")(timestamps_non_decreasing)},
        user_id=(int, Field(ge=0, le=MAX_USER_ID, description="user id; keys the user's KV cache")),
        history=(
            list[history_event],
            Field(
                max_length=limits.max_events,
                description=(
                    f"the user's whole history, at most {limits.max_events} events; each request must repeat "
                    "the previous history and may append to it (a changed or shorter history is recomputed; "
                    "409 only in the server's strict mode)"
                ),
            ),
        ),
        candidates=(
            list[item_id],
            Field(min_length=1, max_length=limits.max_candidates, description="items to score"),
        ),
        contextual=(
            list[contextual] | None,
            Field(
                default=None,
                min_length=n_ctx,
                max_length=n_ctx,
                description=f"exactly {n_ctx} contextual feature ids; derived from user_id when omitted",
            ),
        ),
        request_id=(
            str | None,
            Field(
                default=None,
                min_length=1,
                max_length=MAX_REQUEST_ID_LEN,
                description="echoed back; generated when omitted",
            ),
        ),
    )


def build_rank_columns_model(limits: RequestLimits) -> type[BaseModel]:
    """The columnar POST /v1/rank body: the history as three equal-length arrays (fast to parse)."""
    n = limits.max_events
    column = lambda kind, upper, text: (  # noqa: E731
        list[Annotated[int, Field(ge=0, **({"lt": upper} if kind == "id" else {"le": upper}))]],
        Field(max_length=n, description=text),
    )

    def columns_agree(model):
        problem = prefix_problem(model.prefix_length, model.prefix_digest, len(model.item_ids), n)
        if problem is not None:
            raise ValueError(problem)
        lengths = {len(model.item_ids), len(model.actions), len(model.timestamps)}
        if len(lengths) != 1:
            raise ValueError(
                f"item_ids, actions, timestamps need equal lengths, got {len(model.item_ids)}, "
                f"{len(model.actions)}, {len(model.timestamps)}"
            )
        for i in range(1, len(model.timestamps)):
            if model.timestamps[i] < model.timestamps[i - 1]:
                raise ValueError(
                    f"timestamps must be non-decreasing: event {i} has timestamp {model.timestamps[i]} "
                    f"after {model.timestamps[i - 1]}"
                )
        return model

    item_id = Annotated[int, Field(ge=0, lt=limits.num_items)]
    ctx = Annotated[int, Field(ge=0, lt=limits.num_contextual_features)]
    return create_model(
        "RankRequestColumns",
        __config__=_with_example(_example_columns(limits), _example_increment(limits)),
        __doc__=(
            "The same request with the history as columns: event i is (item_ids[i], actions[i], timestamps[i]). "
            "Incremental form: with prefix_length k and prefix_digest D (the history_length and "
            "history_digest of an earlier response), the columns hold only the events after the first k; "
            "the server rebuilds the full history from the one it holds, or answers 412 history_incomplete "
            "(then send the full history)."
        ),
        __validators__={"_columns": model_validator(mode="after")(columns_agree)},
        user_id=(int, Field(ge=0, le=MAX_USER_ID, description="user id; keys the user's KV cache")),
        item_ids=column("id", limits.num_items, f"item id of each event, oldest first; at most {n} events"),
        actions=column("id", limits.num_actions, f"action id of each event, in [0, {limits.num_actions})"),
        timestamps=column("ts", MAX_TIMESTAMP, "event times (any unit), non-decreasing"),
        candidates=(list[item_id], Field(min_length=1, max_length=limits.max_candidates, description="items to score")),
        contextual=(
            list[ctx] | None,
            Field(default=None, min_length=limits.num_contextual, max_length=limits.num_contextual),
        ),
        request_id=(str | None, Field(default=None, min_length=1, max_length=MAX_REQUEST_ID_LEN)),
        prefix_length=(
            int | None,
            Field(
                default=None,
                ge=0,
                le=n,
                description="incremental form: the columns are the events after the first prefix_length (a history_length the server returned)",
            ),
        ),
        prefix_digest=(
            str | None,
            Field(
                default=None,
                pattern=f"^[0-9a-fA-F]{{{DIGEST_HEX_CHARS}}}$",
                description="incremental form: the history_digest the server returned for those first prefix_length events",
            ),
        ),
    )


class CandidateScore(BaseModel):
    item_id: int
    scores: dict[str, float] = Field(description="probability per task (sigmoid of the task logit)")


class RankResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "request_id": "3f2b9c1e",
                    "user_id": 42,
                    "scores": [{"item_id": 5, "scores": {"click": 0.61, "like": 0.12}}],
                    "cached_tokens": 0,
                    "computed_tokens": 6,
                    "latency_ms": 3.2,
                    "history_digest": "5d41402abc4b2a76b9719d911017c5925d41402abc4b2a76b9719d911017c592",
                    "history_length": 2,
                }
            ]
        }
    )

    request_id: str
    user_id: int
    scores: list[CandidateScore] = Field(description="one entry per candidate, in request order")
    cached_tokens: int = Field(description="history tokens whose K/V came from the cache")
    computed_tokens: int = Field(description="tokens computed for this request (new history + candidates)")
    latency_ms: float = Field(description="server time from arrival to the response (body, parsing, queue, model)")
    history_digest: str | None = Field(
        default=None,
        description=(
            "exact-identity digest (hex) of the whole history ranked; with history_length it lets the next "
            "request send only newer events (prefix_length, prefix_digest); null when the server keeps no histories"
        ),
    )
    history_length: int = Field(description="events in the history ranked (the prefix_length that history_digest covers)")


MAX_PREFETCH_USERS = 1024


class PrefetchRequest(BaseModel):
    """Users expected to rank soon: their host-tier K/V start moving to the GPU now."""

    model_config = ConfigDict(strict=True, extra="forbid")
    user_ids: list[Annotated[int, Field(ge=0, le=MAX_USER_ID)]] = Field(min_length=1, max_length=MAX_PREFETCH_USERS)


class PrefetchResponse(BaseModel):
    requested: int = Field(description="distinct users asked for")
    started: int = Field(description="onloads started (the rest are on the GPU already, not in the host tier, or do not fit free pages)")


class ErrorResponse(BaseModel):
    error: str = Field(
        description=(
            "error kind: invalid_json, invalid_request, history_conflict, history_incomplete, payload_too_large, not_found, "
            "method_not_allowed, capacity, overloaded, unavailable, timeout, internal"
        )
    )
    detail: str = Field(description="what was wrong, naming the offending value")
    request_id: str | None = None


class HealthResponse(BaseModel):
    status: str
    detail: str | None = None
