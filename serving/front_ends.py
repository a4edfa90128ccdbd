"""`hstu serve --front-ends N`: N HTTP front-end processes on one port, one engine process behind them.

Why: with the engine in its own process (serving/engine_process.py), the front end's one event
loop (HTTP, parsing, digests, responses) became the server's limit: on the H200 it was busy for
most of a load run while the engine's model thread was busy for a quarter (py-spy, eleventh
session in benchmarks/RESULTS.md). Front ends share nothing but the engine, so N of them serve
about N times the requests, up to what the engine ranks.

Layout: this (primary) process binds the listening socket, makes one pipe per front end and starts
the other N - 1 front ends as spawned processes, each given the socket and its pipe; the kernel
hands each new connection to whichever front end accepts it first. The primary's runtime
(EngineProcessRuntime) spawns the engine with every engine-side pipe end. Each front end parses,
digests and answers its own connections; the engine batches requests from all of them.

Lifecycle: on SIGTERM/SIGINT the primary drains as one front end does, and first signals the
others (STOP_SIGNAL; they ignore the group's SIGINT and SIGTERM), which stop accepting and finish
their own requests while the engine drains, then it closes the engine and joins them. A further
front end whose engine is gone (the primary died) exits. Incremental requests: each front end keeps the histories of the requests it answered
(serving/history_store.py), so one that reaches another front end is answered
`history_incomplete` and the client resends the whole history (hstu.client does); a client's
keep-alive connection stays with one front end.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection

from hstu.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

# The primary stops the further front ends with this signal. They ignore SIGINT and SIGTERM: a
# Ctrl-C or a service manager signals the whole process group, and a second signal would make a
# draining front end exit at once (serving/server.py) before its requests are answered.
STOP_SIGNAL = signal.SIGUSR1


@dataclass
class FrontEndLinks:
    """The pipes between N front ends and the engine, and the further front ends' processes."""

    primary: Connection  # the primary front end's end of its pipe
    engine_ends: list[Connection]  # the engine's end of every front end's pipe, the primary's first
    others: list[multiprocessing.process.BaseProcess] = field(default_factory=list)

    def stop_others(self) -> None:
        """Ask every further front end to shut down (STOP_SIGNAL: it drains its own requests)."""
        for process in self.others:
            if process.is_alive() and process.pid is not None:
                try:
                    os.kill(process.pid, STOP_SIGNAL)
                except ProcessLookupError:
                    pass

    def join_others(self, timeout_s: float) -> None:
        """Wait for the further front ends to exit; kill those still running after `timeout_s`."""
        for process in self.others:
            process.join(timeout_s)
            if process.is_alive():
                logger.error("front end process %d did not exit; killing it", process.pid)
                process.kill()
                process.join()


def front_end_main(settings: ServerSettings, conn: Connection, index: int, sock: socket.socket, log_level: int) -> None:
    """Entry point of a further front end: the same app, ranking over `conn`, serving on `sock`."""
    from hstu.serving.app import create_app
    from hstu.serving.engine_process import EngineLinkRuntime
    from hstu.serving.server import draining_server

    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s [front {index}]: %(message)s")
    server = None

    def engine_gone() -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(settings, partial(EngineLinkRuntime, conn=conn, index=index, on_engine_gone=engine_gone))
    host, port = sock.getsockname()[:2]
    server = draining_server(app, host, port)
    server.handle_exit = lambda sig, frame: None  # SIGINT / SIGTERM of the group: the primary drives
    signal.signal(STOP_SIGNAL, lambda sig, frame: setattr(server, "should_exit", True))
    server.run(sockets=[sock])


def serve_front_ends(settings: ServerSettings, host: str, port: int) -> None:
    """Run settings.front_ends front ends on host:port until shut down (see the module docstring)."""
    from hstu.serving.app import create_app
    from hstu.serving.engine_process import EngineProcessRuntime
    from hstu.serving.server import draining_server

    count = settings.front_ends
    ctx = multiprocessing.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(count)]
    links = FrontEndLinks(primary=pipes[0][0], engine_ends=[theirs for _, theirs in pipes])
    app = create_app(settings, partial(EngineProcessRuntime, links=links))
    server = draining_server(app, host, port)
    sock = server.config.bind_socket()
    level = logging.getLogger().getEffectiveLevel()
    for index in range(1, count):
        process = ctx.Process(
            target=front_end_main, args=(settings, pipes[index][0], index, sock, level), name=f"hstu-front-{index}",
        )
        process.start()
        pipes[index][0].close()
        links.others.append(process)
    logger.info("%d front ends on %s:%d (pids %s and this one)", count, host, port, [p.pid for p in links.others])
    try:
        server.run(sockets=[sock])
    finally:
        links.stop_others()
        links.join_others(settings.shutdown_timeout_s + 30.0)
        sock.close()
