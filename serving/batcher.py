"""Batcher: an asyncio task that groups ranking requests into batches and runs them off the loop.

Invariants:
  - A batch never holds two requests of the same user. A request whose user is already in the
    batch being formed waits in `_carry`; carried requests go first into the next batch, so each
    user's requests run in arrival order, one batch after another.
  - Batches run one at a time, in formation order, on one model thread (`_executor`); the event
    loop only forms batches and resolves futures. Batch N+1 is formed while batch N runs.
  - A batch is closed when it holds `max_batch_size` requests or `max_wait_s` after its oldest
    request arrived, whichever is first.
  - Every submitted request gets exactly one outcome (scores or a RankError); no exception from
    a batch stops the loop. A batch that needs more KV pages than exist unpinned is split in
    halves; a batch that raises anything else is retried one request at a time, so each request
    gets its own error and the healthy ones get scores.
  - A request reaches the model thread only if, when its batch is dispatched, its client still
    waits (submit() was not cancelled), its deadline has not passed and it has waited in the
    queue at most `max_queue_wait_s`. Otherwise it is dropped there: answered 504 (deadline) or
    503 overloaded (queue wait), or not at all (the client went away).
  - Each request's timer answers it whatever the model thread is doing: 503 overloaded once the
    queue wait is over while still queued, 504 at the deadline (queued or running; a running
    batch's late result is then dropped).
  - close(timeout_s) refuses new requests and runs everything already queued; at the deadline
    every request still unanswered gets 503 unavailable, then the model thread is joined (it
    finishes the batch it is running, whose results are dropped).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from hstu.model.batch import RankingRequest
from hstu.engine import RankOutput
from hstu.ops.kvcache.manager import CacheCapacityError
from hstu.serving.errors import RETRY_AFTER_S, RankError, classify
from hstu.serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)

RankFn = Callable[[list[RankingRequest]], Sequence[RankOutput]]
_CLOSE = object()


@dataclass(eq=False)
class _Item:
    request: RankingRequest
    future: asyncio.Future
    enqueued: float
    deadline: float
    queue_deadline: float
    started: bool = False  # its batch went to the model thread
    refused: bool = False  # answered 503/504 before that (by its timer or at dispatch)
    timer: asyncio.TimerHandle | None = None


class Batcher:
    """Forms batches of distinct users and runs `rank_fn` on them in a worker thread."""

    def __init__(
        self,
        rank_fn: RankFn,
        max_batch_size: int,
        max_wait_s: float,
        max_queue: int,
        metrics: ServingMetrics | None = None,
        max_queue_wait_s: float = math.inf,
    ) -> None:
        if max_batch_size <= 0 or max_queue <= 0 or max_wait_s < 0 or max_queue_wait_s <= 0:
            raise ValueError(
                "need max_batch_size > 0, max_queue > 0, max_wait_s >= 0, max_queue_wait_s > 0; "
                f"got {max_batch_size}, {max_queue}, {max_wait_s}, {max_queue_wait_s}"
            )
        self.rank_fn = rank_fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self.metrics = metrics
        self._queue: asyncio.Queue = asyncio.Queue()
        self._carry: deque[_Item] = deque()
        self._live: set[_Item] = set()
        self._closing = False
        self._input_done = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="hstu-model")
        self._task: asyncio.Task | None = None

    @property
    def pending(self) -> int:
        """Requests submitted and not yet answered."""
        return len(self._live)

    def start(self) -> None:
        """Start the batching task on the running event loop."""
        if self._task is not None:
            raise RuntimeError("batcher already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="hstu-batcher")

    async def submit(self, request: RankingRequest, deadline: float = math.inf) -> RankOutput:
        """Queue one request and wait for its output until `deadline` (time.monotonic()).

        Raises RankError when it gets none: 503 unavailable (closed), 503 overloaded (queue full
        or queued longer than max_queue_wait_s), 504 timeout (deadline). Cancelling the caller
        (the client went away) drops the request before it reaches the model thread."""
        if self._closing or self._task is None or self._task.done():
            raise RankError(
                503,
                "unavailable",
                "the server is not accepting requests (starting or shutting down)",
                retry_after_s=RETRY_AFTER_S,
            )
        if len(self._live) >= self.max_queue:
            raise self._overloaded(f"{len(self._live)} requests are already waiting (max_queue {self.max_queue})")
        now = time.monotonic()
        item = _Item(request, asyncio.get_running_loop().create_future(), now, deadline, now + self.max_queue_wait_s)
        self._live.add(item)
        self._queue.put_nowait(item)
        self._arm(item)
        try:
            return await item.future
        finally:
            self._live.discard(item)
            if item.timer is not None:
                item.timer.cancel()

    def _arm(self, item: _Item) -> None:
        """Schedule _expire at the item's next limit: the queue wait until it starts, then the deadline."""
        limit = item.deadline if item.started else min(item.deadline, item.queue_deadline)
        if limit != math.inf:
            item.timer = asyncio.get_running_loop().call_later(max(0.0, limit - time.monotonic()), self._expire, item)

    def _expire(self, item: _Item) -> None:
        if item.future.done():
            return
        refusal = self._refusal(item, time.monotonic())
        if refusal is None:  # it started in time: wait for the deadline now
            self._arm(item)
            return
        if not item.started:
            item.refused = True
            self._count_drop(refusal.kind)
        item.future.set_exception(refusal)

    def _refusal(self, item: _Item, now: float) -> RankError | None:
        """Why `item` gets no scores any more at `now` (deadline, queue wait), else None."""
        if now >= item.deadline:
            where = "while running" if item.started else "in the queue"
            return RankError(504, "timeout", f"request deadline passed {where} after {now - item.enqueued:.3f}s")
        if not item.started and now >= item.queue_deadline:
            waited = f"waited {now - item.enqueued:.3f}s in the queue (max_queue_wait {self.max_queue_wait_s:.3f}s)"
            return self._overloaded(waited)
        return None

    def _overloaded(self, detail: str) -> RankError:
        return RankError(503, "overloaded", detail, retry_after_s=RETRY_AFTER_S)

    async def run_on_model_thread(self, fn, *args):
        """Run fn(*args) on the model thread, between batches (e.g. a prefetch)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def close(self, timeout_s: float | None = None) -> None:
        """Refuse new requests and finish the queued ones; after `timeout_s` answer the rest 503.
        Then stop the task and join the model thread."""
        if not self._closing:
            self._closing = True
            self._queue.put_nowait(_CLOSE)
        if self._task is not None:
            done, _ = await asyncio.wait((self._task,), timeout=timeout_s)
            if not done:
                self._refuse_all(f"the server shut down before this request finished (deadline {timeout_s}s)")
                await self._task
        self._executor.shutdown(wait=True)

    def _refuse_all(self, detail: str) -> None:
        live = [item for item in self._live if not item.future.done()]
        logger.warning("shutdown deadline: answering %d unfinished requests 503", len(live))
        for item in live:
            item.future.set_exception(RankError(503, "unavailable", detail))

    # ------------------------------------------------------------------ loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._collect()
            if not batch:
                return
            started = time.monotonic()
            batch = [item for item in batch if self._admit(item, started)]
            if not batch:
                continue
            if self.metrics is not None:
                self.metrics.batch_size.observe(len(batch))
                for item in batch:
                    self.metrics.queue_wait.observe(started - item.enqueued)
            try:
                outcomes = await loop.run_in_executor(self._executor, self._execute, [i.request for i in batch])
            except Exception as exc:  # _execute maps errors itself; this is a last line of defence
                logger.exception("batch of %d requests failed outside the model call", len(batch))
                outcomes = [RankError(500, "internal", f"batch failed: {type(exc).__name__}: {exc}") for _ in batch]
            if self.metrics is not None:
                self.metrics.batch_latency.observe(time.monotonic() - started)
            for item, outcome in zip(batch, outcomes):
                if item.future.done():  # answered meanwhile: 504 while running, 503 at the shutdown deadline
                    continue
                if isinstance(outcome, RankError):
                    item.future.set_exception(outcome)
                else:
                    item.future.set_result(outcome)

    async def _collect(self) -> list[_Item]:
        """The next batch: carried requests first, then the queue, until full or the wait expires."""
        batch: list[_Item] = []
        users: set[int] = set()
        carried, self._carry = self._carry, deque()
        while carried and len(batch) < self.max_batch_size:
            self._offer(carried.popleft(), batch, users)
        self._carry.extend(carried)
        while len(batch) < self.max_batch_size and not self._input_done:
            if not self._queue.empty():
                item = self._queue.get_nowait()
            elif batch:
                remaining = batch[0].enqueued + self.max_wait_s - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            else:
                item = await self._queue.get()
            if item is _CLOSE:
                self._input_done = True
                break
            self._offer(item, batch, users)
        return batch

    def _admit(self, item: _Item, now: float) -> bool:
        """Whether `item` still goes to the model thread; answers it here when it does not."""
        if self._abandoned(item):
            return False
        refusal = self._refusal(item, now)
        if refusal is not None:
            item.refused = True
            self._count_drop(refusal.kind)
            item.future.set_exception(refusal)
            return False
        item.started = True
        return True

    def _abandoned(self, item: _Item) -> bool:
        """Whether its caller stopped waiting (the client went away, or a timer refused it)."""
        if not item.future.done():
            return False
        if not item.refused:
            self._count_drop("abandoned")
        return True

    def _count_drop(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.dropped.labels(reason).inc()

    def _offer(self, item: _Item, batch: list[_Item], users: set[int]) -> None:
        if self._abandoned(item):
            return
        user = item.request.user_id
        if user in users:
            self._carry.append(item)
        else:
            batch.append(item)
            users.add(user)

    # ----------------------------------------------------------- model thread
    def _execute(self, requests: list[RankingRequest]) -> list[RankOutput | RankError]:
        """Outcome per request, in order; runs on the model thread."""
        try:
            outputs = list(self.rank_fn(requests))
        except CacheCapacityError as exc:
            if len(requests) == 1:
                return [classify(exc, requests[0].user_id)]
            logger.info("batch of %d does not fit in the KV cache (%s); splitting it", len(requests), exc)
            if self.metrics is not None:
                self.metrics.batch_splits.inc()
            mid = len(requests) // 2
            return self._execute(requests[:mid]) + self._execute(requests[mid:])
        except Exception as exc:
            if len(requests) == 1:
                return [classify(exc, requests[0].user_id)]
            logger.info(
                "batch of %d failed (%s: %s); retrying its requests one by one", len(requests), type(exc).__name__, exc
            )
            return [outcome for r in requests for outcome in self._execute([r])]
        if len(outputs) != len(requests):
            detail = f"model returned {len(outputs)} outputs for {len(requests)} requests"
            return [RankError(500, "internal", detail) for _ in requests]
        return outputs
