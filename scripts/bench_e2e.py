"""End-to-end section of `hstu bench`: the cached and uncached engines (same seeded weights) and
the timed uncached / cached_gpu / cached_host (/ cached_host_planned) / cached_rerank forwards,
taking turns (one of each a round, so the machine's drift over the section falls on each alike),
with their self-checks; and the split sweep (its forwards taking turns likewise)."""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from hstu.engine import ForwardTiming, RankingEngine, RankOutput
from hstu.engine.engine import default_graph_buckets
from hstu.model.batch import RankingRequest
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from hstu.ops.kvcache.host_tier import prefilled_host_user
from hstu.ops.kvcache.planner import FixedSplit, choose_split, predict, predict_front
from hstu.scripts.bench_shapes import BenchShape, make_requests
from hstu.scripts.compare import compare_logits
from hstu.scripts.forward_trace import traced_call
from hstu.scripts.timing import TimedRun, Timer, summarize
from hstu.scripts.workload import FreshUserIds, as_users


_PHASES = ForwardTiming.field_names()


class PhaseProbe:
    """The model thread's host time per phase in each timed forward, from the engine's own
    per-forward timings: the prepare join and per-layer onload waits (the time blocked on the
    cache), and plan / inputs / forward (launch) / finish / total. Why the phases: beside the
    event-timed median they say how much of a forward is host work before the GPU starts. On
    CUDA an onload wait blocks only until a layer's copies are enqueued, so the device-side wait
    shows in the cached_host - cached_gpu difference instead."""

    def __init__(self, engine: RankingEngine) -> None:
        self.engine = engine
        self.entries: list[dict[str, float]] = []

    def timed(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            out = fn()
            last = self.engine.timings[-1]
            self.entries.append({p: getattr(last, p) for p in _PHASES})
            return out

        return run

    def per_forward_ms(self, last: int) -> dict[str, Any]:
        """Medians over the last `last` recorded calls (the timed repeats, after the warm-ups)."""
        entries = self.entries[-last:]
        median = lambda p: statistics.median(e[p] for e in entries) * 1e3  # noqa: E731
        return {
            "prepare_wait_ms": median("prepare_wait_s"),
            "onload_wait_ms": median("onload_wait_s"),
            "host_phases_ms": {p.removesuffix("_s"): median(p) for p in _PHASES},
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
        trace: bool = False,
    ) -> None:
        self.shape = shape
        self.device = device
        self.trace = trace  # one more forward of each pass under the profiler, after the timed ones
        self.model_config = shape.model_config()
        self.cached_mgr = AsyncKVCacheManager(shape.cache_config(self.model_config, host_batches=3), device)
        # HostStorage needs at least one slot; one chunk keeps the uncached pass's offloads negligible.
        self.uncached_mgr = AsyncKVCacheManager(shape.cache_config(self.model_config, host_batches=0), device)
        self.cached = RankingEngine(InferenceRankingGR(self.model_config, device), self.cached_mgr)
        self.uncached = RankingEngine(InferenceRankingGR(self.model_config, device), self.uncached_mgr)
        self.ids = FreshUserIds()
        self.cuda_graphs = cuda_graphs
        if cuda_graphs:
            # The serving buckets, plus one per measured row count: cached (new + candidates) and
            # full (history + candidates) rows.
            rows = {b * (shape.new_tokens + shape.num_candidates) for b in shape.batch_sizes}
            rows |= {b * (shape.history_tokens + shape.num_candidates) for b in shape.batch_sizes}
            rows |= set(default_graph_buckets(host_split=shape.host_split))
            for model in (self.cached, self.uncached):
                model.enable_cuda_graphs(
                    max_batch=max(shape.batch_sizes), buckets=tuple(sorted(rows)), compile=compile_layers
                )
        # The planner's cost model, measured once here through the forward it will plan for (graphs
        # included; None: planner off, or unmeasurable).
        self.cost = self.cached.calibrate() if planner else None
        self.cached_mgr.cost_model = None

    def _replays(self, model: RankingEngine) -> tuple[int, int]:
        """(graph replays, of which launched from the device) so far."""
        g = model.graphs
        return (g.replays, g.device_launches) if g is not None else (0, 0)

    def close(self) -> None:
        self.cached_mgr.close()
        self.uncached_mgr.close()

    # Untimed setups of a timed forward; each leaves the requests to rank in state["requests"].
    def fresh_full(self, full: list[RankingRequest], state: dict[str, Any]) -> Callable[[], None]:
        """The full requests under never-seen users (every lookup misses)."""

        def setup() -> None:
            state["requests"] = as_users(full, self.ids.take(len(full)))
            self.uncached_mgr.drain()

        return setup

    def prefilled(
        self, first: list[RankingRequest], full: list[RankingRequest], state: dict[str, Any], drop_gpu: bool
    ) -> Callable[[], None]:
        """New users ranked with `first` (their earlier requests), then the full requests; drop_gpu
        leaves the cached prefixes in the host tier only. state["before"]: the counters then."""

        def setup() -> None:
            ids = self.ids.take(len(full))
            self.cached.rank(as_users(first, ids))
            self.cached_mgr.drain()
            if drop_gpu:
                self.cached_mgr.evict_gpu(ids)
            state["requests"] = as_users(full, ids)
            state["before"] = self.cached_mgr.stats.snapshot()

        return setup

    @staticmethod
    def ranking(model: RankingEngine, state: dict[str, Any]) -> Callable[[], list[RankOutput]]:
        return lambda: model.rank(state["requests"])

    def with_cost(self, fn: Callable[[], Any], cost: Any) -> Callable[[], Any]:
        """fn with the cached manager's planner set to `cost` during the call only (the forwards
        around it, timed in turn, keep theirs: None)."""
        mgr = self.cached_mgr

        def call() -> Any:
            mgr.cost_model = cost
            try:
                return fn()
            finally:
                mgr.cost_model = None

        return call

    def run(self, batch: int, timer: Timer, warmup: int, repeats: int) -> dict[str, Any]:
        """The uncached, cached_gpu, cached_host (and cached_host_planned, with the planner) and
        cached_rerank forwards of one batch size, timed taking turns (Timer.measure_interleaved),
        each with its own users and state."""
        shape, mgr = self.shape, self.cached_mgr
        prefix, full = make_requests(shape, self.model_config, batch)
        out: dict[str, Any] = {}
        failures: list[str] = []
        dtype = self.model_config.dtype

        def prefilled_whole(state: dict[str, Any]) -> Callable[[], None]:
            def setup() -> None:  # the whole history cached: the re-rank computes candidates only
                ids = self.ids.take(len(full))
                self.cached.rank(as_users(full, ids))
                mgr.drain()
                state["requests"] = as_users(full, ids)
                state["before"] = mgr.stats.snapshot()

            return setup

        # (name, engine, setup of a state, host tier in the timed forward, cost model during it)
        passes: list[tuple[str, RankingEngine, Callable, str | None, Any]] = [
            ("uncached", self.uncached, lambda st: self.fresh_full(full, st), None, None),
            ("cached_gpu", self.cached, lambda st: self.prefilled(prefix, full, st, False), "gpu_hits", None),
            ("cached_host", self.cached, lambda st: self.prefilled(prefix, full, st, True), "host_hits", None),
        ]
        if self.cost is not None:  # the host tier again, the planner choosing onload vs recompute
            passes.append(("cached_host_planned", self.cached, lambda st: self.prefilled(prefix, full, st, True),
                           "host_hits", self.cost))
        passes.append(("cached_rerank", self.cached, prefilled_whole, None, None))

        states = {name: {"replays": 0, "device_launches": 0} for name, *_ in passes}
        probes = {name: PhaseProbe(model) for name, model, *_ in passes}

        def timed(name: str, model: RankingEngine, cost: Any) -> Callable[[], list[RankOutput]]:
            state, rank = states[name], self.ranking(model, states[name])
            fn = self.with_cost(probes[name].timed(rank), cost)

            def call() -> list[RankOutput]:
                replays, launches = self._replays(model)
                try:
                    return fn()
                finally:
                    now = self._replays(model)
                    state["replays"] += now[0] - replays
                    state["device_launches"] += now[1] - launches

            return call

        def after(name: str, model: RankingEngine) -> Callable[[], None]:
            def read() -> None:  # the cache's counters of this forward, its offloads settled
                if model is self.cached:
                    mgr.drain()
                    states[name]["delta"] = {k: v - states[name]["before"][k] for k, v in mgr.stats.snapshot().items()}

            return read

        runs = [TimedRun(timed(name, model, cost), setup(states[name]), after(name, model))
                for name, model, setup, _, cost in passes]
        measured = dict(zip((p[0] for p in passes), timer.measure_interleaved(runs, warmup, repeats)))
        for name, _, _, _, _ in passes:
            if self.cuda_graphs and states[name]["replays"] < repeats:
                failures.append(f"e2e/{name}: CUDA graphs enabled but only {states[name]['replays']} graph replays "
                                f"in {warmup + repeats} forwards")
        times, uncached_out = measured["uncached"]
        failures += _check_outputs("e2e/uncached", uncached_out, 0, batch)
        out["uncached"] = {**summarize(times), "cuda_graph_replays": states["uncached"]["replays"],
                           "device_launches": states["uncached"]["device_launches"],
                           "host_phases_ms": probes["uncached"].per_forward_ms(repeats)["host_phases_ms"]}
        reference = [o.logits for o in uncached_out]
        for name, _, _, tier, cost in passes[1:-1]:
            times, cached_out = measured[name]
            delta = states[name]["delta"]
            if cost is None:  # the planner may reuse less than the whole cached prefix
                failures += _check_outputs(f"e2e/{name}", cached_out, shape.cached_tokens, batch)
            if delta[tier] != batch:
                failures.append(f"e2e/{name}: expected {batch} {tier} in the last timed forward, stats delta {delta}")
            out[name] = {
                **summarize(times),
                **probes[name].per_forward_ms(repeats),
                "cuda_graph_replays": states[name]["replays"],
                "device_launches": states[name]["device_launches"],
                "bytes_onloaded_per_forward": delta["bytes_onloaded"],
                "onloaded_tokens_per_forward": delta["tokens_onloaded"],
                "recomputed_tokens_per_forward": delta["tokens_recomputed"],
                "max_abs_diff_vs_uncached": _compare(f"e2e/{name} vs uncached", cached_out, reference, dtype, failures),
            }
            if cost is not None:  # what the planner's plans measured against their predictions (plan_feedback.py)
                out[name]["planner_feedback"] = mgr.plan_feedback.as_dict()
                out[name]["plans_overridden"] = delta["plans_overridden"]
        times, rerank_out = measured["cached_rerank"]
        failures += _check_outputs("e2e/cached_rerank", rerank_out, shape.history_tokens, batch)
        out["cached_rerank"] = {
            **summarize(times),
            "host_phases_ms": probes["cached_rerank"].per_forward_ms(repeats)["host_phases_ms"],
            "device_launches": states["cached_rerank"]["device_launches"],
            "max_abs_diff_vs_uncached": _compare("e2e/cached_rerank vs uncached", rerank_out, reference, dtype, failures),
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
        if self.trace:  # after the checks: its setup and after() replace the states they read
            for (name, *_), run in zip(passes, runs):
                run.setup()
                timer.sync()
                _, out[name]["trace"] = traced_call(run.fn, self.device)
                run.after()
        out["check_failures"] = failures
        return out


SPLIT_FRACTIONS = (0.0, 0.25, 0.5, 0.625, 0.75, 1.0)


def split_sweep(
    e2e: EndToEnd, batch: int, timer: Timer, warmup: int, repeats: int, fractions: tuple[float, ...] = SPLIT_FRACTIONS
) -> dict[str, Any]:
    """Compute or load, measured: the host-tier batch (every user's cached prefix evicted to the
    host) ranked with a fixed share f of each prefix onloaded and the rest recomputed, for each f
    in `fractions`; beside it the same batch with those f prefix tokens already on the GPU
    (the split's compute alone, no onload), the uncached batch, and what the cost model predicts
    for each split, all timed taking turns. Where the measured curve has its minimum is what the
    planner should pick."""
    shape, mgr = e2e.shape, e2e.cached_mgr
    prefix, full = make_requests(shape, e2e.model_config, batch)
    chunk, cached = shape.chunk_tokens, shape.cached_tokens
    failures: list[str] = []

    def prefilled(tokens: int, drop_gpu: bool, state: dict[str, Any]) -> Callable[[], None]:
        """Users whose first `tokens` history tokens (contextual ones included) are cached."""
        first = prefix
        if tokens < cached:
            first = [r.first_events((tokens - shape.num_contextual) // 2, e2e.model_config) for r in prefix]
        return e2e.prefilled(first, full, state, drop_gpu)

    users = [prefilled_host_user(mgr.config, cached, shape.history_tokens, shape.num_candidates)] * batch
    L = e2e.model_config.num_layers
    front = mgr.config.host_split == "compute_front"  # the sweep's order ("auto" sweeps load_front's)
    onloads = {f: FixedSplit(f).choose(users, L, chunk).onload_tokens for f in fractions}
    # (name, engine, setup, cost model during the timed forward), timed taking turns
    runs: list[tuple[str, RankingEngine, Callable[[dict], Callable[[], None]], Any]] = [
        ("uncached", e2e.uncached, lambda st: e2e.fresh_full(full, st), None)
    ]
    for f in fractions:
        runs.append((f"host {f}", e2e.cached, lambda st: prefilled(cached, True, st), FixedSplit(f)))
        if 0 < onloads[f][0] < cached:  # the split's compute with its onloaded share already on the GPU
            runs.append((f"gpu {f}", e2e.cached, lambda st, t=onloads[f][0]: prefilled(t, False, st), None))
    states = {name: {} for name, *_ in runs}
    measured = dict(zip(
        (name for name, *_ in runs),
        timer.measure_interleaved(
            [TimedRun(e2e.with_cost(e2e.ranking(model, states[name]), cost), setup(states[name]), mgr.drain)
             for name, model, setup, cost in runs],
            warmup, repeats,
        ),
    ))
    times, reference = measured["uncached"]
    uncached_ms = summarize(times)["median_ms"]
    out: dict[str, Any] = {"uncached_ms": uncached_ms, "splits": []}
    for f in fractions:
        onload = onloads[f]
        row: dict[str, Any] = {"fraction": f, "onload_tokens_per_user": onload[0]}
        times, outputs = measured[f"host {f}"]
        row["host_tier_ms"] = summarize(times)["median_ms"]
        row["host_tier_vs_uncached"] = uncached_ms / row["host_tier_ms"]
        _compare(f"split {f} vs uncached", outputs, [o.logits for o in reference], e2e.model_config.dtype, failures)
        if f"gpu {f}" in measured:
            row["gpu_prefix_ms"] = summarize(measured[f"gpu {f}"][0])["median_ms"]
        if e2e.cost is not None:
            buckets = e2e.cached.graph_buckets
            predicted = (
                predict_front(users, onload, e2e.cost, L, chunk, buckets) if front  # predict at either end
                else predict(users, onload, e2e.cost, L, buckets, chunk)
            )
            row["predicted_ms"], row["predicted_onload_ms"], row["predicted_compute_ms"] = (t * 1e3 for t in predicted)
        out["splits"].append(row)
    if e2e.cost is not None:
        chosen, chosen_front = choose_split(e2e.cost, users, L, chunk, e2e.cached.graph_buckets, mgr.config.host_split)
        out["planner_onload_tokens_per_user"] = chosen.onload_tokens[0]
        out["planner_order"] = "compute_front" if chosen_front else "load_front"
        out["planner_predicted_ms"] = chosen.predicted_s * 1e3
        out["cost_model"] = e2e.cost.as_dict()
    best = min(out["splits"], key=lambda r: r["host_tier_ms"])
    out["best_fraction"], out["best_vs_uncached"] = best["fraction"], best["host_tier_vs_uncached"]
    out["check_failures"] = failures
    return out
