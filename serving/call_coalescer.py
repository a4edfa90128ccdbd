"""CallCoalescer: concurrent requests bound for the same remote worker share one remote call.

Ray Serve's ingress reaches a ranking replica through a deployment handle, and each handle call
costs far more than the ranking work it carries at small batches (routing, scheduling, two
serialisations and an actor task on either side: on the H200 the Ray path answered 0.2-0.6x the
requests/s of `hstu serve`, its replica idle half the time with batches of 1.3). The replica
batches anyway, so the ingress sends what is waiting for the same replica as one call: up to
`max_calls` calls per lane are in flight, and requests arriving meanwhile queue in their lane and
leave together (at most `max_group`) as soon as a call returns, or at once when `max_group` of them
wait. An idle lane sends a request at once (no added wait); a busy one sends batches, so the
per-call cost is shared, and no more than max_group - 1 requests ever wait for a slot.

A lane is what `lane_of(item)` names (the user's replica on the routing ring). `send(items)`
returns one outcome per item, in order: a value, or an exception (raised to that item's caller
alone). When `send` raises an exception `retryable` accepts (a lost replica), the items queue
again, in the lane `lane_of` now names, after the next of `backoff_s` (then fail with
`exhausted(exc)`); any other exception fails the call's items. A call silent for
`silent_after_s` (neither answered nor failed) counts as lost too: its awaitable is cancelled
(RemoteRuntime then cancels the Serve call, so a merely slow call does not run beside its retry)
and its items are retried: a call that reached a replica killed mid-request once never failed,
and held its request until the deadline (issue 16's CI flake, 2026-12-04). Every item has a
deadline: one that passes while queued is failed with `expired()` and never sent; a caller stops
waiting at its deadline, and what it waited for is dropped if not yet sent.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generic, Hashable, Sequence, TypeVar

T = TypeVar("T")


class CallSilent(Exception):
    """A remote call that neither answered nor failed within the coalescer's silent_after_s."""


@dataclass
class _Pending(Generic[T]):
    item: T
    deadline: float  # time.monotonic()
    future: asyncio.Future
    attempts: int = 0


@dataclass
class _Lane:
    queue: deque = field(default_factory=deque)
    in_flight: int = 0


@dataclass
class CoalescerStats:
    """Calls sent and the items they carried (for metrics: mean items per call)."""

    calls: int = 0
    items: int = 0
    retried: int = 0


class CallCoalescer(Generic[T]):
    """See the module docstring. All methods run on one event loop."""

    def __init__(
        self,
        send: Callable[[Sequence[T], Sequence[float]], Awaitable[Sequence[Any]]],
        lane_of: Callable[[T], Hashable],
        *,
        max_calls: int,
        max_group: int,
        retryable: Callable[[BaseException], bool],
        exhausted: Callable[[BaseException], BaseException],
        expired: Callable[[], BaseException],
        backoff_s: Sequence[float] = (0.05, 0.1, 0.2, 0.5),
        silent_after_s: float | None = None,
    ) -> None:
        if max_calls < 1 or max_group < 1:
            raise ValueError(f"max_calls and max_group must be >= 1, got {max_calls} and {max_group}")
        if silent_after_s is not None and silent_after_s <= 0:
            raise ValueError(f"silent_after_s must be > 0 (or None: wait until the deadline), got {silent_after_s}")
        self._silent_after_s = silent_after_s
        self._send, self._lane_of = send, lane_of
        self.max_calls, self.max_group = max_calls, max_group
        self._retryable, self._exhausted, self._expired = retryable, exhausted, expired
        self._backoff_s = tuple(backoff_s)
        self._lanes: dict[Hashable, _Lane] = {}
        self._tasks: set[asyncio.Task] = set()
        self.stats = CoalescerStats()

    @property
    def queued(self) -> int:
        """Items waiting for a call slot."""
        return sum(len(lane.queue) for lane in self._lanes.values())

    async def submit(self, item: T, deadline: float) -> Any:
        """`item`'s outcome, or expired() once `deadline` (time.monotonic()) passes."""
        pending = _Pending(item, deadline, asyncio.get_running_loop().create_future())
        self._enqueue(pending)
        try:
            return await asyncio.wait_for(asyncio.shield(pending.future), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise self._expired() from None
        finally:
            if not pending.future.done():
                pending.future.cancel()  # still queued: dropped when its lane reaches it

    def _enqueue(self, pending: _Pending[T]) -> None:
        lane = self._lanes.setdefault(self._lane_of(pending.item), _Lane())
        lane.queue.append(pending)
        self._pump(lane)

    def _pump(self, lane: _Lane) -> None:
        # A full group leaves at once even past max_calls: waiting only ever gathers a partial one,
        # and the router's load bound still sees every call (and moves them when a replica is busy).
        while lane.queue and (lane.in_flight < self.max_calls or len(lane.queue) >= self.max_group):
            group = self._take(lane)
            if not group:
                return
            lane.in_flight += 1
            task = asyncio.get_running_loop().create_task(self._call(lane, group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self, lane: _Lane) -> list[_Pending[T]]:
        """Up to max_group live items from the front of the lane; expired ones are failed."""
        now, group = time.monotonic(), []
        while lane.queue and len(group) < self.max_group:
            pending = lane.queue.popleft()
            if pending.future.done():
                continue  # its caller stopped waiting
            if pending.deadline <= now:
                pending.future.set_exception(self._expired())
                continue
            group.append(pending)
        return group

    async def _call(self, lane: _Lane, group: list[_Pending[T]]) -> None:
        try:
            now = time.monotonic()
            self.stats.calls += 1
            self.stats.items += len(group)
            call = self._send([p.item for p in group], [p.deadline - now for p in group])
            budget = max(p.deadline for p in group) - now
            wait_s = budget if self._silent_after_s is None else min(budget, self._silent_after_s)
            try:
                outcomes = await asyncio.wait_for(call, wait_s)
            except TimeoutError:
                if wait_s < budget:  # silent, not late: another call may still make the deadline
                    self._retry(group, CallSilent(f"no answer within {wait_s:.3g} s"))
                else:
                    self._fail(group, self._expired())
                return
            except Exception as exc:  # noqa: BLE001  (every outcome reaches its caller)
                if self._retryable(exc):
                    self._retry(group, exc)
                else:
                    self._fail(group, exc)
                return
            if len(outcomes) != len(group):
                self._fail(group, RuntimeError(f"remote call returned {len(outcomes)} outcomes for {len(group)} items"))
                return
            for pending, outcome in zip(group, outcomes):
                if pending.future.done():
                    continue
                if isinstance(outcome, BaseException):
                    pending.future.set_exception(outcome)
                else:
                    pending.future.set_result(outcome)
        finally:
            lane.in_flight -= 1
            self._pump(lane)

    def _fail(self, group: list[_Pending[T]], exc: BaseException) -> None:
        for pending in group:
            if not pending.future.done():
                pending.future.set_exception(exc)

    def _retry(self, group: list[_Pending[T]], exc: BaseException) -> None:
        loop = asyncio.get_running_loop()
        for pending in group:
            if pending.future.done():
                continue
            if pending.attempts >= len(self._backoff_s):
                pending.future.set_exception(self._exhausted(exc))
                continue
            delay = self._backoff_s[pending.attempts]
            pending.attempts += 1
            self.stats.retried += 1
            loop.call_later(delay, self._requeue, pending)

    def _requeue(self, pending: _Pending[T]) -> None:
        if not pending.future.done():
            self._enqueue(pending)

    async def close(self) -> None:
        """Wait for the calls in flight (their callers get their outcomes)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
