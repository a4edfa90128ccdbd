"""The parse-time benchmark runs and reports both forms (numbers only; no timing assertion)."""

from __future__ import annotations

import json

from hstu.scripts import bench_parse


def test_bench_parse_reports_both_forms_and_the_incremental_body(tmp_path, capsys):
    out = tmp_path / "parse.json"
    assert bench_parse.main(["--events", "200", "--candidates", "8", "--repeats", "3", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["forms"]) == {"events", "columns"}
    assert all(r["fast_ms"] > 0 and r["pydantic_ms"] > 0 for r in doc["forms"].values())
    inc = doc["incremental"]
    assert inc["incremental_ms"] > 0 and inc["full_ms"] > 0 and inc["body_bytes"] < inc["full_body_bytes"]
    assert "columns" in capsys.readouterr().out
