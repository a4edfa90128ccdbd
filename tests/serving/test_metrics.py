"""serving/metrics.py: scrape-time collectors."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from hstu.serving.metrics import ServingMetrics


def test_graph_replays_are_counted_by_who_launched_them():
    """Whole forwards launched from the GPU or, where that is off, refused or stopped by a
    profiler, from the host: an operator reads which from /metrics."""
    engine = SimpleNamespace(graphs=SimpleNamespace(replays=12, device_launches=9))
    metrics = ServingMetrics(max_batch_size=8)
    metrics.watch_graphs(lambda: engine)
    text = generate_latest(metrics.registry).decode()
    assert 'hstu_graph_replays_total{launch="device"} 9.0' in text
    assert 'hstu_graph_replays_total{launch="host"} 3.0' in text


def test_no_graph_samples_before_the_engine_loads_or_without_graphs():
    metrics = ServingMetrics(max_batch_size=8)
    engines = iter([None, SimpleNamespace(graphs=None)])
    metrics.watch_graphs(lambda: next(engines))
    for _ in range(2):
        assert "hstu_graph_replays" not in generate_latest(metrics.registry).decode()
