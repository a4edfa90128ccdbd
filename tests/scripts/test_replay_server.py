"""The replay reads the server's cache counters through serving/metrics.py's own table."""

from __future__ import annotations

import pytest

from hstu.ops.kvcache.stats import CacheStats
from hstu.scripts.replay_server import parse_server_metrics, server_metric_keys

metrics = pytest.importorskip("hstu.serving.metrics", reason="hstu.serving is not importable")


class _Manager:
    cost_model = None  # the planner is off

    def __init__(self, stats: CacheStats) -> None:
        self.stats = stats

    def occupancy(self) -> dict[str, int]:
        return {"gpu_free_pages": 3, "host_free_slots": 4}


def test_every_cache_counter_the_server_exports_is_read_back():
    from prometheus_client import generate_latest

    stats = CacheStats()
    values = {name: i + 1 for i, name in enumerate(stats.snapshot()) if name != "invalidations"}
    stats.add(**values, invalidations=values["invalidated_shorter"] + values["invalidated_diverged"])
    served = metrics.ServingMetrics(max_batch_size=4)
    served.watch_cache(lambda: _Manager(stats))
    served.batch_size.observe(3)
    parsed = parse_server_metrics(generate_latest(served.registry).decode())
    expected = {k: v for k, v in stats.snapshot().items() if not k.startswith("invalidated_")}
    assert parsed == {**expected, "batches": 1, "batched_requests": 3}


def test_the_counters_of_a_server_with_replicas_are_summed_over_its_replicas():
    """`--engine-process` and Ray Serve expose each replica's samples with a replica label, after
    the front end's own (which has no cache): the replay reads the same counters, summed."""
    from prometheus_client import generate_latest

    texts = {}
    for name, hits in (("a", 2), ("b", 5)):
        stats = CacheStats()
        stats.add(gpu_hits=hits, misses=1)
        served = metrics.ServingMetrics(max_batch_size=4)
        served.watch_cache(lambda stats=stats: _Manager(stats))
        served.batch_size.observe(hits)
        texts[name] = generate_latest(served.registry).decode()
    front = metrics.ServingMetrics(max_batch_size=4)
    parsed = parse_server_metrics(metrics.merged_exposition(front.registry, texts).decode())
    assert parsed["gpu_hits"] == 7 and parsed["misses"] == 2
    assert parsed["batches"] == 2 and parsed["batched_requests"] == 7


def test_the_metric_names_come_from_the_serving_table():
    keys = server_metric_keys()
    for sample, key in metrics.cache_counter_samples().items():
        assert keys[sample] == ("invalidations" if key.startswith("invalidated_") else key)
