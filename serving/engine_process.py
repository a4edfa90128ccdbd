"""The engine in its own process (`hstu serve --engine-process`): the model thread keeps its GIL.

Why: the model thread's host work (metadata, launches, waits) needs the GIL, and in one process
it shares it with the event loop (HTTP, parsing, responses). Every torch call drops and re-takes
the GIL, and a thread running Python keeps it up to the switch interval, so a busy loop stalls
the forward: beside a Python-busy thread RankingEngine.rank ran 2x to 51x slower on the dev CPU
(`python -m hstu.scripts.bench_gil`, tiny model, 2 shared cores); on the H200 the server's model
thread spent ~3 ms per request against ~1.7 ms in process (benchmarks/RESULTS.md, run N).
Here the front-end process keeps HTTP, parsing, digests and the history store; a spawned child
owns a ServingRuntime (engine, KV cache, batcher, model thread) and receives parsed requests.

Protocol over one multiprocessing pipe, pickled tuples (RankingRequest with its identity chain,
so digests are not recomputed; a RankOutput pickles its logits as numpy, see RankOutput.__reduce__):
  front -> engine   ("rank", id, request, seconds left) | ("prefetch", id, user_ids) |
                    ("scrape", id) | ("cancel", id) | ("drain",) | ("close",)
  engine -> front   ("ready", fingerprint) | ("failed", detail) | ("done", id, outcome)
Each side reads in a thread (blocking reads never hold up a loop) and sends from one thread, so
a full pipe never blocks an event loop. The engine's metrics come back with /metrics, labelled
replica="engine" (as Ray replicas' are). A dead engine process answers every waiting and later
request 503 and the front end turns not ready.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from hstu.engine import RankOutput
from hstu.model.batch import RankingRequest
from hstu.serving.errors import RETRY_AFTER_S, RankError
from hstu.serving.metrics import ServingMetrics, merged_exposition
from hstu.serving.runtime import Runtime, ServedModel, ServingRuntime
from hstu.serving.schemas import RequestLimits
from hstu.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

ENGINE_REPLICA = "engine"
_CLOSE_TIMEOUT_S = 30.0
_ANSWER_GRACE_S = 1.0  # past a request's deadline, before the front end gives up on the engine's 504
_SCRAPE_TIMEOUT_S = 2.0


class _Sender:
    """One thread that pickles and writes messages in order (a full pipe blocks it, not a loop)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn, self._queue = conn, queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, EOFError):  # the other side is gone; its reader reports that
                return


def _read_into(conn: Connection, loop: asyncio.AbstractEventLoop, handle, name: str) -> None:
    """A thread calling handle(message) on `loop` for every message, then handle(None) at EOF."""

    def run() -> None:
        while True:
            try:
                message = conn.recv()
            except (OSError, EOFError):
                message = None
            try:
                loop.call_soon_threadsafe(handle, message)
            except RuntimeError:  # the loop closed
                return
            if message is None:
                return

    threading.Thread(target=run, name=name, daemon=True).start()


# ------------------------------------------------------------------ the engine process
def engine_main(conn: Connection, settings: ServerSettings, log_level: int) -> None:
    """Entry point of the spawned engine process. It ignores SIGINT and SIGTERM: a Ctrl-C or a
    service manager signals the whole process group, and the front end drives the shutdown (drain,
    then close); when the front end dies, the pipe's end-of-file stops the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    asyncio.run(_serve_engine(conn, settings))


async def _serve_engine(conn: Connection, settings: ServerSettings) -> None:
    runtime = ServingRuntime.standalone(settings)
    out = _Sender(conn, "hstu-engine-sender")
    await runtime.start()
    if not runtime.ready:
        out.send(("failed", runtime.detail))
        await runtime.close()
        out.close()
        return
    out.send(("ready", runtime.fingerprint))
    inbox: asyncio.Queue = asyncio.Queue()
    _read_into(conn, asyncio.get_running_loop(), inbox.put_nowait, "hstu-engine-reader")
    tasks: dict[int, asyncio.Task] = {}

    async def answer(kind: str, rid: int, *args) -> None:
        try:
            if kind == "rank":
                outcome = await runtime.submit(args[0], time.monotonic() + args[1])
            elif kind == "prefetch":
                outcome = await runtime.prefetch_users(args[0])
            else:
                outcome = await runtime.exposition()
        except RankError as exc:
            outcome = exc
        except Exception as exc:  # the front end gets an answer whatever happened
            logger.exception("engine call %s failed", kind)
            outcome = RankError(500, "internal", f"engine call failed: {type(exc).__name__}: {exc}")
        out.send(("done", rid, outcome))

    while (message := await inbox.get()) is not None and message[0] != "close":
        kind = message[0]
        if kind == "drain":
            runtime.drain()
        elif kind == "cancel":
            task = tasks.get(message[1])
            if task is not None:
                task.cancel()
        else:
            task = tasks[message[1]] = asyncio.create_task(answer(*message))
            task.add_done_callback(lambda _, rid=message[1]: tasks.pop(rid, None))
    await runtime.close()
    out.close()


# ------------------------------------------------------------------ the front end
class EngineProcessRuntime(Runtime):
    """The front end's Runtime: forwards parsed requests to the engine process (see the module
    docstring). `model` is a ServedModel once the engine is ready; no cache here."""

    def __init__(self, settings: ServerSettings, config, limits: RequestLimits, metrics: ServingMetrics) -> None:
        super().__init__(settings, config, limits, metrics, "starting the engine process")
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._process: multiprocessing.process.BaseProcess | None = None
        self._sender: _Sender | None = None
        self._started: asyncio.Future | None = None

    @property
    def pending(self) -> int:
        return len(self._waiting)

    async def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        self._process = ctx.Process(
            target=engine_main, args=(theirs, self.settings, logging.getLogger().getEffectiveLevel()),
            name="hstu-engine", daemon=True,
        )
        self._process.start()
        theirs.close()
        loop = asyncio.get_running_loop()
        self._started = loop.create_future()
        self._sender = _Sender(ours, "hstu-front-sender")
        _read_into(ours, loop, self._on_message, "hstu-front-reader")
        first = await self._started
        if first[0] != "ready":
            detail = first[1] if first[0] == "failed" else "the engine process exited while starting"
            logger.error("engine process did not start: %s", detail)
            self.state, self.detail = "failed", "loading the model failed; the server log has the cause"
            return
        if self.state != "loading":  # close() ran meanwhile
            return
        self.fingerprint = first[1]
        self.model = ServedModel(bytes.fromhex(self.fingerprint))
        self.state, self.detail = "ready", None
        self.metrics.ready.set(1)
        logger.info("engine process %d ready (weights %s)", self._process.pid, self.fingerprint)

    def _on_message(self, message: tuple | None) -> None:
        if self._started is not None and not self._started.done():
            self._started.set_result(message or ("exited",))
            return
        if message is None:
            self._engine_gone()
            return
        if message[0] == "done":
            future = self._waiting.pop(message[1], None)
            if future is not None and not future.done():
                future.set_result(message[2])

    def _engine_gone(self) -> None:
        if self.state in ("loading", "ready"):
            logger.error("the engine process exited; answering 503 until restarted")
            self.state, self.detail = "failed", "the engine process exited"
            self.metrics.ready.set(0)
        for future in self._waiting.values():
            if not future.done():
                future.set_result(RankError(503, "unavailable", "the engine process exited", retry_after_s=RETRY_AFTER_S))
        self._waiting.clear()

    async def _call(self, kind: str, *args, timeout_s: float | None = None) -> Any:
        """Send one call and wait for its answer, at most `timeout_s` (then it is cancelled there)."""
        if self.state not in ("ready", "stopping"):
            raise RankError(503, "unavailable", f"server is {self.state}: {self.detail}", retry_after_s=RETRY_AFTER_S)
        rid = next(self._ids)
        future = self._waiting[rid] = asyncio.get_running_loop().create_future()
        self._sender.send((kind, rid, *args))
        try:
            outcome = await asyncio.wait_for(future, timeout_s)
        except (asyncio.CancelledError, TimeoutError) as exc:  # the client went away, or no answer in time
            self._waiting.pop(rid, None)
            self._sender.send(("cancel", rid))
            if isinstance(exc, TimeoutError):
                raise RankError(504, "timeout", f"the engine process did not answer {kind} within {timeout_s:.3f}s") from exc
            raise
        if isinstance(outcome, RankError):
            raise outcome
        return outcome

    async def submit(self, request: RankingRequest, deadline: float) -> RankOutput:
        """The engine's batcher answers 504 at the deadline; the front end stops waiting shortly after
        even if the engine process hangs."""
        left = deadline - time.monotonic()
        return await self._call("rank", request, left, timeout_s=left + _ANSWER_GRACE_S)

    async def prefetch_users(self, user_ids: list[int]) -> int:
        return await self._call("prefetch", user_ids, timeout_s=self.settings.request_timeout_ms / 1000.0)

    async def exposition(self) -> bytes:
        """The front end's metrics, then the engine's with replica="engine"."""
        try:
            text = (await self._call("scrape", timeout_s=_SCRAPE_TIMEOUT_S)).decode()
        except (RankError, TimeoutError) as exc:
            logger.warning("engine metrics: %s", exc)
            return merged_exposition(self.metrics.registry, {})
        return merged_exposition(self.metrics.registry, {ENGINE_REPLICA: text})

    def drain(self) -> None:
        if self.state in ("loading", "ready"):
            self.state, self.detail = "stopping", "shutting down"
        self.metrics.ready.set(0)
        if self._sender is not None:
            self._sender.send(("drain",))

    async def close(self, start_task: asyncio.Task | None = None) -> None:
        """Drain, wait for the start, then let the engine close its runtime and exit."""
        self.drain()
        if start_task is not None:
            await start_task
        if self._sender is not None:
            self._sender.send(("close",))
            await asyncio.to_thread(self._process.join, self.settings.shutdown_timeout_s + _CLOSE_TIMEOUT_S)
            if self._process.is_alive():
                logger.error("engine process did not exit; terminating it")
                self._process.terminate()
            self._sender.close()
        self.state, self.detail = "stopped", "shutting down"
