"""RankingEngine: the one owner of the ranking pipeline, from requests to logits.

A request's path (`rank`), all on the calling thread, which holds the engine lock so batches run
one at a time (the server's batcher calls rank from its single model thread):
  1. validate every request; digests of each history under the model's identity (model/identity.py)
  2. cache.plan(): lookup (GPU, then host, reused only on an exact digest match), the batch's row
     layout, and the prepare job (pages, metadata; on the model thread, or on the cache's prepare
     worker under KVCacheConfig.prepare_worker)
  3. model.embed(): only the new history tokens and the candidates
  4. cache.wait(): pages and metadata; the block runs layer by layer, layer i first calling the
     plan's ready hook (its onload), as per-layer CUDA graphs when a bucket fits, else eagerly
  5. model.logits(): candidate rows through the postprocessor and the head
  6. cache.finish(): commit, offload newly full chunks; users whose onload failed, or whose
     history turned out not to extend the GPU entry the batch reused (compared after the launch),
     are ranked again, from scratch (their cache entry is gone, so the retry cannot onload)
Any error between plan and finish aborts the plan (pins released, nothing committed).
Without a cache, rank runs every user's full sequence through the dense path.

Who owns what: the engine owns the model, the cache manager (closing it on close()), the CUDA
graphs and compiled layers, and the lock. The cache manager owns its worker threads and streams
(ops/kvcache/manager.py lists which thread touches which state).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.batch import BatchPlan
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.ops.kvcache.planner import CostModel
from hstu.ops.kvcache.transfers import COPY_AHEAD
from hstu.ops.knobs import choice, flag, number
from hstu.ops.kv_ops import write_pinned

# A batch is ranked at most this many times: the retry after a failed onload is a plain miss.
_MAX_ATTEMPTS = 2
# HSTU_ONLOAD_IN_GRAPH=1: a graph-bucket batch that onloads replays one whole-forward graph whose
# layers wait for their pages on the device (external events, engine/graphs.py "waited") instead
# of a segment a layer with the waits between them on the host (an experiment knob, off until
# measured on a GPU)
_ONLOAD_IN_GRAPH = os.environ.get("HSTU_ONLOAD_IN_GRAPH", "0") == "1"
# HSTU_LOGITS_OUT=kernel: rank_async writes the batch's logits to pinned memory with a kernel
# (kv_ops.write_pinned) instead of a D2H copy, which shares the copy engine with the offloads' D2H
# and may queue behind a whole history's (an experiment knob, off until measured on a GPU)
_LOGITS_BY_KERNEL = choice("HSTU_LOGITS_OUT", ("copy", "kernel"), "copy") == "kernel"
# HSTU_COMPILE_MODE: torch.compile's mode for the layers enable_cuda_graphs(compile=True) captures.
# "max-autotune-no-cudagraphs" lets Inductor weigh its Triton GEMM templates against cuBLAS, with
# the SiLU after the projection and the residual after the output matmul fused into their
# epilogues where that measures faster: the memory passes beside the GEMMs (issue 12; run AY's
# default-mode compile gave nothing over eager layers). An experiment: compiling takes minutes.
_COMPILE_MODE = choice("HSTU_COMPILE_MODE", ("default", "max-autotune-no-cudagraphs"), "default")
# HSTU_ONLOAD_AT_RESERVE=0: a graph-bucket batch's onload starts after the plan, as before, not as
# soon as its pages are reserved (an experiment knob for same-call comparisons)
_ONLOAD_AT_RESERVE = flag("HSTU_ONLOAD_AT_RESERVE", default=True)
# A planned host-tier batch is measured from before its plan (=0: from after it, as before; an
# experiment knob for same-call comparisons): plan_feedback.py says why.
_FEEDBACK_FROM_PLAN = flag("HSTU_FEEDBACK_FROM_PLAN", default=True)
# HSTU_COMPUTE_MARGIN: the measured cost model's compute_margin instead of CostModel's default (an experiment
# knob for same-call comparisons; a server's planner_compute_margin setting overrides either)
_COMPUTE_MARGIN = number(
    "HSTU_COMPUTE_MARGIN", CostModel.compute_margin, "the share a split's compute is priced higher when ranked", minimum=0.0
)

# Row buckets of the CUDA graphs, at most 1.5x apart: a batch computes its bucket's rows, and the
# seed replay's cached batches (mixed users: 256-12k rows) padded 28% more rows with buckets 2x apart
# (256, 512, 1024, ...) against 16% with these, on the linear layers, norms and pointwise ops
# (attention skips padded rows). Past 4096 rows too: an eager batch is host-bound well beyond
# that (on the H200 a batch of 8 recomputing 1024 tokens each, 10k rows, spent 12 ms launching 8
# ms of kernels), and split host-tier batches and misses land there.
DEFAULT_GRAPH_BUCKETS = (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
# With torch.compile'd layers each (layer, bucket) compiles once at start-up: fewer buckets.
DEFAULT_COMPILED_GRAPH_BUCKETS = (256, 512, 1024, 2048, 4096)
# host_split "compute_front" adds one: a batch of 8's best front (~2.3-2.4k tokens a user at the
# seed shapes, by the planner's costs of run BB) is 18-19k rows, and the planner skips fronts past
# the largest bucket (an eager front of that size would be host-bound). Front buckets 2,048 rows apart
# (18,432-24,576) were tried (run MW, H100): the planner then recomputed 18 chunks a user instead of 16,
# measured no faster (split sweep: 10.66-10.97 ms for 16-18 chunks; its model predicted 10.02 against
# 11.17 ms), so one bucket stays.
FRONT_GRAPH_BUCKET = 24576


def buckets_from_env() -> tuple[int, ...] | None:
    """HSTU_GRAPH_BUCKETS="256,512,...": the row buckets instead of the defaults (a deployment's
    row counts differ from the seed workload's; also same-call comparisons); None when unset."""
    text = os.environ.get("HSTU_GRAPH_BUCKETS", "").strip()
    if not text:
        return None
    try:
        buckets = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"HSTU_GRAPH_BUCKETS must be comma-separated row counts, got {text!r}") from None
    if not buckets or buckets[0] < 1:
        raise ValueError(f"HSTU_GRAPH_BUCKETS must name row counts >= 1, got {text!r}")
    return buckets


def default_graph_buckets(compile: bool = False, host_split: str = "load_front") -> tuple[int, ...]:
    """The row buckets enable_cuda_graphs captures when none are given (HSTU_GRAPH_BUCKETS, else
    the defaults above)."""
    buckets = buckets_from_env() or (DEFAULT_COMPILED_GRAPH_BUCKETS if compile else DEFAULT_GRAPH_BUCKETS)
    if host_split in ("compute_front", "auto") and not compile and FRONT_GRAPH_BUCKET > buckets[-1]:
        return buckets + (FRONT_GRAPH_BUCKET,)
    return buckets


_NO_CANDIDATES = np.zeros(0, dtype=np.int64)  # a front pass's requests rank nothing


@dataclass
class RankOutput:
    """Per-user result: logits [M, num_tasks] and how much of the history was reused."""

    user_id: int
    logits: torch.Tensor
    cached_tokens: int
    computed_tokens: int
    task_names: tuple[str, ...]

    @property
    def scores(self) -> np.ndarray:
        """Probabilities [M candidates, num_tasks] (sigmoid of the logits)."""
        return torch.sigmoid(self.logits.float()).cpu().numpy()

    def scores_by_task(self) -> dict[str, np.ndarray]:
        """{task name: probability of each candidate}, names as the engine was given (task_0.. by default)."""
        probs = self.scores
        return {name: probs[:, i] for i, name in enumerate(self.task_names)}

    def __reduce__(self):
        """Pickled with the logits as a compact numpy copy (outputs cross processes: the engine
        process's pipe, Ray Serve replicas). A torch tensor pickles its whole storage (here the
        batch's, the logits being a view of it) at ~10x the cost of a numpy array; bfloat16,
        which numpy lacks, travels as its int16 bits."""
        logits = self.logits.detach().cpu().contiguous()
        bits = logits.view(torch.int16) if logits.dtype == torch.bfloat16 else logits
        args = (self.user_id, bits.numpy(), logits.dtype == torch.bfloat16, self.cached_tokens, self.computed_tokens)
        return _unpickle_rank_output, (*args, self.task_names)


def _unpickle_rank_output(user_id, logits, bfloat16, cached_tokens, computed_tokens, task_names) -> RankOutput:
    tensor = torch.from_numpy(logits)
    return RankOutput(user_id, tensor.view(torch.bfloat16) if bfloat16 else tensor, cached_tokens, computed_tokens, task_names)


class PendingRank:
    """A launched batch: its outputs, whose logits are on their way to host memory.

    Why: reading logits on the host waits for the GPU. A caller that launches batch N + 1 before
    reading batch N (rank_async) overlaps N + 1's host work (lookup, metadata, launches) with N's
    kernels, so the GPU does not idle while the model thread prepares the next batch."""

    def __init__(self, outputs: list[RankOutput], copied: "torch.cuda.Event | None") -> None:
        self._outputs = outputs
        self._copied = copied

    def done(self) -> bool:
        """Whether result() would return without waiting."""
        return self._copied is None or self._copied.query()

    def result(self) -> list[RankOutput]:
        """Per-user outputs with host logits, in request order; waits for the copy (a CUDA error
        of the batch's kernels is raised here)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._outputs


@dataclass
class ForwardTiming:
    """Host seconds of one cached forward on the model thread, by phase: plan (lookup, layout,
    prepare job started), inputs (embedding, or a graph's static inputs), blocked on the
    prepare job and on per-layer onloads, forward (the block and head launched, or the graph
    replayed), finish (commit, offload started, outputs split) and the whole batch."""

    plan_s: float = 0.0
    inputs_s: float = 0.0
    prepare_wait_s: float = 0.0
    onload_wait_s: float = 0.0
    forward_s: float = 0.0
    finish_s: float = 0.0
    total_s: float = 0.0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Every field's name, the total last (plan_s ... total_s): what the benchmarks tabulate."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def phases(self) -> dict[str, float]:
        """Seconds by phase name (every field but the total, without its _s): what the server's
        hstu_forward_phase_seconds and the replay's per-batch means report."""
        return {name.removesuffix("_s"): getattr(self, name) for name in self.field_names() if name != "total_s"}


class RankingEngine:
    """Runs ranking batches through `model`, reusing K/V from `cache` when one is given."""

    def __init__(
        self, model: InferenceRankingGR, cache: AsyncKVCacheManager | None = None, task_names: Sequence[str] | None = None
    ) -> None:
        self.task_names = model.config.resolve_task_names(task_names)
        self.model = model
        self.cache = cache
        self.config = model.config
        if cache is not None and cache.config.host_split == "auto" and model.config.num_contextual % 2:
            # a front of whole chunks never ends on an event here: every split onloads the front
            cache.config = dataclasses.replace(cache.config, host_split="load_front")
        if cache is not None and cache.config.may_compute_front and model.config.num_contextual % 2:
            raise ValueError(
                f"host_split {cache.config.host_split!r} recomputes whole chunks from the front, which end on an event only "
                f"with an even number of contextual tokens; this model has {model.config.num_contextual}"
            )
        if cache is not None and cache.config.host_format == "hidden":
            if cache.config.hidden_dim != model.config.embedding_dim:
                raise ValueError(
                    f"host_format 'hidden' stores the model's layer inputs: the cache's hidden_dim "
                    f"{cache.config.hidden_dim} must equal the model's embedding_dim {model.config.embedding_dim}"
                )
            cache.rebuild_kv_with(model.block.kv_from_hidden)
        self.graphs = None
        self.layer_fns: list[Callable] | None = None
        self.timings: deque[ForwardTiming] = deque(maxlen=4096)
        self._lock = threading.Lock()

    @classmethod
    def create(
        cls,
        config: HSTUConfig | None = None,
        *,
        device: torch.device | str = "cpu",
        task_names: Sequence[str] | None = None,
        **cache_options,
    ) -> "RankingEngine":
        """A model (random weights; load_state_dict on `engine.model` for trained ones) with a KV
        cache sized by `cache_options` (KVCacheConfig fields), ready to rank."""
        from hstu.ops.kvcache.config import KVCacheConfig

        config = config or HSTUConfig()
        cache = AsyncKVCacheManager(KVCacheConfig.for_model(config, **cache_options), device=device)
        return cls(InferenceRankingGR(config, device=device), cache, task_names)

    # ------------------------------------------------------------- public API
    @torch.inference_mode()
    def rank(self, requests: list[RankingRequest]) -> list[RankOutput]:
        """Per-user outputs in request order (users must be distinct within a batch)."""
        return self._rank(requests)[0]

    def _rank(self, requests: list[RankingRequest], owned: bool = True) -> tuple[list[RankOutput], torch.Tensor | None]:
        """(outputs, the batch's logits in request order when one forward produced them all).
        owned=False: a graph-replayed batch's logits may be views of the graph's static output,
        which the next replay overwrites; the caller copies them out first, on the same stream."""
        self.model.validate(requests)
        with self._lock:
            if self.cache is None:
                logits = self.model.dense_logits(requests)
                return self._split(requests, logits, [0] * len(requests)), logits
            return self._rank_cached(requests, owned)

    @torch.inference_mode()
    def rank_async(self, requests: list[RankingRequest], dtype: torch.dtype | None = None) -> PendingRank:
        """rank(), returning once the batch is launched: the logits (one batch, one copy, as
        `dtype` if given) go to pinned host memory behind the batch's kernels, and
        PendingRank.result() waits for them. Batches keep their order on the device (one compute
        stream), so a later batch may be launched, and the cache may hand out pages of this one's
        users, before it completes."""
        # On CUDA the logits are copied out below, on the compute stream, so ahead of any later
        # replay: they need no copy of their own first (one kernel and allocation per batch).
        outputs, logits = self._rank(requests, owned=self.model.device.type != "cuda")
        if self.model.device.type != "cuda":
            if dtype is not None:
                outputs = [dataclasses.replace(o, logits=o.logits.to(dtype)) for o in outputs]
            return PendingRank(outputs, None)
        if logits is None:  # a retried batch: its users' logits come from two forwards
            logits = torch.cat([o.logits for o in outputs])
        if dtype is not None:
            logits = logits.to(dtype)
        host = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
        if _LOGITS_BY_KERNEL:
            write_pinned(host, logits.contiguous())
        else:
            host.copy_(logits, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        parts = torch.split(host, [o.logits.shape[0] for o in outputs])
        return PendingRank(
            [RankOutput(o.user_id, p, o.cached_tokens, o.computed_tokens, o.task_names) for o, p in zip(outputs, parts)],
            copied,
        )

    @torch.inference_mode()
    def forward(self, requests: list[RankingRequest]) -> torch.Tensor:
        """Logits [sum M, num_tasks] in request order."""
        return torch.cat([o.logits for o in self.rank(requests)])

    def forward_no_cache(self, requests: list[RankingRequest]) -> torch.Tensor:
        """The reference: the same model without the cache."""
        return self.model.forward_no_cache(requests)

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
        if self.cache is not None:
            self.cache.close()

    @property
    def graph_buckets(self) -> tuple[int, ...] | None:
        """Row counts of the CUDA-graph buckets, ascending (None: graphs off): a batch computes its
        bucket's rows, which the planner and its calibration count."""
        return self.graphs.bucket_sizes if self.graphs is not None else None

    def calibrate(self, cost: CostModel | None = None) -> CostModel | None:
        """Turn on the compute-or-load planner with `cost`, or with costs measured now on this
        device: the H2D bandwidth (ops/kvcache/costs.py), the compute cost of this engine's whole
        forward, then its onload as the cache runs it (engine/calibration.py; call it before
        serving: it ranks synthetic users through both tiers). A measurement that cannot tell
        compute cost apart, or a cache too small to measure with, leaves the planner off (returns
        None)."""
        from hstu.engine.calibration import measure_forward_costs, measure_front, measure_onload
        from hstu.ops.kvcache.costs import measure_h2d

        if self.cache is None:
            raise RuntimeError("the planner splits host-tier prefixes: it needs a KV cache")
        if cost is None:
            self.cache.cost_model = None  # the calibration batches onload whole prefixes and split nothing
            fitted = measure_forward_costs(self)
            if fitted is None or (fitted[1] <= 0 and fitted[2] <= 0):
                return None
            kv = self.cache.config
            forward, per_row, per_pair = fitted
            # A hidden-state chunk's token moves its layer input instead of its K/V (host_format
            # "hidden"; measure_onload folds the rebuild on the GPU into the fitted link rate).
            hidden_bytes = kv.hidden_dim * kv.element_size if kv.host_format == "hidden" else 0
            cost = CostModel(measure_h2d(self.model.device), kv.page_bytes // kv.page_size, per_row, per_pair,
                             forward_s=forward, hidden_bytes_per_token_layer=hidden_bytes, compute_margin=_COMPUTE_MARGIN)
            cost = measure_onload(self, cost)
            if self.cache.config.may_compute_front:
                cost = measure_front(self, cost)
        with self._lock:
            self.cache.cost_model = cost
        return cost

    def prefetch(self, user_ids: list[int]) -> int:
        """Start onloading host-tier users expected to rank soon (between batches); users started."""
        if self.cache is None:
            return 0
        with self._lock:
            return self.cache.prefetch(user_ids)

    # ------------------------------------------------------- compiled / graphs
    def compile_paged_layers(self, **compile_kwargs) -> None:
        """torch.compile each paged layer on its own (fullgraph), so the per-layer onload waits
        stay outside the compiled regions. Eager batches then recompile per new shape; for serving,
        enable_cuda_graphs(compile=True) compiles once per row bucket instead."""
        self.layer_fns = self._compiled_layers(**compile_kwargs)

    def _compiled_layers(self, **compile_kwargs) -> list[Callable]:
        block = self.model.block
        return [
            torch.compile(functools.partial(block.paged_layer, i), fullgraph=True, **compile_kwargs)
            for i in range(self.config.num_layers)
        ]

    def enable_cuda_graphs(
        self,
        max_batch: int = 8,
        buckets: tuple[int, ...] | None = None,
        compile: bool = False,
        capture: bool = True,
    ) -> None:
        """Replay the whole cached forward (features to logits) as CUDA graphs for batches that
        fit a row bucket (padded); larger batches run eagerly. Captures every bucket now, before
        serving (engine/graphs.py).

        compile: the graphs capture torch.compile'd layers, compiled once per (layer, bucket) with
        static shapes; eager fallback batches keep the eager layers, so no batch compiles while
        serving. capture=False runs the same padded static-buffer path eagerly (no CUDA needed).
        buckets: row counts, default default_graph_buckets(compile, the cache's host_split).
        """
        if buckets is None:
            host_split = self.cache.config.host_split if self.cache is not None else "load_front"
            buckets = default_graph_buckets(compile, host_split)
        if self.cache is None or (capture and self.model.device.type != "cuda"):
            raise RuntimeError("CUDA graphs need a CUDA model with a KV cache manager")
        from hstu.engine.device_launch import DeviceLaunch
        from hstu.engine.graphs import ForwardGraphs

        if self.graphs is not None:  # captured again: the last set's device execs go first
            self.graphs.close()

        layer_fns = self._compiled_layers(dynamic=False, mode=_COMPILE_MODE) if compile else None
        self.graphs = ForwardGraphs(
            self.model, self.cache.kv_pages, self.cache.scratch_page, max_batch, buckets, layer_fns, capture,
            keep_layer_inputs=self.cache.keeps_hidden, waits_in_graph=_ONLOAD_IN_GRAPH,
            onloads=self.cache.config.host_slots > 0,
            device_launch=DeviceLaunch.create(self.model.device) if capture else None,
        )
        # Every layer is one code object (paged_layer) compiled once per (layer, bucket): lift
        # Dynamo's per-code recompile limit for the captures, else the later ones run uncompiled.
        limit = max(torch._dynamo.config.recompile_limit, self.config.num_layers * len(buckets) + 8)
        with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=limit):
            self.graphs.capture_all()
        # host_format "hidden" (a no-op otherwise); HSTU_REBUILD_GRAPHS=0 keeps the eager rebuild
        # (an experiment knob for same-call comparisons)
        if os.environ.get("HSTU_REBUILD_GRAPHS", "1") != "0":  # an onload holds at most every user's whole history
            chunks_per_user = -(-self.config.max_seq_len // self.cache.config.chunk_tokens)
            self.cache.capture_rebuild_graphs(max_batch * chunks_per_user, capture)

    # -------------------------------------------------------------- pipeline
    def _rank_cached(
        self, requests: list[RankingRequest], owned: bool = True
    ) -> tuple[list[RankOutput], torch.Tensor | None]:
        outputs: dict[int, RankOutput] = {}
        todo = requests
        for attempt in range(_MAX_ATTEMPTS):
            failed, logits = self._rank_batch(todo, outputs, owned)
            if not failed:
                return [outputs[r.user_id] for r in requests], logits if attempt == 0 else None
            if not owned:  # the retry's replay may overwrite the static output these views read
                outputs = {u: dataclasses.replace(o, logits=o.logits.clone()) for u, o in outputs.items()}
            todo = [r for r in todo if r.user_id in failed]
        raise RuntimeError(f"users {sorted(failed)} failed (onload, or a diverged history) on every attempt")

    def _rank_batch(
        self, requests: list[RankingRequest], outputs: dict[int, RankOutput], owned: bool = True
    ) -> tuple[set[int], torch.Tensor]:
        """Rank one batch into `outputs`; returns the users whose onload failed (to rank again)
        and the batch's logits (see _rank for `owned`)."""
        cache = self.cache
        timing = ForwardTiming()
        t0 = time.perf_counter()
        # a planner's host-tier plan is measured against its prediction (plan_feedback.py), from
        # before its plan where a cost model may plan one, the host tier holding anyone (its start
        # event is then recorded now: ~5-10 us, which a GPU-resident batch need not pay otherwise)
        from_plan = _FEEDBACK_FROM_PLAN and isinstance(cache.cost_model, CostModel) and cache.host.num_users() > 0
        start = cache.plan_feedback.mark(self.model.device) if from_plan else None
        plan = self._plan(requests)
        timing.plan_s = time.perf_counter() - t0
        measured = (
            cache.plan_feedback.begin(*plan.measure, self.model.device, start=start) if plan.measure is not None else None
        )
        try:
            logits = self._forward(requests, plan, timing, owned)
        except BaseException:
            cache.abort(plan)
            raise
        t1 = time.perf_counter()
        if measured is not None:
            cache.plan_feedback.end(measured, t1 - t0 - (0.0 if from_plan else timing.plan_s))
        failed = set(cache.finish(plan))
        reused = [c - plan.front_tokens.get(u, 0) for u, c in zip(plan.user_ids, plan.cached_lens)]  # fronts: recomputed
        for out in self._split(requests, logits, reused):
            if out.user_id not in failed:
                outputs[out.user_id] = out
        t2 = time.perf_counter()
        timing.finish_s, timing.total_s = t2 - t1, t2 - t0
        self.timings.append(timing)
        return failed, logits

    def _plan(self, requests: list[RankingRequest]) -> BatchPlan:
        """cache.plan for the batch: its users, lengths, identities and candidates, padded for a
        graph bucket when one fits."""
        model_id = self.model.identity
        return self.cache.plan(
            [r.user_id for r in requests],
            [r.history_tokens(self.config) for r in requests],
            [r.identity(model_id) for r in requests],
            [r.candidates.shape[0] for r in requests],
            pad_for=self.graphs.pad_spec if self.graphs is not None else None,
            graph_buckets=self.graph_buckets,
            onload_at_reserve=self._onload_at_reserve if _ONLOAD_AT_RESERVE else None,
        )

    def _onload_at_reserve(self, plan: BatchPlan) -> bool:
        """Whether the plan's onload may start as soon as its pages are reserved: exactly the plans
        whose onload _forward (or _forward_front) starts first thing, a graph bucket's whose stage is
        a kernel and whose graph holds no waits (those take their event set before the onload
        starts). Nothing runs between the two points but the metadata's packing, which the copies
        do not read."""
        graphs = self.graphs
        if graphs is None or not graphs.onload_before_stage or graphs.waits_in_graph:
            return False
        return plan.front_pad is not None if plan.front_tokens else plan.pad is not None

    def _forward(
        self, requests: list[RankingRequest], plan: BatchPlan, timing: ForwardTiming, owned: bool = True
    ) -> torch.Tensor:
        """Logits of the planned batch: one graph replay when it fits a bucket, else eagerly."""
        model = self.model
        t0 = time.perf_counter()
        staged = False  # the batch's inputs already copied (a front pass staged them ahead of its onload)
        # HSTU_ONLOAD_IN_GRAPH: the event set the batch's replay waits on (taken before its onload starts)
        wait_set = None
        if plan.pad is not None and plan.onload_slots and self.graphs.waits_in_graph:
            wait_set = self.graphs.take_wait_set()
        if plan.front_tokens:  # host_split "compute_front": the prefixes' fronts first, beside their onloads
            staged = self._forward_front(requests, plan, wait_set)
        elif plan.pad is not None and plan.onload_slots and wait_set is None and self.graphs.onload_before_stage:
            # The onload's first copies before the inputs are built and staged: layer 0's pages land
            # while the host does that, where they used to start after it and hold the first layer
            # (run GB: a batch-1 split's first kernel 0.93 ms after a GPU-resident batch's). The
            # stage's kernel does not queue behind these copies. Run GF, same call: batch-1 splits
            # 0.06-0.11 ms faster, the planner's 1.30x against 1.24x; batch 8 unchanged.
            t = time.perf_counter()
            self.cache.wait(plan).start_onload(ahead=COPY_AHEAD)
            timing.onload_wait_s += time.perf_counter() - t
        if plan.pad is not None:  # written into the bucket's staging slot, after the metadata
            if not staged:
                model.static_inputs(requests, plan.layout, self.graphs.inputs_of(plan.pad))
        else:
            x = model.embed(requests, plan.cached_lens)
        t1 = time.perf_counter()
        prepared = self.cache.wait(plan)
        t2 = time.perf_counter()
        timing.inputs_s, timing.prepare_wait_s = t1 - t0 - timing.onload_wait_s, t2 - t1
        started = timing.onload_wait_s  # (an onload started early: before t2)

        def ready(layer: int) -> None:
            t0 = time.perf_counter()
            prepared.ready(layer)
            timing.onload_wait_s += time.perf_counter() - t0

        if plan.pad is not None:
            before_layer = ready if prepared.onload_users else None
            onload = None
            if before_layer is not None and wait_set is not None:
                # every layer's copies (and rebuilds) enqueued, each recording its layer's event of
                # the set, then one replay whose layers wait on the device
                def enqueue_all() -> None:
                    t0 = time.perf_counter()
                    prepared.handle.mirror = self.graphs.wait_events(wait_set)  # (a front pass set it already)
                    prepared.enqueue_onload()
                    timing.onload_wait_s += time.perf_counter() - t0

                onload, before_layer = enqueue_all, None
            logits = self.graphs.run(
                plan.pad, prepared.packed_metadata(), plan.layout.num_candidate_rows, before_layer, owned, staged=staged,
                onload=onload, wait_set=wait_set,
            )
            if logits is None:  # padded metadata only fits its graph bucket
                raise RuntimeError(f"no CUDA graph replayed the batch of {plan.layout.num_rows} rows padded for one")
            if plan.hidden_chunks:  # host_format "hidden": finish() gathers their rows before the next replay
                plan.layer_inputs = self.graphs.layer_inputs()
        else:
            if plan.hidden_chunks:  # host_format "hidden": finish() offloads their history rows' inputs
                plan.layer_inputs = []
            y = model.block.forward_paged(
                x, prepared.kv_pages, prepared.packed_metadata(), ready, self.layer_fns, layer_inputs=plan.layer_inputs
            )
            logits = model.logits(y, plan.layout)
        timing.forward_s = time.perf_counter() - t2 - (timing.onload_wait_s - started)
        return logits

    def _forward_front(self, requests: list[RankingRequest], plan, wait_set: int | None = None) -> bool:
        """host_split "compute_front": recompute tokens [0, q) of each front user (plan.front_tokens)
        into their first pages, in a pass of its own that reads no onloaded page, with the onload of
        the rest of their prefixes started once its first kernels are enqueued (its first layers
        before anything else when a kernel stages the inputs), so the copies run beside it; the
        batch's pass then waits for them layer by layer as usual. When the batch replays a graph
        bucket of its own, its inputs are staged here too (returns True): before everything when a
        copy engine stages them (copied behind the onload, they would hold its first layer until
        every copy had landed), after the front pass's launch when a kernel does."""
        model, ctx = self.model, self.config.num_contextual
        fronts = []
        for r in requests:
            q = plan.front_tokens.get(r.user_id)
            if q:
                events, odd = divmod(q - ctx, 2)
                if events < 0 or odd:
                    raise RuntimeError(f"user {r.user_id}: a front of {q} tokens does not end on an event")
                fronts.append(RankingRequest(
                    r.user_id, r.item_ids[:events], r.actions[:events], r.timestamps[:events], _NO_CANDIDATES, r.contextual
                ))
        prepared = self.cache.wait(plan)
        if wait_set is not None:  # the main pass's waits inside its graph: the onload starts below
            prepared.handle.mirror = self.graphs.wait_events(wait_set)
        own_bucket = plan.pad is not None and (plan.front_pad is None or plan.front_pad.rows != plan.pad.rows)
        staged = False
        if plan.front_pad is not None and self.graphs.onload_before_stage:
            # Kernel stages: the first layers' copies now, ahead of every input of both passes, and the
            # rest once the front pass is launched (all of them now held its launch by their enqueue,
            # ~0.15 ms a layer at batch 8). On an H100 (run GG) batch 8's copies began 0.86 ms after
            # its first kernel, when the front replay's launch started them.
            prepared.start_onload(ahead=COPY_AHEAD)
            start_onload = prepared.enqueue_onload
        else:
            # The copies wait for the work before the front pass, not for it: it writes other pages.
            before_front = None
            if model.device.type == "cuda":
                before_front = torch.cuda.Event()
                before_front.record()

            def start_onload() -> None:
                prepared.start_onload(after=before_front)

        # A kernel stages the batch's own bucket too, on the compute stream, where it runs after the
        # front pass whenever it is enqueued: enqueued after the front's launch, its host work
        # (its rows' features and stage, ~0.08 ms at batch 8 on the dev CPU) no longer holds that launch.
        # A copy engine's stage goes first, ahead of the copies it would otherwise queue behind.
        def stage_batch() -> bool:
            model.static_inputs(requests, plan.layout, self.graphs.inputs_of(plan.pad))
            return self.graphs.stage(plan.pad, prepared.packed_metadata())

        stage_first = own_bucket and not (plan.front_pad is not None and self.graphs.onload_before_stage)
        if stage_first:
            staged = stage_batch()

        if plan.front_pad is not None:
            model.static_inputs(fronts, plan.front_layout, self.graphs.inputs_of(plan.front_pad))
            done = self.graphs.run(plan.front_pad, prepared.front_metadata, 0, copy=False, after_launch=start_onload)
            if done is None:
                raise RuntimeError(f"no CUDA graph replayed the front pass of {plan.front_layout.num_rows} rows padded for one")
            if own_bucket and not stage_first:
                staged = stage_batch()
        else:
            x = model.embed(fronts, [0] * len(fronts))

            def launched(layer: int) -> None:  # the onload starts once the first layer is enqueued
                if layer == 1:
                    start_onload()

            model.block.forward_paged(x, prepared.kv_pages, prepared.front_metadata, launched, self.layer_fns)
            start_onload()  # (one layer: not started yet; else a no-op)
        return staged

    def _split(self, requests: list[RankingRequest], logits: torch.Tensor, cached: list[int]) -> list[RankOutput]:
        parts = torch.split(logits, [r.candidates.shape[0] for r in requests])
        return [
            RankOutput(r.user_id, p, c, r.history_tokens(self.config) - c + r.candidates.shape[0], self.task_names)
            for r, p, c in zip(requests, parts, cached)
        ]

