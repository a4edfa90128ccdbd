"""The engine in its own process (`hstu serve --engine-process`): the model thread keeps its GIL.

Why: the model thread's host work (metadata, launches, waits) needs the GIL, and in one process
it shares it with the event loop (HTTP, parsing, responses). Every torch call drops and re-takes
the GIL, and a thread running Python keeps it up to the switch interval, so a busy loop stalls
the forward: beside a Python-busy thread RankingEngine.rank ran 2x to 51x slower on the dev CPU
(`python -m hstu.scripts.bench_gil`, tiny model, 2 shared cores); on the H200 the server's model
thread spent ~3 ms per request against ~1.7 ms in process (benchmarks/RESULTS.md, run N).
Here the front-end process keeps HTTP, parsing, digests and the history store; a spawned child
owns a ServingRuntime (engine, KV cache, batcher, model thread) and receives parsed requests.

Protocol over one multiprocessing pipe per front end, pickled tuples (RankingRequest with its
identities' digests, so nothing is hashed again, and not their token records, which the engine
rebuilds from the arrays: RankingRequest.__reduce__; a RankOutput pickles its logits as numpy,
see RankOutput.__reduce__):
  front -> engine   ("rank", id, request, seconds left, sent at, arrived) | ("prefetch", id, user_ids) |
                    ("scrape", id) | ("cancel", id) | ("metrics", text) | ("drain",) | ("close",)
  engine -> front   ("ready", fingerprint) | ("failed", detail) | ("done", id, outcome, sent at)
("sent at": time.monotonic(), one clock for the processes of a host; each side reports how long its
messages took to reach the other's loop: hstu_request_phase_seconds, pipe_to_engine / _from_engine.)
A message goes out from the sending loop's thread itself when that cannot block (small, the
pipe idle and writable), else from a sender thread, so a full pipe never blocks an event loop
(_Sender); a front end's loop, and an engine's that launches batches (model_on_loop), read their
pipes themselves, others in a reader thread. Why: every hand-off to a thread waits for the GIL,
up to the switch interval (5 ms) while the loop runs Python. The engine's metrics come back
with /metrics, labelled replica="engine" (as Ray replicas' are). A dead engine process answers every waiting and later
request 503 and the front end turns not ready.

Several front ends (`--front-ends N`, serving/front_ends.py): the first one (EngineProcessRuntime)
spawns the engine with one pipe per front end; the others (EngineLinkRuntime) hold one pipe each.
Only the first one's drain and close (or its pipe's end) stop the engine; another front end's end
drops just its own calls. Each front end pushes its metrics text every second ("metrics"), and a
scrape answers the engine's text with every other front end's latest, so any front end's /metrics
shows them all, each labelled replica="front-<k>".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import select
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest

from hstu.engine import RankOutput
from hstu.model.batch import RankingRequest
from hstu.serving.gc_policy import freeze_startup_objects
from hstu.serving.errors import RETRY_AFTER_S, RankError
from hstu.serving.metrics import ServingMetrics, merged_exposition
from hstu.serving.runtime import Runtime, ServedModel, ServingRuntime
from hstu.serving.schemas import RequestLimits
from hstu.serving.settings import ServerSettings

if TYPE_CHECKING:
    from hstu.serving.front_ends import FrontEndLinks

logger = logging.getLogger(__name__)

ENGINE_REPLICA = "engine"
_CLOSE_TIMEOUT_S = 30.0
_ANSWER_GRACE_S = 1.0  # past a request's deadline, before the front end gives up on the engine's 504
_SCRAPE_TIMEOUT_S = 2.0
_METRICS_PUSH_S = 1.0  # how often each of several front ends sends the engine its metrics text
PRIMARY = 0  # the front end whose drain, close or end stops the engine


def front_end_label(index: int) -> str:
    """The replica label of front end `index`'s metrics when there are several."""
    return f"front-{index}"


# A write of several messages: what queued while the sender waited goes out in one pickle and one
# write, one turn at its process's GIL for the sending thread instead of one per message. Measured
# on the H200 it did not shorten an answer's transit from the engine to the front end (29-32 ms
# before, runs AZ and BB; 25-37 ms with it, runs BD and BE): that transit waits on the front end's
# busy loop, and fell to 6-16 ms with two front ends (run BE).
_MANY = "_many"
_MAX_MANY = 256

# HSTU_PIPE_THREADS=1: every message through the sender thread and the front end's pipe read by a
# reader thread, as before direct writes (an experiment knob for same-call comparisons).
_PIPE_THREADS = os.environ.get("HSTU_PIPE_THREADS", "0") == "1"
# Messages are plain pickles (Connection.recv reads them): multiprocessing's ForkingPickler copies its
# reducer tables for every message (+2-4 us each on the dev CPU) for reducers no message needs (no
# socket, connection or tensor travels: a RankOutput's logits go as numpy).
_PROTOCOL = pickle.HIGHEST_PROTOCOL
_WANTED_SNDBUF = 4 << 20  # asked of the kernel for a pipe's socket; it grants at most net.core.wmem_max (doubled)


def _direct_limit(conn) -> int:
    """The largest message a thread may write into `conn` itself without ever blocking (0: none).

    A multiprocessing pipe is a Unix stream socket pair. Linux reports such a socket writable only
    while at most a quarter of its send buffer is in use, and a write blocks only once the buffer
    is full, so a message of at most a quarter of it, written while the socket polls writable,
    goes out whole at once. A blocked write is what must never happen on an event loop: the two
    processes' loops, each blocked writing to the other, would never read again."""
    if _PIPE_THREADS or not hasattr(conn, "fileno"):
        return 0
    fd = conn.fileno()
    blocking = os.get_blocking(fd)  # a socket object may change the flag, which its dup shares
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
                return 0
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _WANTED_SNDBUF)
            except OSError:
                pass
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 4
    except OSError:
        return 0
    finally:
        os.set_blocking(fd, blocking)


class _Sender:
    """Writes messages to a pipe in order, never blocking its callers (event loops).

    A message goes out at once from the calling thread when nothing queued before it is still
    unwritten, it pickles to at most the pipe's direct limit (_direct_limit) and the socket is
    writable: no other thread is woken and no GIL changes hands before it leaves (each hand-off
    waits up to the switch interval, 5 ms, while the caller's loop runs Python). Otherwise a
    thread writes it (a full pipe then blocks that thread, not a loop), together with what
    queued meanwhile (_MANY)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self._conn, self._queue = conn, queue.SimpleQueue()
        self._direct_limit = _direct_limit(conn)
        self._poll = select.poll()  # (select.select fails for descriptors past 1023)
        if self._direct_limit:
            self._poll.register(conn.fileno(), select.POLLOUT)
        self._state = threading.Lock()
        self._unwritten = 0  # messages queued for the thread and not yet written
        self._writing = False  # a write in progress (a caller's or the thread's)
        self._written = threading.Condition(self._state)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message: tuple) -> None:
        if self._direct_limit:
            with self._state:
                direct = self._unwritten == 0 and not self._writing
                if direct:
                    self._writing = True
            if direct:
                try:
                    written = self._write_now(message)
                    if written is True:
                        return
                    with self._state:  # not written: queued behind nothing, still in order
                        self._unwritten += 1
                    self._queue.put(written)
                    return
                finally:
                    with self._state:
                        self._writing = False
                        self._written.notify_all()
        with self._state:
            self._unwritten += 1
        self._queue.put(message)

    def _write_now(self, message: tuple) -> "bool | _Pickled":
        """Write `message` from this thread if that cannot block: True if written, else what the
        thread should write (the message pickled already, when it is over the direct limit)."""
        data = pickle.dumps(message, _PROTOCOL)
        if len(data) > self._direct_limit:
            return _Pickled(data)
        events = self._poll.poll(0)
        if not events or events[0][1] != select.POLLOUT:  # full, or gone (POLLHUP, POLLERR): the thread tells
            return _Pickled(data)
        try:
            self._conn.send_bytes(data)
        except (OSError, ValueError):  # the other side is gone; its reader reports that
            pass
        return True

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        held = None  # a message taken from the queue that goes out in the next write
        while (message := held if held is not None else self._queue.get()) is not None:
            held, closing = None, False
            if isinstance(message, _Pickled):  # pickled by a caller already: written on its own
                data, count = message.data, 1
            else:
                messages = [message]
                while len(messages) < _MAX_MANY:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        closing = True
                        break
                    if isinstance(more, _Pickled):
                        held = more
                        break
                    messages.append(more)
                data = pickle.dumps(messages[0] if len(messages) == 1 else (_MANY, messages), _PROTOCOL)
                count = len(messages)
            with self._state:
                while self._writing:
                    self._written.wait()
                self._writing = True
            try:
                self._conn.send_bytes(data)
            except (OSError, EOFError, ValueError):  # the other side is gone; its reader reports that
                return
            finally:
                with self._state:
                    self._writing = False
                    self._unwritten -= count
                    self._written.notify_all()
            if closing:
                return


class _Pickled:
    """A message a caller pickled already (too large, or the pipe busy, to write at once)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _deliver(messages: list, handle, name: str) -> None:
    for message in messages:
        try:
            handle(message)
        except Exception:  # as a callback of its own would: logged, the other messages still delivered
            logger.exception("%s: handling a message failed", name)


def _receive(conn: Connection) -> tuple[list, bool]:
    """(the messages of one write, whether the pipe ended: then the last one is None)."""
    try:
        message = conn.recv()
    except (OSError, EOFError):
        return [None], True
    return (message[1] if message[0] == _MANY else [message]), False


def _read_into(conn: Connection, loop: asyncio.AbstractEventLoop, handle, name: str) -> None:
    """A thread calling handle(message) on `loop` for every message, in order (the messages of one
    _MANY write in one loop callback), then handle(None) at EOF."""

    def run() -> None:
        ended = False
        while not ended:
            messages, ended = _receive(conn)
            try:
                loop.call_soon_threadsafe(_deliver, messages, handle, name)
            except RuntimeError:  # the loop closed
                return

    threading.Thread(target=run, name=name, daemon=True).start()


def _read_on_loop(conn: Connection, loop: asyncio.AbstractEventLoop, handle, name: str) -> None:
    """_read_into without its thread: the loop reads `conn` itself whenever it is readable. For an
    engine process whose loop launches the batches (model_on_loop): a reader thread would take the
    GIL from the launch to unpickle each request."""
    fd = conn.fileno()

    def readable() -> None:
        while conn.poll():  # a whole write arrives at once (one sender writes it); EOF polls readable
            messages, ended = _receive(conn)
            _deliver(messages, handle, name)
            if ended:
                loop.remove_reader(fd)
                return

    loop.add_reader(fd, readable)
    # uvloop's add_reader (uvicorn's loop in a front end) makes the descriptor non-blocking, and
    # recv() of a message not yet whole would then raise BlockingIOError, read as the pipe's end
    os.set_blocking(fd, True)


# ------------------------------------------------------------------ the engine process
def engine_main(conns: list[Connection], settings: ServerSettings, log_level: int) -> None:
    """Entry point of the spawned engine process, one pipe per front end (conns[PRIMARY] first).
    It ignores SIGINT and SIGTERM: a Ctrl-C or a service manager signals the whole process group,
    and the primary front end drives the shutdown (drain, then close); when it dies, its pipe's
    end-of-file stops the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    asyncio.run(_serve_engine(conns, settings))


async def _serve_engine(conns: list[Connection], settings: ServerSettings) -> None:
    runtime = ServingRuntime.standalone(settings)
    outs = [_Sender(conn, f"hstu-engine-sender-{i}") for i, conn in enumerate(conns)]
    await runtime.start()
    if not runtime.ready:
        for out in outs:
            out.send(("failed", runtime.detail))
        await runtime.close()
        for out in outs:
            out.close()
        return
    for out in outs:
        out.send(("ready", runtime.fingerprint))
    inbox: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    read = _read_on_loop if settings.model_on_loop else _read_into
    for i, conn in enumerate(conns):
        read(conn, loop, lambda message, i=i: inbox.put_nowait((i, message)), f"hstu-engine-reader-{i}")
    tasks: dict[tuple[int, int], asyncio.Task] = {}
    pushed: dict[int, str] = {}  # each front end's latest metrics text

    async def answer(link: int, kind: str, rid: int, *args) -> None:
        answered_early = False

        def answer_early(outcome) -> None:  # on the completion thread, as soon as the batch's outputs are there
            nonlocal answered_early
            answered_early = True
            outs[link].send(("done", rid, outcome, time.monotonic()))

        try:
            if kind == "rank":
                # args: request, seconds left when sent, sent at, arrived (at the front end, or None;
                # one monotonic clock per host): the deadline and the batch window count from the
                # front end, not from this later read
                sent, arrived = args[2], args[3]
                runtime.metrics.phase.labels("pipe_to_engine").observe(time.monotonic() - sent)
                outcome = await runtime.submit(
                    args[0], sent + args[1], arrived=sent if arrived is None else arrived, answer=answer_early
                )
            elif kind == "prefetch":
                outcome = await runtime.prefetch_users(args[0])
            else:
                own = (await runtime.exposition()).decode()
                outcome = {ENGINE_REPLICA: own, **{front_end_label(i): t for i, t in pushed.items() if i != link}}
        except RankError as exc:
            outcome = exc
        except Exception as exc:  # the front end gets an answer whatever happened
            logger.exception("engine call %s failed", kind)
            outcome = RankError(500, "internal", f"engine call failed: {type(exc).__name__}: {exc}")
        if not answered_early:
            outs[link].send(("done", rid, outcome, time.monotonic()))

    while True:
        link, message = await inbox.get()
        kind = None if message is None else message[0]
        if kind in (None, "close"):
            if link == PRIMARY:
                break
            logger.info("front end %d %s", link, "closed" if kind else "is gone")
            pushed.pop(link, None)
            for (i, rid), task in list(tasks.items()):
                if i == link:
                    task.cancel()
        elif kind == "drain":
            if link == PRIMARY:
                runtime.drain()
        elif kind == "metrics":
            pushed[link] = message[1]
        elif kind == "cancel":
            task = tasks.get((link, message[1]))
            if task is not None:
                task.cancel()
        else:
            key = (link, message[1])
            task = tasks[key] = asyncio.create_task(answer(link, *message))
            task.add_done_callback(lambda _, key=key: tasks.pop(key, None))
    await runtime.close()
    for out in outs:
        out.close()


# ------------------------------------------------------------------ the front end
class _EngineClient(Runtime):
    """A front end's Runtime over its pipe to the engine process (see the module docstring): calls
    and their answers, the engine's readiness, metrics. `model` is a ServedModel once the engine is
    ready; no cache here. `index` is this front end's among several (None: the only one)."""

    def __init__(
        self, settings: ServerSettings, config, limits: RequestLimits, metrics: ServingMetrics, index: int | None = None
    ) -> None:
        super().__init__(settings, config, limits, metrics, "starting the engine process")
        self.index = index
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._sender: _Sender | None = None
        self._started: asyncio.Future | None = None
        self._pusher: asyncio.Task | None = None

    @property
    def pending(self) -> int:
        return len(self._waiting)

    async def _connect(self, conn: Connection) -> bool:
        """Read and send on `conn`; wait for the engine's first message. True once ready."""
        loop = asyncio.get_running_loop()
        self._started = loop.create_future()
        self._sender = _Sender(conn, "hstu-front-sender")
        # read on the loop itself (no reader thread, whose every message waits for the loop's GIL)
        read = _read_into if _PIPE_THREADS else _read_on_loop
        read(conn, loop, self._on_message, "hstu-front-reader")
        # while the engine loads: this process's own startup objects (imports, the app) are all here
        freeze_startup_objects("front end" if self.index is None else front_end_label(self.index))
        first = await self._started
        if first[0] != "ready":
            detail = first[1] if first[0] == "failed" else "the engine process exited while starting"
            logger.error("engine process did not start: %s", detail)
            self.state, self.detail = "failed", "loading the model failed; the server log has the cause"
            return False
        if self.state != "loading":  # close() ran meanwhile
            return False
        self.fingerprint = first[1]
        self.model = ServedModel(bytes.fromhex(self.fingerprint))
        self.state, self.detail = "ready", None
        self.metrics.ready.set(1)
        if self.index is not None:
            self._pusher = asyncio.create_task(self._push_metrics(), name="hstu-metrics-push")
        return True

    async def _push_metrics(self) -> None:
        """Several front ends: send the engine this front end's metrics text every second."""
        while True:
            self._sender.send(("metrics", generate_latest(self.metrics.registry).decode()))
            await asyncio.sleep(_METRICS_PUSH_S)

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
                self.metrics.phase.labels("pipe_from_engine").observe(time.monotonic() - message[3])
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

    async def submit(self, request: RankingRequest, deadline: float, arrived: float | None = None) -> RankOutput:
        """The engine's batcher answers 504 at the deadline; the front end stops waiting shortly after
        even if the engine process hangs."""
        now = time.monotonic()
        left = deadline - now
        return await self._call("rank", request, left, now, arrived, timeout_s=left + _ANSWER_GRACE_S)

    async def prefetch_users(self, user_ids: list[int]) -> int:
        return await self._call("prefetch", user_ids, timeout_s=self.settings.request_timeout_ms / 1000.0)

    async def exposition(self) -> bytes:
        """The front end's metrics, then the engine's with replica="engine" (and with several front
        ends, every front end's labelled replica="front-<k>", this one's fresh)."""
        try:
            replicas = await self._call("scrape", timeout_s=_SCRAPE_TIMEOUT_S)
        except (RankError, TimeoutError) as exc:
            logger.warning("engine metrics: %s", exc)
            replicas = {}
        if self.index is None:
            return merged_exposition(self.metrics.registry, replicas)
        own = generate_latest(self.metrics.registry).decode()
        return merged_exposition(CollectorRegistry(), {front_end_label(self.index): own, **replicas})

    async def close(self, start_task: asyncio.Task | None = None) -> None:
        """Drain, wait for the start, tell the engine this front end closes, then `_closed()`."""
        self.drain()
        if start_task is not None:
            await start_task
        if self._sender is not None:
            self._sender.send(("close",))
            await self._closed()
            self._sender.close()
        self.state, self.detail = "stopped", "shutting down"

    async def _closed(self) -> None:
        """After the close message: what else this front end waits for."""

    def _stop_accepting(self) -> None:
        if self.state in ("loading", "ready"):
            self.state, self.detail = "stopping", "shutting down"
        self.metrics.ready.set(0)
        if self._pusher is not None:
            self._pusher.cancel()


class EngineProcessRuntime(_EngineClient):
    """The primary front end: spawns the engine process (with a pipe for each further front end,
    `links`: serving/front_ends.py) and drives its shutdown."""

    def __init__(
        self, settings: ServerSettings, config, limits: RequestLimits, metrics: ServingMetrics,
        links: "FrontEndLinks | None" = None,
    ) -> None:
        super().__init__(settings, config, limits, metrics, None if links is None else PRIMARY)
        self.links = links
        self._process: multiprocessing.process.BaseProcess | None = None

    async def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        if self.links is None:
            ours, theirs = ctx.Pipe()
            engine_ends = [theirs]
        else:
            ours, engine_ends = self.links.primary, self.links.engine_ends
        self._process = ctx.Process(
            target=engine_main, args=(engine_ends, self.settings, logging.getLogger().getEffectiveLevel()),
            name="hstu-engine", daemon=True,
        )
        self._process.start()
        for end in engine_ends:
            end.close()
        if await self._connect(ours):
            logger.info("engine process %d ready (weights %s)", self._process.pid, self.fingerprint)

    def drain(self) -> None:
        """Stop the other front ends (they finish their own requests), then drain the engine."""
        self._stop_accepting()
        if self.links is not None:
            self.links.stop_others()
        if self._sender is not None:
            self._sender.send(("drain",))

    async def _closed(self) -> None:
        """The engine closes its runtime and exits; then the further front ends are joined."""
        limit_s = self.settings.shutdown_timeout_s + _CLOSE_TIMEOUT_S
        await asyncio.to_thread(self._process.join, limit_s)
        if self._process.is_alive():
            logger.error("engine process did not exit; terminating it")
            self._process.terminate()
        if self.links is not None:
            await asyncio.to_thread(self.links.join_others, limit_s)


class EngineLinkRuntime(_EngineClient):
    """A further front end (`index` >= 1): ranks through the engine the primary spawned, over
    `conn`. Its drain and close end its own traffic only; when the engine is gone it calls
    `on_engine_gone` (the front-end process then exits: serving/front_ends.py)."""

    def __init__(
        self, settings: ServerSettings, config, limits: RequestLimits, metrics: ServingMetrics, *,
        conn: Connection, index: int, on_engine_gone=None,
    ) -> None:
        super().__init__(settings, config, limits, metrics, index)
        self._conn = conn
        self._on_engine_gone = on_engine_gone

    async def start(self) -> None:
        if await self._connect(self._conn):
            logger.info("front end %d ready (weights %s)", self.index, self.fingerprint)
        elif self.state == "failed" and self._on_engine_gone is not None:
            self._on_engine_gone()  # no engine to serve with

    def _engine_gone(self) -> None:
        super()._engine_gone()
        if self._on_engine_gone is not None:
            self._on_engine_gone()

    def drain(self) -> None:
        self._stop_accepting()
