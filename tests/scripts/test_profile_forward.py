"""hstu profile on the CPU at the tiny shapes: every phase, the host and device sections, with the
requests prepared where the server prepares them and cold (as hstu bench times them)."""

from __future__ import annotations

import argparse
import json

import pytest

from hstu.scripts import profile_forward


@pytest.mark.parametrize("cold", [False, True], ids=["prepared", "cold"])
def test_profile_reports_every_phase_for_prepared_and_cold_requests(tmp_path, cold):
    parser = argparse.ArgumentParser()
    profile_forward.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["profile", "--tiny", "--device", "cpu", "--batch", "2", "--forwards", "2", "--out", str(tmp_path)]
        + (["--cold-requests"] if cold else [])
    )
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert doc["cold_requests"] is cold
    phases = doc["2"]["phases"]
    assert {"plan_ms", "inputs_ms", "forward_ms", "finish_ms", "total_ms", "wall_ms"} <= set(phases)
    assert phases["total_ms"] > 0 and doc["2"]["host"]["top_own_time"]
