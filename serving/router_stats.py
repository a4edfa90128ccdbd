"""RouterStats: what the user-affinity router decided, per deployment and process, for /metrics.

The router (serving/ray_router.py) runs inside every process that holds a handle to the ranking
deployment (the ingress) and counts each routed request here: affinity hits, the bounded-load
fallbacks (next_on_ring, least_loaded), users whose replica changed since their previous request,
and the live replicas on the ring. RouterCollector exports them as hstu_router_*. No Ray import:
Ray Serve pickles the router's module by value, so the state it shares with the ingress lives here.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hstu.serving.user_ring import AFFINITY, LEAST_LOADED, NEXT_ON_RING

DEFAULT_TRACKED_USERS = 1 << 20


class RouterStats:
    """The routing decisions of one deployment's router in this process; thread-safe."""

    def __init__(self, max_tracked_users: int = DEFAULT_TRACKED_USERS) -> None:
        self.max_tracked_users = max_tracked_users
        self.decisions: Counter[str] = Counter({AFFINITY: 0, NEXT_ON_RING: 0, LEAST_LOADED: 0})
        self.moved_users = 0
        self.ring_changes = 0
        self.replicas: tuple[str, ...] = ()
        self._homes: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def routed(self, user_id: int, replica: str, decision: str) -> None:
        """Count one routed request; a user whose replica differs from their previous one moved."""
        with self._lock:
            self.decisions[decision] += 1
            previous = self._homes.pop(user_id, None)
            if previous is not None and previous != replica:
                self.moved_users += 1
            self._homes[user_id] = replica
            if len(self._homes) > self.max_tracked_users:
                self._homes.popitem(last=False)

    def ring_changed(self, replicas: frozenset[str]) -> None:
        with self._lock:
            self.ring_changes += 1
            self.replicas = tuple(sorted(replicas))


_STATS: dict[str, RouterStats] = {}
_STATS_LOCK = threading.Lock()


def router_stats(deployment: str) -> RouterStats:
    """The RouterStats of `deployment` in this process (created empty before its router exists)."""
    with _STATS_LOCK:
        return _STATS.setdefault(deployment, RouterStats())


class RouterCollector(Collector):
    """Exports a RouterStats at scrape time (hstu_router_*)."""

    def __init__(self, stats: RouterStats) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        m = CounterMetricFamily(
            "hstu_router_decisions", "Routed ranking requests by decision: affinity (the user's owner), "
            "next_on_ring or least_loaded (bounded-load fallbacks)", labels=["decision"],
        )
        for decision, count in sorted(s.decisions.items()):
            m.add_metric([decision], count)
        yield m
        yield CounterMetricFamily(
            "hstu_router_moved_users", "Requests whose user was last served by another replica", value=s.moved_users
        )
        yield CounterMetricFamily("hstu_router_ring_changes", "Changes of the live replica set", value=s.ring_changes)
        yield GaugeMetricFamily("hstu_router_replicas", "Live ranking replicas on the ring", value=len(s.replicas))
