"""HistoryStore: the history the server last answered for each user, so a client may send only new events.

One entry per user: the HistoryIdentity of the last history ranked for that user. It holds the
history's token records (contextual ids, item ids, actions, timestamps as int64: 16 bytes a token,
32 an event) and its chained block digests, so the exact-identity digest of any prefix of it is
one short hash away and a client's new events extend it without the old ones being sent again
(serving/incremental.py). The request's history stays the truth: an entry is only ever replaced
by the next history answered for that user, never merged with it.

Invariants:
  - total bytes of the entries <= capacity_bytes; put() evicts least recently used users first,
    and an entry larger than the whole capacity is not kept;
  - an entry's identity has every block digest of its records computed before it is stored
    (prefix(num_tokens) ran: the response's history_digest), so readers in parse threads only read its chain, never extend it;
  - one lock guards the entries, the byte count and the eviction count (parse threads and the event loop share them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from hstu.model.identity import HistoryIdentity

ENTRY_OVERHEAD_BYTES = 256
"""Bytes counted per entry beyond its records: the dict slot, the identity object, its digests."""


class HistoryStore:
    """A byte-bounded LRU map user_id -> HistoryIdentity; capacity_bytes 0 keeps nothing."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.evictions = 0  # users evicted to make room (read by /metrics)
        self._entries: OrderedDict[int, HistoryIdentity] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def entry_bytes(identity: HistoryIdentity) -> int:
        return identity.num_tokens * 16 + ENTRY_OVERHEAD_BYTES

    def get(self, user_id: int) -> HistoryIdentity | None:
        """The user's stored history (now the most recently used), or None."""
        with self._lock:
            identity = self._entries.get(user_id)
            if identity is not None:
                self._entries.move_to_end(user_id)
            return identity

    def put(self, user_id: int, identity: HistoryIdentity) -> None:
        """Keep `identity` as the user's history (replacing the previous one), evicting LRU users to fit.
        Precondition: identity.prefix(identity.num_tokens) ran (the response's digest), so every block
        digest is computed and readers never extend the chain."""
        size = self.entry_bytes(identity)
        if size > self.capacity_bytes:
            self.discard(user_id)
            return
        with self._lock:
            self._pop(user_id)
            while self._entries and self._bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= self.entry_bytes(evicted)
                self.evictions += 1
            self._entries[user_id] = identity
            self._bytes += size

    def discard(self, user_id: int) -> None:
        """Forget the user's history, if any."""
        with self._lock:
            self._pop(user_id)

    def _pop(self, user_id: int) -> None:
        """Drop the user's entry and its bytes; the caller holds the lock."""
        old = self._entries.pop(user_id, None)
        if old is not None:
            self._bytes -= self.entry_bytes(old)
