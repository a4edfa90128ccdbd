"""CallCoalescer (serving/call_coalescer.py): requests for one lane share calls, at most max_calls
in flight unless a full group waits; outcomes reach their own callers; lost calls retry in the
lane named now; deadlines."""

from __future__ import annotations

import asyncio
import time

import pytest

from hstu.serving.call_coalescer import CallCoalescer


class Lost(Exception):
    pass


class Remote:
    """A fake remote worker: records each call's items; a call waits until released."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.release = asyncio.Event()
        self.fail_next: list[BaseException] = []
        self.in_flight = self.max_in_flight = 0

    async def send(self, items, timeouts):
        assert all(t > 0 for t in timeouts)
        self.calls.append(list(items))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.release.wait()
            if self.fail_next:
                raise self.fail_next.pop(0)
            return [ValueError(f"bad {i}") if i < 0 else i * 10 for i in items]
        finally:
            self.in_flight -= 1


def coalescer(remote: Remote, lane_of=lambda item: abs(item) % 2, **kw) -> CallCoalescer[int]:
    args = dict(max_calls=1, max_group=3, backoff_s=(0.0, 0.0))
    args.update(kw)
    return CallCoalescer(
        remote.send, lane_of, retryable=lambda e: isinstance(e, Lost),
        exhausted=lambda e: RuntimeError(f"lost: {e}"), expired=lambda: TimeoutError("deadline"), **args,
    )


def run(coro):
    return asyncio.run(coro)


def test_waiting_requests_share_the_next_call_per_lane_and_get_their_own_outcomes():
    async def go():
        remote = Remote()
        c = coalescer(remote)
        deadline = time.monotonic() + 5
        tasks = [asyncio.create_task(c.submit(i, deadline)) for i in (2, 4, 6, 8, 10, -12, 3)]
        await asyncio.sleep(0.01)
        # one call per lane at once: 2 (even lane) and 3 (odd lane) alone; then a full group of the
        # even lane leaves without a free slot, and the partial rest waits
        assert sorted(remote.calls) == [[2], [3], [4, 6, 8]]
        remote.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return remote, c, results

    remote, c, results = run(go())
    assert results[:5] == [20, 40, 60, 80, 100] and results[6] == 30
    assert isinstance(results[5], ValueError) and "bad -12" in str(results[5])  # only that caller fails
    assert [2] in remote.calls and [4, 6, 8] in remote.calls and [10, -12] in remote.calls  # max_group 3
    assert c.stats.calls == 4 and c.stats.items == 7
    assert remote.max_in_flight == 3


def test_an_idle_lane_sends_at_once_and_max_calls_bounds_the_calls_in_flight():
    async def go():
        remote = Remote()
        c = coalescer(remote, lane_of=lambda item: 0, max_calls=3, max_group=8)
        deadline = time.monotonic() + 5
        tasks = [asyncio.create_task(c.submit(i, deadline)) for i in range(10)]
        await asyncio.sleep(0.01)
        first = [list(call) for call in remote.calls]
        remote.release.set()
        return first, await asyncio.gather(*tasks), remote

    first, results, remote = run(go())
    assert first == [[0], [1], [2]]  # three calls at once, the rest wait for a slot
    assert results == [i * 10 for i in range(10)] and remote.max_in_flight == 3
    assert [3, 4, 5, 6, 7, 8, 9] in remote.calls


def test_a_lost_call_is_retried_in_the_lane_named_now_then_fails_with_exhausted():
    async def go():
        remote = Remote()
        lanes = {"now": 0}
        c = coalescer(remote, lane_of=lambda item: lanes["now"])
        remote.fail_next = [Lost("replica died")]
        remote.release.set()
        first = await c.submit(5, time.monotonic() + 5)
        lanes["now"] = 1
        remote.fail_next = [Lost("a"), Lost("b"), Lost("c")]
        with pytest.raises(RuntimeError, match="lost: c"):
            await c.submit(6, time.monotonic() + 5)
        return first, c, remote

    first, c, remote = run(go())
    assert first == 50 and remote.calls == [[5], [5], [6], [6], [6]] and c.stats.retried == 3


def test_a_silent_call_is_retried_and_answered_before_the_deadline():
    """A call that neither answers nor fails (a replica killed mid-request) holds its items only
    for silent_after_s; the retry answers them."""

    class Hangs(Remote):
        async def send(self, items, timeouts):
            if not self.calls:
                self.calls.append(list(items))
                await asyncio.Event().wait()  # never answers
            return await super().send(items, timeouts)

    async def go():
        remote = Hangs()
        remote.release.set()
        c = coalescer(remote, lane_of=lambda item: 0, silent_after_s=0.05)
        started = time.monotonic()
        outcome = await c.submit(7, time.monotonic() + 5)
        return outcome, time.monotonic() - started, remote, c

    outcome, waited, remote, c = run(go())
    assert outcome == 70 and waited < 1 and remote.calls == [[7], [7]] and c.stats.retried == 1


def test_a_call_late_for_its_deadline_is_expired_not_retried():
    async def go():
        remote = Remote()  # never released
        c = coalescer(remote, lane_of=lambda item: 0, silent_after_s=10.0)
        with pytest.raises(TimeoutError, match="deadline"):
            await c.submit(3, time.monotonic() + 0.05)
        return remote, c

    remote, c = run(go())
    assert remote.calls == [[3]] and c.stats.retried == 0


def test_other_failures_reach_every_item_of_the_call():
    async def go():
        remote = Remote()
        c = coalescer(remote, lane_of=lambda item: 0, max_group=4)
        remote.fail_next = [KeyError("broken")]
        tasks = [asyncio.create_task(c.submit(i, time.monotonic() + 5)) for i in range(3)]
        await asyncio.sleep(0.01)
        remote.release.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = run(go())
    assert isinstance(results[0], KeyError) and results[1:] == [10, 20]


def test_deadlines_bound_the_wait_and_expired_items_are_never_sent():
    async def go():
        remote = Remote()
        c = coalescer(remote, lane_of=lambda item: 0)
        slow = asyncio.create_task(c.submit(1, time.monotonic() + 5))
        await asyncio.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):
            await c.submit(2, time.monotonic() + 0.05)  # queued behind the call in flight
        waited = time.monotonic() - started
        remote.release.set()
        return waited, await slow, remote, c

    waited, slow, remote, c = run(go())
    assert waited < 1 and slow == 10 and remote.calls == [[1]] and c.queued == 0


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="max_calls and max_group"):
        coalescer(Remote(), max_calls=0)
    with pytest.raises(ValueError, match="silent_after_s"):
        coalescer(Remote(), silent_after_s=0)
