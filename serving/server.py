"""uvicorn with a shutdown deadline: DrainingServer.

On the first SIGTERM/SIGINT (or should_exit) uvicorn stops accepting connections and waits for
the open ones; before that wait, DrainingServer starts the runtime's drain, so requests already
queued get settings.shutdown_timeout_s to finish and the rest are answered 503 at that deadline
(instead of running the whole queue, or being cut off without an answer). uvicorn's own
timeout_graceful_shutdown is a backstop a second later. A second signal exits the process at once.
"""

from __future__ import annotations

import logging
import os
import socket
from types import FrameType

import uvicorn

from hstu.serving.runtime import ServingRuntime

logger = logging.getLogger(__name__)

BACKSTOP_S = 1.0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains `runtime` first on shutdown; exits at once on a second signal."""

    def __init__(self, config: uvicorn.Config, runtime: ServingRuntime) -> None:
        super().__init__(config)
        self.runtime = runtime

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        logger.info("shutting down: queued requests get %.1fs", self.runtime.settings.shutdown_timeout_s)
        self.runtime.drain()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            logger.warning("second signal %d during shutdown: exiting now", sig)
            os._exit(128 + sig)
        super().handle_exit(sig, frame)


def draining_server(app, host: str, port: int, **config) -> DrainingServer:
    """A DrainingServer for an app made by create_app (its runtime is app.state.runtime)."""
    runtime = app.state.runtime
    timeout = runtime.settings.shutdown_timeout_s + BACKSTOP_S
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, timeout_graceful_shutdown=timeout, **config
    )
    return DrainingServer(uv_config, runtime)
