"""The Ray Serve application: an HTTP ingress in front of N ranking replicas, routed by user.

    HTTP -> HSTUIngress (the FastAPI app of `hstu serve`: parsing, validation, limits, errors)
         -> DeploymentHandle(user_id=...) -> UserAffinityRouter (serving/ray_router.py)
         -> HSTURanking replica (one per GPU: its own ServingRuntime = engine, KV cache, batcher)

The ingress builds the very app `hstu serve` runs (serving/app.py) with a RemoteRuntime in place of
the in-process ServingRuntime, so both paths share every endpoint, error and limit. A request's
deadline travels as the time left (clocks of two hosts are not comparable). A request whose
replica died is sent again: Serve's router re-routes one that the dead replica had not answered,
and the ingress re-sends one that still fails with a lost replica (hstu_replica_retries_total),
until its deadline. Ranking is pure, so a retry is safe, and the new replica recomputes the user's
history, since its K/V are not there. A user who returns to a replica holding an older prefix is checked by exact
identity by that replica's engine, so every answer equals the no-cache model's.

/metrics on the ingress: its own request metrics, the router's decisions (hstu_router_*), and every
live replica's metrics (batcher, cache) with a `replica` label. /v2/models/hstu reports the number
of live replicas. Each ranking replica's check_health fails unless its runtime is ready, so Ray
Serve replaces a replica whose model failed.

`build_app(settings, replicas=N)` is the application; `app_builder(args)` is the same for a Serve
config file (`import_path: hstu.serving.ray_app:app_builder`); `serve_locally` runs it for
`hstu serve --replicas N`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from functools import partial
from typing import Any

from prometheus_client import Counter
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from hstu.engine import RankOutput
from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.serving.app import create_app
from hstu.serving.errors import RETRY_AFTER_S, RankError
from hstu.serving.metrics import ServingMetrics, merged_exposition
from hstu.serving.ray_router import DEFAULT_MAX_QUEUE, ROUTING_KEY, UserAffinityRouter
from hstu.serving.router_stats import RouterCollector, router_stats
from hstu.serving.runtime import Runtime, ServedModel, ServingRuntime
from hstu.serving.schemas import RequestLimits
from hstu.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

APP_NAME = "hstu"
RANKING = "HSTURanking"
INGRESS = "HSTUIngress"
DEFAULT_MAX_ONGOING = 64
_LOST_REPLICA = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)
_RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.5)
_SCRAPE_TIMEOUT_S = 2.0
_READY_POLL_S = 0.5
_NO_ACCESS_LOG = {"enable_access_log": False}  # as `hstu serve` (uvicorn access_log=False): no per-request lines


class RankingReplica:
    """One ranking replica: a ServingRuntime (engine, KV cache, batcher) inside a Serve replica."""

    async def __init__(self, settings: ServerSettings) -> None:
        settings.check()  # on the replica's own node: its files, its GPU
        self.runtime = ServingRuntime.standalone(settings)
        self.name = serve.get_replica_context().replica_id.unique_id
        await self.runtime.start()
        if not self.runtime.ready:
            raise RuntimeError(f"ranking replica {self.name} did not start: {self.runtime.state} ({self.runtime.detail})")

    async def rank(self, request: RankingRequest, timeout_s: float, user_id: int) -> RankOutput | RankError:
        """Scores of one request within `timeout_s`; a RankError is returned, not raised (it crosses
        Ray as a value). `user_id` is the routing key and must be the request's."""
        if user_id != request.user_id:
            return RankError(500, "internal", f"routing key user_id={user_id} is not the request's user {request.user_id}")
        try:
            return await self.runtime.submit(request, time.monotonic() + timeout_s)
        except RankError as exc:
            return exc

    async def prefetch(self, user_id: int) -> int:
        """Start the onload of `user_id` (also the routing key, so it runs on the user's replica)."""
        return await self.runtime.prefetch_users([user_id])

    def describe(self) -> dict[str, Any]:
        """Who this replica is and what it serves: the ingress checks it serves the same model."""
        return {"replica": self.name, "config": self.runtime.config.to_dict(), "fingerprint": self.runtime.fingerprint}

    async def scrape(self) -> tuple[str, bytes]:
        """(this replica's name, its Prometheus text): what the ingress broadcasts for /metrics."""
        return self.name, await self.runtime.exposition()

    def check_health(self) -> None:
        if not self.runtime.ready:
            raise RuntimeError(f"ranking replica {self.name} is {self.runtime.state}")

    async def __del__(self) -> None:
        await self.runtime.close()


class RemoteRuntime(Runtime):
    """The ingress's Runtime: ranks through a handle to the ranking deployment, with the user id as
    the routing key. `model` is a ServedModel once a replica described itself; no cache here
    (`manager` stays None): the replicas' cache metrics come through exposition()."""

    def __init__(
        self,
        settings: ServerSettings,
        config: HSTUConfig,
        limits: RequestLimits,
        metrics: ServingMetrics,
        ranking: DeploymentHandle,
    ) -> None:
        super().__init__(settings, config, limits, metrics, "waiting for a ranking replica")
        self._in_flight = 0
        self._ranking = ranking
        self._stats = router_stats(RANKING)
        metrics.registry.register(RouterCollector(self._stats))
        self._retries = Counter(
            "hstu_replica_retries", "Requests sent again because their ranking replica was lost", registry=metrics.registry
        )

    @property
    def pending(self) -> int:
        return self._in_flight

    @property
    def replicas(self) -> int:
        """Live ranking replicas as the router saw them last."""
        return len(self._stats.replicas)

    async def start(self) -> None:
        """Ready once a ranking replica answers and serves this app's model config."""
        while self.state == "loading":
            try:
                info = await asyncio.wait_for(self._ranking.describe.remote(), _SCRAPE_TIMEOUT_S)
            except (TimeoutError, *_LOST_REPLICA) as exc:
                logger.info("no ranking replica answered yet (%s)", type(exc).__name__)
                await asyncio.sleep(_READY_POLL_S)
                continue
            if info["config"] != self.config.to_dict():
                logger.error("replica %s serves another model config: %s", info["replica"], info["config"])
                self.state, self.detail = "failed", "the ranking replicas serve another model config"
                return
            self.fingerprint = info["fingerprint"]
            self.model = ServedModel(bytes.fromhex(self.fingerprint))
            self.state, self.detail = "ready", None
            self.metrics.ready.set(1)
            logger.info("ingress ready: ranking replicas serve weights %s", self.fingerprint)

    async def submit(self, request: RankingRequest, deadline: float) -> RankOutput:
        """Rank on the user's replica; a lost replica means a retry elsewhere until `deadline`."""
        self._in_flight += 1
        try:
            for attempt in range(len(_RETRY_BACKOFF_S) + 1):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                call = self._ranking.rank.remote(request, left, **{ROUTING_KEY: request.user_id})
                try:
                    outcome = await asyncio.wait_for(call, left)
                except TimeoutError:
                    break
                except _LOST_REPLICA as exc:
                    if attempt == len(_RETRY_BACKOFF_S):
                        raise RankError(
                            503, "unavailable", f"user {request.user_id}: ranking replicas lost ({type(exc).__name__})",
                            retry_after_s=RETRY_AFTER_S,
                        ) from exc
                    logger.info("user %d: replica lost (%s); sending again", request.user_id, type(exc).__name__)
                    self._retries.inc()
                    await asyncio.sleep(_RETRY_BACKOFF_S[attempt])
                    continue
                if isinstance(outcome, RankError):
                    raise outcome
                return outcome
            raise RankError(504, "timeout", f"user {request.user_id}: request deadline passed")
        finally:
            self._in_flight -= 1

    async def prefetch_users(self, user_ids: list[int]) -> int:
        """One prefetch per user, each on the user's replica, one after another: Serve gives the
        calls made while serving one HTTP request one internal request id, and its router's
        exact-id matching assigns only one of several such calls in flight at once."""
        started = 0
        for u in user_ids:
            started += await self._ranking.prefetch.remote(**{ROUTING_KEY: u})
        return started

    async def exposition(self) -> bytes:
        """The ingress's metrics, then every live replica's (one broadcast) with a `replica` label."""
        try:
            scraped = await self._ranking.broadcast("scrape").results_async(
                timeout_s=_SCRAPE_TIMEOUT_S, return_exceptions=True
            )
        except TimeoutError:
            logger.warning("replica metrics: no answer within %.1fs", _SCRAPE_TIMEOUT_S)
            scraped = []
        texts = {}
        for outcome in scraped:
            if isinstance(outcome, BaseException):
                logger.warning("replica metrics: %s: %s", type(outcome).__name__, outcome)
            else:
                texts[outcome[0]] = outcome[1].decode()
        return merged_exposition(self.metrics.registry, texts)

    def drain(self) -> None:
        self.state, self.detail = "stopping", "shutting down"
        self.metrics.ready.set(0)

    async def close(self, start_task: asyncio.Task | None = None) -> None:
        self.drain()
        if start_task is not None:
            await start_task
        self.state = "stopped"


@serve.ingress()
class HTTPIngress:
    """The HTTP ingress: the app of serving/app.py over a RemoteRuntime to the ranking deployment."""

    def __init__(self, settings: ServerSettings, ranking: DeploymentHandle) -> None:
        self._settings = settings
        self._ranking = ranking

    def __serve_build_asgi_app__(self):
        return create_app(self._settings, runtime_factory=partial(RemoteRuntime, ranking=self._ranking))


def build_app(
    settings: ServerSettings,
    replicas: int = 1,
    gpus_per_replica: float | None = None,
    cpus_per_replica: float = 1.0,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING,
    ingress_replicas: int = 1,
):
    """The Serve application: `replicas` ranking replicas (each `gpus_per_replica` GPUs: 1 on CUDA,
    0 on CPU by default) behind `ingress_replicas` HTTP ingresses. `max_queue` is the router's load
    bound (a replica with more ongoing requests hands new ones on); `max_ongoing_requests` is
    Serve's hard cap per replica."""
    if replicas < 1 or ingress_replicas < 1:
        raise ValueError(f"need at least one replica and one ingress, got {replicas} and {ingress_replicas}")
    if max_ongoing_requests <= max_queue:
        raise ValueError(f"max_ongoing_requests ({max_ongoing_requests}) must exceed max_queue ({max_queue})")
    if gpus_per_replica is None:
        gpus_per_replica = 1.0 if settings.device.startswith("cuda") else 0.0
    if gpus_per_replica > 0 and settings.device.startswith("cuda:"):
        raise ValueError(f"with GPUs per replica use device 'cuda' (Ray assigns each replica its GPU), got {settings.device!r}")
    ranking = serve.deployment(
        RankingReplica,
        name=RANKING,
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        logging_config=_NO_ACCESS_LOG,
        request_router_config=RequestRouterConfig(
            request_router_class=UserAffinityRouter, request_router_kwargs={"max_queue": max_queue}
        ),
    )
    ingress = serve.deployment(
        HTTPIngress,
        name=INGRESS,
        num_replicas=ingress_replicas,
        max_ongoing_requests=settings.max_queue,
        ray_actor_options={"num_cpus": 0},
        logging_config=_NO_ACCESS_LOG,
    )
    return ingress.bind(settings, ranking.bind(settings))


def app_builder(args: dict[str, Any]):
    """build_app for a Serve config file: `args` holds `config_file` (a ServerSettings file),
    `settings` (ServerSettings fields over it) and build_app's keyword arguments."""
    args = dict(args)
    settings = ServerSettings.load(args.pop("config_file", None), {}, **args.pop("settings", {}))
    return build_app(settings, **args)


def serve_locally(settings: ServerSettings, host: str, port: int, replicas: int, gpus_per_replica: float | None) -> None:
    """`hstu serve --replicas N`: start (or join, with RAY_ADDRESS) a Ray cluster, serve the app on
    host:port until SIGINT/SIGTERM, then delete the app (replicas drain their queues)."""
    import ray

    ray.init(include_dashboard=False)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # after ray.init, which installs its own
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_app(settings, replicas=replicas, gpus_per_replica=gpus_per_replica)
        serve.run(app, name=APP_NAME, route_prefix="/")
        logger.info("serving %d ranking replicas on http://%s:%d (docs at /docs)", replicas, host, port)
        signal.pause()
    except KeyboardInterrupt:
        logger.info("stopping: deleting the %s application", APP_NAME)
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
