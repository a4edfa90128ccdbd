"""RankError: a per-request failure with its HTTP status, and the mapping from model exceptions.

    ValueError (bad request content)                 -> 422 invalid_request
    HistoryConflictError (history shorter than cache) -> 409 history_conflict
    incremental request, prefix not held              -> 412 history_incomplete (history_incomplete())
    CacheCapacityError for a single request           -> 503 capacity
    queue full, or queued longer than max_queue_wait  -> 503 overloaded (with Retry-After)
    not ready / shutting down                         -> 503 unavailable (with Retry-After)
    request deadline passed                           -> 504 timeout
    anything else                                     -> 500 internal (logged with traceback)
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from hstu.ops.kvcache.manager import CacheCapacityError, HistoryConflictError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""Retry-After of the 503s that pass (overloaded, not ready, shutting down): one second."""


class RankError(Exception):
    """A request's outcome when it got no scores: HTTP status, error kind and message."""

    def __init__(
        self,
        status: int,
        kind: str,
        detail: str,
        retry_after_s: int | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.kind = kind
        self.detail = detail
        self.retry_after_s = retry_after_s
        self.request_id = request_id  # the client's, when known before the body was parsed

    def __reduce__(self):
        """Picklable with every field (a parse worker process raises it)."""
        return RankError, (self.status, self.kind, self.detail, self.retry_after_s, self.request_id)


def classify(exc: BaseException, user_id: int) -> RankError:
    """The RankError of one request whose model call raised `exc`."""
    if isinstance(exc, HistoryConflictError):
        hint = "send the user's full history (the previous one plus new events)"
        return RankError(409, "history_conflict", f"{exc}; {hint}")
    if isinstance(exc, ValueError):
        return RankError(422, "invalid_request", str(exc))
    if isinstance(exc, CacheCapacityError):
        return RankError(503, "capacity", f"user {user_id}: request does not fit in the KV cache: {exc}")
    logger.error("ranking user %s failed", user_id, exc_info=exc)
    return RankError(500, "internal", f"user {user_id}: ranking failed: {type(exc).__name__}: {exc}")


HISTORY_INCOMPLETE_STATUS = 412
"""An incremental request says "apply these events to the history whose digest is D" (a body-level
If-Match); when the server does not hold that history the precondition failed, which is what 412
Precondition Failed means. Not 409 (history_conflict: the history itself contradicts the cache),
not 422 (the body is valid; it is the server's state that lacks the prefix), not 428 (that asks a
client to add a condition it did not send). A distinct status lets proxies and dashboards tell
"resend the full history" from "fix the request"."""


def history_incomplete(user_id: int, why: str, request_id: str | None = None) -> RankError:
    """The answer to an incremental request whose prefix the server does not hold: resend it all."""
    detail = f"user {user_id}: {why}; send the full history (item_ids, actions, timestamps) without prefix_length"
    return RankError(HISTORY_INCOMPLETE_STATUS, "history_incomplete", detail, request_id=request_id)


def error_body(kind: str, detail: str, request_id: str | None = None) -> dict:
    """The one error shape of every non-2xx answer."""
    return {"error": kind, "detail": detail, "request_id": request_id}


def error_response(
    status: int, kind: str, detail: str, request_id: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(kind, detail, request_id), headers=headers)


def rank_error_response(exc: RankError, request_id: str | None = None) -> JSONResponse:
    """`exc` as a response (its own request_id first); 503s that may pass carry Retry-After."""
    headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return error_response(exc.status, exc.kind, exc.detail, exc.request_id or request_id, headers)
