"""Prometheus metrics of one app, in the app's own CollectorRegistry (several apps never collide).

Serving metrics are updated where they happen (request handler, batcher). Cache metrics are read
from the manager's CacheStats at scrape time by CacheCollector, so they never drift from the
manager's own counters:
  hstu_cache_lookups_total{result=gpu_hit|host_hit|miss}    hstu_cache_hit_rate{tier=gpu|host|any}
  hstu_cache_bytes_total{direction=onload|offload}          hstu_cache_evictions_total{tier=gpu|host}
  hstu_cache_invalidations_total{reason=shorter|diverged}
  hstu_cache_recomputes_total  hstu_cache_offload_skipped_total  hstu_cache_shorter_reused_total
  hstu_cache_diverged_after_launch_total
  hstu_cache_failures_total{stage=onload|offload}           hstu_cache_tokens_total{kind=cached|computed}
  hstu_cache_gpu_free_pages  hstu_cache_host_free_slots
Incremental requests (serving/incremental.py) are counted where they are rebuilt; the history
store's occupancy is read at scrape time by HistoryStoreCollector:
  hstu_incremental_requests_total{result}  hstu_history_incomplete_total{reason}
  hstu_incremental_events_total{source=stored|sent}
  hstu_history_store_bytes  hstu_history_store_users  hstu_history_store_evictions_total
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

INCREMENTAL_RESULTS = ("hit", "history_incomplete")
INCOMPLETE_REASONS = ("disabled", "unknown_user", "shorter", "mismatch", "contextual")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Phases of a request or batch (queue waits, pipes, launches): most take well under a millisecond, so
# the finer edges tell a typical request's wait from a tail's (loadgen reads quantiles off them).
_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075) + _LATENCY_BUCKETS[:3] + (0.0075,) + _LATENCY_BUCKETS[3:]


def _batch_buckets(max_batch_size: int) -> tuple[float, ...]:
    buckets, b = [], 1
    while b < max_batch_size:
        buckets.append(float(b))
        b *= 2
    buckets.append(float(max_batch_size))
    return tuple(buckets)


# (metric, help, label, [(label value, stats key)]): cache counters exported with one label each.
_LABELLED_COUNTERS = (
    ("hstu_cache_lookups", "Lookups by result, one per user per batch", "result",
     (("gpu_hit", "gpu_hits"), ("host_hit", "host_hits"), ("miss", "misses"))),
    ("hstu_cache_bytes", "Bytes copied between the tiers", "direction",
     (("onload", "bytes_onloaded"), ("offload", "bytes_offloaded"))),
    ("hstu_cache_evictions", "Users evicted from a tier", "tier", (("gpu", "gpu_evictions"), ("host", "host_evictions"))),
    ("hstu_cache_failures", "Failed host<->GPU copies (fail-open)", "stage",
     (("onload", "onload_failures"), ("offload", "offload_failures"))),
    ("hstu_cache_invalidations", "Cache entries dropped because the request's history was shorter or differed",
     "reason", (("shorter", "invalidated_shorter"), ("diverged", "invalidated_diverged"))),
    ("hstu_cache_tokens", "Tokens reused, computed, onloaded or recomputed from host-tier prefixes", "kind",
     (("cached", "cached_tokens"), ("computed", "computed_tokens"), ("candidates", "candidate_tokens"),
      ("onloaded", "tokens_onloaded"), ("recomputed_from_host", "tokens_recomputed"))),
    ("hstu_cache_offload_rejected", "Offloads not admitted to the host tier (users seen too rarely)", "unit",
     (("users", "offload_rejected_users"), ("bytes", "offload_rejected_bytes"))),
    ("hstu_planner_plans", "Host-tier batches by the planner's plan (after the measured feedback), and the plans "
     "that feedback overrode", "kind", (("split", "plans_split"), ("front", "plans_front"), ("onload", "plans_onload"),
                                       ("recompute", "plans_recompute"), ("overridden", "plans_overridden"))),
    ("hstu_cache_prefetch", "Prefetches started and later found on the GPU", "result",
     (("started", "prefetches"), ("hit", "prefetch_hits"))),
    ("hstu_cache_hidden_chunks", "Host chunks moved as layer inputs (host_format hidden; K/V rebuilt on onload)",
     "direction", (("onload", "hidden_chunks_onloaded"), ("offload", "hidden_chunks_offloaded"))),
)
# (metric, help, stats key): cache counters exported without a label.
_COUNTERS = (
    ("hstu_cache_recomputes", "Users recomputed after a failed onload", "recomputes"),
    ("hstu_cache_offload_skipped", "Offloads skipped (host tier full of pinned users)", "offload_skipped"),
    ("hstu_cache_shorter_reused", "Shorter histories ranked read-only from the cached prefix of a longer one",
     "shorter_reused"),
    ("hstu_cache_diverged_after_launch", "Diverged histories found after their batch's launch (ranked again, from "
     "scratch)", "diverged_after_launch"),
)


def cache_counter_samples() -> dict[tuple[str, str | None], str]:
    """(Prometheus sample name, label value or None) -> CacheStats key, for every cache counter this
    module exports: how a /metrics reader (hstu replay --server) maps samples back to the stats."""
    samples: dict[tuple[str, str | None], str] = {}
    for name, _, _, values in _LABELLED_COUNTERS:
        samples.update({(f"{name}_total", value): key for value, key in values})
    samples.update({(f"{name}_total", None): key for name, _, key in _COUNTERS})
    return samples


class ServingMetrics:
    """The server's metrics; `registry` is what /metrics exposes."""

    def __init__(self, max_batch_size: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_latency = Histogram(
            "hstu_request_latency_seconds",
            "POST /v1/rank time from arrival to the response, by HTTP status",
            ["status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter("hstu_errors", "Failed ranking requests by error kind", ["kind"], registry=r)
        self.batch_size = Histogram(
            "hstu_batch_size",
            "Requests per batch formed by the batcher",
            buckets=_batch_buckets(max_batch_size),
            registry=r,
        )
        self.batch_latency = Histogram(
            "hstu_batch_latency_seconds",
            "Time of one batch from its start on the model thread to its outputs on the host (including "
            "splits and retries; launched batches overlap, so the sum may pass the wall time)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_phase = Histogram(
            "hstu_batch_phase_seconds",
            "Time of one batch in each phase: handoff (formed until the model thread starts it), launch "
            "(the model thread's work), outputs (launched until its outputs are on the host: the GPU), "
            "deliver (until the event loop answers it)",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.forward_phase = Histogram(
            "hstu_forward_phase_seconds",
            "Host time of one batch's cached forward on the model thread, by phase (engine ForwardTiming): "
            "plan (lookup, joins of in-flight offloads, layout), inputs (request features), prepare_wait, "
            "onload_wait, forward (graph replay or launches), finish (commit, offload start, outputs split)",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "hstu_queue_wait_seconds",
            "Time a request waited in the batcher before its batch started",
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.phase = Histogram(
            "hstu_request_phase_seconds",
            "Time of an answered POST /v1/rank in each phase: read_parse (body read, parsed, digested), "
            "rank (handed to the runtime until its answer), respond (the body encoded); with the engine "
            "process also pipe_to_engine (sent until the engine's loop takes it, reported by the engine) "
            "and pipe_from_engine (answered until the front end's loop takes it)",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.batch_splits = Counter(
            "hstu_batch_splits", "Batches split in two because they needed more KV pages than were free", registry=r
        )
        self.dropped = Counter(
            "hstu_requests_dropped",
            "Queued requests dropped before the model thread: abandoned (the caller stopped waiting), "
            "timeout (deadline passed), overloaded (queued longer than max_queue_wait)",
            ["reason"],
            registry=r,
        )
        self.queue_depth = Gauge("hstu_queue_depth", "Requests queued or running in the batcher", registry=r)
        self.ready = Gauge("hstu_ready", "1 once the model is loaded and warmed up", registry=r)
        self.incremental = Counter(
            "hstu_incremental_requests",
            "Incremental rank requests (prefix_length + prefix_digest): prefix held (hit) or 412 history_incomplete",
            ["result"],
            registry=r,
        )
        self.history_incomplete = Counter(
            "hstu_history_incomplete",
            "Incremental requests answered 412 history_incomplete, by why the prefix was not held",
            ["reason"],
            registry=r,
        )
        self.incremental_events = Counter(
            "hstu_incremental_events",
            "History events of incremental requests that were held: taken from the store (not resent) or sent",
            ["source"],
            registry=r,
        )
        for labels, counter in ((INCREMENTAL_RESULTS, self.incremental), (INCOMPLETE_REASONS, self.history_incomplete),
                                (("stored", "sent"), self.incremental_events)):
            for label in labels:
                counter.labels(label)

    def watch_cache(self, manager_fn: Callable[[], object | None]) -> None:
        """Expose the cache metrics of whatever manager `manager_fn` returns (None: not loaded yet)."""
        self.registry.register(CacheCollector(manager_fn))

    def watch_graphs(self, engine_fn: Callable[[], object | None]) -> None:
        """Expose the CUDA-graph replays of whatever engine `engine_fn` returns (None, or an engine
        without graphs: nothing), by who launched them."""
        self.registry.register(GraphsCollector(engine_fn))

    def watch_history_store(self, store) -> None:
        """Expose the occupancy and evictions of a serving/history_store.HistoryStore."""
        self.registry.register(HistoryStoreCollector(store))


class _ScrapeTimeCollector(Collector):
    """A collector whose samples are read when /metrics is scraped (nothing to describe up front)."""

    def describe(self) -> list[Metric]:
        return []


class HistoryStoreCollector(_ScrapeTimeCollector):
    """Reads a HistoryStore's bytes, users and evictions at scrape time."""

    def __init__(self, store) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        s = self._store
        yield GaugeMetricFamily("hstu_history_store_bytes", "Bytes of the histories kept for incremental requests", value=s.nbytes)
        yield GaugeMetricFamily("hstu_history_store_users", "Users whose history is kept", value=len(s))
        yield CounterMetricFamily("hstu_history_store_evictions", "Users' histories evicted to make room", value=s.evictions)


class GraphsCollector(_ScrapeTimeCollector):
    """Reads an engine's graph replay counts at scrape time. Why: whole forwards are launched from
    the GPU unless that is off, refused or stopped (a profiler ran in the process: every later
    launch goes through the host), and an operator sees which here."""

    def __init__(self, engine_fn: Callable[[], object | None]) -> None:
        self._engine_fn = engine_fn

    def collect(self) -> Iterator[Metric]:
        graphs = getattr(self._engine_fn(), "graphs", None)
        if graphs is None:
            return
        m = CounterMetricFamily("hstu_graph_replays", "CUDA-graph forwards (whole or in layer segments), by who "
                                "launched them: the GPU (engine/device_launch.py) or the host", labels=["launch"])
        m.add_metric(["device"], graphs.device_launches)
        m.add_metric(["host"], graphs.replays - graphs.device_launches)
        yield m


class CacheCollector(_ScrapeTimeCollector):
    """Reads AsyncKVCacheManager.stats and pool occupancy at scrape time."""

    def __init__(self, manager_fn: Callable[[], object | None]) -> None:
        self._manager_fn = manager_fn

    def collect(self) -> Iterator[Metric]:
        manager = self._manager_fn()
        if manager is None:
            return
        s = manager.stats.snapshot()
        lookups = s["gpu_hits"] + s["host_hits"] + s["misses"]

        m = GaugeMetricFamily("hstu_cache_hit_rate", "Fraction of lookups hit in a tier", labels=["tier"])
        for tier, hits in (("gpu", s["gpu_hits"]), ("host", s["host_hits"]), ("any", s["gpu_hits"] + s["host_hits"])):
            m.add_metric([tier], hits / lookups if lookups else 0.0)
        yield m

        for name, doc, label, values in _LABELLED_COUNTERS:
            m = CounterMetricFamily(name, doc, labels=[label])
            for value, key in values:
                m.add_metric([value], s[key])
            yield m

        for name, doc, key in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=s[key])
        cost = manager.cost_model
        if cost is not None:
            m = GaugeMetricFamily("hstu_planner_cost", "Compute-or-load planner cost model (measured or set)", labels=["input"])
            for key, value in cost.as_dict().items():
                m.add_metric([key], float(value))
            yield m
            m = GaugeMetricFamily("hstu_planner_feedback", "Measured / predicted layer time of host-tier plans, by kind "
                                  "of plan and batch size (moving average; 1 until measured)", labels=["kind", "users"])
            for key, value in manager.plan_feedback.as_dict().items():
                kind, users = key.split("@")
                m.add_metric([kind, users], value["factor"])
            yield m
        occupancy = manager.occupancy()
        free_pages, free_slots = occupancy["gpu_free_pages"], occupancy["host_free_slots"]
        yield GaugeMetricFamily("hstu_cache_gpu_free_pages", "Free pages in the GPU page pool", value=free_pages)
        yield GaugeMetricFamily("hstu_cache_host_free_slots", "Free chunk slots in the host arena", value=free_slots)


class _Families:
    """A collector of already-built metric families (what generate_latest reads)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


REPLICA_LABEL = "replica"
"""The label merged_exposition adds to each replica's samples (a /metrics reader sums over it)."""


def merged_exposition(own: CollectorRegistry, replicas: dict[str, str]) -> bytes:
    """One Prometheus text: `own`'s families, plus each replica's samples labelled replica=<name>
    (families of the same name merged, so every family is declared once)."""
    families: dict[str, Metric] = {m.name: m for m in own.collect()}
    for name, text in replicas.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            merged.samples.extend(s._replace(labels={**s.labels, REPLICA_LABEL: name}) for s in family.samples)
    return generate_latest(_Families(families.values()))
