"""UserAffinityRouter: Ray Serve's RequestRouter for the ranking deployment, routed by user id.

A request that carries the routing key `user_id` (a keyword argument of the handle call) goes to
the user's owner on a consistent-hash ring of the live replicas (serving/user_ring.py), so a
returning user reaches the replica that holds their K/V. Bounded load: when the owner's queue is
over `max_queue` the request goes to the next replica on the ring, then to the least loaded one; if
Ray finds the chosen replica full (max_ongoing_requests) it falls back to the others, least loaded
first. The ring follows the live replicas (Serve's updates, a replica seen dead, every routing
call), so a replica that joins or dies moves only the users of the arcs that change owner (~1/N).
Anchors: Ray Serve's PrefixCacheAffinityRouter (affinity with a load bound), NVIDIA Dynamo's
KV-aware router.

A request without the key goes to the least loaded replica. A call that carries several users'
requests (the ingress coalesces those that share an owner) is routed by its first user and lists
them all under `users`; each is counted.

Decisions are counted once per routed request (on_request_routed) into the RouterStats of the
deployment in this process (serving/router_stats.py), which the ingress exports on /metrics.
Ray Serve pickles this module by value into every process with a handle, so it holds no state of
its own: process state lives in router_stats, imported by reference.
"""

from __future__ import annotations

import logging

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from hstu.serving.router_stats import router_stats
from hstu.serving.user_ring import AFFINITY, LEAST_LOADED, NEXT_ON_RING, UserRing

logger = logging.getLogger(__name__)

ROUTING_KEY = "user_id"
USERS_KEY = "users"  # every user of a call that carries several requests (routed by the first)
DEFAULT_MAX_QUEUE = 16


def _user_id(pending_request: PendingRequest | None) -> int | None:
    user_id = None if pending_request is None else pending_request.kwargs.get(ROUTING_KEY)
    return None if user_id is None else int(user_id)


class UserAffinityRouter(RequestRouter):
    """Consistent hashing of user ids over the live replicas with bounded load (see the module doc)."""

    def initialize_state(self, max_queue: int = DEFAULT_MAX_QUEUE, vnodes: int = 256) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self._max_queue = max_queue
        self._ring = UserRing(vnodes=vnodes)
        self._stats = router_stats(self._deployment_id.name)

    def _sync_ring(self, candidates: list[RunningReplica]) -> dict[str, RunningReplica]:
        by_name = {r.replica_id.unique_id: r for r in candidates}
        if self._ring.set_replicas(by_name):
            logger.info("ring of %s: %d replicas %s", self._deployment_id.name, len(by_name), sorted(by_name))
            self._stats.ring_changed(self._ring.replicas)
        return by_name

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's push of the live replicas: the ring (and the ingress's replica count) follows at
        once, not only at the next routed request."""
        super().update_replicas(replicas)
        self._sync_ring(self._replicas_list)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sync_ring(self._replicas_list)

    def _queue_len(self, replica: RunningReplica) -> int:
        return self._replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = self._sync_ring(candidate_replicas)
        user_id = _user_id(pending_request)
        if user_id is None or not by_name:
            return [candidate_replicas]
        queues = {name: self._queue_len(r) for name, r in by_name.items()}
        chosen = self._ring.route(user_id, queues, self._max_queue).replica
        rest = sorted((r for name, r in by_name.items() if name != chosen), key=self._queue_len)
        return [[by_name[chosen]], rest] if rest else [[by_name[chosen]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Count the decision for every user the call carries (`users`, the ingress's coalesced
        calls; else the routing key alone), each against its own owner."""
        user_id = _user_id(pending_request)
        if user_id is None or not len(self._ring):
            return
        replica = replica_id.unique_id
        for user in pending_request.kwargs.get(USERS_KEY) or [user_id]:
            owner, *second = self._ring.successors(int(user), 2)
            decision = AFFINITY if replica == owner else NEXT_ON_RING if replica in second else LEAST_LOADED
            self._stats.routed(int(user), replica, decision)
