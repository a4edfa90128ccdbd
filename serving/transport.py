"""What the HTTP transport tells a handler: the raw body under a size limit, and client disconnects.

read_body() never holds more than `limit` bytes: a declared Content-Length over the limit is
refused before any byte is read, and a chunked (or lying) upload is refused as soon as the bytes
received pass the limit. Turning the bytes into a request is a separate step (schemas.json_parser).

cancel_on_disconnect() awaits a coroutine while a watcher listens for http.disconnect on the same
ASGI receive channel; when the client goes away first, the coroutine is cancelled (the batcher
then drops the request before it reaches the model thread) and ClientGone is raised.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from hstu.serving.errors import RankError
from hstu.serving.schemas import sniff_request_id

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _too_large(limit: int, got: str, prefix: bytes) -> RankError:
    detail = f"request body of {got} is over the limit of {limit} bytes"
    return RankError(413, "payload_too_large", detail, request_id=sniff_request_id(prefix))


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or RankError 413 once it is known to exceed `limit` bytes; ClientGone if
    the client disconnects mid-upload."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f"{int(declared)} bytes (Content-Length)", b"")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            if size + len(chunk) > limit:
                prefix = b"".join(chunks) + chunk[: limit - size]
                raise _too_large(limit, f"more than {limit} bytes", prefix)
            size += len(chunk)
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ClientGone("the client disconnected while sending the body") from exc
    return b"".join(chunks)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work` (after the body was read); cancel it and raise ClientGone if the client leaves
    first. One watcher task per request: on disconnect it cancels the awaiting task itself."""
    waiter = asyncio.current_task()
    waiting = True

    def on_disconnect(watch: asyncio.Future) -> None:
        if waiting and not watch.cancelled():  # never cancel the handler once it stopped waiting here
            waiter.cancel()

    watch = asyncio.ensure_future(_disconnected(receive))
    watch.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if not (watch.done() and not watch.cancelled()):
            raise
        if hasattr(waiter, "uncancel"):  # Python 3.11+: the cancellation was ours, take it back
            waiter.uncancel()
        raise ClientGone("the client disconnected while its request waited") from None
    finally:
        waiting = False
        watch.cancel()
