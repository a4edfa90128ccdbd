"""The attention schedule model (scripts/schedule_model.py) on hand-made batches."""

from __future__ import annotations

import json

from hstu.scripts import schedule_model as sm


def _request(n: int, c: int, m: int, batch: int = 0) -> dict:
    return {"history_tokens": n, "cached_tokens": c, "candidates": m, "batch_index": batch}


def test_units_count_causal_keys_and_long_first_reverses_the_row_blocks():
    units = sm.units_of([_request(300, 0, 20)])  # rows 320: 3 row blocks of 128, the last holds candidates
    assert [u.actual for u in units[:: sm.HEADS]] == [2, 4, 5]  # keys up to row 127, 255, then all 300
    assert all(u.accounted == 5 for u in units) and len(units) == 3 * sm.HEADS
    assert [u.actual for u in sm.units_of([_request(300, 0, 20)], long_first=True)[:: sm.HEADS]] == [5, 4, 2]


def test_makespans_of_a_tail_and_of_an_even_wave():
    units = [sm.Unit(8, 8)] + [sm.Unit(1, 1)] * 7  # one long unit beside short ones: the wave's tail
    assert sm.aligned_makespan(units, 8) == 8
    assert sm.balanced_makespan(units, 8) == 2  # 15 iterations in shares of 1-2
    causal = [sm.Unit(8, 8)] + [sm.Unit(8, 1)] * 7  # accounted alike, so the shares cannot see the difference
    assert sm.balanced_makespan(causal, 8) == 8
    assert sm.balanced_makespan(causal, 8, causal_shares=True) == 2  # counted at their work, they even out
    even = [sm.Unit(4, 4)] * 8
    assert sm.aligned_makespan(even, 4) == 8 == sm.balanced_makespan(even, 4)


def test_the_tail_rule_sends_a_wave_with_one_long_unit_to_the_balanced_schedule():
    tail = sm.units_of([_request(4000, 3900, 20), _request(200, 0, 30), _request(250, 0, 10)])
    assert sm.schedule(tail, 8) == "aligned"
    assert sm.schedule(tail, 8, align_tail=1.0) == "balanced"
    equal = sm.units_of([_request(1000, 900, 20)] * 4)
    assert sm.schedule(equal, 8, align_tail=1.0) == "aligned"


def test_cli_reports_every_pass_and_rule(tmp_path, capsys):
    path = tmp_path / "replay.json"
    path.write_text(json.dumps({"requests": {
        "cached": [_request(4000, 3900, 20, 0), _request(200, 0, 30, 0), _request(300, 280, 50, 1)],
        "uncached": [_request(4000, 0, 20, 0), _request(200, 0, 30, 0), _request(300, 0, 50, 1)],
    }}))
    report = sm.main([str(path), "--sms", "16"])
    assert set(report) == {"cached", "uncached"}
    assert all(ratio >= 1.0 for ratios in report.values() for ratio in ratios.values())
    assert "align_tail=1" in capsys.readouterr().out
