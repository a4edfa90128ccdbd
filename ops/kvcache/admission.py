"""Offload admission and pacing: which users' chunks are worth writing to the host tier, and how fast.

Every newly full chunk of every user used to be copied to the host whether or not the user came
back. Admission keeps a small frequency sketch of users seen (as TinyLFU does, with aging): a
user's chunks are offloaded only once it was seen `min_seen` times within the window; a user not
admitted is recomputed if it returns after its GPU pages were evicted. Pacing is a token bucket in
bytes per second: the offload worker waits for budget before a copy, so D2H traffic stays under a
set share of the link and never crowds the next batch's onload.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict


class FrequencyAdmission:
    """Admit a user once it was seen `min_seen` times; remembers at most `capacity` users and halves
    every count each `window` sightings (aging), so old popularity fades."""

    def __init__(self, min_seen: int = 2, capacity: int = 1 << 16, window: int = 1 << 18) -> None:
        if min_seen < 0 or capacity <= 0 or window <= 0:
            raise ValueError(f"need min_seen >= 0, capacity > 0, window > 0; got {min_seen}, {capacity}, {window}")
        self.min_seen, self.capacity, self.window = min_seen, capacity, window
        self._counts: OrderedDict[int, int] = OrderedDict()
        self._sightings = 0
        self._lock = threading.Lock()

    def see(self, user: int) -> int:
        """Record one request of `user`; its count after this sighting."""
        with self._lock:
            count = self._counts.pop(user, 0) + 1
            self._counts[user] = count
            if len(self._counts) > self.capacity:
                self._counts.popitem(last=False)
            self._sightings += 1
            if self._sightings >= self.window:
                self._sightings = 0
                for u in list(self._counts):
                    halved = self._counts[u] // 2
                    if halved:
                        self._counts[u] = halved
                    else:
                        del self._counts[u]
            return count

    def admits(self, user: int) -> bool:
        with self._lock:
            return self._counts.get(user, 0) >= self.min_seen


class ByteBudget:
    """Token bucket of `bytes_per_s` (None: unlimited) holding at most `burst_bytes`."""

    def __init__(self, bytes_per_s: float | None, burst_bytes: int | None = None) -> None:
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be positive or None, got {bytes_per_s}")
        self.rate = bytes_per_s
        self.burst = burst_bytes if burst_bytes is not None else int(bytes_per_s or 0)
        self._tokens = float(self.burst)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def delay_for(self, nbytes: int) -> float:
        """Seconds to wait before sending `nbytes` (taken from the bucket now; 0 when unlimited)."""
        if self.rate is None:
            return 0.0
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= nbytes
            return max(0.0, -self._tokens / self.rate)
