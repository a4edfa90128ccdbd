"""The Ray Serve application: an HTTP ingress in front of N ranking replicas, routed by user.

    HTTP -> HSTUIngress (the FastAPI app of `hstu serve`: parsing, validation, limits, errors)
         -> CallCoalescer (serving/call_coalescer.py: requests for the same replica share a call)
         -> DeploymentHandle(user_id=...) -> UserAffinityRouter (serving/ray_router.py)
         -> HSTURanking replica (one per GPU: its own ServingRuntime = engine, KV cache, batcher)

A Serve handle call costs more than a small batch's ranking, so the ingress keeps at most
`max_calls_per_replica` calls in flight to each replica (the owner of the users on the router's
ring) and sends the requests that arrive meanwhile together in the next call (at most the
replica's batch size, sent at once when that many wait); an idle replica gets each request at once.

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
import socket
import time
from functools import partial
from typing import Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from hstu.engine import RankOutput
from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.serving.app import create_app
from hstu.serving.call_coalescer import CallCoalescer, CoalescerStats
from hstu.serving.errors import RETRY_AFTER_S, RankError
from hstu.serving.metrics import ServingMetrics, merged_exposition
from hstu.serving.ray_router import DEFAULT_MAX_QUEUE, ROUTING_KEY, USERS_KEY, UserAffinityRouter
from hstu.serving.router_stats import RouterCollector, router_stats
from hstu.serving.runtime import Runtime, ServedModel, ServingRuntime
from hstu.serving.schemas import RequestLimits
from hstu.serving.settings import ServerSettings
from hstu.serving.user_ring import UserRing

logger = logging.getLogger(__name__)

APP_NAME = "hstu"
RANKING = "HSTURanking"
INGRESS = "HSTUIngress"
DEFAULT_MAX_ONGOING = 64
DEFAULT_CALLS_PER_REPLICA = 4  # calls in flight from one ingress to one replica; more requests wait and share a call
_LOST_REPLICA = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)
_RETRY_BACKOFF_S = (0.05, 0.1, 0.2, 0.5)
_SCRAPE_TIMEOUT_S = 2.0
_MIN_SILENT_S = 1.0  # a call may take this long before it counts as lost, however short the deadline
_READY_POLL_S = 0.5
_LISTEN_BACKLOG = 2048
_NO_ACCESS_LOG = {"enable_access_log": False}  # as `hstu serve` (uvicorn access_log=False): no per-request lines


class RankingReplica:
    """One ranking replica: a ServingRuntime (engine, KV cache, batcher) inside a Serve replica."""

    async def __init__(self, settings: ServerSettings) -> None:
        settings.check()  # on the replica's own node: its files, its GPU
        if settings.engine_process:  # the engine in a child process: the GIL here stays Serve's
            from hstu.serving.engine_process import EngineProcessRuntime

            self.runtime = EngineProcessRuntime.standalone(settings)
        else:
            self.runtime = ServingRuntime.standalone(settings)
        self.name = serve.get_replica_context().replica_id.unique_id
        await self.runtime.start()
        if not self.runtime.ready:
            raise RuntimeError(f"ranking replica {self.name} did not start: {self.runtime.state} ({self.runtime.detail})")

    async def rank_many(
        self, requests: list[RankingRequest], timeouts_s: list[float], user_id: int, users: list[int]
    ) -> tuple[list[RankOutput | RankError], float]:
        """Scores of several requests (the ingress's CallCoalescer's call), all submitted to the
        batcher at once, each within its `timeouts_s`; a RankError is returned, not raised (it
        crosses Ray as a value). Also the seconds spent here, so the ingress can tell Serve's share
        of the round trip. `user_id` is the routing key (the first request's user), `users` every
        request's (the router counts them)."""
        started = time.monotonic()
        if users != [r.user_id for r in requests] or user_id != users[0]:
            error = RankError(500, "internal", f"routing keys {user_id}, {users} are not the requests' users")
            return [error] * len(requests), 0.0
        outcomes = await asyncio.gather(*(self._rank_one(r, t) for r, t in zip(requests, timeouts_s)))
        return list(outcomes), time.monotonic() - started

    async def _rank_one(self, request: RankingRequest, timeout_s: float) -> RankOutput | RankError:
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


class _CoalescerCollector(Collector):
    """hstu_replica_calls_total and hstu_replica_call_requests_total (their ratio: requests per
    call) and hstu_replica_retries_total."""

    def __init__(self, stats: CoalescerStats) -> None:
        self._stats = stats

    def describe(self):
        return []

    def collect(self):
        s = self._stats
        for name, doc, value in (
            ("hstu_replica_calls", "Calls from this ingress to ranking replicas", s.calls),
            ("hstu_replica_call_requests", "Requests those calls carried", s.items),
            ("hstu_replica_retries", "Requests sent again because their ranking replica was lost", s.retried),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


async def await_or_cancel(response: Any) -> Any:
    """Await a Serve call (a DeploymentResponse); if the awaiting task is cancelled (the coalescer
    gave up on a silent call and retries it, or the caller left), cancel the call itself too.
    Awaiting alone does not: the call stayed queued in Serve's router, or ran on its replica, and a
    merely slow call's retry then doubled the work of an overloaded replica (issue 16). Serve
    drops a cancelled call still waiting for a replica, and a replica's handler sees the
    cancellation, which its batcher turns into dropping the requests not started yet."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


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
        max_calls_per_replica: int = DEFAULT_CALLS_PER_REPLICA,
    ) -> None:
        super().__init__(settings, config, limits, metrics, "waiting for a ranking replica")
        self._in_flight = 0
        self._ranking = ranking
        self._stats = router_stats(RANKING)
        metrics.registry.register(RouterCollector(self._stats))
        self._ring = UserRing()
        self._calls: CallCoalescer[RankingRequest] = CallCoalescer(
            self._send,
            self._lane_of,
            max_calls=max_calls_per_replica,
            max_group=settings.max_batch_size,
            retryable=lambda exc: isinstance(exc, _LOST_REPLICA),
            exhausted=self._lost,
            expired=lambda: RankError(504, "timeout", "request deadline passed"),
            backoff_s=_RETRY_BACKOFF_S,
            # a call silent for a third of the request deadline is taken as lost and retried, so a
            # retry still has most of the deadline left
            silent_after_s=max(_MIN_SILENT_S, settings.request_timeout_ms / 1e3 / 3),
        )
        metrics.registry.register(_CoalescerCollector(self._calls.stats))
        self._call_overhead = Histogram(
            "hstu_replica_call_overhead_seconds",
            "Per call to a ranking replica: its round trip less the time the replica spent ranking (Ray Serve's share)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=metrics.registry,
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

    async def submit(self, request: RankingRequest, deadline: float, arrived: float | None = None) -> RankOutput:
        """Rank on the user's replica, in one call with whatever else waits for it (CallCoalescer);
        a lost replica means a retry elsewhere until `deadline`. (`arrived` does not cross to the
        replica: its batch window counts from its own receipt.)"""
        self._in_flight += 1
        try:
            return await self._calls.submit(request, deadline)
        finally:
            self._in_flight -= 1

    def _lane_of(self, request: RankingRequest) -> str:
        """The replica owning the request's user on the router's ring ('' before it has replicas)."""
        self._ring.set_replicas(self._stats.replicas)  # a no-op while they are unchanged
        return self._ring.owner(request.user_id) if len(self._ring) else ""

    async def _send(self, requests: list[RankingRequest], timeouts_s: list[float]) -> list[RankOutput | RankError]:
        """One call to the ranking deployment for requests of users that share an owner: routed by
        the first user, every user counted by the router."""
        started = time.monotonic()
        call = self._ranking.rank_many.remote(
            requests, timeouts_s, **{USERS_KEY: [r.user_id for r in requests], ROUTING_KEY: requests[0].user_id}
        )
        outcomes, inside_s = await await_or_cancel(call)
        self._call_overhead.observe(max(0.0, time.monotonic() - started - inside_s))
        return outcomes

    @staticmethod
    def _lost(exc: BaseException) -> RankError:
        return RankError(503, "unavailable", f"ranking replicas lost ({type(exc).__name__})", retry_after_s=RETRY_AFTER_S)

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
        await self._calls.close()
        self.state = "stopped"


@serve.ingress()
class HTTPIngress:
    """The HTTP ingress behind Serve's proxy: the app of serving/app.py over a RemoteRuntime to the
    ranking deployment."""

    def __init__(self, settings: ServerSettings, ranking: DeploymentHandle, max_calls_per_replica: int) -> None:
        self._settings = settings
        self._runtime = partial(RemoteRuntime, ranking=ranking, max_calls_per_replica=max_calls_per_replica)

    def __serve_build_asgi_app__(self):
        return create_app(self._settings, runtime_factory=self._runtime)


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other processes of this host may bind too
    (SO_REUSEPORT: the kernel spreads new connections over them)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("listening ingress replicas share their port through SO_REUSEPORT, which this OS lacks")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(_LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"an ingress replica cannot listen on {host}:{port} ({exc.strerror}); is another "
                                 "server, not an hstu ingress, on that port?") from exc
    return sock


class ListeningIngress:
    """An ingress replica serving HTTP on host:port itself: the same app and RemoteRuntime as
    HTTPIngress, under its own uvicorn (as `hstu serve` runs it), with no proxy in between.

    Why: behind Serve's proxy each request's 230 KB body and its answer are relayed through actor
    calls; on the H200 that capped the Ray path at 0.25-0.34x of `hstu serve`'s requests/s, with
    ~130-400 ms per request spent receiving the body (benchmarks/RESULTS.md, runs BA and BB). Ray's
    own direct ingress (2.60, a feature flag) gives each ingress replica a port of its own, so one
    address reaches one replica: 0.53x (session 17). Here every ingress replica of a node binds the
    same port (SO_REUSEPORT) and the kernel spreads connections over them, so `--front-ends N`
    scales the HTTP side as it does for `hstu serve`. On a cluster, each node's ingress replicas
    listen on that node's port (put a load balancer over the nodes). A replica listens only once
    its runtime is ready (a ranking replica answered), so no connection reaches one that would
    answer 503."""

    async def __init__(
        self, settings: ServerSettings, ranking: DeploymentHandle, max_calls_per_replica: int, host: str, port: int
    ) -> None:
        from hstu.serving.server import draining_server

        runtime = partial(RemoteRuntime, ranking=ranking, max_calls_per_replica=max_calls_per_replica)
        app = create_app(settings, runtime_factory=runtime)
        # Ready before listening: the kernel hands a listening socket its share of new connections
        # whether or not its server would answer them 503 (the app's lifespan then finds it started).
        await app.state.runtime.start()
        if not app.state.runtime.ready:
            raise RuntimeError(f"ingress replica did not start: {app.state.runtime.detail}")
        self._sock = reuse_port_socket(host, port)
        self._server = draining_server(app, host, port)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:  # uvicorn's start-up (the app's lifespan) before this replica counts
            if self._task.done():
                self._sock.close()
                raise RuntimeError(f"ingress HTTP server on {host}:{port} did not start: {self._task.exception()!r}")
            await asyncio.sleep(_READY_POLL_S / 10)

    def check_health(self) -> None:
        if self._task.done():
            raise RuntimeError("the ingress's HTTP server stopped")

    async def __del__(self) -> None:
        """Serve's graceful shutdown: stop accepting, drain (DrainingServer), close the socket."""
        self._server.should_exit = True
        try:
            await self._task
        finally:
            self._sock.close()


def build_app(
    settings: ServerSettings,
    replicas: int = 1,
    gpus_per_replica: float | None = None,
    cpus_per_replica: float = 1.0,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING,
    ingress_replicas: int = 1,
    max_calls_per_replica: int = DEFAULT_CALLS_PER_REPLICA,
    listen_port: int | None = None,
    listen_host: str = "0.0.0.0",
):
    """The Serve application: `replicas` ranking replicas (each `gpus_per_replica` GPUs: 1 on CUDA,
    0 on CPU by default) behind `ingress_replicas` HTTP ingresses. `max_queue` is the router's load
    bound (a replica with more ongoing requests hands new ones on); `max_ongoing_requests` is
    Serve's hard cap per replica; `max_calls_per_replica` the calls one ingress keeps in flight to
    one replica (CallCoalescer: requests beyond them wait and share the next call). With
    `listen_port` each ingress replica serves HTTP on listen_host:listen_port itself
    (ListeningIngress) and the app has no route on Serve's proxy; else Serve's proxy relays to them."""
    if replicas < 1 or ingress_replicas < 1:
        raise ValueError(f"need at least one replica and one ingress, got {replicas} and {ingress_replicas}")
    if max_calls_per_replica < 1:
        raise ValueError(f"max_calls_per_replica must be >= 1, got {max_calls_per_replica}")
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
        HTTPIngress if listen_port is None else ListeningIngress,
        name=INGRESS,
        num_replicas=ingress_replicas,
        max_ongoing_requests=settings.max_queue,
        ray_actor_options={"num_cpus": 0},
        logging_config=_NO_ACCESS_LOG,
    )
    listen = () if listen_port is None else (listen_host, listen_port)
    return ingress.bind(settings, ranking.bind(settings), max_calls_per_replica, *listen)


def app_builder(args: dict[str, Any]):
    """build_app for a Serve config file: `args` holds `config_file` (a ServerSettings file),
    `settings` (ServerSettings fields over it) and build_app's keyword arguments."""
    args = dict(args)
    settings = ServerSettings.load(args.pop("config_file", None), {}, **args.pop("settings", {}))
    return build_app(settings, **args)


def serve_locally(
    settings: ServerSettings,
    host: str,
    port: int,
    replicas: int,
    gpus_per_replica: float | None,
    direct_ingress: bool = False,
    **app_options: Any,
) -> None:
    """`hstu serve --replicas N`: start (or join, with RAY_ADDRESS) a Ray cluster, serve the app on
    host:port until SIGINT/SIGTERM, then delete the app (replicas drain their queues). With
    `direct_ingress` the ingress replicas listen on host:port themselves (ListeningIngress) and
    Serve runs no proxy; else Serve's proxy listens there. `app_options` are build_app's keyword
    arguments."""
    import ray

    ray.init(include_dashboard=False)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # after ray.init, which installs its own
    try:
        if direct_ingress:
            serve.start(proxy_location="Disabled")
            app = build_app(settings, replicas=replicas, gpus_per_replica=gpus_per_replica, listen_port=port,
                            listen_host=host, **app_options)
            serve.run(app, name=APP_NAME, route_prefix=None)
        else:
            serve.start(http_options={"host": host, "port": port})
            app = build_app(settings, replicas=replicas, gpus_per_replica=gpus_per_replica, **app_options)
            serve.run(app, name=APP_NAME, route_prefix="/")
        how = "the ingress replicas directly" if direct_ingress else "Serve's proxy"
        logger.info("serving %d ranking replicas on http://%s:%d through %s (docs at /docs)", replicas, host, port, how)
        signal.pause()
    except KeyboardInterrupt:
        logger.info("stopping: deleting the %s application", APP_NAME)
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
