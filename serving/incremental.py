"""Incremental requests: a user's full history rebuilt from the history the server holds plus the new events.

Every successful POST /v1/rank answers `history_digest` (the exact-identity digest of the history
it ranked, model/identity.py) and `history_length` (its events), and the server keeps that history
(serving/history_store.py). A client's next request may then send only the events after the
first k = history_length, with prefix_length k and prefix_digest D. The server checks that the
history it holds for the user has at least k events whose digest is D (a prefix digest of a chained
hash: one short hash, no old event resent), that the request's contextual features are the held
ones and that the new events do not go back in time, then builds the full request: the held
records of the prefix followed by the new ones, whose identity extends the held block digests
(only the new blocks are hashed). The ranked history is then exactly the one a client sending
every event would have sent, so the scores are equal.

When the server does not hold that prefix (never seen, evicted, restarted, the history changed
since, another model) the answer is 412 history_incomplete (serving/errors.py) and the client
sends the full history (hstu.client does it by itself). Counted in /metrics:
  hstu_incremental_requests_total{result=hit|history_incomplete}
  hstu_history_incomplete_total{reason=disabled|unknown_user|shorter|mismatch|contextual}
  hstu_incremental_events_total{source=stored|sent}  (stored: events the client did not resend)
"""

from __future__ import annotations

import numpy as np

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.identity import token_records
from hstu.serving.errors import RankError, history_incomplete
from hstu.serving.history_store import HistoryStore
from hstu.serving.metrics import ServingMetrics
from hstu.serving.parsing import ParsedRank

_NO_CONTEXTUAL = np.zeros(0, dtype=np.int64)


class IncrementalHistories:
    """Rebuilds incremental requests from the store and keeps each answered history in it."""

    def __init__(self, store: HistoryStore, config: HSTUConfig, metrics: ServingMetrics) -> None:
        self.store, self.config, self.metrics = store, config, metrics
        self._hits = metrics.incremental.labels("hit")
        self._stored_events = metrics.incremental_events.labels("stored")
        self._sent_events = metrics.incremental_events.labels("sent")

    def rebuild(self, parsed: ParsedRank, model_id: bytes) -> ParsedRank:
        """The full request of an incremental `parsed` (its request holds the new events only);
        RankError 412 history_incomplete when the prefix is not held, 422 when the new events go
        back in time. ~0.1 ms for a 4k-event held history (one copy of its records, no full hash)."""
        tail, prefix, rid = parsed.request, parsed.prefix, parsed.request_id
        user, c = tail.user_id, self.config.num_contextual
        if not self.store.enabled:
            raise self._incomplete(rid, "disabled", user, "this server keeps no histories (history_store_bytes is 0)")
        held = self.store.get(user)
        if held is None:
            raise self._incomplete(
                rid, "unknown_user", user, "the server holds no history of this user (never ranked here, evicted or restarted)"
            )
        held_events = (held.num_tokens - c) // 2
        if prefix.length > held_events:
            raise self._incomplete(
                rid, "shorter", user, f"prefix_length {prefix.length} is more than the {held_events} events the server holds"
            )
        prefix_tokens = c + 2 * prefix.length
        if held.prefix(prefix_tokens) != prefix.digest:
            raise self._incomplete(
                rid,
                "mismatch",
                user,
                f"prefix_digest {prefix.digest.hex()} is not the digest of the first {prefix.length} events the "
                "server holds (the history or the model changed since that response)",
            )
        records = held.records
        if not np.array_equal(records[:c, 0], tail.contextual):
            raise self._incomplete(
                rid, "contextual", user, f"contextual {tail.contextual.tolist()} differ from the held history's {records[:c, 0].tolist()}"
            )
        if prefix.length and tail.num_events and tail.timestamps[0] < records[prefix_tokens - 1, 1]:
            raise RankError(
                422,
                "invalid_request",
                f"user {user}: timestamps[0] = {int(tail.timestamps[0])} is before {int(records[prefix_tokens - 1, 1])}, "
                f"the timestamp of event {prefix.length - 1} of the prefix; timestamps must be non-decreasing",
                request_id=rid,
            )
        identity = held.extended(prefix_tokens, token_records(_NO_CONTEXTUAL, tail.item_ids, tail.actions, tail.timestamps))
        full_records = identity.records
        full = RankingRequest.create(
            user,
            full_records[c::2, 0],
            full_records[c + 1 :: 2, 0],
            full_records[c::2, 1],
            tail.candidates,
            tail.contextual,
            self.config,
        )
        full.adopt_identity(model_id, identity)
        self._hits.inc()
        self._stored_events.inc(prefix.length)
        self._sent_events.inc(tail.num_events)
        return ParsedRank(full, parsed.request_id, parsed.candidates, prefix, identity.prefix(identity.num_tokens))

    def remember(self, request: RankingRequest, model_id: bytes) -> None:
        """Keep the history just answered for its user (no-op when the store is disabled)."""
        if self.store.enabled:
            self.store.put(request.user_id, request.identity(model_id))

    def _incomplete(self, request_id: str | None, reason: str, user_id: int, why: str) -> RankError:
        self.metrics.incremental.labels("history_incomplete").inc()
        self.metrics.history_incomplete.labels(reason).inc()
        return history_incomplete(user_id, why, request_id)
