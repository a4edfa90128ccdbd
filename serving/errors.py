"""RankError: a per-request failure with its HTTP status, and the mapping from model exceptions.

    ValueError (bad request content)                 -> 422 invalid_request
    HistoryConflictError (history shorter than cache) -> 409 history_conflict
    CacheCapacityError for a single request           -> 503 capacity
    queue full                                        -> 503 overloaded
    not ready / shutting down                         -> 503 unavailable
    anything else                                     -> 500 internal (logged with traceback)
"""

from __future__ import annotations

import logging

from hstu.ops.kvcache.manager import CacheCapacityError, HistoryConflictError

logger = logging.getLogger(__name__)


class RankError(Exception):
    """A request's outcome when it got no scores: HTTP status, error kind and message."""

    def __init__(self, status: int, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.kind = kind
        self.detail = detail


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
