"""Replay passes: in-process, a workload's batches ranked through a new engine and cache manager;
per-request records and cache counters of a pass (in-process or server), its JSON summary and the
table of several passes' summaries."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from hstu.engine import ForwardTiming, RankingEngine
from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.scripts import report
from hstu.scripts.compare import VerifyTally
from hstu.scripts.timing import sync, wall_ms
from hstu.scripts.workload import FreshUserIds, WorkloadConfig, as_users
from hstu.serving.gc_policy import freeze_startup_objects
from hstu.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

UNCACHED_METHOD = (
    "same model, paged kernels and manager code; every request under a never-seen user id so every "
    "lookup misses and the whole history is recomputed; host tier of one chunk (offloads skipped)"
)


@dataclass(frozen=True)
class CacheSettings:
    """KV cache sizes for the replay; num_pages None = two batches at the history limit.
    offload_min_seen: host-tier admission as `hstu serve` runs it by default (ServerSettings)."""

    page_size: int = 16
    num_pages: int | None = None
    chunk_tokens: int = 64
    host_capacity_bytes: int = 256 << 20
    offload_min_seen: int = ServerSettings.offload_min_seen
    prepare_worker: bool = False
    host_split: str = "auto"
    host_format: str = "kv"

    def build(self, model: HSTUConfig, workload: WorkloadConfig, batch_size: int) -> KVCacheConfig:
        per_batch = batch_size * -(-workload.history_limit(model) // self.page_size)
        pages = 2 * per_batch if self.num_pages is None else self.num_pages
        if pages < per_batch:
            raise ValueError(
                f"num_pages {pages} cannot hold one batch of {batch_size} users at the history limit "
                f"({per_batch} pages of {self.page_size} tokens)"
            )
        return KVCacheConfig.for_model(
            model,
            page_size=self.page_size,
            num_pages=pages,
            chunk_tokens=self.chunk_tokens,
            host_capacity_bytes=self.host_capacity_bytes,
            offload_min_seen=self.offload_min_seen,
            prepare_worker=self.prepare_worker,
            host_split=self.host_split,
            host_format=self.host_format,
            on_no_new_tokens="raise",
            on_shorter_history="invalidate",
        )


@dataclass
class RequestRecord:
    user_id: int
    history_tokens: int
    candidates: int
    cached_tokens: int
    batch_index: int
    batch_size: int
    latency_ms: float


@dataclass
class PassResult:
    """One pass over the workload: per-request records, wall time, cache counters (deltas).

    client_observed: each record's latency is the client's own request round trip (server mode);
    otherwise it is the time of the batch the request ran in (in-process)."""

    name: str
    records: list[RequestRecord]
    wall_s: float
    stats: dict[str, int] = field(default_factory=dict)
    mismatches: int | None = None
    max_abs_diff: float | None = None
    errors: int = 0
    conflicts: int | None = None
    client_observed: bool = False
    forward_phase_ms: dict[str, float] = field(default_factory=dict)  # model-thread ms per batch (in process)

    def mean_batch_size(self) -> float:
        """Mean requests per batch: from the records in-process, from the server's metrics otherwise.
        (Per batch, not per request: a mean over the records' batch sizes weighs each batch by its
        size, 6.6 for the seed replay's 200 requests in 43 batches, against the server's 4.7.)"""
        if "batches" in self.stats:
            return self.stats["batched_requests"] / self.stats["batches"] if self.stats["batches"] else math.nan
        return len(self.records) / len({r.batch_index for r in self.records}) if self.records else math.nan

    def summary(self) -> dict[str, Any]:
        lat = np.asarray([r.latency_ms for r in self.records], dtype=np.float64)
        n = len(self.records)
        out: dict[str, Any] = {
            "requests": n,
            "wall_s": self.wall_s,
            "requests_per_s": n / self.wall_s if self.wall_s > 0 else math.nan,
            "latency_p50_ms": float(np.percentile(lat, 50)) if n else math.nan,
            "latency_p99_ms": float(np.percentile(lat, 99)) if n else math.nan,
            "latency_mean_ms": float(lat.mean()) if n else math.nan,
            "mean_batch_size": self.mean_batch_size(),
            "errors": self.errors,
        }
        if self.conflicts is not None:
            out["history_conflicts"] = self.conflicts
        out.update({f"forward_{k}_ms": v for k, v in self.forward_phase_ms.items()})
        s = self.stats
        if s:
            lookups = s["gpu_hits"] + s["host_hits"] + s["misses"]
            tokens = s["cached_tokens"] + s["computed_tokens"]
            out.update(
                gpu_hit_rate=s["gpu_hits"] / lookups if lookups else 0.0,
                host_hit_rate=s["host_hits"] / lookups if lookups else 0.0,
                miss_rate=s["misses"] / lookups if lookups else 0.0,
                cached_token_share=s["cached_tokens"] / tokens if tokens else 0.0,
                **{k: s[k] for k in _STAT_KEYS if k in s},
            )
        if self.mismatches is not None:
            out.update(verify_mismatches=self.mismatches, verify_max_abs_diff=self.max_abs_diff)
        return out


_STAT_KEYS = (
    "gpu_hits",
    "host_hits",
    "misses",
    "recomputes",
    "invalidations",
    "gpu_evictions",
    "host_evictions",
    "onload_failures",
    "offload_failures",
    "bytes_onloaded",
    "bytes_offloaded",
    "cached_tokens",
    "computed_tokens",
)


def run_pass(
    name: str,
    model_config: HSTUConfig,
    cache_config: KVCacheConfig,
    batches: list[list[RankingRequest]],
    device: torch.device,
    *,
    fresh_users: bool,
    verify: bool = False,
    progress: bool = True,
    cuda_graphs: bool = False,
    compile_layers: bool = False,
    pipeline: int = 1,
    planner: bool = False,
) -> PassResult:
    """Rank every batch through a new model + cache manager; `fresh_users` makes every lookup miss.

    pipeline 1: each batch is ranked and the device synchronised before the next (a request's
    latency is its batch's time in rank() plus the sync). pipeline k > 1: up to k batches are
    launched (RankingEngine.rank_async) before the oldest one's logits are read, as the server's
    batcher does, so a batch's host work overlaps the previous one's kernels; a request's latency
    is then from its batch's launch to its logits on the host, and the pass's time is the wall
    time from the first launch to the last result. Verification never counts.
    cuda_graphs: whole-forward CUDA graphs per row bucket (batches past the buckets run eagerly);
    compile_layers: the graphs capture torch.compile'd layers; planner: the compute-or-load planner
    with costs measured before the pass (RankingEngine.calibrate), as `hstu serve` runs on CUDA."""
    if pipeline < 1:
        raise ValueError(f"pipeline must be >= 1 batch in flight, got {pipeline}")
    manager = AsyncKVCacheManager(cache_config, device)
    try:
        model = RankingEngine(InferenceRankingGR(model_config, device), manager)
        if cuda_graphs:
            model.enable_cuda_graphs(max_batch=max((len(b) for b in batches), default=1), compile=compile_layers)
        ids = FreshUserIds()
        if batches:
            warmup = as_users(batches[0], ids.take(len(batches[0])))
            model.rank(warmup)
            # Then one user alone: on CUDA a small batch runs the attention kernel's other
            # (key-split) variant, which would otherwise compile inside the timed pass.
            model.rank(as_users(warmup[:1], ids.take(1)))
            sync(device)
        if planner and model.calibrate() is None:
            logger.warning("planner off: the cost measurement showed no per-token compute cost")
        manager.drain()
        freeze_startup_objects(name)  # as a serving process does once warmed up (serving/gc_policy.py)
        before = manager.stats.snapshot()
        records: list[RequestRecord] = []
        tally = VerifyTally(model_config.dtype, "cached logits")
        bar = tqdm(total=sum(len(b) for b in batches), desc=name, unit="req", disable=not progress, leave=False)
        ranked_s = 0.0
        ranked: list[tuple[list[RankingRequest], list]] = []  # verified after a pipelined pass
        in_flight: deque[tuple[int, list[RankingRequest], Any, float]] = deque()

        def record(index: int, batch: list[RankingRequest], outputs: list, ms: float) -> None:
            records.extend(
                RequestRecord(r.user_id, r.history_tokens(model_config), r.candidates.shape[0], o.cached_tokens,
                              index, len(batch), ms)
                for r, o in zip(batch, outputs)
            )
            bar.update(len(batch))

        def read_oldest() -> None:
            index, batch, launched, t0 = in_flight.popleft()
            outputs = launched.result()
            record(index, batch, outputs, (time.perf_counter() - t0) * 1e3)
            if verify:
                ranked.append((batch, outputs))

        first_timing = len(model.timings)
        started = time.perf_counter()
        for index, batch in enumerate(batches):
            if fresh_users:
                batch = as_users(batch, ids.take(len(batch)))
            if pipeline > 1:
                in_flight.append((index, batch, model.rank_async(batch), time.perf_counter()))
                if len(in_flight) >= pipeline:
                    read_oldest()
                continue
            ms, outputs = wall_ms(lambda: model.rank(batch), device)
            ranked_s += ms / 1e3
            record(index, batch, outputs, ms)
            if verify:
                _verify(model, batch, outputs, tally)
        while in_flight:
            read_oldest()
        if pipeline > 1:
            ranked_s = time.perf_counter() - started
        phases = forward_phase_means(list(model.timings)[first_timing:])
        bar.close()
        for batch, outputs in ranked:
            _verify(model, batch, outputs, tally)
        manager.drain()
        after = manager.stats.snapshot()
        stats = {k: after[k] - before[k] for k in after}
    finally:
        manager.close()
    result = PassResult(name, records, ranked_s, stats, forward_phase_ms=phases)
    if verify:
        result.mismatches, result.max_abs_diff = tally.mismatches, tally.max_abs_diff
    return result


def forward_phase_means(timings: list[ForwardTiming]) -> dict[str, float]:
    """Mean model-thread ms per batch by ForwardTiming phase (the server's hstu_forward_phase_seconds,
    which loadgen prints as forward_*), so the two compare within one call."""
    if not timings:
        return {}
    per_batch = [{**t.phases(), "total": t.total_s} for t in timings]
    return {name: 1e3 * sum(p[name] for p in per_batch) / len(per_batch) for name in per_batch[0]}


def _verify(model: RankingEngine, batch: list[RankingRequest], outputs: list, tally: VerifyTally) -> None:
    reference = torch.split(model.forward_no_cache(batch), [r.candidates.shape[0] for r in batch])
    for r, o, ref in zip(batch, outputs, reference):
        tally.check(r.user_id, o.logits.to(ref.device), ref)


def uncached_cache_config(cache_config: KVCacheConfig) -> KVCacheConfig:
    """The uncached pass's cache: same pages, no host tier."""
    return dataclasses.replace(cache_config, host_capacity_bytes=0)


_TABLE_ROWS = (
    ("requests/s", "requests_per_s"),
    ("p50 latency ms", "latency_p50_ms"),
    ("p99 latency ms", "latency_p99_ms"),
    ("mean batch size", "mean_batch_size"),
    (None, "gpu_hit_rate"),
    ("host-tier hit rate", "host_hit_rate"),
    ("cached token share", "cached_token_share"),
    ("recomputes", "recomputes"),
    ("invalidations", "invalidations"),
    ("device / host evictions", None),
    ("bytes onloaded", "bytes_onloaded"),
    ("bytes offloaded", "bytes_offloaded"),
    ("verify mismatches", "verify_mismatches"),
    ("history conflicts (409)", "history_conflicts"),
    ("errors", "errors"),
)
"""(label, summary key): the table's rows; label None is the device tier's hit rate, named after
the device; key None is the evictions of both tiers in one cell."""


def format_table(summaries: dict[str, dict[str, Any]], speedup: dict[str, float] | None, device: str | None = None) -> str:
    """One column per pass; `device` names the device tier ("device-tier (cpu) hit rate")."""
    names = list(summaries)
    rows = [["metric", *names]]
    for label, key in _TABLE_ROWS:
        if key is None:
            cells = [
                f"{report.fmt(s['gpu_evictions'])} / {report.fmt(s['host_evictions'])}" if "gpu_evictions" in s else "-"
                for s in summaries.values()
            ]
        elif all(key not in s for s in summaries.values()):
            continue
        else:
            cells = [report.fmt(s.get(key)) for s in summaries.values()]
        if label is None:
            label = f"{report.device_tier(device)} hit rate" if device else "device-tier hit rate"
        rows.append([label, *cells])
    for label, value in (speedup or {}).items():
        rows.append([label, f"{value:.2f}x", *[""] * (len(names) - 1)])
    return report.format_table(rows, left=1)


def speedups(cached: dict[str, Any], uncached: dict[str, Any]) -> dict[str, float]:
    return {
        "speedup req/s (cached/uncached)": cached["requests_per_s"] / uncached["requests_per_s"],
        "speedup p50 latency": uncached["latency_p50_ms"] / cached["latency_p50_ms"],
    }


# ------------------------------------------------------------------------------------ entry points
