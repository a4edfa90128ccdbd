"""bench_gil runs and reports a slowdown ratio per switch interval (no timing asserted: a benchmark)."""

from __future__ import annotations

import json
import sys

from hstu.scripts import bench_gil


def test_bench_gil_reports_alone_and_busy_time_per_switch_interval_and_restores_it(tmp_path):
    before = sys.getswitchinterval()
    assert bench_gil.main(["--batches", "2", "--out", str(tmp_path / "gil.json")]) == 0
    doc = json.loads((tmp_path / "gil.json").read_text())
    assert set(doc["switch_interval_ms"]) == {"5", "0.5"}
    for r in doc["switch_interval_ms"].values():
        assert r["alone_ms"] > 0 and r["busy_ms"] > 0 and r["slowdown"] > 0
    assert sys.getswitchinterval() == before
