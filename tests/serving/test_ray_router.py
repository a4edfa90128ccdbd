"""UserAffinityRouter's choices on stand-in replicas (no Ray cluster), its stats and the ingress's
merged /metrics text."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from prometheus_client import CollectorRegistry, Counter, generate_latest  # noqa: E402
from ray.serve._private.common import DeploymentHandleSource, DeploymentID  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402

from hstu.serving.ray_app import merged_exposition  # noqa: E402
from hstu.serving.ray_router import ROUTING_KEY, UserAffinityRouter  # noqa: E402
from hstu.serving.router_stats import RouterCollector, RouterStats, router_stats  # noqa: E402
from hstu.serving.user_ring import AFFINITY, LEAST_LOADED, NEXT_ON_RING, UserRing  # noqa: E402

NAMES = ("r-a", "r-b", "r-c")
_deployments = (DeploymentID(name=f"RouterUnderTest{i}", app_name="test") for i in itertools.count())


def _replica(router: UserAffinityRouter, name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=_id(router, name), max_ongoing_requests=64)


def _id(router: UserAffinityRouter, name: str) -> ReplicaID:
    return ReplicaID(name, router._deployment_id)


def _request(**kwargs) -> PendingRequest:
    return PendingRequest(args=[], kwargs=kwargs, metadata=SimpleNamespace(internal_request_id="x"), future=None)


@pytest.fixture
def router() -> UserAffinityRouter:
    """A router of its own deployment (so its RouterStats start empty), load bound 4."""
    r = UserAffinityRouter(
        deployment_id=next(_deployments), handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
    )
    r.initialize_state(max_queue=4)
    return r


def _choose(router: UserAffinityRouter, **kwargs) -> list[list[str]]:
    replicas = [_replica(router, n) for n in NAMES]
    ranks = asyncio.run(router.choose_replicas(replicas, _request(**kwargs)))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def _user_with_distinct_owner_and_successor(ring: UserRing) -> int:
    return next(u for u in range(1000) if len(set(ring.successors(u, 3))) == 3)


def test_a_user_goes_to_the_ring_owner_then_the_others_least_loaded_first(router):
    ring = UserRing(NAMES)
    user = _user_with_distinct_owner_and_successor(ring)
    owner, second, third = ring.successors(user, 3)
    router.replica_queue_len_cache.update(_id(router, second), 3)
    assert _choose(router, **{ROUTING_KEY: user}) == [[owner], [third, second]]


def test_an_owner_over_the_load_bound_hands_the_user_to_the_next_replica_on_the_ring(router):
    ring = UserRing(NAMES)
    user = _user_with_distinct_owner_and_successor(ring)
    owner, second, third = ring.successors(user, 3)
    router.replica_queue_len_cache.update(_id(router, owner), 5)
    assert _choose(router, **{ROUTING_KEY: user})[0] == [second]
    router.replica_queue_len_cache.update(_id(router, second), 5)
    assert _choose(router, **{ROUTING_KEY: user})[0] == [third]


def test_a_request_without_a_user_may_go_to_any_replica(router):
    assert _choose(router) == [list(NAMES)]


def test_routed_requests_count_affinity_fallbacks_and_moved_users(router):
    ring = UserRing(NAMES)
    user = _user_with_distinct_owner_and_successor(ring)
    owner, second, third = ring.successors(user, 3)
    _choose(router, **{ROUTING_KEY: user})  # syncs the ring
    stats = router_stats(router._deployment_id.name)
    for name in (owner, owner, second, third):
        router.on_request_routed(_request(**{ROUTING_KEY: user}), _id(router, name), None)
    assert dict(stats.decisions) == {AFFINITY: 2, NEXT_ON_RING: 1, LEAST_LOADED: 1}
    assert stats.moved_users == 2 and stats.replicas == NAMES


def test_router_stats_forget_the_oldest_users_beyond_their_bound():
    stats = RouterStats(max_tracked_users=2)
    for user in (1, 2, 3):
        stats.routed(user, "a", AFFINITY)
    stats.routed(1, "b", AFFINITY)  # user 1 was forgotten: not a move
    stats.routed(3, "b", AFFINITY)
    assert stats.moved_users == 1


def test_merged_metrics_declare_each_family_once_with_every_replica_labelled():
    own = CollectorRegistry()
    Counter("hstu_errors", "errors", ["kind"], registry=own).labels("timeout").inc()
    own.register(RouterCollector(RouterStats()))
    replica = CollectorRegistry()
    Counter("hstu_errors", "errors", ["kind"], registry=replica).labels("internal").inc(2)
    text = generate_latest(replica).decode()
    merged = merged_exposition(own, {"r1": text, "r2": text}).decode()
    assert merged.count("# TYPE hstu_errors_total counter") == 1
    assert 'hstu_errors_total{kind="timeout"} 1.0' in merged
    assert 'hstu_errors_total{kind="internal",replica="r1"} 2.0' in merged
    assert 'hstu_errors_total{kind="internal",replica="r2"} 2.0' in merged
    assert 'hstu_router_decisions_total{decision="affinity"} 0.0' in merged
