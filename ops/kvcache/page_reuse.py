"""PageReuse: which earlier batch an onload's copies must wait for before they overwrite their pages.

Why: the pages a batch reserves for its onload may still be read on the device by a batch the
engine launched earlier (the pages' last owner, evicted or invalidated since, or the batch's own
users' resized entries): finish() releases a batch's users when it is launched, not when it
completes. The copies used to wait for all compute work enqueued so far, which put batch N+1's
copies behind batch N's whole forward, so under memory pressure the link idled while N computed
and N+1's first layer then waited for its copies. Batches run in order on one compute stream, so
the compute event of the latest batch that used any page since handed back, or any page of the
batch's own users, covers every earlier one; once that batch completed, the copies wait for
nothing.

Sequence numbers: begin() numbers each plan; reserved() names the batch to wait for (-1: none) and
marks the batch's users as last used by it; freed() notes a user whose pages went back to the free
list (eviction, invalidation) or may go back later unnoted (an aborted batch's users: a shrinking
reserve, an empty entry dropped); launched() keeps a batch's compute event (finish() or abort(), after
everything the batch enqueued), dropped once it and every earlier one completed. Off CUDA there are
no events and nothing waits. All calls run under the manager's index lock.
"""

from __future__ import annotations

import os
from collections import deque

# the copies wait for all compute work enqueued so far (the default before PageReuse, and always for
# a prefetch, whose free pages no batch accounts for)
ALL_EARLIER = object()

# HSTU_ONLOAD_WAITS_ALL=1: every onload waits for all earlier compute work (an experiment knob for
# same-call comparisons)
_WAITS_ALL = os.environ.get("HSTU_ONLOAD_WAITS_ALL", "0") == "1"


class PageReuse:
    def __init__(self, cuda: bool, waits_all: bool = _WAITS_ALL) -> None:
        self.cuda, self.waits_all = cuda, waits_all
        self._next = 0
        self._last_batch: dict[int, int] = {}  # user -> the last batch that reserved its pages
        self._freed_after = -1  # the latest batch that used a page now back in the free list
        self._events: deque = deque()  # (batch, compute event) of launched batches not yet known complete

    def begin(self) -> int:
        """The next batch's sequence number."""
        seq, self._next = self._next, self._next + 1
        return seq

    def freed(self, user: int) -> None:
        """`user`'s pages went back to the free list."""
        self._freed_after = max(self._freed_after, self._last_batch.pop(user, -1))

    def reserved(self, seq: int, users: list[int]) -> int:
        """Batch `seq` reserved pages for `users` (evictions already noted through freed()): the
        batch its onload must wait for (-1: none), and `users` now last used by `seq`."""
        last = self._last_batch
        wait = max(self._freed_after, max((last.get(u, -1) for u in users), default=-1))
        for u in users:
            last[u] = seq
        return wait

    def launched(self, seq: int, event) -> None:
        """Batch `seq` enqueued all its compute work, up to `event` (None off CUDA)."""
        if event is None:
            return
        events = self._events
        while events and events[0][1].query():  # in order: the first incomplete one bounds the rest
            events.popleft()
        events.append((seq, event))

    def wait_for(self, seq: int):
        """What an onload that must wait for batch `seq` waits for: None (nothing: no batch, or it
        completed, or no CUDA), that batch's compute event, or ALL_EARLIER (not known)."""
        if self.waits_all:
            return ALL_EARLIER
        if seq < 0 or not self.cuda:
            return None
        events = self._events
        if not events or seq < events[0][0]:
            return None  # dropped: it completed
        for s, event in events:
            if s == seq:
                return event
        return ALL_EARLIER  # launched without an event (cannot happen on CUDA): wait for everything
