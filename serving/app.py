"""The FastAPI app: POST /v1/rank, health, model metadata, /metrics, /docs.

create_app(settings) resolves the model config at once (the request limits come from it); the
lifespan starts ServingRuntime.start() in the background (model load + warm-up) and, on shutdown,
drains the batcher (settings.shutdown_timeout_s) and closes the cache manager. Until warm-up is
done /v2/health/ready, /v2/models/hstu/ready and /v1/rank answer 503; /v2/health/live answers 200
unless loading failed.

A rank request goes: read the raw body under max_body_bytes (413) -> parse the bytes (400 not
JSON, 422 invalid) -> an incremental body's full history rebuilt from the one held (412
history_incomplete when not held, serving/incremental.py) -> queue in the batcher until its
deadline (request_timeout_ms: 504), its queue wait (max_queue_wait_ms: 503 + Retry-After) or the
client's disconnect (dropped) -> scores, with the history's digest and length for the next
incremental request; the history is kept (serving/history_store.py).

Every non-2xx answer has the body {"error": kind, "detail": message, "request_id": id or null},
with the client's request_id when its body had one (read best-effort even from a rejected body).
"""

import asyncio
import itertools
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from hstu import __version__
from hstu.model.batch import RankingRequest
from hstu.serving.errors import RETRY_AFTER_S, RankError, error_body, error_response, rank_error_response
from hstu.serving.history_store import HistoryStore
from hstu.serving.incremental import IncrementalHistories
from hstu.serving.docs import install_docs
from hstu.serving.metadata import MODEL_NAME, ModelMetadata, ModelReady, model_metadata
from hstu.serving.metrics import ServingMetrics
from hstu.serving.parse_pool import ParsePool
from hstu.serving.parsing import ParsedRank, RankBodyParser
from hstu.serving.responses import ScoresEncoder, encode_response
from hstu.serving.runtime import RuntimeFactory, ServingRuntime
from hstu.serving.schemas import (
    ErrorResponse,
    HealthResponse,
    PrefetchRequest,
    PrefetchResponse,
    RankResponse,
    RequestLimits,
    build_rank_columns_model,
    build_rank_request_model,
    describe_validation_error,
    json_parser,
)
from hstu.serving.settings import ServerSettings
from hstu.serving.transport import ClientGone, cancel_on_disconnect, read_body

logger = logging.getLogger(__name__)

# Every status an endpoint may answer with the error shape; the README's error table lists them too.
_ERROR_STATUSES = {
    400: "the body is not valid JSON",
    409: "history is shorter than the user's cached history",
    412: "history_incomplete: the server does not hold the prefix an incremental request names; send the full history",
    413: "the body is larger than max_body_bytes",
    422: "invalid request (schema, id ranges, limits, timestamps)",
    500: "the model call failed; the server keeps serving",
    503: "not ready, shutting down, overloaded (queue full or queue wait over; Retry-After), or over the KV cache",
    504: "the request's deadline (request_timeout_ms) passed",
}
_HTTP_KINDS = {404: "not_found", 405: "method_not_allowed"}
_INLINE_PARSE_BYTES = 32 << 10
_CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never seen by a client


RANK_PATH = "/v1/rank"


class RequestIds:
    """Ids for requests that bring none: 32 hex digits, 64 random bits drawn once per process then a
    counter, so they are unique across front ends and restarts without a uuid4 per request (an
    os.urandom call each, ~1.5 us on the dev CPU and more where system calls cost more)."""

    def __init__(self) -> None:
        self._restart()
        os.register_at_fork(after_in_child=self._restart)  # a forked child never repeats its parent's ids

    def _restart(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


_new_request_id = RequestIds()  # one per process (every app of it shares it; one fork hook)


class RankingApp(FastAPI):
    """FastAPI with POST /v1/rank handed straight to its handler (`rank_handler`), past the
    middleware stack and the router. The route stays registered: OpenAPI documents it, other
    methods get FastAPI's 405, and a path under a root_path is routed as before. Once any
    middleware is added (add_middleware: authentication, CORS), every request takes the stack again,
    so none is bypassed.

    Why: the stack around one endpoint (error and exception middlewares, the exit-stack middleware,
    routing, the request/response wrappers) took ~0.13 ms before the handler's first line and
    about as much after it, per request, on every front end's event loop (dev CPU, tiny model:
    ASGI call p50 4.87 ms against the handler's own 4.45 ms). The handler already answers every
    error it knows in the one error shape; anything else is a 500 in that shape here, where the
    stack's error middleware answered plain text."""

    rank_handler: Callable[[Request], Awaitable[Response]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.rank_handler
        if (
            handler is None or self.user_middleware or scope["type"] != "http" or scope["path"] != RANK_PATH
            or scope["method"] != "POST"
        ):
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        try:
            response = await handler(Request(scope, receive))
        except Exception as exc:  # what the handler does not answer itself (a bug): a 500 in the error shape
            logger.exception("POST %s failed", RANK_PATH)
            metrics = getattr(self.state, "metrics", None)
            if metrics is not None:
                metrics.errors.labels("internal").inc()
            detail = f"the server failed to answer this request ({type(exc).__name__})"
            response = error_response(500, "internal", detail)
        await response(scope, receive, send)


def _responses(*statuses: int) -> dict:
    return {s: {"model": ErrorResponse, "description": _ERROR_STATUSES[s]} for s in statuses}


def create_app(settings: ServerSettings | None = None, runtime_factory: RuntimeFactory | None = None) -> FastAPI:
    """A ranking app for `settings` (defaults: the embedded HSTUConfig on CPU).

    `runtime_factory` builds the Runtime that ranks the requests: by default the in-process
    ServingRuntime of `hstu serve`, or with settings.engine_process the front end of an engine
    process (serving/engine_process.py); the Ray Serve ingress passes its RemoteRuntime
    (serving/ray_app.py). All behind the same endpoints."""
    settings = settings or ServerSettings()
    if runtime_factory is None:
        if settings.engine_process:
            from hstu.serving.engine_process import EngineProcessRuntime

            runtime_factory = EngineProcessRuntime
        else:
            runtime_factory = ServingRuntime
    config = settings.resolve_model_config()
    task_names = settings.resolve_task_names(config)
    encode_scores = ScoresEncoder(task_names)
    limits = RequestLimits.for_model(config, settings.max_candidates, settings.max_body_bytes)
    metrics = ServingMetrics(settings.max_batch_size)
    runtime = runtime_factory(settings, config, limits, metrics)
    metrics.watch_cache(lambda: runtime.manager)
    metrics.watch_graphs(lambda: getattr(runtime, "engine", None))
    metrics.queue_depth.set_function(lambda: runtime.pending)
    RankRequestModel = build_rank_request_model(limits)
    RankColumnsModel = build_rank_columns_model(limits)
    parse_rank_body = RankBodyParser(limits, config, RankRequestModel, RankColumnsModel)
    histories = IncrementalHistories(HistoryStore(settings.history_store_bytes), config, metrics)
    metrics.watch_history_store(histories.store)
    request_timeout_s = settings.request_timeout_ms / 1000.0
    parse_pool = ParsePool(settings.parse_processes, limits, config) if settings.parse_processes else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start_task = asyncio.create_task(runtime.start(), name="hstu-load")
        try:
            if parse_pool is not None:
                await asyncio.to_thread(parse_pool.start)
            yield
        finally:
            await runtime.close(start_task)
            if parse_pool is not None:
                await asyncio.to_thread(parse_pool.close)

    app = RankingApp(
        title="hstu-kvcache ranking server",
        version=__version__,
        description=(
            "Ranks candidates for a user with an HSTU model whose history K/V are kept in a tiered "
            f"(GPU pages + host) cache. Tasks: {', '.join(task_names)}."
        ),
        lifespan=lifespan,
        docs_url=None,  # serving/docs.py: local assets
        redoc_url=None,
    )
    install_docs(app)
    app.state.runtime = runtime
    app.state.metrics = metrics
    app.state.histories = histories
    app.state.parse_pool = parse_pool

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.errors.labels("invalid_request").inc()
        return error_response(422, "invalid_request", describe_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = _HTTP_KINDS.get(exc.status_code, "http_error")
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, kind, detail, None, exc.headers)

    @app.post(
        RANK_PATH,
        response_model=RankResponse,
        responses=_responses(400, 409, 412, 413, 422, 500, 503, 504),
        summary="Score candidates for one user",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "oneOf": [
                                {"$ref": "#/components/schemas/RankRequest"},
                                {"$ref": "#/components/schemas/RankRequestColumns"},
                            ]
                        }
                    }
                },
            }
        },
    )
    async def rank(request: Request) -> Response:
        arrived = time.perf_counter()
        reached = time.monotonic()  # the batch window, queue limit and deadline count from here
        deadline = reached + request_timeout_s
        request_id = None
        try:
            parsed = await _parse(await read_body(request, limits.max_body_bytes))
            request_id = parsed.request_id or _new_request_id()
            handed = time.perf_counter()
            output = await cancel_on_disconnect(request.receive, _rank_one(parsed.request, deadline, reached))
            answered = time.perf_counter()
        except RankError as exc:
            return _failed(exc.status, exc.kind, arrived, rank_error_response(exc, request_id))
        except ClientGone as exc:
            logger.info("request %s: %s", request_id, exc)
            return _failed(_CLIENT_GONE, "client_gone", arrived, Response(status_code=_CLIENT_GONE))
        if parsed.digest is None:  # parsed before the model had loaded
            parsed.digest = parsed.request.identity(runtime.model.identity).prefix(parsed.request.history_tokens(config))
        histories.remember(parsed.request, runtime.model.identity)
        latency = time.perf_counter() - arrived
        metrics.request_latency.labels("200").observe(latency)
        # Encoded here (serving/responses.py) rather than through the RankResponse model (~3 ms of
        # validation and encoding on the event loop); the model documents the shape.
        body = encode_response(
            {
                "request_id": request_id,
                "user_id": parsed.request.user_id,
                "scores": encode_scores(parsed.candidates, output.scores),
                "cached_tokens": output.cached_tokens,
                "computed_tokens": output.computed_tokens,
                "latency_ms": latency * 1000.0,
                "history_digest": parsed.digest.hex() if histories.store.enabled else None,
                "history_length": parsed.request.num_events,
            }
        )
        done = time.perf_counter()
        metrics.phase.labels("read_parse").observe(handed - arrived)
        metrics.phase.labels("rank").observe(answered - handed)
        metrics.phase.labels("respond").observe(done - answered)
        return Response(content=body, media_type="application/json")

    app.rank_handler = rank
    parse_prefetch = json_parser(PrefetchRequest)

    @app.post("/v1/prefetch", response_model=PrefetchResponse, responses=_responses(400, 413, 422, 503),
              summary="Start moving users' cached K/V from the host tier to the GPU")
    async def prefetch(request: Request) -> Response:
        try:
            body = parse_prefetch(await read_body(request, limits.max_body_bytes))
            if not runtime.ready:
                raise RankError(503, "unavailable", f"server is {runtime.state}", retry_after_s=RETRY_AFTER_S)
        except RankError as exc:
            return rank_error_response(exc, None)
        users = list(dict.fromkeys(body.user_ids))
        started = await runtime.prefetch_users(users)
        return PrefetchResponse(requested=len(users), started=started)

    def _failed(status: int, kind: str, arrived: float, response: Response) -> Response:
        metrics.errors.labels(kind).inc()
        metrics.request_latency.labels(str(status)).observe(time.perf_counter() - arrived)
        return response

    def _digested(parsed: ParsedRank) -> ParsedRank:
        """The full history (an incremental body rebuilt from the held one) with its identity digests
        (model/identity.py), computed here, off the model thread. Before the model loads a full
        request goes on (to its 503 in _rank_one); an incremental one cannot be rebuilt: 503 here."""
        if runtime.model is None:
            if parsed.prefix is not None:
                raise _unavailable(parsed.request_id)
            return parsed
        if parsed.prefix is not None:
            return histories.rebuild(parsed, runtime.model.identity)
        if parsed.digest is not None:  # a parse worker hashed it
            return parsed
        r = parsed.request
        parsed.digest = r.identity(runtime.model.identity).prefix(r.history_tokens(config))
        return parsed

    def _parse_and_digest(raw: bytes) -> ParsedRank:
        return _digested(parse_rank_body(raw))

    async def _parse(raw: bytes) -> ParsedRank:
        """Small bodies parse on the loop (microseconds); large ones in a worker thread, so health
        checks and batching stay responsive while a 4k-event body is read. A small incremental body
        is rebuilt on the loop whatever its held prefix: ~0.1-0.15 ms for 1k to 4k held events here
        (mostly fixed costs), about what a 32 KiB body parses and hashes inline in (0.15 ms). With
        settings.parse_processes, large bodies parse in worker processes instead (serving/parse_pool.py)."""
        if len(raw) < _INLINE_PARSE_BYTES:
            return _parse_and_digest(raw)
        if parse_pool is not None:
            model_id = runtime.model.identity if runtime.model is not None else None
            parsed = await parse_pool.parse(raw, model_id)
            if parsed is not None:
                return _digested(parsed)
        return await asyncio.to_thread(_parse_and_digest, raw)

    def _unavailable(request_id: str | None = None) -> RankError:
        detail = f"server is {runtime.state}: {runtime.detail}"
        return RankError(503, "unavailable", detail, retry_after_s=RETRY_AFTER_S, request_id=request_id)

    async def _rank_one(request: RankingRequest, deadline: float, reached: float):
        if not runtime.ready:
            raise _unavailable()
        return await runtime.submit(request, deadline, arrived=reached)

    def _not_ready() -> JSONResponse:
        """503 in the error shape, with `status` for the health probes; never exception text."""
        content = {**error_body("unavailable", runtime.detail or runtime.state), "status": runtime.state}
        return JSONResponse(status_code=503, content=content, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/v2/health/live", response_model=HealthResponse, responses=_responses(503))
    async def live() -> HealthResponse | JSONResponse:
        return _not_ready() if runtime.state == "failed" else HealthResponse(status="live")

    @app.get("/v2/health/ready", response_model=HealthResponse, responses=_responses(503))
    async def ready() -> HealthResponse | JSONResponse:
        return HealthResponse(status="ready") if runtime.ready else _not_ready()

    @app.get(f"/v2/models/{MODEL_NAME}", response_model=ModelMetadata, summary="Served model metadata")
    @app.get("/v1/model", response_model=ModelMetadata, summary="Served model metadata (alias)")
    async def metadata() -> ModelMetadata:
        return model_metadata(runtime, task_names)

    @app.get(f"/v2/models/{MODEL_NAME}/ready", response_model=ModelReady, responses=_responses(503))
    async def model_ready() -> ModelReady | JSONResponse:
        return ModelReady(name=MODEL_NAME, ready=True) if runtime.ready else _not_ready()

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics")
    async def prometheus() -> Response:
        return Response(await runtime.exposition(), media_type=CONTENT_TYPE_LATEST)

    _publish_request_schema(app, RankRequestModel)
    _publish_request_schema(app, RankColumnsModel)
    return app


def _publish_request_schema(app: FastAPI, model) -> None:
    """Add the rank body model (read from raw bytes, so FastAPI does not see it) to the OpenAPI schemas."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            spec = build()  # cached by FastAPI in app.openapi_schema; completed here once
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components = spec.setdefault("components", {}).setdefault("schemas", {})
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
        return app.openapi_schema

    app.openapi = openapi
