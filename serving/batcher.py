"""Batcher: an asyncio task that groups ranking requests into batches and runs them off the loop.

Invariants:
  - A batch never holds two requests of the same user. A request whose user is already in the
    batch being formed waits in `_carry`; carried requests go first into the next batch, so each
    user's requests run in arrival order, one batch after another.
  - Batches are launched one at a time, in formation order, on one model thread (`_executor`);
    the event loop only forms batches and resolves futures. (inline: on the loop's own thread,
    for a process whose loop does nothing else much, the engine process; see
    ServerSettings.model_on_loop.) Batch N+1 is formed while batch N is
    launched and keeps growing until it could start: the model thread free and fewer than the
    in-flight limit of batches unanswered (or it is full, then it queues behind N), so a busy
    model thread or GPU always starts on the largest batch the arrivals allow.
  - A launch may return a PendingRank (the GPU still computing): the completion thread waits for
    its logits while the model thread launches the next batch, so one batch's host work overlaps
    the previous one's kernels. At most `_MAX_IN_FLIGHT` batches are between formed and answered.
  - With the model thread idle, a batch is closed when it holds `max_batch_size` requests or
    `max_wait_s` after its oldest request arrived (at the server: submit's `arrived`); the wait is skipped while requests arrive
    further apart than max_wait_s (it would add latency without adding requests).
  - Of two requests of one user in the queue, the older one runs first: the one whose last event
    is earlier, or, at equal last events, the shorter history. (Shorter-first alone ran a
    restarted user's new, short history before the old, long requests still queued, and each
    switch between the two invalidated and recomputed the user: ~4 per restart under load.)
  - A request submitted with `answer` also has its outcome handed to that callback, once, on the
    thread that saw its batch's outputs arrive (the completion thread, or the launching thread when
    the launch finished them), before the loop resolves it; never when a timer or the shutdown
    answered it first (`_Item.claimed`, under one lock: whichever decides first wins).
  - Every submitted request gets exactly one outcome (scores or a RankError); no exception from
    a batch stops the loop. A batch that needs more KV pages than exist unpinned is split in
    halves; a batch that raises anything else is retried one request at a time, so each request
    gets its own error and the healthy ones get scores.
  - A request is ranked only if, when its batch starts on the model thread, its client still
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
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

from hstu.model.batch import RankingRequest
from hstu.engine import PendingRank, RankOutput
from hstu.ops.kvcache.manager import CacheCapacityError
from hstu.serving.errors import RETRY_AFTER_S, RankError, classify
from hstu.serving.metrics import ServingMetrics

logger = logging.getLogger(__name__)

RankFn = Callable[[list[RankingRequest]], "Sequence[RankOutput] | PendingRank"]
_CLOSE = object()
_MAX_IN_FLIGHT = 3  # batches past formation: one completing on the GPU, one launching, one formed behind
# ... while launches return outputs still on their way (CUDA); when a launch returns finished
# outputs (CPU) there is nothing to overlap: one running, one formed behind it, settled on the loop.
_MAX_IN_FLIGHT_SYNC = 2
_GAP_WEIGHT = 0.2  # weight of the latest inter-arrival gap in the running mean


@dataclass(eq=False)
class _Item:
    request: RankingRequest
    future: asyncio.Future
    enqueued: float  # when submit() queued it here (the queue-wait metric counts from then)
    deadline: float
    queue_deadline: float
    arrived: float  # when it reached the server (its batch window and queue limit count from then)
    started: bool = False  # its batch went to the model thread
    refused: bool = False  # answered 503/504 before that (by its timer or when its batch started)
    timer: asyncio.TimerHandle | None = None
    # submit's `answer`: called with the outcome as soon as it is known, on whichever thread has it
    answer: Callable[[RankOutput | RankError], None] | None = None
    claimed: bool = False  # its outcome is decided (an early answer, a timer, the shutdown), under Batcher._claims


@dataclass
class _Ran:
    """What the model thread did with one batch, for _deliver to apply on the loop."""

    outcomes: list[tuple[_Item, RankOutput | RankError]]
    dropped: list[_Item]  # not run: its future was already done when the batch started
    started: float
    seconds: float | None  # from the batch's start to its outputs on the host; None when nothing ran
    pending: tuple[list[_Item], PendingRank] | None = None  # launched, outputs not yet on the host
    formed: float | None = None  # handed to the model thread's executor
    launched: float | None = None  # the model thread done with it
    outputs_at: float | None = None  # its outputs on the host

    def phases(self) -> dict[str, float]:
        """Seconds of the batch's hand-offs and work (hstu_batch_phase_seconds): handoff (formed
        until the model thread starts it), launch (the model thread's work), outputs (launched
        until its outputs reach the host: the GPU's queue and kernels), deliver (until the loop
        answers it)."""
        if None in (self.formed, self.launched, self.outputs_at):
            return {}
        return {
            "handoff": self.started - self.formed,
            "launch": self.launched - self.started,
            "outputs": self.outputs_at - self.launched,
            "deliver": time.monotonic() - self.outputs_at,
        }

    def settle(self) -> "_Ran":
        """On the completion thread: wait for the pending outputs (see _settle)."""
        if self.pending is not None:
            items, pending = self.pending
            self.outcomes += zip(items, _settle(pending, len(items)))
            self.pending = None
            self.outputs_at = time.monotonic()
            self.seconds = self.outputs_at - self.started
        return self


def _recency(request: RankingRequest) -> tuple[int, int]:
    """Order of one user's requests: the last event's timestamp, then the number of events. A
    user's next request adds events (never earlier ones: timestamps do not decrease) or starts a
    new history, whose events come after the old ones."""
    n = request.num_events
    return (int(request.timestamps[n - 1]) if n else -1, n)


def _settle(outputs: "Sequence[RankOutput] | PendingRank", expected: int) -> list[RankOutput | RankError]:
    """Outcome per request of a rank_fn result: a launched batch's error (a CUDA fault shows when
    its logits are read) answers each of its requests 500, as does an output count that differs."""
    try:
        outputs = list(outputs.result() if isinstance(outputs, PendingRank) else outputs)
    except Exception as exc:
        logger.exception("a launched batch of %d requests failed", expected)
        return [RankError(500, "internal", f"batch failed: {type(exc).__name__}: {exc}") for _ in range(expected)]
    if len(outputs) != expected:
        detail = f"model returned {len(outputs)} outputs for {expected} requests"
        return [RankError(500, "internal", detail) for _ in range(expected)]
    return outputs


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
        inline: bool = False,
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
        # inline: batches launch on the loop's thread (a process whose loop does little else: the
        # engine process, ServerSettings.model_on_loop); else on a model thread of their own
        self._executor = None if inline else ThreadPoolExecutor(1, thread_name_prefix="hstu-model")
        self._completer = ThreadPoolExecutor(1, thread_name_prefix="hstu-complete")
        self._claims = threading.Lock()  # _Item.claimed, set by the loop's timers and the early answers
        self._task: asyncio.Task | None = None
        self._getter: asyncio.Task | None = None
        self._last_arrival: float | None = None
        self._overlapping = False  # a launch returned outputs still being computed
        self._arrival_gap_s = 0.0  # starts as 'busy': wait max_wait_s until arrivals prove sparse

    @property
    def pending(self) -> int:
        """Requests submitted and not yet answered."""
        return len(self._live)

    def start(self) -> None:
        """Start the batching task on the running event loop."""
        if self._task is not None:
            raise RuntimeError("batcher already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="hstu-batcher")

    async def submit(
        self,
        request: RankingRequest,
        deadline: float = math.inf,
        arrived: float | None = None,
        answer: Callable[[RankOutput | RankError], None] | None = None,
    ) -> RankOutput:
        """Queue one request and wait for its output until `deadline` (time.monotonic()).
        `arrived`: when the request reached the server (the HTTP handler's first line), if earlier
        than now: its body was parsed since, and an engine process reads it a pipe transit later.
        The batch it opens closes max_wait_s after that arrival, and its queue wait counts from
        then, so time already spent is not waited again.

        `answer(outcome)`, if given, is called once with the batch's outcome (scores or RankError)
        the moment it is known, on the completion thread (or wherever the launch finished), before
        the loop resolves this call: an engine process sends it to its front end from there, so an
        answer does not wait while the loop launches the next batch (up to 1.5 ms on an H100 host,
        run HE). It is not called when a timer or the shutdown answered first; the returned value or
        raised RankError is the same outcome either way.

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
        at = now if arrived is None else min(now, arrived)
        future = asyncio.get_running_loop().create_future()
        item = _Item(request, future, now, deadline, at + self.max_queue_wait_s, at, answer=answer)
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
        if item.future.done() or item.claimed:  # (claimed: answered early; the loop resolves it shortly)
            return
        refusal = self._refusal(item, time.monotonic())
        if refusal is None:  # it started in time: wait for the deadline now
            self._arm(item)
            return
        if not self._claim(item):
            return
        if not item.started:
            item.refused = True
            self._count_drop(refusal.kind)
        item.future.set_exception(refusal)

    def _refusal(self, item: _Item, now: float) -> RankError | None:
        """Why `item` gets no scores any more at `now` (deadline, queue wait), else None."""
        if now >= item.deadline:
            where = "while running" if item.started else "in the queue"
            return RankError(504, "timeout", f"request deadline passed {where} after {now - item.arrived:.3f}s")
        if not item.started and now >= item.queue_deadline:
            waited = f"waited {now - item.arrived:.3f}s in the queue (max_queue_wait {self.max_queue_wait_s:.3f}s)"
            return self._overloaded(waited)
        return None

    def _overloaded(self, detail: str) -> RankError:
        return RankError(503, "overloaded", detail, retry_after_s=RETRY_AFTER_S)

    async def run_on_model_thread(self, fn, *args):
        """Run fn(*args) on the model thread, between batches (e.g. a prefetch); inline, on the
        loop's thread, which launches batches only from _run."""
        if self._executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _launch(self, batch: list[_Item]) -> asyncio.Future:
        """_run_batch on the model thread, or inline on this one (the future then done already)."""
        loop = asyncio.get_running_loop()
        if self._executor is not None:
            return loop.run_in_executor(self._executor, self._launch_now, batch, time.monotonic())
        launched = loop.create_future()
        try:
            launched.set_result(self._launch_now(batch, time.monotonic()))
        except Exception as exc:  # as the executor would hand it over
            launched.set_exception(exc)
        return launched

    def _launch_now(self, batch: list[_Item], formed: float) -> "_Ran":
        """_run_batch; a batch whose outputs are already there (CPU) is settled and answered
        early here, before the next batch launches on this thread."""
        ran = self._run_batch(batch, formed)
        if ran.pending is None or ran.pending[1].done():
            self._answer_early(ran.settle())
        return ran

    def _settled(self, ran: "_Ran") -> "_Ran":
        """On the completion thread: wait for the batch's outputs, then answer early."""
        self._answer_early(ran.settle())
        return ran

    def _claim(self, item: _Item) -> bool:
        """Decide `item`'s outcome here, unless something decided it already (any thread)."""
        with self._claims:
            if item.claimed:
                return False
            item.claimed = True
            return True

    def _answer_early(self, ran: "_Ran") -> None:
        """Hand each outcome of a settled batch to its request's `answer`, if it has one and no
        timer answered it first. A failing callback is logged; the loop still resolves the call."""
        for item, outcome in ran.outcomes:
            if item.answer is None or item.future.done() or not self._claim(item):
                continue
            try:
                item.answer(outcome)
            except Exception:
                logger.exception("answering request of user %d early failed", item.request.user_id)

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
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._completer.shutdown(wait=True)

    def _refuse_all(self, detail: str) -> None:
        live = [item for item in self._live if not item.future.done() and self._claim(item)]
        logger.warning("shutdown deadline: answering %d unfinished requests 503", len(live))
        for item in live:
            item.future.set_exception(RankError(503, "unavailable", detail))

    # ------------------------------------------------------------------ loop
    async def _run(self) -> None:
        """Form a batch, hand it to the model thread, form the next while it runs.

        At most `_MAX_IN_FLIGHT` batches are past formation (one completing, one launching, one
        queued behind it), so a full batch starts the moment the model thread is free, with no
        event-loop round trip in between, and the queue of formed batches stays bounded."""
        in_flight: deque[asyncio.Future] = deque()  # each batch until answered
        launches: deque[asyncio.Future] = deque()  # each batch until the model thread is done with it
        while True:
            batch = await self._collect(launches, in_flight)
            limit = self._in_flight_limit()
            while len(in_flight) >= limit or (in_flight and not batch):
                await asyncio.wait((in_flight[0],))
                in_flight.popleft()
            if not batch:
                if self._input_done:
                    return
                continue
            launched = self._launch(batch)
            launches.append(launched)
            in_flight.append(asyncio.ensure_future(self._complete(batch, launched)))
            for queue in (in_flight, launches):
                while queue and queue[0].done():
                    queue.popleft()

    async def _complete(self, batch: list[_Item], launched: asyncio.Future) -> None:
        """Wait for the launch, then (on the completion thread) for its outputs; deliver them."""
        try:
            ran = await launched
            if ran.pending is not None:  # outputs still on their way (a launch that finished was settled)
                self._overlapping = True
                ran = await asyncio.get_running_loop().run_in_executor(self._completer, self._settled, ran)
        except Exception as exc:  # _run_batch maps errors itself; this is a last line of defence
            logger.exception("batch of %d requests failed outside the model call", len(batch))
            error = RankError(500, "internal", f"batch failed: {type(exc).__name__}: {exc}")
            ran = _Ran([(item, error) for item in batch], [], time.monotonic(), None)
        self._deliver(batch, ran)

    def _deliver(self, batch: list[_Item], ran: _Ran) -> None:
        """On the loop: answer a finished batch's requests (unless a timer already did), the
        refusals the model thread decided, and the metrics."""
        for item in ran.dropped:
            self._abandoned(item)  # counts it unless a timer already did
        if self.metrics is not None and ran.seconds is not None:
            self.metrics.batch_size.observe(sum(1 for item in batch if item.started))
            self.metrics.batch_latency.observe(ran.seconds)
            for phase, seconds in ran.phases().items():
                self.metrics.batch_phase.labels(phase).observe(seconds)
            for item in batch:
                if item.started:
                    self.metrics.queue_wait.observe(ran.started - item.enqueued)
        for item, outcome in ran.outcomes:
            if item.future.done():  # answered meanwhile: 504 while running, 503 at the shutdown deadline
                continue
            if isinstance(outcome, RankError):
                if not item.started:
                    item.refused = True
                    self._count_drop(outcome.kind)
                item.future.set_exception(outcome)
            else:
                item.future.set_result(outcome)

    def _in_flight_limit(self) -> int:
        return _MAX_IN_FLIGHT if self._overlapping else _MAX_IN_FLIGHT_SYNC

    def _blocker(self, launches: deque[asyncio.Future], in_flight: deque[asyncio.Future]) -> asyncio.Future | None:
        """What keeps a formed batch from starting now, if anything: the model thread's current
        launch, or, with `_in_flight_limit` batches unanswered, the oldest of them."""
        launch = next((f for f in launches if not f.done()), None)
        if launch is not None:
            return launch
        unanswered = [f for f in in_flight if not f.done()]
        return unanswered[0] if len(unanswered) >= self._in_flight_limit() else None

    async def _collect(self, launches: deque[asyncio.Future], in_flight: deque[asyncio.Future]) -> list[_Item]:
        """The next batch: carried requests first, then the queue. It closes when full, or when
        it could start (see `_blocker`) and its wait is over (see `_wait_s`); while it could not
        start anyway (the model thread busy, or the pipeline of launched batches full) it keeps
        filling, since waiting then costs nothing. (Closing it early would leave it small: the
        launches return before the GPU finishes, so the pipeline, not the model thread, is what
        a batch waits for under load.)"""
        batch: list[_Item] = []
        users: dict[int, int] = {}
        carried, self._carry = self._carry, deque()
        while carried and len(batch) < self.max_batch_size:
            self._offer(carried.popleft(), batch, users)
        self._carry.extend(carried)
        while len(batch) < self.max_batch_size and not self._input_done:
            busy = self._blocker(launches, in_flight)
            if not self._queue.empty() and self._getter is None:
                item = self._queue.get_nowait()
            else:
                # One get() outlives a timed-out wait (kept for the next call), so no item is
                # taken off the queue and then dropped or requeued out of order.
                self._getter = self._getter or asyncio.ensure_future(self._queue.get())
                timeout = None
                if busy is None and batch:
                    timeout = batch[0].arrived + self._wait_s() - time.monotonic()
                    if timeout <= 0 and not self._getter.done():
                        break
                waits = (self._getter,) if busy is None else (self._getter, busy)
                await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not self._getter.done():
                    continue
                item, self._getter = self._getter.result(), None
            if item is _CLOSE:
                self._input_done = True
                break
            self._note_arrival(item.arrived)
            self._offer(item, batch, users)
        return batch

    def _note_arrival(self, at: float) -> None:
        """Track the mean gap between arrivals (exponentially weighted) for `_wait_s`."""
        if self._last_arrival is not None:
            gap = max(0.0, at - self._last_arrival)
            self._arrival_gap_s += _GAP_WEIGHT * (gap - self._arrival_gap_s)
        self._last_arrival = at

    def _wait_s(self) -> float:
        """How long an idle model thread waits for a batch to grow: max_wait_s while requests
        arrive faster than that (the wait is likely to add one), else nothing (waiting would only
        add latency)."""
        return self.max_wait_s if self._arrival_gap_s <= self.max_wait_s else 0.0

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

    def _offer(self, item: _Item, batch: list[_Item], users: dict[int, int]) -> None:
        """Add `item` unless its user is in the batch already; then the older request runs first
        (see `_recency`: an earlier request that arrived late, e.g. parsed after its successor) and
        the other is carried to the next batch."""
        if self._abandoned(item):
            return
        user = item.request.user_id
        at = users.get(user)
        if at is None:
            users[user] = len(batch)
            batch.append(item)
        elif _recency(item.request) < _recency(batch[at].request):
            self._carry.appendleft(batch[at])
            batch[at] = item
        else:
            self._carry.append(item)

    # ----------------------------------------------------------- model thread
    def _run_batch(self, batch: list[_Item], formed: float | None = None) -> "_Ran":
        """On the model thread, when the batch starts: admit each request (its client still
        waits, its deadline and queue wait are not over), rank the admitted ones. Futures are
        only read here; _deliver answers them on the loop. A timer that refuses a request in the
        instant it is admitted only wastes its compute: its late result is dropped."""
        started = time.monotonic()
        admitted, outcomes, dropped = [], [], []
        for item in batch:
            if item.future.done():  # the client went away, or a timer refused it
                dropped.append(item)
                continue
            refusal = self._refusal(item, started)
            if refusal is None:
                item.started = True
                admitted.append(item)
            else:
                outcomes.append((item, refusal))
        pending = None
        if admitted:
            result = self._execute([item.request for item in admitted])
            if isinstance(result, PendingRank):
                pending = (admitted, result)
            else:
                outcomes += zip(admitted, result)
        launched = time.monotonic()
        seconds = launched - started if admitted else None
        outputs_at = launched if pending is None else None
        return _Ran(outcomes, dropped, started, seconds, pending, formed if admitted else None, launched, outputs_at)

    def _execute(self, requests: list[RankingRequest]) -> "list[RankOutput | RankError] | PendingRank":
        """Outcome per request, in order, or the launched batch; runs on the model thread. A batch
        split after an error completes each half before the next (the rare path)."""
        try:
            outputs = self.rank_fn(requests)
        except CacheCapacityError as exc:
            if len(requests) == 1:
                return [classify(exc, requests[0].user_id)]
            logger.info("batch of %d does not fit in the KV cache (%s); splitting it", len(requests), exc)
            if self.metrics is not None:
                self.metrics.batch_splits.inc()
            mid = len(requests) // 2
            halves = (requests[:mid], requests[mid:])
            return [outcome for half in halves for outcome in _settle(self._execute(half), len(half))]
        except Exception as exc:
            if len(requests) == 1:
                return [classify(exc, requests[0].user_id)]
            logger.info(
                "batch of %d failed (%s: %s); retrying its requests one by one", len(requests), type(exc).__name__, exc
            )
            return [outcome for r in requests for outcome in _settle(self._execute([r]), 1)]
        return outputs if isinstance(outputs, PendingRank) else _settle(outputs, len(requests))
