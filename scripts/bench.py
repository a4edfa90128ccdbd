"""`hstu bench`: cached vs uncached HSTU block and end-to-end forward at the seed's shapes.

Seed shapes (the defaults): 8 layers, hidden 1024, 4 heads x 256 head dim, page 32, bf16; a user
with a 4096-token history of which 3968 are cached, so a request adds 128 history tokens and
ranks 256 candidates; batch 1 and 8. `--tiny` swaps in small shapes that run on CPU in seconds.

Measurements per batch size B (median of --repeats after --warmup, torch.cuda.Event on CUDA,
perf_counter on CPU):
  block/cached      HSTUBlock.forward_paged on B x (128 new + 256 candidate) rows, 4096 keys each
  block/uncached    the same block on B x (4096 + 256) rows: the whole history through the same
                    paged kernels (append + paged attention), nothing reused
  e2e/uncached      InferenceRankingGR.rank of B requests whose users were never seen (a fresh id
                    per user and repeat), so every lookup misses and 4096 + 256 tokens per user are
                    computed through the cached pipeline's own kernels
  e2e/cached_gpu    rank of B requests adding 128 tokens to 3968 tokens that a first (untimed)
                    request left in GPU pages
  e2e/cached_host   the same, but the users' GPU pages are dropped after the first request, so the
                    3968 tokens come from the host tier: the onload is real
Exposed cache time = cached_host - cached_gpu (median), and its share of cached_host: the part of
the onload the per-layer pipelining does not hide. Also recorded: host time the model thread
blocked on the prepare job and on the per-layer onload waits per forward (RankingEngine.timings).

Self-checks (a failure is recorded in the JSON and makes the exit status 1): every timed request
reports the expected cached length and tier; cached logits equal uncached logits (and, at batch 1,
the dense forward_no_cache reference) within the dtype's tolerance relative to the logit scale
(scripts/compare.py). Each section runs on its own so one failure does not lose the others; the
JSON is rewritten after every section.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import numpy as np
import torch

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.ops.kvcache.layout import JaggedLayout
from hstu.engine import RankingEngine, RankOutput
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.ops.kvcache.metadata import KVCacheMetadata
from hstu.scripts.compare import compare_logits

logger = logging.getLogger(__name__)

SEED_REFERENCE = {
    "source": "seed project's published figures (NVIDIA L20, 256 candidates)",
    "block_speedup": (3.0, 8.0),
    "e2e_speedup": (1.3, 2.6),
}


@dataclass(frozen=True)
class BenchShape:
    """Model and request shapes of the benchmark; history and cached counts include contextual tokens."""

    num_layers: int = 8
    embedding_dim: int = 1024
    num_heads: int = 4
    head_dim: int = 256
    page_size: int = 32
    chunk_tokens: int = 128
    history_tokens: int = 4096
    cached_tokens: int = 3968
    num_candidates: int = 256
    batch_sizes: tuple[int, ...] = (1, 8)
    dtype: str = "bfloat16"
    num_contextual: int = 2
    num_items: int = 100_000
    mlp_hidden: int = 512

    def __post_init__(self) -> None:
        C = self.num_contextual
        if not 0 < self.cached_tokens < self.history_tokens:
            raise ValueError(f"need 0 < cached_tokens < history_tokens, got {self.cached_tokens}, {self.history_tokens}")
        for name in ("cached_tokens", "history_tokens"):
            if (getattr(self, name) - C) % 2 or getattr(self, name) <= C:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be num_contextual ({C}) plus a positive even count "
                    "(2 tokens per event)"
                )
        if self.cached_tokens % self.chunk_tokens:
            raise ValueError(
                f"cached_tokens {self.cached_tokens} must be a multiple of chunk_tokens {self.chunk_tokens} "
                "so that the host tier holds exactly the cached prefix"
            )
        if not self.batch_sizes or min(self.batch_sizes) <= 0:
            raise ValueError(f"batch_sizes must be positive, got {self.batch_sizes}")

    @property
    def new_tokens(self) -> int:
        return self.history_tokens - self.cached_tokens

    @property
    def pages_per_user(self) -> int:
        return -(-self.history_tokens // self.page_size)

    def model_config(self) -> HSTUConfig:
        return HSTUConfig(
            num_items=self.num_items,
            num_contextual=self.num_contextual,
            embedding_dim=self.embedding_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim_qk=self.head_dim,
            head_dim_v=self.head_dim,
            max_seq_len=self.history_tokens + self.num_candidates,
            mlp_hidden=self.mlp_hidden,
            dtype=self.dtype,
        )

    def cache_config(self, model: HSTUConfig, host_batches: int) -> KVCacheConfig:
        """Pages for two largest batches; a host tier for `host_batches` of them (0: no host tier)."""
        B = max(self.batch_sizes)
        base = KVCacheConfig.for_model(
            model,
            page_size=self.page_size,
            num_pages=2 * B * self.pages_per_user,
            chunk_tokens=self.chunk_tokens,
            host_capacity_bytes=1,
            on_no_new_tokens="candidates",
            on_shorter_history="raise",
        )
        chunks = host_batches * B * (self.history_tokens // self.chunk_tokens)
        return dataclasses.replace(base, host_capacity_bytes=chunks * base.chunk_bytes)


TINY_SHAPE = BenchShape(
    num_layers=2,
    embedding_dim=64,
    num_heads=2,
    head_dim=32,
    page_size=16,
    chunk_tokens=64,
    history_tokens=322,
    cached_tokens=256,
    num_candidates=32,
    batch_sizes=(1, 2),
    dtype="float32",
    num_items=1_000,
    mlp_hidden=64,
)


# ------------------------------------------------------------------------------------ timing
class Timer:
    """Times one call: CUDA events on the current stream (device time incl. host gaps), else wall."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def measure(
        self, fn: Callable[[], Any], setup: Callable[[], None] | None, warmup: int, repeats: int
    ) -> tuple[list[float], Any]:
        """Milliseconds of `repeats` timed calls after `warmup` untimed ones; setup() runs untimed before each."""
        times, result = [], None
        for i in range(warmup + repeats):
            if setup is not None:
                setup()
            self.sync()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = fn()
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                result = fn()
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(ms)
        return times, result


def _summary(times: list[float]) -> dict[str, Any]:
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "repeats": len(times),
        "times_ms": times,
    }


# ------------------------------------------------------------------------------------ requests
def make_requests(
    shape: BenchShape, model: HSTUConfig, batch: int, seed: int = 0
) -> tuple[list[RankingRequest], list[RankingRequest]]:
    """(prefix requests with cached_tokens, full requests with history_tokens) for users 0..batch-1."""
    rng = np.random.default_rng(seed)
    C = shape.num_contextual
    full_events, prefix_events = (shape.history_tokens - C) // 2, (shape.cached_tokens - C) // 2
    prefix, full = [], []
    for u in range(batch):
        items = rng.integers(0, model.num_items, full_events)
        actions = rng.integers(0, model.num_actions, full_events)
        stamps = np.cumsum(rng.integers(1, 600, full_events))
        candidates = rng.integers(0, model.num_items, shape.num_candidates)
        e = prefix_events
        prefix.append(RankingRequest.create(u, items[:e], actions[:e], stamps[:e], candidates, config=model))
        full.append(RankingRequest.create(u, items, actions, stamps, candidates, config=model))
    return prefix, full


class _UserIds:
    """Never-reused user ids, so each repeat starts from an empty cache entry."""

    def __init__(self, start: int = 1 << 40) -> None:
        self._next = start

    def take(self, requests: list[RankingRequest]) -> list[int]:
        ids = list(range(self._next, self._next + len(requests)))
        self._next += len(requests)
        return ids


def _as_users(requests: list[RankingRequest], ids: list[int]) -> list[RankingRequest]:
    return [dataclasses.replace(r, user_id=u) for r, u in zip(requests, ids)]


# ------------------------------------------------------------------------------------ block
def block_inputs(
    shape: BenchShape, model: InferenceRankingGR, batch: int, cached: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, KVCacheMetadata]:
    """(x, kv_cache, metadata) for `batch` users of history_tokens with `cached` of them in pages.

    Pages are a random permutation of the pool (no two users' pages adjacent by construction);
    cached K/V and x are random (timing does not depend on their values).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    cfg, ppu = model.config, shape.pages_per_user
    num_pages = batch * ppu
    kv = torch.randn(
        (cfg.num_layers, num_pages, 2, shape.page_size, cfg.num_heads, cfg.head_dim_qk),
        generator=g,
        device=device,
        dtype=cfg.torch_dtype,
    )
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pages = [perm[b * ppu : (b + 1) * ppu] for b in range(batch)]
    hist, cached_lens, cands = [shape.history_tokens] * batch, [cached] * batch, [shape.num_candidates] * batch
    layout = JaggedLayout.build(hist, cached_lens, cands)
    meta = KVCacheMetadata.from_layout(pages, layout, shape.page_size).to(device, non_blocking=False)
    x = torch.randn((layout.num_rows, cfg.embedding_dim), generator=g, device=device, dtype=cfg.torch_dtype)
    return x, kv, meta


def bench_block(
    shape: BenchShape, model: InferenceRankingGR, batch: int, timer: Timer, warmup: int, repeats: int, device: torch.device
) -> dict:
    out: dict[str, Any] = {"check_failures": []}
    for name, cached in (("cached", shape.cached_tokens), ("uncached", 0)):
        x, kv, meta = block_inputs(shape, model, batch, cached, device)
        with torch.inference_mode():
            times, y = timer.measure(lambda: model.block.forward_paged(x, kv, meta), None, warmup, repeats)
        if not torch.isfinite(y).all():
            out["check_failures"].append(f"block/{name}: non-finite outputs")
        out[name] = {**_summary(times), "rows": int(x.shape[0]), "kv_tokens_per_user": shape.history_tokens}
        del x, kv, meta, y
    out["speedup"] = out["uncached"]["median_ms"] / out["cached"]["median_ms"]
    return out


# ------------------------------------------------------------------------------------ end to end
class CacheWaitProbe:
    """Host time the model thread spent blocked on the cache in each timed forward, from the
    engine's own per-forward timings (prepare join and per-layer onload waits). On CUDA an onload
    wait blocks only until a layer's copies are enqueued, so the device-side wait shows in the
    cached_host - cached_gpu difference instead."""

    def __init__(self, engine: RankingEngine) -> None:
        self.engine = engine
        self.entries: list[dict[str, float]] = []

    def timed(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            out = fn()
            last = self.engine.timings[-1]
            self.entries.append({"prepare_s": last.prepare_wait_s, "onload_s": last.onload_wait_s})
            return out

        return run

    def per_forward_ms(self, last: int) -> dict[str, float]:
        """Medians over the last `last` recorded calls (the timed repeats, after the warm-ups)."""
        entries = self.entries[-last:]
        return {
            "prepare_wait_ms": statistics.median(e["prepare_s"] for e in entries) * 1e3,
            "onload_wait_ms": statistics.median(e["onload_s"] for e in entries) * 1e3,
        }


def _check_outputs(name: str, outputs: list[RankOutput], cached: int, expected: int) -> list[str]:
    """Failure messages (empty when fine): output count and every request's cached length."""
    failures = []
    if len(outputs) != expected:
        failures.append(f"{name}: expected {expected} outputs, got {len(outputs)}")
    got = [o.cached_tokens for o in outputs]
    if any(c != cached for c in got):
        failures.append(f"{name}: expected every request to reuse {cached} cached tokens, got {got}")
    return failures


def _compare(name: str, outputs: list[RankOutput], reference: list[torch.Tensor], dtype: str, failures: list[str]) -> float:
    """Max abs logit difference over the batch; appends a failure per request out of tolerance."""
    worst = 0.0
    for i, (o, ref) in enumerate(zip(outputs, reference)):
        check = compare_logits(o.logits, ref, dtype)
        worst = max(worst, check.max_abs_diff)
        if not check.ok:
            failures.append(
                f"{name}: request {i} logits differ by {check.max_abs_diff:.3g} "
                f"(tolerance {check.tolerance:.3g}, logit scale {check.scale:.3g})"
            )
    return worst


class EndToEnd:
    """The cached and uncached models (same seeded weights) and their managers, shared by sections."""

    def __init__(
        self,
        shape: BenchShape,
        device: torch.device,
        cuda_graphs: bool = False,
        compile_layers: bool = False,
        planner: bool = True,
    ) -> None:
        self.shape = shape
        self.device = device
        self.model_config = shape.model_config()
        self.cached_mgr = AsyncKVCacheManager(shape.cache_config(self.model_config, host_batches=3), device)
        # HostStorage needs at least one slot; one chunk keeps the uncached pass's offloads negligible.
        self.uncached_mgr = AsyncKVCacheManager(shape.cache_config(self.model_config, host_batches=0), device)
        self.cached = RankingEngine(InferenceRankingGR(self.model_config, device), self.cached_mgr)
        self.uncached = RankingEngine(InferenceRankingGR(self.model_config, device), self.uncached_mgr)
        self.ids = _UserIds()
        # The planner's cost model, measured once here (None: --no-planner).
        self.cost = self.cached.calibrate() if planner else None  # None also when unmeasurable
        self.cached_mgr.cost_model = None
        self.cuda_graphs = cuda_graphs
        if cuda_graphs:
            # One bucket per measured row count: cached (new + candidates) and full (history + candidates) rows.
            rows = {b * (shape.new_tokens + shape.num_candidates) for b in shape.batch_sizes}
            rows |= {b * (shape.history_tokens + shape.num_candidates) for b in shape.batch_sizes}
            for model in (self.cached, self.uncached):
                model.enable_cuda_graphs(
                    max_batch=max(shape.batch_sizes), buckets=tuple(sorted(rows)), compile=compile_layers
                )

    def _replays(self, model: RankingEngine) -> int:
        return model.graphs.replays if model.graphs is not None else 0

    def close(self) -> None:
        self.cached_mgr.close()
        self.uncached_mgr.close()

    def run(self, batch: int, timer: Timer, warmup: int, repeats: int) -> dict[str, Any]:
        shape, mgr = self.shape, self.cached_mgr
        prefix, full = make_requests(shape, self.model_config, batch)
        state: dict[str, Any] = {}
        out: dict[str, Any] = {}

        def fresh_full() -> None:
            state["requests"] = _as_users(full, self.ids.take(full))
            self.uncached_mgr.drain()

        def prefilled(drop_gpu: bool) -> Callable[[], None]:
            def setup() -> None:
                ids = self.ids.take(full)
                self.cached.rank(_as_users(prefix, ids))
                mgr.drain()
                if drop_gpu:
                    mgr.evict_gpu(ids)
                state["requests"] = _as_users(full, ids)
                state["before"] = mgr.stats.snapshot()

            return setup

        def prefilled_whole() -> None:  # the whole history cached: the re-rank computes candidates only
            ids = self.ids.take(full)
            self.cached.rank(_as_users(full, ids))
            mgr.drain()
            state["requests"] = _as_users(full, ids)

        def rank_with(model: RankingEngine) -> Callable[[], list[RankOutput]]:
            return lambda: model.rank(state["requests"])

        failures: list[str] = []
        dtype = self.model_config.dtype

        def check_graphs(name: str, model: RankingEngine, before: int) -> int:
            replays = self._replays(model) - before
            if self.cuda_graphs and replays < repeats:
                failures.append(f"e2e/{name}: CUDA graphs enabled but only {replays} graph replays in {repeats} timed forwards")
            return replays

        before = self._replays(self.uncached)
        times, uncached_out = timer.measure(rank_with(self.uncached), fresh_full, warmup, repeats)
        failures += _check_outputs("e2e/uncached", uncached_out, 0, batch)
        out["uncached"] = {**_summary(times), "cuda_graph_replays": check_graphs("uncached", self.uncached, before)}

        passes = [("cached_gpu", False, "gpu_hits", None), ("cached_host", True, "host_hits", None)]
        if self.cost is not None:  # the host tier again, the planner choosing onload vs recompute
            passes.append(("cached_host_planned", True, "host_hits", self.cost))
        for name, drop_gpu, tier, cost in passes:
            replays = self._replays(self.cached)
            probe = CacheWaitProbe(self.cached)
            mgr.cost_model = cost
            try:
                times, cached_out = timer.measure(
                    probe.timed(rank_with(self.cached)), prefilled(drop_gpu), warmup, repeats
                )
            finally:
                mgr.cost_model = None
            replays = check_graphs(name, self.cached, replays)
            mgr.drain()
            delta = {k: v - state["before"][k] for k, v in mgr.stats.snapshot().items()}
            if cost is None:
                failures += _check_outputs(f"e2e/{name}", cached_out, shape.cached_tokens, batch)
            if delta[tier] != batch:
                failures.append(f"e2e/{name}: expected {batch} {tier} in the last timed forward, stats delta {delta}")
            out[name] = {
                **_summary(times),
                **probe.per_forward_ms(repeats),
                "cuda_graph_replays": replays,
                "bytes_onloaded_per_forward": delta["bytes_onloaded"],
                "onloaded_tokens_per_forward": delta["tokens_onloaded"],
                "recomputed_tokens_per_forward": delta["tokens_recomputed"],
                "max_abs_diff_vs_uncached": _compare(
                    f"e2e/{name} vs uncached", cached_out, [o.logits for o in uncached_out], dtype, failures
                ),
            }
        times, rerank_out = timer.measure(rank_with(self.cached), prefilled_whole, warmup, repeats)
        failures += _check_outputs("e2e/cached_rerank", rerank_out, shape.history_tokens, batch)
        out["cached_rerank"] = {
            **_summary(times),
            "max_abs_diff_vs_uncached": _compare(
                "e2e/cached_rerank vs uncached", rerank_out, [o.logits for o in uncached_out], dtype, failures
            ),
        }
        if batch == 1:
            reference = [self.uncached.forward_no_cache(full)]
            out["max_abs_diff_uncached_vs_dense"] = _compare("e2e/uncached vs forward_no_cache", uncached_out, reference, dtype, failures)
        out["logit_scale"] = float(uncached_out[0].logits.float().abs().max())

        gpu_ms, host_ms = out["cached_gpu"]["median_ms"], out["cached_host"]["median_ms"]
        out["speedup"] = out["uncached"]["median_ms"] / gpu_ms
        out["speedup_host_tier"] = out["uncached"]["median_ms"] / host_ms
        if "cached_host_planned" in out:
            out["speedup_host_tier_planned"] = out["uncached"]["median_ms"] / out["cached_host_planned"]["median_ms"]
            out["cost_model"] = self.cost.as_dict()
        out["speedup_rerank"] = out["uncached"]["median_ms"] / out["cached_rerank"]["median_ms"]
        out["exposed_cache_ms"] = host_ms - gpu_ms
        out["exposed_cache_share"] = (host_ms - gpu_ms) / host_ms
        out["check_failures"] = failures
        return out


# ------------------------------------------------------------------------------------ memory
def memory_plan(shape: BenchShape) -> dict[str, int]:
    """Bytes the benchmark allocates up front (device tables, pinned host arena, block inputs)."""
    model = shape.model_config()
    cached = shape.cache_config(model, host_batches=3)
    uncached = shape.cache_config(model, host_batches=0)
    B = max(shape.batch_sizes)
    table = lambda c: c.num_layers * c.num_pages * c.page_bytes  # noqa: E731
    return {
        "cached_gpu_table": table(cached),
        "uncached_gpu_table": table(uncached),
        "block_kv": B * shape.pages_per_user * model.num_layers * cached.page_bytes,
        "host_arena_pinned": cached.host_slots * cached.chunk_bytes + uncached.host_slots * uncached.chunk_bytes,
    }


def check_memory(shape: BenchShape, device: torch.device, plan: dict[str, int]) -> None:
    """Raise MemoryError naming the numbers when the device tables clearly cannot fit."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    need = plan["cached_gpu_table"] + plan["uncached_gpu_table"] + plan["block_kv"]
    if need * 1.5 > free:
        raise MemoryError(
            f"benchmark needs ~{need * 1.5 / 2**30:.1f} GiB of device memory, "
            f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f}"
        )


# ------------------------------------------------------------------------------------ driver
@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """"auto": the ops' own dispatch (Triton on CUDA when available); "torch": force the torch path."""
    if name not in ("auto", "torch"):
        raise ValueError(f"attention must be 'auto' or 'torch', got {name!r}")
    if name == "auto":
        yield
        return
    try:
        from hstu.ops import triton_attention
    except ImportError:
        yield
        return
    with mock.patch.object(triton_attention, "available", lambda: False):
        yield


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
        try:
            from hstu.ops import triton_attention

            env["attention"] = "triton" if triton_attention.available() else "torch"
        except ImportError as exc:
            env["attention"] = f"torch (triton kernel not importable: {exc})"
    else:
        env["attention"] = "torch"
    return env


def run_bench(
    shape: BenchShape,
    device: torch.device,
    warmup: int,
    repeats: int,
    out_dir: Path,
    sections: tuple[str, ...] = ("block", "e2e"),
    attention: str = "auto",
    cuda_graphs: bool = False,
    compile_layers: bool = False,
    planner: bool = True,
) -> dict[str, Any]:
    """Run the sections for every batch size; write bench.json (after each section) and bench.md.

    cuda_graphs: the end-to-end models replay per-layer CUDA graphs (RankingEngine.enable_cuda_graphs);
    compile_layers: those graphs capture torch.compile'd layers. The block section always runs the
    eager block.
    """
    with attention_backend(attention):
        return _run_bench(shape, device, warmup, repeats, out_dir, sections, cuda_graphs, compile_layers, planner)


def _run_bench(
    shape: BenchShape,
    device: torch.device,
    warmup: int,
    repeats: int,
    out_dir: Path,
    sections: tuple[str, ...],
    cuda_graphs: bool,
    compile_layers: bool,
    planner: bool,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = memory_plan(shape)
    doc: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "shape": dataclasses.asdict(shape),
        "model_config": shape.model_config().to_dict(),
        "warmup": warmup,
        "repeats": repeats,
        "cuda_graphs": cuda_graphs,
        "compile_layers": compile_layers,
        "environment": environment(device),
        "memory_plan_bytes": plan,
        "seed_reference": SEED_REFERENCE,
        "block": {},
        "e2e": {},
        "errors": [],
    }
    path = out_dir / "bench.json"

    def save() -> None:
        if device.type == "cuda":
            doc["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        path.write_text(json.dumps(doc, indent=1))

    def section(name: str, batch: int, fn: Callable[[], dict]) -> None:
        logger.info("%s, batch %d ...", name, batch)
        t0 = time.perf_counter()
        try:
            result = doc[name][str(batch)] = fn()
        except Exception as exc:  # recorded; the other sections still run
            logger.exception("%s at batch %d failed", name, batch)
            doc["errors"].append({"section": name, "batch": batch, "error": f"{type(exc).__name__}: {exc}"})
        else:
            for failure in result["check_failures"]:
                logger.error("check failed: %s", failure)
                doc["errors"].append({"section": name, "batch": batch, "error": f"check failed: {failure}"})
        logger.info("%s, batch %d took %.1fs", name, batch, time.perf_counter() - t0)
        save()

    timer = Timer(device)
    try:
        check_memory(shape, device, plan)
        e2e = EndToEnd(shape, device, cuda_graphs, compile_layers, planner)
    except Exception as exc:
        logger.exception("setup failed")
        doc["errors"].append({"section": "setup", "batch": None, "error": f"{type(exc).__name__}: {exc}"})
        save()
        return doc
    try:
        for batch in shape.batch_sizes:
            if "block" in sections:
                section("block", batch, lambda: bench_block(shape, e2e.cached.model, batch, timer, warmup, repeats, device))
            if "e2e" in sections:
                section("e2e", batch, lambda: e2e.run(batch, timer, warmup, repeats))
    finally:
        e2e.close()
    save()
    (out_dir / "bench.md").write_text(markdown_table(doc) + "\n")
    return doc


def _cell(doc: dict, section: str, batch: int, *keys: str) -> Any:
    value: Any = doc[section].get(str(batch))
    for k in keys:
        if not isinstance(value, dict) or k not in value:
            return None
        value = value[k]
    return value


def table_rows(doc: dict) -> list[list[str]]:
    ref = doc["seed_reference"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    times = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    rows = [["measure", "batch", "cached ms", "uncached ms", "speedup", "seed (L20)", "host-tier ms", "exposed cache"]]
    e2e_rows = []
    for batch in doc["shape"]["batch_sizes"]:
        rows.append(
            [
                "HSTU block",
                str(batch),
                fmt(_cell(doc, "block", batch, "cached", "median_ms"), ".2f"),
                fmt(_cell(doc, "block", batch, "uncached", "median_ms"), ".2f"),
                times(_cell(doc, "block", batch, "speedup")),
                "{:g}-{:g}x".format(*ref["block_speedup"]),
                "",
                "",
            ]
        )
    for batch in doc["shape"]["batch_sizes"]:
        if _cell(doc, "e2e", batch, "cached_host_planned", "median_ms") is not None:
            e2e_rows.append(
                [
                    "host tier + planner",
                    str(batch),
                    fmt(_cell(doc, "e2e", batch, "cached_host_planned", "median_ms"), ".2f"),
                    fmt(_cell(doc, "e2e", batch, "uncached", "median_ms"), ".2f"),
                    times(_cell(doc, "e2e", batch, "speedup_host_tier_planned")),
                    "",
                    "",
                    "",
                ]
            )
        e2e_rows.append(
            [
                "re-rank, same history",
                str(batch),
                fmt(_cell(doc, "e2e", batch, "cached_rerank", "median_ms"), ".2f"),
                fmt(_cell(doc, "e2e", batch, "uncached", "median_ms"), ".2f"),
                times(_cell(doc, "e2e", batch, "speedup_rerank")),
                "",
                "",
                "",
            ]
        )
        exposed, share = _cell(doc, "e2e", batch, "exposed_cache_ms"), _cell(doc, "e2e", batch, "exposed_cache_share")
        rows.append(
            [
                "end-to-end",
                str(batch),
                fmt(_cell(doc, "e2e", batch, "cached_gpu", "median_ms"), ".2f"),
                fmt(_cell(doc, "e2e", batch, "uncached", "median_ms"), ".2f"),
                times(_cell(doc, "e2e", batch, "speedup")),
                "{:g}-{:g}x".format(*ref["e2e_speedup"]),
                fmt(_cell(doc, "e2e", batch, "cached_host", "median_ms"), ".2f"),
                "-" if exposed is None else f"{exposed:.2f} ms ({100 * share:.0f}%)",
            ]
        )
    return rows + e2e_rows


def format_table(doc: dict) -> str:
    rows = table_rows(doc)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    s, env = doc["shape"], doc["environment"]
    lines.append(
        f"{env.get('gpu', env['device'])}, attention {env['attention']}, {s['num_layers']} layers, "
        f"hidden {s['embedding_dim']}, "
        f"{s['num_heads']}x{s['head_dim']} heads, page {s['page_size']}, {s['dtype']}; history {s['history_tokens']} "
        f"({s['cached_tokens']} cached), {s['num_candidates']} candidates; median of {doc['repeats']}"
        + ("; e2e with CUDA graphs" if doc["cuda_graphs"] else "")
        + (" of compiled layers" if doc.get("compile_layers") else "")
    )
    for err in doc["errors"]:
        lines.append(f"FAILED {err['section']} batch {err['batch']}: {err['error']}")
    return "\n".join(lines)


def markdown_table(doc: dict) -> str:
    rows = table_rows(doc)
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d = BenchShape()
    p = subparsers.add_parser(
        "bench",
        help="cached vs uncached HSTU block and end-to-end benchmark (seed shapes; --tiny for CPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tiny", action="store_true", help="small shapes that run on CPU in seconds (shape flags override)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for flag, field in (
        ("--layers", "num_layers"),
        ("--hidden", "embedding_dim"),
        ("--heads", "num_heads"),
        ("--head-dim", "head_dim"),
        ("--page-size", "page_size"),
        ("--chunk-tokens", "chunk_tokens"),
        ("--history-tokens", "history_tokens"),
        ("--cached-tokens", "cached_tokens"),
        ("--candidates", "num_candidates"),
    ):
        p.add_argument(flag, dest=field, type=int, default=None, help=f"default {getattr(d, field)}")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help=f"default {' '.join(map(str, d.batch_sizes))}")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=f"default {d.dtype}")
    p.add_argument("--sections", nargs="+", choices=["block", "e2e"], default=["block", "e2e"])
    p.add_argument("--attention", choices=["auto", "torch"], default="auto", help="torch: bypass the Triton kernel")
    p.add_argument("--cuda-graphs", action="store_true", help="end-to-end models replay per-layer CUDA graphs (CUDA only)")
    p.add_argument("--compile", action="store_true", help="those graphs capture torch.compile'd layers (implies --cuda-graphs)")
    p.add_argument("--no-planner", action="store_true", help="skip the host-tier pass with the compute-or-load planner")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("out/bench"))
    p.set_defaults(func=main)
    return p


def shape_from_args(args: argparse.Namespace) -> BenchShape:
    base = TINY_SHAPE if args.tiny else BenchShape()
    overrides = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(BenchShape) if getattr(args, f.name, None) is not None
    }
    if args.batch_sizes:
        overrides["batch_sizes"] = tuple(args.batch_sizes)
    if args.dtype:
        overrides["dtype"] = args.dtype
    return dataclasses.replace(base, **overrides)


def main(args: argparse.Namespace) -> int:
    if args.warmup < 0 or args.repeats <= 0:
        raise ValueError(f"need warmup >= 0 and repeats > 0, got {args.warmup}, {args.repeats}")
    args.cuda_graphs = args.cuda_graphs or args.compile
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise ValueError(f"--cuda-graphs/--compile need a CUDA device, got --device {args.device}")
    doc = run_bench(
        shape_from_args(args),
        torch.device(args.device),
        args.warmup,
        args.repeats,
        args.out,
        tuple(args.sections),
        args.attention,
        args.cuda_graphs,
        args.compile,
        not args.no_planner,
    )
    logger.info("wrote %s and %s", args.out / "bench.json", args.out / "bench.md")
    print(format_table(doc))
    return 1 if doc["errors"] else 0
