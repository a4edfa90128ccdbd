"""bench_engine_process runs both engine-process modes with the forward stubbed and reports their
rates (no timing asserted: a benchmark)."""

from __future__ import annotations

import json

from hstu.scripts import bench_engine_process


def test_bench_engine_process_answers_every_request_in_both_modes(tmp_path):
    out = tmp_path / "engine.json"
    assert bench_engine_process.main(["--requests", "40", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["modes"]) == {"thread", "loop"}
    for r in doc["modes"].values():
        assert r["requests_per_s"] > 0 and r["engine_cpu_ms_per_request"] >= 0
