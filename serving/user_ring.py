"""UserRing: consistent hashing of user ids over replicas, with a bounded-load fallback.

Each replica owns `vnodes` points on a 64-bit ring; a user belongs to the replica of the first point
at or after the user's hash. Adding or removing one of N replicas therefore moves only the users
whose arc changes owner (~1/N of them), so the others keep reaching the replica that holds their
K/V. `route` adds bounded load: an owner whose queue exceeds `max_queue` hands the request to the
next replica on the ring (the user's stable second home), and if that one is over the bound too,
to the least loaded replica. Pure Python, no Ray: the Ray Serve router (serving/ray_router.py)
wraps it.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass
from typing import Iterable, Mapping

AFFINITY, NEXT_ON_RING, LEAST_LOADED = "affinity", "next_on_ring", "least_loaded"


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass(frozen=True)
class Route:
    """Where one request goes and why: `decision` is AFFINITY, NEXT_ON_RING or LEAST_LOADED."""

    replica: str
    owner: str
    decision: str


class UserRing:
    """A consistent-hash ring of replica names; `owner(user)` is stable while the replicas are."""

    def __init__(self, replicas: Iterable[str] = (), vnodes: int = 256) -> None:
        if vnodes <= 0:
            raise ValueError(f"vnodes must be positive, got {vnodes}")
        self.vnodes = vnodes
        self._replicas: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []
        self.set_replicas(replicas)

    @property
    def replicas(self) -> frozenset[str]:
        return self._replicas

    def __len__(self) -> int:
        return len(self._replicas)

    def set_replicas(self, replicas: Iterable[str]) -> bool:
        """Rebuild the ring for `replicas`; returns whether the set changed."""
        new = frozenset(replicas)
        if new == self._replicas:
            return False
        points = sorted(
            (_hash64(f"{name}#{v}".encode()), name) for name in new for v in range(self.vnodes)
        )
        self._replicas = new
        self._points = [p for p, _ in points]
        self._owners = [name for _, name in points]
        return True

    def _start(self, user_id: int) -> int:
        if not self._points:
            raise LookupError(f"no replicas on the ring to own user {user_id}")
        i = bisect.bisect_left(self._points, _hash64(user_id.to_bytes(8, "big", signed=True)))
        return i % len(self._points)

    def owner(self, user_id: int) -> str:
        """The replica that owns `user_id` (raises LookupError on an empty ring)."""
        return self._owners[self._start(user_id)]

    def successors(self, user_id: int, count: int) -> list[str]:
        """The first `count` distinct replicas clockwise from the user's hash, owner first."""
        start, n = self._start(user_id), len(self._points)
        found: list[str] = []
        for step in range(n):
            name = self._owners[(start + step) % n]
            if name not in found:
                found.append(name)
                if len(found) == min(count, len(self._replicas)):
                    break
        return found

    def route(self, user_id: int, queue_lengths: Mapping[str, int], max_queue: int) -> Route:
        """The replica for one request of `user_id` given each replica's queue length (missing: 0)."""
        owner, *rest = self.successors(user_id, 2)
        if queue_lengths.get(owner, 0) <= max_queue:
            return Route(owner, owner, AFFINITY)
        if rest and queue_lengths.get(rest[0], 0) <= max_queue:
            return Route(rest[0], owner, NEXT_ON_RING)
        least = min(sorted(self._replicas), key=lambda name: queue_lengths.get(name, 0))
        return Route(least, owner, LEAST_LOADED)

    def shares(self) -> dict[str, float]:
        """Fraction of the hash space each replica owns (what it would receive of uniform users)."""
        if not self._points:
            return {}
        span = 1 << 64
        shares = dict.fromkeys(self._replicas, 0.0)
        previous = self._points[-1] - span
        for point, name in zip(self._points, self._owners):
            shares[name] += (point - previous) / span
            previous = point
        return shares
