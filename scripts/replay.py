"""`hstu replay`: run a synthetic workload through the cached model and the uncached pipeline.

In-process (default): the workload (scripts/workload.py) is cut into batches of distinct users
(`distinct_user_batches`), then run twice over the same batches:
  cached    InferenceRankingGR with an AsyncKVCacheManager (GPU pages + host chunks);
  uncached  the same paged pipeline and kernels, but every request gets a never-seen user id, so
            each lookup misses and the whole history is recomputed (and its manager has the
            smallest host tier, so almost nothing is offloaded).
Each pass starts with one warm-up batch of never-seen users (lazy initialisation and kernel
compilation stay out of the numbers). A request's latency is its batch's wall time (rank() plus a
device sync). `--verify` checks every cached result against forward_no_cache (dense reference).

Server mode (`--server URL`, loopback only): the replay first reads the server's model metadata
(GET /v2/models/hstu) and adopts its model config, so the workload fits the served model; then the
same requests go over HTTP, `--concurrency` at a time, each user's requests in order. The server
rejects a history shorter than its cached one with 409, so workload restarts show up as history
conflicts (counted apart from errors); cache counters come from the server's /metrics. With
`--verify` the replay builds the no-cache model from the server's config and seed, refuses to run
unless its weights fingerprint equals the server's (the server may serve a checkpoint this client
lacks), and checks every answered request's scores against it (mismatches make the exit non-zero).

Presets: `--preset cpu` (default) is a small embedded model that replays 200 requests on CPU in
well under a minute; `--preset seed` is the benchmark's model (8 layers, hidden 1024, 4x256 heads,
bf16, page 32) for a GPU. `--model-config` replaces the preset's model.

Outputs: a progress bar on stderr, `replay.json` and `replay.png` (latency vs history length) in
--out, and a table printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import torch
from tqdm import tqdm

from hstu.engine import RankingEngine
from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.identity import model_identity
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.scripts.compare import compare_logits
from hstu.scripts.workload import Workload, WorkloadConfig, count_restarts, distinct_user_batches

logger = logging.getLogger(__name__)

DEFAULT_MODEL = HSTUConfig(
    num_items=10_000,
    num_contextual=2,
    embedding_dim=64,
    num_layers=2,
    num_heads=2,
    head_dim_qk=32,
    head_dim_v=32,
    max_seq_len=1024,
    mlp_hidden=64,
    dtype="float32",
)
"""Embedded CPU model: small enough that the default replay takes about a minute on 2 cores."""

UNCACHED_USER_BASE = 1 << 40
"""User ids of the uncached pass (and warm-ups) start here: never seen by any workload user."""

UNCACHED_METHOD = (
    "same model, paged kernels and manager code; every request under a never-seen user id so every "
    "lookup misses and the whole history is recomputed; host tier of one chunk (offloads skipped)"
)



@dataclass(frozen=True)
class CacheSettings:
    """KV cache sizes for the replay; num_pages None = two batches at the history limit."""

    page_size: int = 16
    num_pages: int | None = None
    chunk_tokens: int = 64
    host_capacity_bytes: int = 256 << 20

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
    """One pass over the workload: per-request records, wall time, cache counters (deltas)."""

    name: str
    records: list[RequestRecord]
    wall_s: float
    stats: dict[str, int] = field(default_factory=dict)
    mismatches: int | None = None
    max_abs_diff: float | None = None
    errors: int = 0
    conflicts: int | None = None

    def mean_batch_size(self) -> float:
        """Mean requests per batch: from the records in-process, from the server's metrics otherwise."""
        if "batches" in self.stats:
            return self.stats["batched_requests"] / self.stats["batches"] if self.stats["batches"] else math.nan
        return float(np.mean([r.batch_size for r in self.records])) if self.records else math.nan

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def _with_user(request: RankingRequest, user_id: int) -> RankingRequest:
    """The same request (history, contextual features, candidates) under another user id."""
    return dataclasses.replace(request, user_id=user_id)


@dataclass
class VerifyTally:
    """Mismatches and the largest logit difference over every request checked against the reference."""

    dtype: str
    what: str
    mismatches: int = 0
    max_abs_diff: float = 0.0

    def check(self, user_id: int, logits: torch.Tensor, reference: torch.Tensor) -> None:
        check = compare_logits(logits, reference, self.dtype)
        self.max_abs_diff = max(self.max_abs_diff, check.max_abs_diff)
        if not check.ok:
            self.mismatches += 1
            logger.warning(
                "user %d: %s differ from the no-cache reference by %.3g (tolerance %.3g)",
                user_id,
                self.what,
                check.max_abs_diff,
                check.tolerance,
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
) -> PassResult:
    """Rank every batch through a new model + cache manager; `fresh_users` makes every lookup miss.

    cuda_graphs: replay the paged layers as per-layer CUDA graphs (batches past the graphs' row
    buckets run eagerly); compile_layers: the graphs capture torch.compile'd layers."""
    manager = AsyncKVCacheManager(cache_config, device)
    try:
        model = RankingEngine(InferenceRankingGR(model_config, device), manager)
        if cuda_graphs:
            model.enable_cuda_graphs(max_batch=max((len(b) for b in batches), default=1), compile=compile_layers)
        next_id = UNCACHED_USER_BASE
        warmup = []
        for r in batches[0] if batches else []:
            warmup.append(_with_user(r, next_id))
            next_id += 1
        if warmup:
            model.rank(warmup)
            # Then one user alone: on CUDA a small batch runs the attention kernel's other
            # (key-split) variant, which would otherwise compile inside the timed pass.
            model.rank([_with_user(warmup[0], next_id)])
            next_id += 1
            _sync(device)
        manager.drain()
        before = manager.stats.snapshot()
        records: list[RequestRecord] = []
        tally = VerifyTally(model_config.dtype, "cached logits")
        total = sum(len(b) for b in batches)
        bar = tqdm(total=total, desc=name, unit="req", disable=not progress, leave=False)
        ranked_s = 0.0  # time inside rank() + device sync; verify excluded
        for index, batch in enumerate(batches):
            if fresh_users:
                batch = [_with_user(r, next_id + i) for i, r in enumerate(batch)]
                next_id += len(batch)
            t0 = time.perf_counter()
            outputs = model.rank(batch)
            _sync(device)
            ms = (time.perf_counter() - t0) * 1e3
            ranked_s += ms / 1e3
            for r, o in zip(batch, outputs):
                records.append(
                    RequestRecord(
                        r.user_id,
                        r.history_tokens(model_config),
                        r.candidates.shape[0],
                        o.cached_tokens,
                        index,
                        len(batch),
                        ms,
                    )
                )
            if verify:
                reference = torch.split(model.forward_no_cache(batch), [r.candidates.shape[0] for r in batch])
                for r, o, ref in zip(batch, outputs, reference):
                    tally.check(r.user_id, o.logits, ref)
            bar.update(len(batch))
        bar.close()
        manager.drain()
        stats = _stats_delta(before, manager.stats.snapshot())
    finally:
        manager.close()
    result = PassResult(name, records, ranked_s, stats)
    if verify:
        result.mismatches, result.max_abs_diff = tally.mismatches, tally.max_abs_diff
    return result


def uncached_cache_config(cache_config: KVCacheConfig) -> KVCacheConfig:
    """The uncached pass's cache: same pages, no host tier."""
    return dataclasses.replace(cache_config, host_capacity_bytes=0)


# ------------------------------------------------------------------------------------ server mode
def request_payload(request: RankingRequest) -> dict[str, Any]:
    """JSON body of POST /v1/rank for one request."""
    return {
        "user_id": request.user_id,
        "history": [
            {"item_id": int(i), "action": int(a), "timestamp": int(t)}
            for i, a, t in zip(request.item_ids, request.actions, request.timestamps)
        ],
        "candidates": [int(c) for c in request.candidates],
        "contextual": [int(c) for c in request.contextual],
    }


def check_loopback(url: str) -> None:
    """Raise ValueError unless `url` is http(s) on a loopback host."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or parsed.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"--server must be an http URL on a loopback host (127.0.0.1, localhost, ::1), got {url!r}")


# (metric sample name, label value or None) -> CacheStats key, as exported by hstu.serving.metrics;
# samples mapped to one key are summed.
_SERVER_METRICS = {
    ("hstu_cache_lookups_total", "gpu_hit"): "gpu_hits",
    ("hstu_cache_lookups_total", "host_hit"): "host_hits",
    ("hstu_cache_lookups_total", "miss"): "misses",
    ("hstu_cache_bytes_total", "onload"): "bytes_onloaded",
    ("hstu_cache_bytes_total", "offload"): "bytes_offloaded",
    ("hstu_cache_evictions_total", "gpu"): "gpu_evictions",
    ("hstu_cache_evictions_total", "host"): "host_evictions",
    ("hstu_cache_failures_total", "onload"): "onload_failures",
    ("hstu_cache_failures_total", "offload"): "offload_failures",
    ("hstu_cache_tokens_total", "cached"): "cached_tokens",
    ("hstu_cache_tokens_total", "computed"): "computed_tokens",
    ("hstu_cache_recomputes_total", None): "recomputes",
    ("hstu_cache_invalidations_total", "shorter"): "invalidations",
    ("hstu_cache_invalidations_total", "diverged"): "invalidations",
    ("hstu_cache_offload_skipped_total", None): "offload_skipped",
    ("hstu_batch_size_count", None): "batches",
    ("hstu_batch_size_sum", None): "batched_requests",
}


def parse_server_metrics(text: str) -> dict[str, int]:
    """Cache counters and batch counts from the server's Prometheus /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    stats: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            label = next(iter(sample.labels.values()), None)
            key = _SERVER_METRICS.get((sample.name, label))
            if key is not None:
                stats[key] = stats.get(key, 0) + int(sample.value)
    return stats


async def _scrape(client, url: str) -> dict[str, int]:
    import httpx

    try:
        response = await client.get("/metrics")
        response.raise_for_status()
    except httpx.HTTPError as exc:
        logger.warning("could not read %s/metrics (%s); cache counters are left out", url, exc)
        return {}
    return parse_server_metrics(response.text)


async def _send_all(
    url: str,
    requests: list[RankingRequest],
    model_config: HSTUConfig,
    concurrency: int,
    timeout_s: float,
    progress: bool,
    answers: list | None,
) -> PassResult:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    previous: dict[int, asyncio.Task] = {}
    records: list[RequestRecord | None] = [None] * len(requests)
    errors = conflicts = 0
    bar = tqdm(total=len(requests), desc="server", unit="req", disable=not progress, leave=False)

    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:

        async def one(index: int, request: RankingRequest, before: asyncio.Task | None) -> None:
            nonlocal errors, conflicts
            if before is not None:
                await asyncio.wait([before])
            async with limit:
                t0 = time.perf_counter()
                try:
                    response = await client.post("/v1/rank", json=request_payload(request))
                    if response.status_code == 409:
                        conflicts += 1
                        logger.info("request %d (user %d): history conflict: %s", index, request.user_id, response.text)
                        return
                    response.raise_for_status()
                    body = response.json()
                except (httpx.HTTPError, ValueError) as exc:
                    errors += 1
                    logger.warning("request %d (user %d) failed: %s", index, request.user_id, exc)
                    return
                finally:
                    bar.update(1)
                ms = (time.perf_counter() - t0) * 1e3
            if answers is not None:
                answers.append((request, body["scores"]))
            records[index] = RequestRecord(
                request.user_id,
                request.history_tokens(model_config),
                request.candidates.shape[0],
                int(body["cached_tokens"]),
                index,
                1,
                ms,
            )

        before = await _scrape(client, url)
        t0 = time.perf_counter()
        tasks = []
        for i, r in enumerate(requests):
            task = asyncio.create_task(one(i, r, previous.get(r.user_id)))
            previous[r.user_id] = task
            tasks.append(task)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        after = await _scrape(client, url)
    bar.close()
    stats = {k: after[k] - before[k] for k in after if k in before}
    return PassResult("server", [r for r in records if r is not None], wall, stats, errors=errors, conflicts=conflicts)


def run_server(
    url: str,
    requests: list[RankingRequest],
    model_config: HSTUConfig,
    concurrency: int = 8,
    timeout_s: float = 60.0,
    progress: bool = True,
    answers: list | None = None,
) -> PassResult:
    """Send `requests` to a running server, `concurrency` in flight, each user's requests in order.

    A 409 (the history is shorter than the server's cached one: a workload restart, which the
    server rejects by policy) is counted in `conflicts`, any other failure in `errors`. When
    `answers` is a list, (request, response scores) of every 200 is appended to it.
    """
    check_loopback(url)
    if concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    return asyncio.run(_send_all(url, requests, model_config, concurrency, timeout_s, progress, answers))


class VerifyRefused(Exception):
    """--verify cannot check this server: its model is not the one the client can build."""


def fetch_server_model(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The server's model metadata (GET /v2/models/hstu)."""
    import httpx

    check_loopback(url)
    response = httpx.get(f"{url.rstrip('/')}/v2/models/hstu", timeout=timeout_s)
    response.raise_for_status()
    return response.json()


def server_reference(meta: dict[str, Any], url: str, device: torch.device) -> InferenceRankingGR:
    """The local no-cache model of the server's config and seed; VerifyRefused unless its weights
    fingerprint equals the server's."""
    config = HSTUConfig(**meta["config"])
    served = meta.get("weights_fingerprint")
    if served is None:
        raise VerifyRefused(f"--verify: the server at {url} has not loaded its model yet (no weights fingerprint)")
    model = InferenceRankingGR(config, device)
    local = model_identity(model, config).hex()
    if local != served:
        raise VerifyRefused(
            f"--verify: the server at {url} serves weights {served}, but the model built here from its config "
            f"(seed {config.seed}) has {local}; it may serve a checkpoint this client does not have"
        )
    return model


def verify_answers(
    reference: InferenceRankingGR, answers: list, task_names: list[str], batch_size: int = 8
) -> tuple[int, float]:
    """(mismatched requests, max abs logit difference) of the server's scores against `reference`.

    The server answers probabilities; they are compared as logits (log p - log(1 - p), float64),
    the scale compare_logits' per-dtype tolerance is defined on."""
    tally = VerifyTally(reference.config.dtype, "server scores (as logits)")
    for start in range(0, len(answers), batch_size):
        chunk = answers[start : start + batch_size]
        requests = [request for request, _ in chunk]
        expected = torch.split(reference.forward_no_cache(requests), [r.candidates.shape[0] for r in requests])
        for (request, scores), want in zip(chunk, expected):
            probs = torch.tensor([[c["scores"][t] for t in task_names] for c in scores], dtype=torch.float64)
            tally.check(request.user_id, torch.log(probs) - torch.log1p(-probs), want.double().cpu())
    return tally.mismatches, tally.max_abs_diff


# ------------------------------------------------------------------------------------ reporting
def plot_latency(results: list[PassResult], path: Path, title: str) -> None:
    """Latency vs history length per pass: one point per batch (x = the batch's mean history
    length, y = its latency), with the per-bin median as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for res, color in zip(results, ("tab:blue", "tab:orange", "tab:green")):
        if not res.records:
            continue
        by_batch: dict[int, list[RequestRecord]] = {}
        for r in res.records:
            by_batch.setdefault(r.batch_index, []).append(r)
        x = np.asarray([np.mean([r.history_tokens for r in b]) for b in by_batch.values()])
        y = np.asarray([b[0].latency_ms for b in by_batch.values()])
        ax.scatter(x, y, s=12, alpha=0.45, color=color, label=f"{res.name} (median {np.median(y):.1f} ms)")
        edges = np.linspace(x.min(), x.max() + 1, 9)
        mids, meds = [], []
        for lo, hi in zip(edges[:-1], edges[1:]):
            sel = (x >= lo) & (x < hi)
            if sel.any():
                mids.append((lo + hi) / 2)
                meds.append(np.median(y[sel]))
        ax.plot(mids, meds, color=color, linewidth=2)
    ax.set_xlabel("mean history length of the batch (tokens)")
    ax.set_ylabel("batch latency (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


_TABLE_ROWS = (
    ("requests/s", "requests_per_s"),
    ("p50 latency ms", "latency_p50_ms"),
    ("p99 latency ms", "latency_p99_ms"),
    ("mean batch size", "mean_batch_size"),
    ("GPU hit rate", "gpu_hit_rate"),
    ("host hit rate", "host_hit_rate"),
    ("cached token share", "cached_token_share"),
    ("recomputes", "recomputes"),
    ("invalidations", "invalidations"),
    ("GPU / host evictions", None),
    ("bytes onloaded", "bytes_onloaded"),
    ("bytes offloaded", "bytes_offloaded"),
    ("verify mismatches", "verify_mismatches"),
    ("history conflicts (409)", "history_conflicts"),
    ("errors", "errors"),
)


def format_table(summaries: dict[str, dict[str, Any]], speedup: dict[str, float] | None) -> str:
    names = list(summaries)
    rows = [["metric", *names]]
    for label, key in _TABLE_ROWS:
        if key is None:
            cells = [
                f"{_fmt(s['gpu_evictions'])} / {_fmt(s['host_evictions'])}" if "gpu_evictions" in s else "-"
                for s in summaries.values()
            ]
        else:
            if all(key not in s for s in summaries.values()):
                continue
            cells = [_fmt(s.get(key)) for s in summaries.values()]
        rows.append([label, *cells])
    if speedup:
        for label, value in speedup.items():
            rows.append([label, f"{value:.2f}x", *[""] * (len(names) - 1)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def speedups(cached: dict[str, Any], uncached: dict[str, Any]) -> dict[str, float]:
    return {
        "speedup req/s (cached/uncached)": cached["requests_per_s"] / uncached["requests_per_s"],
        "speedup p50 latency": uncached["latency_p50_ms"] / cached["latency_p50_ms"],
    }


# ------------------------------------------------------------------------------------ entry points
@dataclass(frozen=True)
class ReplaySettings:
    model: HSTUConfig = DEFAULT_MODEL
    workload: WorkloadConfig = WorkloadConfig()
    cache: CacheSettings = CacheSettings()
    batch_size: int = 8
    device: str = "cpu"
    uncached: bool = True
    verify: bool = False
    server: str | None = None
    concurrency: int = 8
    progress: bool = True
    cuda_graphs: bool = False
    compile_layers: bool = False


def replay(settings: ReplaySettings, out_dir: Path) -> dict[str, Any]:
    """Run the replay, write replay.json and replay.png to out_dir, return the JSON document."""
    device = torch.device(settings.device)
    model_cfg, wl_cfg = settings.model, settings.workload
    meta = None
    if settings.server:
        meta = fetch_server_model(settings.server)
        served = HSTUConfig(**meta["config"])
        if served != model_cfg:
            logger.info("adopting the model config of the server at %s", settings.server)
        model_cfg = served
    reference = server_reference(meta, settings.server, device) if meta is not None and settings.verify else None
    workload = Workload(wl_cfg, model_cfg)
    requests = list(workload)
    logger.info(
        "workload: %d requests, %d users, %d restarts, history %d..%d tokens",
        len(requests),
        len({r.user_id for r in requests}),
        count_restarts(requests),
        min((r.history_tokens(model_cfg) for r in requests), default=0),
        max((r.history_tokens(model_cfg) for r in requests), default=0),
    )
    results: list[PassResult] = []
    kv_cfg = None
    if settings.server:
        answers = [] if reference is not None else None
        result = run_server(
            settings.server, requests, model_cfg, settings.concurrency, progress=settings.progress, answers=answers
        )
        if reference is not None:
            result.mismatches, result.max_abs_diff = verify_answers(reference, answers, meta["task_names"])
        results.append(result)
    else:
        kv_cfg = settings.cache.build(model_cfg, wl_cfg, settings.batch_size)
        batches = list(distinct_user_batches(requests, settings.batch_size))
        common = dict(
            progress=settings.progress, cuda_graphs=settings.cuda_graphs, compile_layers=settings.compile_layers
        )
        results.append(
            run_pass("cached", model_cfg, kv_cfg, batches, device, fresh_users=False, verify=settings.verify, **common)
        )
        if settings.uncached:
            uncached_cfg = uncached_cache_config(kv_cfg)
            results.append(run_pass("uncached", model_cfg, uncached_cfg, batches, device, fresh_users=True, **common))
    summaries = {r.name: r.summary() for r in results}
    speed = speedups(summaries["cached"], summaries["uncached"]) if "uncached" in summaries else None
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "settings": {
            "model": model_cfg.to_dict(),
            "workload": dataclasses.asdict(wl_cfg),
            "cache": None if kv_cfg is None else {**dataclasses.asdict(kv_cfg), "dtype": str(kv_cfg.dtype)},
            "batch_size": settings.batch_size,
            "device": str(device),
            "cuda_graphs": settings.cuda_graphs,
            "compile_layers": settings.compile_layers,
            "server": settings.server,
            "server_weights_fingerprint": None if meta is None else meta["weights_fingerprint"],
            "concurrency": settings.concurrency if settings.server else None,
            "uncached_method": None if settings.server or not settings.uncached else UNCACHED_METHOD,
        },
        "environment": {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()},
        "workload_restarts": count_restarts(requests),
        "summary": summaries,
        "speedup": speed,
        "requests": {r.name: [dataclasses.asdict(x) for x in r.records] for r in results},
    }
    (out_dir / "replay.json").write_text(json.dumps(doc, indent=1))
    title = (
        f"{len(requests)} requests, {wl_cfg.num_users} users, batch {settings.batch_size}, "
        f"{model_cfg.num_layers}L d{model_cfg.embedding_dim} {model_cfg.dtype}, {device}"
    )
    plot_latency(results, out_dir / "replay.png", title)
    doc["table"] = format_table(summaries, speed)
    return doc


def presets() -> dict[str, tuple[HSTUConfig, CacheSettings]]:
    """Named (model, cache) setups: "cpu" the embedded small model, "seed" the benchmark's model
    (8 layers, hidden 1024, 4x256 heads, bf16) with page 32 / chunk 128 and a 4 GiB host tier."""
    from hstu.scripts.bench import BenchShape

    return {
        "cpu": (DEFAULT_MODEL, CacheSettings()),
        "seed": (BenchShape().model_config(), CacheSettings(page_size=32, chunk_tokens=128, host_capacity_bytes=4 << 30)),
    }


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d, w = ReplaySettings(), WorkloadConfig()
    p = subparsers.add_parser(
        "replay",
        help="replay a synthetic workload: cached vs uncached (or against a running server)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=["cpu", "seed"], default="cpu", help="model + cache sizes (default cpu: small model)")
    p.add_argument("--model-config", type=Path, help="HSTUConfig JSON (overrides the preset's model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="max distinct users per batch")
    p.add_argument("--requests", type=int, default=w.num_requests)
    p.add_argument("--users", type=int, default=w.num_users)
    p.add_argument("--zipf-alpha", type=float, default=w.zipf_alpha)
    p.add_argument("--new-tokens", type=int, nargs=2, default=w.new_tokens, metavar=("LO", "HI"), help="tokens per session")
    p.add_argument(
        "--initial-tokens", type=int, nargs=2, default=w.initial_tokens, metavar=("LO", "HI"), help="tokens of a new history"
    )
    p.add_argument(
        "--max-history-tokens", type=int, default=w.max_history_tokens, help="restart a user beyond this (max_seq_len-1 caps it)"
    )
    p.add_argument("--candidates", type=int, nargs=2, default=w.candidates, metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--page-size", type=int, help="tokens per page (default: the preset's)")
    p.add_argument("--num-pages", type=int, help="GPU pages (default: two batches at the history limit)")
    p.add_argument("--chunk-tokens", type=int, help="tokens per host chunk (default: the preset's)")
    p.add_argument("--host-capacity-mb", type=float, help="host tier size (default: the preset's)")
    p.add_argument("--no-uncached", action="store_true", help="skip the uncached comparison pass")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every cached (or, with --server, every answered) result against forward_no_cache",
    )
    p.add_argument("--server", help="URL of a running `hstu serve` on loopback, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight in --server mode")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true", help="per-layer CUDA graphs for the paged layers (CUDA only)")
    p.add_argument("--compile", action="store_true", help="CUDA graphs of torch.compile'd layers (implies --cuda-graphs)")
    p.add_argument("--out", type=Path, default=Path("out/replay"))
    p.set_defaults(func=main)
    return p


def settings_from_args(args: argparse.Namespace) -> ReplaySettings:
    preset_model, preset_cache = presets()[args.preset]
    model = HSTUConfig.from_json(args.model_config) if args.model_config else preset_model
    workload = WorkloadConfig(
        num_requests=args.requests,
        num_users=args.users,
        zipf_alpha=args.zipf_alpha,
        new_tokens=tuple(args.new_tokens),
        initial_tokens=tuple(args.initial_tokens),
        max_history_tokens=args.max_history_tokens,
        candidates=tuple(args.candidates),
        seed=args.seed,
    )
    overrides = {
        "page_size": args.page_size,
        "num_pages": args.num_pages,
        "chunk_tokens": args.chunk_tokens,
        "host_capacity_bytes": None if args.host_capacity_mb is None else int(args.host_capacity_mb * 2**20),
    }
    cache = dataclasses.replace(preset_cache, **{k: v for k, v in overrides.items() if v is not None})
    if args.server:
        check_loopback(args.server)
    return ReplaySettings(
        model=model,
        workload=workload,
        cache=cache,
        batch_size=args.batch_size,
        device=args.device,
        uncached=not args.no_uncached,
        verify=args.verify,
        server=args.server,
        concurrency=args.concurrency,
        progress=not args.no_progress,
        cuda_graphs=args.cuda_graphs or args.compile,
        compile_layers=args.compile,
    )


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        doc = replay(settings_from_args(args), args.out)
    except VerifyRefused as exc:
        logger.error("%s", exc)
        return 2
    logger.info("wrote %s and %s", args.out / "replay.json", args.out / "replay.png")
    print(doc["table"])
    mismatches = sum(s.get("verify_mismatches") or 0 for s in doc["summary"].values())
    errors = sum(s.get("errors", 0) for s in doc["summary"].values())
    return 1 if (mismatches or errors) else 0
