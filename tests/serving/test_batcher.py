"""Batcher behaviour with a fake model: batch formation, per-user order, error mapping, draining."""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time

import pytest
import torch

from hstu.model.batch import RankingRequest
from hstu.engine import RankOutput
from hstu.ops.kvcache.manager import CacheCapacityError, HistoryConflictError
from hstu.serving.batcher import Batcher
from hstu.serving.errors import RankError

from .conftest import TASKS, TINY

pytestmark = pytest.mark.anyio

# Tests that need a model thread apart from the loop: the loop must act while a launch runs.
_NEEDS_MODEL_THREAD = {
    "test_a_formed_batch_starts_when_the_running_one_ends_even_with_the_loop_busy",
    "test_cancelled_request_is_dropped_without_stopping_the_batcher",  # cancels during the first launch
    "test_a_request_its_timer_answered_gets_no_early_answer",  # the timer fires during the launch
}


@pytest.fixture(autouse=True, params=[False, True], ids=["model-thread", "inline"])
def batcher_mode(request, monkeypatch):
    """Every behaviour below holds with batches launched on the loop's thread too (inline: the
    engine process's model_on_loop)."""
    if request.param:
        if request.node.originalname in _NEEDS_MODEL_THREAD:
            pytest.skip("needs a model thread apart from the loop")
        monkeypatch.setattr(sys.modules[__name__], "Batcher", functools.partial(Batcher, inline=True))
    return request.param


def request(user: int, tag: int = 0) -> RankingRequest:
    """A request whose single candidate id carries `tag`, so outputs can be traced back."""
    return RankingRequest.create(user, [1, 2], [0, 1], [0, 1], [tag], config=TINY)


class FakeModel:
    """Records each batch as [(user, tag)], returns logits = tag; optional failure per batch."""

    def __init__(self, fail=None, delay_s: float = 0.0) -> None:
        self.batches: list[list[tuple[int, int]]] = []
        self.fail = fail
        self.delay_s = delay_s
        self.thread_names: set[str] = set()

    def rank(self, requests: list[RankingRequest]) -> list[RankOutput]:
        self.thread_names.add(threading.current_thread().name)
        batch = [(r.user_id, int(r.candidates[0])) for r in requests]
        self.batches.append(batch)
        if self.fail is not None:
            self.fail(batch)
        if self.delay_s:
            threading.Event().wait(self.delay_s)
        return [RankOutput(r.user_id, torch.full((1, 3), float(r.candidates[0])), 0, 1, TASKS) for r in requests]


async def submit_all(batcher: Batcher, requests: list[RankingRequest]) -> list:
    return await asyncio.gather(*(batcher.submit(r) for r in requests), return_exceptions=True)


async def test_same_user_never_twice_in_a_batch_and_each_user_runs_in_arrival_order(batcher_mode):
    model = FakeModel()
    batcher = Batcher(model.rank, max_batch_size=4, max_wait_s=0.05, max_queue=100)
    batcher.start()
    arrivals = [(1, 0), (1, 1), (2, 2), (1, 3), (3, 4), (2, 5), (4, 6), (5, 7), (6, 8), (1, 9)]
    outputs = await submit_all(batcher, [request(u, t) for u, t in arrivals])
    await batcher.close()

    assert [int(o.logits[0, 0]) for o in outputs] == [t for _, t in arrivals]
    for batch in model.batches:
        users = [u for u, _ in batch]
        assert len(users) == len(set(users)), f"user twice in batch {batch}"
        assert len(batch) <= 4
    order = [(u, t) for batch in model.batches for u, t in batch]
    for user in {u for u, _ in arrivals}:
        assert [t for u, t in order if u == user] == [t for u, t in arrivals if u == user]
    thread = threading.current_thread().name if batcher_mode else "hstu-model_0"
    assert model.thread_names == {thread}, "the model runs on the batcher's model thread, or inline on the loop's"


async def test_batch_closes_when_full_or_after_max_wait():
    model = FakeModel()
    batcher = Batcher(model.rank, max_batch_size=3, max_wait_s=0.2, max_queue=100)
    batcher.start()
    await submit_all(batcher, [request(u, u) for u in range(7)])
    assert [len(b) for b in model.batches] == [3, 3, 1]
    loop = asyncio.get_running_loop()
    started = loop.time()
    await batcher.submit(request(10, 10))
    waited = loop.time() - started
    await batcher.close()
    assert 0.15 <= waited < 2.0, f"a lone request waits about max_wait_s, waited {waited:.3f}s"


async def test_the_batch_window_and_queue_limit_count_from_when_the_request_reached_the_server():
    """An engine process reads a request a pipe transit after its front end sent it: the batch it
    opens closes max_wait_s after the send, not after the read, and its queue wait counts from then."""
    model = FakeModel()
    batcher = Batcher(model.rank, max_batch_size=4, max_wait_s=0.4, max_queue=100, max_queue_wait_s=1.0)
    batcher.start()
    started = time.monotonic()
    await batcher.submit(request(1, 1), arrived=started - 0.3)  # no arrival history: the window applies
    waited = time.monotonic() - started
    assert waited < 0.25, f"0.3 s of the 0.4 s window had passed before it was queued; waited {waited:.3f}s"
    with pytest.raises(RankError) as refused:  # already past its queue limit when it is queued
        await batcher.submit(request(2, 2), deadline=time.monotonic() + 5, arrived=time.monotonic() - 2.0)
    assert refused.value.status == 503 and "waited 2." in refused.value.detail
    await batcher.close()


async def test_batch_over_capacity_is_split_and_a_single_request_over_capacity_gets_503():
    def fail(batch):
        if len(batch) > 2 or any(u == 99 for u, _ in batch):
            raise CacheCapacityError(f"batch needs more pages than exist: {batch}")

    model = FakeModel(fail=fail)
    batcher = Batcher(model.rank, max_batch_size=8, max_wait_s=0.05, max_queue=100)
    batcher.start()
    outputs = await submit_all(batcher, [request(u, u) for u in (1, 2, 3, 4, 5, 99)])
    await batcher.close()

    assert [int(o.logits[0, 0]) for o in outputs[:5]] == [1, 2, 3, 4, 5]
    err = outputs[5]
    assert isinstance(err, RankError) and err.status == 503 and err.kind == "capacity"
    assert "user 99" in err.detail and "pages" in err.detail


async def test_errors_map_per_request_after_a_failing_batch_is_retried_one_by_one():
    def fail(batch):
        users = {u for u, _ in batch}
        if 7 in users:
            raise HistoryConflictError("user 7: history of 4 tokens is shorter than the 8 cached tokens")
        if 8 in users:
            raise ValueError("user 8: item_ids value 5000 out of range [0, 1000)")
        if 9 in users:
            raise RuntimeError("injected model failure")

    model = FakeModel(fail=fail)
    batcher = Batcher(model.rank, max_batch_size=8, max_wait_s=0.05, max_queue=100)
    batcher.start()
    outputs = await submit_all(batcher, [request(u, u) for u in (1, 7, 8, 9, 2)])
    after = await batcher.submit(request(3, 3))
    await batcher.close()

    assert int(outputs[0].logits[0, 0]) == 1 and int(outputs[4].logits[0, 0]) == 2
    conflict, invalid, internal = outputs[1:4]
    assert (conflict.status, conflict.kind) == (409, "history_conflict") and "shorter" in conflict.detail
    assert (invalid.status, invalid.kind) == (422, "invalid_request") and "5000" in invalid.detail
    assert (internal.status, internal.kind) == (500, "internal") and "injected model failure" in internal.detail
    assert int(after.logits[0, 0]) == 3, "the batcher keeps serving after a model failure"


async def test_close_finishes_queued_requests_then_refuses_new_ones():
    model = FakeModel(delay_s=0.02)
    batcher = Batcher(model.rank, max_batch_size=2, max_wait_s=0.0, max_queue=100)
    batcher.start()
    tasks = [asyncio.create_task(batcher.submit(request(u, u))) for u in range(9)]
    await asyncio.sleep(0)
    await batcher.close()
    assert [int(t.result().logits[0, 0]) for t in tasks] == list(range(9))
    with pytest.raises(RankError) as info:
        await batcher.submit(request(1))
    assert info.value.status == 503 and info.value.kind == "unavailable"


async def test_full_queue_answers_503_overloaded():
    model = FakeModel(delay_s=0.2)
    batcher = Batcher(model.rank, max_batch_size=1, max_wait_s=0.0, max_queue=2)
    batcher.start()
    outputs = await submit_all(batcher, [request(u, u) for u in range(3)])
    await batcher.close()
    assert isinstance(outputs[0], RankOutput) and isinstance(outputs[1], RankOutput)
    assert isinstance(outputs[2], RankError) and (outputs[2].status, outputs[2].kind) == (503, "overloaded")


async def test_cancelled_request_is_dropped_without_stopping_the_batcher():
    model = FakeModel(delay_s=0.05)
    batcher = Batcher(model.rank, max_batch_size=1, max_wait_s=0.0, max_queue=100)
    batcher.start()
    first = asyncio.create_task(batcher.submit(request(1, 1)))
    second = asyncio.create_task(batcher.submit(request(2, 2)))
    await asyncio.sleep(0.01)
    second.cancel()
    third = await batcher.submit(request(3, 3))
    await batcher.close()
    assert int((await first).logits[0, 0]) == 1 and int(third.logits[0, 0]) == 3
    assert second.cancelled()
    assert [b for b in model.batches if b == [(2, 2)]] == [], "a request cancelled while queued never runs"
    assert batcher.pending == 0
    assert len(model.batches) == 2


async def test_shorter_history_of_a_user_runs_first_when_both_are_queued():
    """An earlier request that reaches the queue after its successor (parsed later) still runs first."""
    model = FakeModel()
    batcher = Batcher(model.rank, max_batch_size=4, max_wait_s=0.05, max_queue=100)
    batcher.start()
    longer = RankingRequest.create(1, [1, 2, 3, 4], [0, 1, 0, 1], [0, 1, 2, 3], [1], config=TINY)
    shorter = RankingRequest.create(1, [1, 2], [0, 1], [0, 1], [2], config=TINY)
    await submit_all(batcher, [longer, shorter, request(2, 3)])
    await batcher.close()
    assert model.batches == [[(1, 2), (2, 3)], [(1, 1)]]


async def test_a_restarted_users_new_history_runs_after_the_old_requests_queued_before_it():
    """A user whose history restarted: the new, shorter history has the later events, so the old,
    longer requests still queued run first (shorter-first would switch histories twice)."""
    model = FakeModel()
    batcher = Batcher(model.rank, max_batch_size=4, max_wait_s=0.05, max_queue=100)
    batcher.start()
    old = [RankingRequest.create(1, [1] * n, [0] * n, list(range(n)), [n], config=TINY) for n in (6, 7)]
    restarted = RankingRequest.create(1, [2, 3], [0, 1], [50, 51], [2], config=TINY)
    await submit_all(batcher, [old[1], restarted, old[0]])  # arrival order scrambled
    await batcher.close()
    assert [b[0] for b in model.batches] == [(1, 6), (1, 7), (1, 2)]


async def test_a_formed_batch_starts_when_the_running_one_ends_even_with_the_loop_busy():
    """The next full batch queues behind the running one on the model thread: no event-loop turn between them."""
    release = threading.Event()
    started: list[float] = []

    def rank(requests):
        started.append(time.monotonic())
        if len(started) == 1:
            release.wait(5.0)
        return FakeModel().rank(requests)

    batcher = Batcher(rank, max_batch_size=2, max_wait_s=0.0, max_queue=100)
    batcher.start()
    first = asyncio.create_task(submit_all(batcher, [request(1, 1), request(2, 2)]))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(submit_all(batcher, [request(3, 3), request(4, 4)]))
    await asyncio.sleep(0.05)  # the batcher forms the second batch while the first runs
    release.set()
    blocked_from = time.monotonic()
    time.sleep(0.3)  # the loop is busy: only the model thread can start the second batch
    blocked_until = time.monotonic()
    await asyncio.gather(first, second)
    await batcher.close()
    assert len(started) == 2 and blocked_from <= started[1] < blocked_until


async def test_a_lone_request_skips_the_wait_once_arrivals_are_sparse():
    model = FakeModel()
    batcher = Batcher(model.rank, max_batch_size=4, max_wait_s=0.1, max_queue=100)
    batcher.start()
    waited = []
    for user in range(3):
        t0 = time.monotonic()
        await batcher.submit(request(user, user))
        waited.append(time.monotonic() - t0)
        await asyncio.sleep(0.3)
    await batcher.close()
    assert waited[0] >= 0.08, f"with no arrival history a lone request waits max_wait_s: {waited}"
    assert waited[-1] < 0.05, f"after gaps of 0.3s > max_wait_s it is dispatched at once: {waited}"


class _Gate:
    """Stands in for a launched batch's copy event: synchronize() blocks until released, then
    optionally raises (a kernel fault surfaces when the logits are read)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.released = threading.Event()
        self.error = error

    def query(self) -> bool:
        return self.released.is_set()

    def synchronize(self) -> None:
        assert self.released.wait(5.0), "gate never released"
        if self.error is not None:
            raise self.error


async def test_the_next_batch_launches_while_the_previous_one_completes():
    """A launch returning a PendingRank frees the model thread: batch 2 launches before batch 1's
    outputs are read, and each request still gets its own output."""
    from hstu.engine import PendingRank

    model = FakeModel()
    gates: list[_Gate] = []

    def launch(requests):
        gates.append(_Gate())
        return PendingRank(model.rank(requests), gates[-1])

    batcher = Batcher(launch, max_batch_size=2, max_wait_s=0.0, max_queue=100)
    batcher.start()
    first = asyncio.create_task(submit_all(batcher, [request(1, 1), request(2, 2)]))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if gates:
            break
    second = asyncio.create_task(submit_all(batcher, [request(3, 3), request(4, 4)]))
    for _ in range(100):  # batch 1 is still pending: batch 2 must launch anyway
        await asyncio.sleep(0.01)
        if len(gates) == 2:
            break
    assert len(gates) == 2 and not first.done(), "the second batch waited for the first one's outputs"
    for gate in gates:
        gate.released.set()
    outputs = await first + await second
    await batcher.close()
    assert [int(o.logits[0, 0]) for o in outputs] == [1, 2, 3, 4]


async def test_a_batch_keeps_growing_while_the_pipeline_of_launched_batches_is_full():
    """Launches return at once (outputs still on the GPU): once three batches are unanswered the
    next one cannot start, so it takes every arrival until one is answered instead of closing
    with the first request and leaving the later ones to a batch of their own."""
    from hstu.engine import PendingRank

    model = FakeModel()
    gates: list[_Gate] = []

    def launch(requests):
        gates.append(_Gate())
        return PendingRank(model.rank(requests), gates[-1])

    async def until(condition) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    batcher = Batcher(launch, max_batch_size=4, max_wait_s=0.0, max_queue=100)
    batcher.start()
    tasks = []
    for tag in (1, 2, 3):  # three batches launched and unanswered
        tasks.append(asyncio.create_task(batcher.submit(request(tag, tag))))
        await until(lambda: len(gates) == tag)
    for tag in (4, 5, 6):  # arriving apart, while the pipeline is full
        tasks.append(asyncio.create_task(batcher.submit(request(tag, tag))))
        await asyncio.sleep(0.03)
    assert len(gates) == 3
    gates[0].released.set()
    await until(lambda: len(gates) == 4)
    for gate in gates:
        gate.released.set()
    outputs = await asyncio.gather(*tasks)
    await batcher.close()
    assert model.batches == [[(1, 1)], [(2, 2)], [(3, 3)], [(4, 4), (5, 5), (6, 6)]]
    assert [int(o.logits[0, 0]) for o in outputs] == [1, 2, 3, 4, 5, 6]


async def test_a_batch_that_fails_when_its_outputs_are_read_answers_500_and_the_next_batch_is_served():
    from hstu.engine import PendingRank

    model = FakeModel()
    calls = []

    def launch(requests):
        calls.append(requests)
        gate = _Gate(RuntimeError("CUDA error: an illegal memory access") if len(calls) == 1 else None)
        gate.released.set()
        return PendingRank(model.rank(requests), gate)

    batcher = Batcher(launch, max_batch_size=2, max_wait_s=0.0, max_queue=100)
    batcher.start()
    failed = await submit_all(batcher, [request(1, 1), request(2, 2)])
    served = await submit_all(batcher, [request(3, 3)])
    await batcher.close()
    assert all(isinstance(e, RankError) and e.status == 500 and "illegal memory access" in e.detail for e in failed), failed
    assert int(served[0].logits[0, 0]) == 3


async def test_an_early_answer_comes_from_the_completion_thread_before_the_call_returns():
    """submit(answer=): the outcome reaches the callback on the thread that saw the outputs arrive,
    once, before the loop resolves the call, which returns the same outcome."""
    from hstu.engine import PendingRank

    model = FakeModel()
    gate = _Gate()
    answers: list[tuple[str, RankOutput]] = []
    batcher = Batcher(lambda rs: PendingRank(model.rank(rs), gate), max_batch_size=2, max_wait_s=0.0, max_queue=10)
    batcher.start()
    call = asyncio.create_task(
        batcher.submit(request(1, 7), answer=lambda o: answers.append((threading.current_thread().name, o)))
    )
    for _ in range(100):
        await asyncio.sleep(0.01)
        if model.batches:
            break
    assert answers == [] and not call.done(), "answered before the outputs arrived"
    gate.released.set()
    output = await call
    await batcher.close()
    assert len(answers) == 1 and answers[0][1] is output and int(output.logits[0, 0]) == 7
    assert answers[0][0].startswith("hstu-complete")


async def test_a_finished_batch_is_answered_before_the_next_one_launches():
    """A launch that returns its outputs at once (CPU) answers them on the launching thread, before
    the next batch of the same user launches (on the loop's thread, inline, the loop itself would
    otherwise launch it before resuming the first call)."""
    events: list[tuple[str, int]] = []
    model = FakeModel()

    def rank(requests):
        events.append(("launch", int(requests[0].candidates[0])))
        return model.rank(requests)

    batcher = Batcher(rank, max_batch_size=2, max_wait_s=0.0, max_queue=10)
    batcher.start()

    def answer(outcome) -> None:
        events.append(("answer", int(outcome.logits[0, 0])))

    await asyncio.gather(*(batcher.submit(request(1, tag), answer=answer) for tag in (1, 2)))
    await batcher.close()
    assert events == [("launch", 1), ("answer", 1), ("launch", 2), ("answer", 2)]


async def test_a_request_its_timer_answered_gets_no_early_answer():
    """The deadline passes while the batch runs: the timer answers 504 and the late outputs are
    neither handed to `answer` nor returned."""
    model = FakeModel(delay_s=0.3)
    answers = []
    batcher = Batcher(model.rank, max_batch_size=2, max_wait_s=0.0, max_queue=10)
    batcher.start()
    with pytest.raises(RankError) as raised:
        await batcher.submit(request(1, 1), deadline=time.monotonic() + 0.05, answer=answers.append)
    await batcher.close()
    assert raised.value.status == 504 and answers == []
