"""The FastAPI app: POST /v1/rank, /v2/health/live, /v2/health/ready, /metrics, /docs.

create_app(settings) resolves the model config at once (the request schema's limits come from
it); the lifespan starts ServingRuntime.start() in the background (model load + warm-up) and, on
shutdown, drains the batcher and closes the cache manager. Until warm-up is done /v2/health/ready
and /v1/rank answer 503; /v2/health/live answers 200 unless loading failed.

Every error response has the body {"error": kind, "detail": message, "request_id": id or null};
request validation errors list each problem as "location: message" in `detail`.
"""

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from hstu import __version__
from hstu.model.batch import RankingRequest
from hstu.serving.errors import RankError
from hstu.serving.metrics import ServingMetrics
from hstu.serving.runtime import ServingRuntime
from hstu.serving.schemas import (
    ErrorResponse,
    HealthResponse,
    RankResponse,
    RequestLimits,
    build_rank_request_model,
)
from hstu.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

_ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in (
        (409, "history is shorter than the user's cached history"),
        (422, "invalid request (schema, id ranges, limits, timestamps)"),
        (500, "the model call failed; the server keeps serving"),
        (503, "not ready, shutting down, queue full, or the request alone exceeds the KV cache"),
    )
}


def _error(status: int, kind: str, detail: str, request_id: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": kind, "detail": detail, "request_id": request_id})


def _describe_validation_error(exc: RequestValidationError) -> str:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body") or "body"
        got = err.get("input")
        shown = f" (got {got!r})" if isinstance(got, (int, float, str, bool)) and len(repr(got)) <= 64 else ""
        problems.append(f"{loc}: {err.get('msg', 'invalid')}{shown}")
    return "; ".join(problems)


def create_app(settings: ServerSettings | None = None) -> FastAPI:
    """A ranking app for `settings` (defaults: the embedded HSTUConfig on CPU)."""
    settings = settings or ServerSettings()
    config = settings.resolve_model_config()
    task_names = settings.resolve_task_names(config)
    limits = RequestLimits.for_model(config, settings.max_candidates)
    metrics = ServingMetrics(settings.max_batch_size)
    runtime = ServingRuntime(settings, config, limits, metrics)
    metrics.watch_cache(lambda: runtime.manager)
    metrics.queue_depth.set_function(lambda: runtime.batcher.pending if runtime.batcher is not None else 0)
    RankRequestModel = build_rank_request_model(limits)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start_task = asyncio.create_task(runtime.start(), name="hstu-load")
        try:
            yield
        finally:
            await runtime.close(start_task)

    app = FastAPI(
        title="hstu-kvcache ranking server",
        version=__version__,
        description=(
            "Ranks candidates for a user with an HSTU model whose history K/V are kept in a tiered "
            f"(GPU pages + host) cache. Tasks: {', '.join(task_names)}."
        ),
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.errors.labels("invalid_request").inc()
        return _error(422, "invalid_request", _describe_validation_error(exc))

    @app.post(
        "/v1/rank",
        response_model=RankResponse,
        responses=_ERROR_RESPONSES,
        summary="Score candidates for one user",
    )
    async def rank(body: RankRequestModel) -> RankResponse | JSONResponse:
        arrived = time.perf_counter()
        request_id = body.request_id or uuid.uuid4().hex
        try:
            output = await _rank_one(body)
        except RankError as exc:
            metrics.errors.labels(exc.kind).inc()
            metrics.request_latency.labels(str(exc.status)).observe(time.perf_counter() - arrived)
            return _error(exc.status, exc.kind, exc.detail, request_id)
        probs = output.scores.tolist()
        latency = time.perf_counter() - arrived
        metrics.request_latency.labels("200").observe(latency)
        return RankResponse(
            request_id=request_id,
            user_id=body.user_id,
            scores=[{"item_id": item, "scores": dict(zip(task_names, p))} for item, p in zip(body.candidates, probs)],
            cached_tokens=output.cached_tokens,
            computed_tokens=output.computed_tokens,
            latency_ms=latency * 1000.0,
        )

    async def _rank_one(body):
        if not runtime.ready:
            raise RankError(503, "unavailable", f"server is {runtime.state}: {runtime.detail}")
        try:
            request = RankingRequest.create(
                body.user_id,
                [e.item_id for e in body.history],
                [e.action for e in body.history],
                [e.timestamp for e in body.history],
                body.candidates,
                contextual=body.contextual,
                config=config,
            )
        except ValueError as exc:
            raise RankError(422, "invalid_request", str(exc)) from exc
        return await runtime.batcher.submit(request)

    @app.get("/v2/health/live", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def live() -> HealthResponse | JSONResponse:
        if runtime.state == "failed":
            return JSONResponse(status_code=503, content={"status": "failed", "detail": runtime.detail})
        return HealthResponse(status="live")

    @app.get("/v2/health/ready", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def ready() -> HealthResponse | JSONResponse:
        if not runtime.ready:
            return JSONResponse(status_code=503, content={"status": runtime.state, "detail": runtime.detail})
        return HealthResponse(status="ready")

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
