"""ServingRuntime: the served model, its KV cache manager and the batcher, with their lifecycle.

    loading --start()--> ready --close()--> stopped
    loading --start() raised (load or warm-up)--> failed --close()--> stopped
    ready --drain()--> stopping --close()--> stopped

start() loads in a worker thread so the event loop keeps answering /v2/health/live meanwhile:
it builds the AsyncKVCacheManager and InferenceRankingGR (weights from config.seed, or the
checkpoint's state_dict), runs a warm-up (a new history, then the same history extended by one
event, so both the miss and the GPU-hit paths run once), drops the warm-up user from the cache and
only then starts the batcher. drain() (the server's first shutdown step) stops new requests and
gives the queued ones settings.shutdown_timeout_s to finish, answering the rest 503; close() waits
for that drain (or starts it), then closes the manager (drains the offloads, joins the cache threads).

`detail` is what unauthenticated health endpoints show: never exception text or paths (those
go to the log).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from abc import ABC, abstractmethod
from typing import Callable

import numpy as np
import torch
from prometheus_client import generate_latest

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.engine import ForwardTiming, PendingRank, RankingEngine, RankOutput
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.serving.gc_policy import freeze_startup_objects
from hstu.serving.batcher import Batcher
from hstu.serving.errors import RankError
from hstu.serving.metrics import ServingMetrics
from hstu.serving.schemas import RequestLimits
from hstu.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

WARMUP_USER = 0

RuntimeFactory = Callable[[ServerSettings, HSTUConfig, RequestLimits, ServingMetrics], "Runtime"]


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What a front end (Ray ingress, engine-process front) holds of a model served elsewhere: its
    identity (model/identity.py; hex is the weights fingerprint). The app needs only that to digest
    histories and to rebuild incremental requests from its history store; the digests travel with
    the request, so the ranking side reuses them."""

    identity: bytes


class Runtime(ABC):
    """What the app (serving/app.py) ranks through: `state` and `detail` for the health endpoints,
    the model's metadata, and submit / prefetch_users / exposition / pending / replicas.
    ServingRuntime ranks in this process, serving/engine_process.py's EngineProcessRuntime in a child
    process, serving/ray_app.py's RemoteRuntime on Ray Serve replicas."""

    replicas = 1
    model: InferenceRankingGR | None = None  # the served model, or what identifies it (`.identity`: digests)
    manager: AsyncKVCacheManager | None = None  # its cache when in this process (cache metrics)

    def __init__(
        self, settings: ServerSettings, config: HSTUConfig, limits: RequestLimits, metrics: ServingMetrics, detail: str
    ) -> None:
        self.settings = settings
        self.config = config
        self.limits = limits
        self.metrics = metrics
        self.state = "loading"
        self.detail: str | None = detail
        self.fingerprint: str | None = None

    @classmethod
    def standalone(cls, settings: ServerSettings) -> "Runtime":
        """A runtime with its own metrics (a queue-depth gauge attached), for processes that rank
        without the app in front of them: the engine process and each Ray ranking replica."""
        config = settings.resolve_model_config()
        limits = RequestLimits.for_model(config, settings.max_candidates, settings.max_body_bytes)
        runtime = cls(settings, config, limits, ServingMetrics(settings.max_batch_size))
        runtime.metrics.queue_depth.set_function(lambda: runtime.pending)
        return runtime

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    @abstractmethod
    def pending(self) -> int:
        """Requests submitted and not yet answered."""

    @abstractmethod
    async def start(self) -> None:
        """Become ready (state 'ready'), or 'failed'; runs in the background of the app's lifespan."""

    @abstractmethod
    async def submit(self, request: RankingRequest, deadline: float, arrived: float | None = None) -> RankOutput:
        """Rank one request by `deadline` (time.monotonic()); RankError otherwise. `arrived`: when it
        reached the server (time.monotonic()), from which its batch window counts (Batcher.submit)."""

    @abstractmethod
    async def prefetch_users(self, user_ids: list[int]) -> int:
        """Start onloads of users expected soon; how many started."""

    @abstractmethod
    async def exposition(self) -> bytes:
        """The Prometheus text of GET /metrics."""

    @abstractmethod
    async def close(self, start_task: asyncio.Task | None = None) -> None:
        """Stop serving (after `start_task`, the running start(), if given)."""


class ServingRuntime(Runtime):
    """Owns the model, the manager and the batcher; `state` is loading, ready, failed, stopping or stopped."""

    def __init__(
        self, settings: ServerSettings, config: HSTUConfig, limits: RequestLimits, metrics: ServingMetrics
    ) -> None:
        super().__init__(settings, config, limits, metrics, "loading the model and warming up")
        self.model: InferenceRankingGR | None = None
        self.manager: AsyncKVCacheManager | None = None
        self.engine: RankingEngine | None = None
        self.batcher: Batcher | None = None
        self._drain: asyncio.Task | None = None

    @classmethod
    def standalone(cls, settings: ServerSettings) -> "ServingRuntime":
        """Runtime.standalone, with the cache's and the graphs' metrics attached too."""
        runtime = super().standalone(settings)
        runtime.metrics.watch_cache(lambda: runtime.manager)
        runtime.metrics.watch_graphs(lambda: runtime.engine)
        return runtime

    @property
    def pending(self) -> int:
        return self.batcher.pending if self.batcher is not None else 0

    async def submit(
        self,
        request: RankingRequest,
        deadline: float,
        arrived: float | None = None,
        answer: Callable[[RankOutput | RankError], None] | None = None,
    ) -> RankOutput:
        """Through the batcher (`arrived`, `answer`: Batcher.submit's)."""
        return await self.batcher.submit(request, deadline, arrived, answer)

    async def prefetch_users(self, user_ids: list[int]) -> int:
        """prefetch() on the model thread, between batches."""
        return await self.batcher.run_on_model_thread(self.prefetch, user_ids)

    async def exposition(self) -> bytes:
        return generate_latest(self.metrics.registry)

    async def start(self) -> None:
        """Load and warm up off the loop, then start the batcher; a failure leaves state 'failed'."""
        started = time.monotonic()
        try:
            await asyncio.to_thread(self._load)
        except Exception as exc:
            logger.exception("loading the model failed (%s: %s); the server stays not ready", type(exc).__name__, exc)
            self.state, self.detail = "failed", "loading the model failed; the server log has the cause"
            return
        if self.state != "loading":  # close() ran while loading
            return
        s = self.settings
        if s.gil_switch_interval_ms is not None:
            sys.setswitchinterval(s.gil_switch_interval_ms / 1000.0)
        self.batcher = Batcher(
            self._rank,
            s.max_batch_size,
            s.max_wait_ms / 1000.0,
            s.max_queue,
            self.metrics,
            max_queue_wait_s=s.max_queue_wait_ms / 1000.0,
            inline=s.model_on_loop,
        )
        self.batcher.start()
        freeze_startup_objects("serving runtime")
        self.state, self.detail = "ready", None
        self.metrics.ready.set(1)
        logger.info("ready after %.2fs (device %s, dtype %s)", time.monotonic() - started, s.device, self.config.dtype)

    def _rank(self, requests: list[RankingRequest]) -> PendingRank:
        """Runs on the model thread and returns once the batch is launched; the batcher's
        completion thread reads the float32 logits on the host (one copy for the whole batch), so
        neither the event loop nor the model thread waits for the GPU."""
        timings = self.engine.timings
        last = timings[-1] if timings else None
        pending = self.engine.rank_async(requests, dtype=torch.float32)
        if timings and timings[-1] is not last:
            self._observe_forward(timings[-1])
        return pending

    def _observe_forward(self, timing: ForwardTiming) -> None:
        """The model thread's host time by phase (hstu_forward_phase_seconds), per batch."""
        for phase, seconds in timing.phases().items():
            self.metrics.forward_phase.labels(phase).observe(seconds)

    def _load(self) -> None:
        s, cfg = self.settings, self.config
        device = torch.device(s.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {s.device!r} requested but torch.cuda.is_available() is False")
        kv_config = s.kv_config(cfg)
        logger.info(
            "cache: %d pages x %d tokens on %s, host arena %d slots of %d tokens (%.1f MiB)",
            kv_config.num_pages,
            kv_config.page_size,
            device,
            kv_config.host_slots,
            kv_config.chunk_tokens,
            kv_config.host_slots * kv_config.chunk_bytes / 2**20,
        )
        self.manager = AsyncKVCacheManager(kv_config, device)
        self.model = InferenceRankingGR(cfg, device)
        if s.checkpoint is not None:
            state_dict = torch.load(s.checkpoint, map_location=device, weights_only=True)
            self.model.load_state_dict(state_dict)
            logger.info("loaded checkpoint %s", s.checkpoint)
        self.engine = RankingEngine(self.model, self.manager)
        self.fingerprint = self.model.identity.hex()
        logger.info("weights fingerprint %s", self.fingerprint)
        if s.cuda_graphs:
            self.engine.enable_cuda_graphs(max_batch=s.max_batch_size, compile=s.compile_layers)
            logger.info(
                "captured CUDA graphs of %s layers for row buckets %s",
                "compiled" if s.compile_layers else "eager",
                self.engine.graphs.bucket_sizes,
            )
        self._warm_up()
        if s.planner:
            cost = self.engine.calibrate()
            overrides = {}
            if s.h2d_gb_per_s is not None:
                overrides["h2d_bytes_per_s"] = s.h2d_gb_per_s * 1e9
            if s.planner_min_gain is not None:
                overrides["min_gain"] = s.planner_min_gain
            if s.planner_compute_margin is not None:
                overrides["compute_margin"] = s.planner_compute_margin
            if cost is not None and overrides:
                cost = self.engine.calibrate(dataclasses.replace(cost, **overrides))
            if cost is None:
                logger.warning("compute-or-load planner off: the cost measurement showed no per-token compute cost")
            else:
                logger.info("compute-or-load planner costs: %s", cost.as_dict())
            self.manager.stats.reset()  # the calibration's synthetic users are no traffic

    def prefetch(self, user_ids: list[int]) -> int:
        """Start onloads for users expected soon, on the model thread between batches (awaitable)."""
        return self.engine.prefetch(user_ids)

    def _warm_up(self) -> None:
        cfg, kv = self.config, self.manager.config
        events = max(0, min((kv.chunk_tokens + kv.page_size - cfg.num_contextual) // 2, self.limits.max_events - 1))
        rng = np.random.default_rng(cfg.seed)
        items = rng.integers(0, cfg.num_items, events + 1)
        actions = rng.integers(0, cfg.num_actions, events + 1)
        candidates = rng.integers(0, cfg.num_items, min(8, self.limits.max_candidates))
        started = time.monotonic()
        for n in (events, events + 1):
            request = RankingRequest.create(
                WARMUP_USER, items[:n], actions[:n], np.arange(n), candidates, config=cfg
            )
            (output,) = self.engine.rank([request])
            if not torch.isfinite(output.logits).all():
                raise RuntimeError(f"warm-up produced non-finite logits for a {n}-event history")
        # A full batch too: on CUDA the attention kernel has a variant for few programs (key
        # splits) and one for many; both compile here rather than on a live request.
        pages_per_user = -(-cfg.history_tokens(events) // kv.page_size)
        batch = max(1, min(self.settings.max_batch_size, kv.num_pages // max(pages_per_user, 1)))
        users = [WARMUP_USER + 1 + i for i in range(batch)]  # dropped again below, before serving
        self.engine.rank(
            [RankingRequest.create(u, items[:events], actions[:events], np.arange(events), candidates, config=cfg) for u in users]
        )
        self.manager.drain()
        for u in [WARMUP_USER, *users]:
            self.manager.invalidate(u)
        self.manager.stats.reset()
        logger.info(
            "warm-up (%d and %d events, then a batch of %d) took %.2fs", events, events + 1, batch, time.monotonic() - started
        )

    def drain(self) -> asyncio.Task:
        """Stop taking requests; the queued ones get settings.shutdown_timeout_s, the rest 503."""
        if self._drain is None:
            if self.state in ("loading", "ready"):
                self.state, self.detail = "stopping", "shutting down"
            self.metrics.ready.set(0)
            self._drain = asyncio.create_task(self._close_batcher(), name="hstu-drain")
        return self._drain

    async def _close_batcher(self) -> None:
        if self.batcher is not None:
            await self.batcher.close(self.settings.shutdown_timeout_s)

    async def close(self, start_task: asyncio.Task | None = None) -> None:
        """Stop serving: wait for a load in progress, drain the batcher, close the manager."""
        previous = self.state
        if start_task is not None:
            self.state, self.detail = "stopping", "shutting down"
            await start_task
        await self.drain()
        self.state, self.detail = "stopped", "shutting down"
        if self.manager is not None:
            await asyncio.to_thread(self.manager.close)
        logger.info("stopped (was %s)", previous)
