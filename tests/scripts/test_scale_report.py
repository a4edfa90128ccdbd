"""scale_report reads two gpu_rest.sh runs: per-replica hit rates and the router's affinity share
from metrics merged as the Ray ingress merges them, and the scaling ratio from the sent loads."""

import json
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from hstu.scripts.scale_report import main, scale_report, server_figures
from hstu.serving.metrics import CacheCollector, merged_exposition
from hstu.serving.router_stats import RouterCollector, RouterStats


class _Stats:
    def __init__(self, **counts) -> None:
        self._counts = counts

    def snapshot(self) -> dict:
        return self._counts


def _replica_text(gpu_hits: int, host_hits: int, misses: int) -> str:
    """A ranking replica's /metrics as its CacheCollector writes it."""
    from hstu.ops.kvcache.stats import CacheStats

    counts = {k: 0 for k in CacheStats().snapshot()}
    counts.update(gpu_hits=gpu_hits, host_hits=host_hits, misses=misses)
    registry = CollectorRegistry()
    manager = SimpleNamespace(
        stats=_Stats(**counts), cost_model=None, occupancy=lambda: {"gpu_free_pages": 0, "host_free_slots": 0}
    )
    registry.register(CacheCollector(lambda: manager))
    return generate_latest(registry).decode()


def _ingress_text(replicas: dict[str, tuple[int, int, int]], affinity: int, fallback: int) -> str:
    """The ingress's /metrics: its router's decisions, then every replica's samples labelled."""
    stats = RouterStats()
    for u in range(affinity):
        stats.routed(u, "a", "affinity")
    for u in range(fallback):
        stats.routed(10_000 + u, "b", "next_on_ring")
    own = CollectorRegistry()
    own.register(RouterCollector(stats))
    return merged_exposition(own, {name: _replica_text(*c) for name, c in replicas.items()}).decode()


def _run(tmp_path, name: str, rate: float, metrics: str, mismatches: int = 0):
    run = tmp_path / name
    (run / "loadgen_sent").mkdir(parents=True)
    (run / "loadgen_sent" / "loadgen.json").write_text(json.dumps({
        "offered_rate": 6000.0, "achieved_rate": rate, "latency_p50_ms": 40.0, "latency_p99_ms": 90.0,
        "mean_batch_size": 3.5, "statuses": {"200": 2000}, "verified": 2000, "verify_mismatches": mismatches,
    }))
    (run / "metrics_end.txt").write_text(metrics)
    return run


def test_hit_rates_per_replica_and_the_affinity_share_come_from_the_merged_metrics():
    text = _ingress_text({"rank#a": (60, 10, 30), "rank#b": (45, 0, 5)}, affinity=90, fallback=10)
    rates, decisions = server_figures(text)
    assert set(rates) == {"rank#a", "rank#b"}
    assert rates["rank#a"]["lookups"] == 100 and abs(rates["rank#a"]["gpu"] - 0.6) < 1e-9
    assert abs(rates["rank#a"]["any"] - 0.7) < 1e-9 and abs(rates["rank#b"]["any"] - 0.9) < 1e-9
    assert decisions == {"affinity": 90.0, "least_loaded": 0.0, "next_on_ring": 10.0}


def test_the_report_gives_the_scaling_ratio_and_fails_on_a_mismatch(tmp_path, capsys):
    one = _run(tmp_path, "replicas_1", 1000.0, _ingress_text({"rank#a": (70, 0, 30)}, 100, 0))
    two = _run(tmp_path, "replicas_2", 1900.0, _ingress_text({"rank#a": (40, 0, 10), "rank#b": (35, 0, 15)}, 95, 5))
    doc = scale_report([one, two])
    assert abs(doc["scaling"] - 1.9) < 1e-9
    assert doc["runs"][1]["affinity_share"] == 0.95 and len(doc["runs"][1]["replicas"]) == 2
    assert main([str(one), str(two)]) == 0
    assert "scaling (last / first requests/s): 1.90x" in capsys.readouterr().out
    assert json.loads((tmp_path / "scale.json").read_text())["scaling"] == doc["scaling"]
    bad = _run(tmp_path, "replicas_2_bad", 1900.0, "", mismatches=3)
    assert main([str(one), str(bad), "--out", str(tmp_path / "bad.json")]) == 1
