"""UserRing: stable owners, ~1/N of users move on a membership change, bounded-load fallbacks."""

from __future__ import annotations

import pytest

from hstu.serving.user_ring import AFFINITY, LEAST_LOADED, NEXT_ON_RING, UserRing

USERS = range(20_000)


def owners(ring: UserRing) -> dict[int, str]:
    return {u: ring.owner(u) for u in USERS}


def test_owner_is_deterministic_and_independent_of_replica_order():
    a, b = UserRing(["r0", "r1", "r2"]), UserRing(["r2", "r0", "r1"])
    assert owners(a) == owners(b)
    assert set(owners(a).values()) == {"r0", "r1", "r2"}


@pytest.mark.parametrize("replicas", [2, 3, 4, 8])
def test_users_spread_evenly_over_replicas(replicas):
    ring = UserRing([f"r{i}" for i in range(replicas)])
    counts: dict[str, int] = {}
    for name in owners(ring).values():
        counts[name] = counts.get(name, 0) + 1
    expected = len(USERS) / replicas
    assert all(abs(c - expected) / expected < 0.15 for c in counts.values()), counts
    assert sum(ring.shares().values()) == pytest.approx(1.0)


@pytest.mark.parametrize("before", [2, 3, 5])
def test_adding_a_replica_moves_only_its_share_of_users_and_only_to_it(before):
    ring = UserRing([f"r{i}" for i in range(before)])
    old = owners(ring)
    assert ring.set_replicas([f"r{i}" for i in range(before + 1)])
    new = owners(ring)
    moved = [u for u in USERS if old[u] != new[u]]
    assert all(new[u] == f"r{before}" for u in moved), "a user only ever moves to the new replica"
    assert len(moved) / len(USERS) == pytest.approx(1 / (before + 1), abs=0.05)


def test_losing_a_replica_moves_only_its_users():
    ring = UserRing(["r0", "r1", "r2"])
    old = owners(ring)
    ring.set_replicas(["r0", "r2"])
    new = owners(ring)
    assert all(old[u] == "r1" for u in USERS if old[u] != new[u])
    assert all(new[u] != "r1" for u in USERS)


def test_set_replicas_reports_whether_the_set_changed():
    ring = UserRing(["a", "b"])
    assert not ring.set_replicas(["b", "a"])
    assert ring.set_replicas(["a"]) and len(ring) == 1


def test_route_keeps_affinity_under_the_bound():
    ring = UserRing(["r0", "r1", "r2"])
    route = ring.route(42, {"r0": 3, "r1": 3, "r2": 3}, max_queue=4)
    assert route.decision == AFFINITY and route.replica == route.owner == ring.owner(42)


def test_route_falls_back_to_the_next_replica_on_the_ring_then_the_least_loaded():
    ring = UserRing(["r0", "r1", "r2"])
    owner, second = ring.successors(42, 2)
    third = ({"r0", "r1", "r2"} - {owner, second}).pop()
    busy_owner = ring.route(42, {owner: 9, second: 1, third: 0}, max_queue=4)
    assert (busy_owner.replica, busy_owner.owner, busy_owner.decision) == (second, owner, NEXT_ON_RING)
    both_busy = ring.route(42, {owner: 9, second: 7, third: 2}, max_queue=4)
    assert (both_busy.replica, both_busy.decision) == (third, LEAST_LOADED)


def test_successors_are_distinct_and_capped_by_the_replica_count():
    ring = UserRing(["r0", "r1"])
    assert sorted(ring.successors(7, 5)) == ["r0", "r1"]
    assert UserRing(["only"]).route(7, {"only": 100}, max_queue=1).replica == "only"


def test_an_empty_ring_names_the_user_it_cannot_place():
    with pytest.raises(LookupError, match="user 5"):
        UserRing().owner(5)
    with pytest.raises(ValueError, match="vnodes"):
        UserRing(vnodes=0)
