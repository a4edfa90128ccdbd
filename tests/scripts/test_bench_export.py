"""bench_export runs the three paths on one batch and checks their logits (no timing asserted: a benchmark)."""

from __future__ import annotations

import json

from hstu.scripts import bench_export


def test_bench_export_times_python_exported_and_aoti_paths_with_matching_logits(tmp_path):
    out = tmp_path / "export.json"
    argv = ["--tiny", "--device", "cpu", "--batch", "2", "--warmup", "0", "--repeats", "1", "--out", str(out)]
    assert bench_export.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["ok"] and doc["batch"] == 2
    for path in ("python", "exported", "aoti"):
        assert doc[path]["repeats"] == 1
    assert doc["python_over_aoti"] > 0 and all(c["ok"] for c in doc["logits_vs_python"].values())
