"""What a client remembers of each user's last answered history, so the next rank sends only new events.

The server answers every rank with `history_digest` and `history_length` (the exact-identity digest
of the history it ranked and its events) and keeps that history for a while. A later rank of the
same user whose history starts with that one may send only the events after it, with
prefix_length and prefix_digest (serving/incremental.py). The client cannot compute the server's
digest (it covers the model's weights), so it checks the "starts with" part itself: per user it
keeps the server's length and digest and a local SHA-256 of what it sent (each column's int64
bytes, the contextual features), and sends the tail only when the new history's first
history_length events hash to the same local digest. A history that was edited, shortened or sent
with other contextual features is sent in full, so a wrong prefix is never claimed.

Bounded: at most `max_users` users, least recently ranked forgotten first (about 200 bytes each).
Thread-safe: one lock around the map (a sync Client may be shared by threads).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

HISTORY_COLUMNS = ("item_ids", "actions", "timestamps")
DEFAULT_MAX_USERS = 10_000


@dataclass(frozen=True)
class _Answered:
    """The server's length and digest of a user's last answered history, and the client's digest of it."""

    length: int
    server_digest: str
    local_digest: bytes


@dataclass(frozen=True)
class PlannedRank:
    """A rank body to send (`body`: incremental or full), the full body, and the full history's local digest."""

    user_id: int
    body: dict
    full_body: dict
    local_digest: bytes

    @property
    def incremental(self) -> bool:
        return self.body is not self.full_body


def _local_digests(columns: Sequence[list[int]], contextual: list[int] | None, k: int | None) -> tuple[bytes | None, bytes]:
    """(local digest of the first k events or None, local digest of all): one pass over the columns."""
    head = hashlib.sha256(b"ctx-none" if contextual is None else b"ctx" + array("q", contextual).tobytes())
    hashers = [hashlib.sha256() for _ in columns]

    def combined() -> bytes:
        h = head.copy()
        for c in hashers:
            h.update(c.digest())
        return h.digest()

    at_k = None
    if k is not None:
        for h, col in zip(hashers, columns):
            h.update(array("q", col[:k]).tobytes())
        at_k = combined()
    for h, col in zip(hashers, columns):
        h.update(array("q", col[k or 0 :]).tobytes())
    return at_k, combined()


class HistoryMemory:
    """Per user, the last answered history's length and digests (LRU, at most `max_users`)."""

    def __init__(self, max_users: int = DEFAULT_MAX_USERS) -> None:
        if max_users < 1:
            raise ValueError(f"max_users must be >= 1, got {max_users}")
        self.max_users = max_users
        self._users: OrderedDict[int, _Answered] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._users)

    def plan(self, full_body: dict) -> PlannedRank:
        """The body to send for the columnar `full_body`: only the new events when the user's last
        answered history is a prefix of this one (checked by local digest), else the full body."""
        user_id = full_body["user_id"]
        columns = [full_body[k] for k in HISTORY_COLUMNS]
        with self._lock:
            known = self._users.get(user_id)
        usable = known is not None and known.length <= len(columns[0])
        at_k, local = _local_digests(columns, full_body.get("contextual"), known.length if usable else None)
        if not usable or at_k != known.local_digest:
            return PlannedRank(user_id, full_body, full_body, local)
        body = {**full_body, **{k: col[known.length :] for k, col in zip(HISTORY_COLUMNS, columns)}}
        body.update(prefix_length=known.length, prefix_digest=known.server_digest)
        return PlannedRank(user_id, body, full_body, local)

    def answered(self, plan: PlannedRank, answer: dict) -> dict:
        """Remember the server's digest of the history `plan` sent (forget the user when it gave none)."""
        digest, length = answer.get("history_digest"), answer.get("history_length")
        with self._lock:
            if digest is None or length != len(plan.full_body[HISTORY_COLUMNS[0]]):
                self._users.pop(plan.user_id, None)
                return answer
            self._users[plan.user_id] = _Answered(length, digest, plan.local_digest)
            self._users.move_to_end(plan.user_id)
            while len(self._users) > self.max_users:
                self._users.popitem(last=False)
        return answer

    def forget(self, user_id: int) -> None:
        with self._lock:
            self._users.pop(user_id, None)
