"""Timer, wall_ms and summarize: the numbers every benchmark reports."""

from __future__ import annotations

import time

import pytest
import torch

from hstu.scripts.timing import Timer, summarize, wall_ms

CPU = torch.device("cpu")


def test_measure_times_only_the_repeats_and_runs_setup_before_every_call():
    calls = []
    times, result = Timer(CPU).measure(lambda: calls.append("fn") or len(calls), lambda: calls.append("setup"), 2, 3)
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["setup", "fn"] * 5
    assert result == 10, "the result of the last call"


def test_wall_ms_measures_the_call():
    ms, result = wall_ms(lambda: time.sleep(0.02) or "done", CPU)
    assert result == "done" and 15 <= ms < 1000


def test_summary_reports_median_extremes_and_every_time():
    assert summarize([3.0, 1.0, 2.0]) == {
        "median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0, "repeats": 3, "times_ms": [3.0, 1.0, 2.0]
    }


def test_an_empty_summary_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        summarize([])


def test_interleaved_runs_take_turns_and_keep_their_own_times_and_results():
    from hstu.scripts.timing import TimedRun

    calls = []

    def run(name: str) -> TimedRun:
        return TimedRun(lambda: calls.append(name) or name + str(len(calls)), lambda: calls.append(f"setup {name}"),
                        lambda: calls.append(f"after {name}"))

    measured = Timer(CPU).measure_interleaved([run("a"), run("b")], 1, 2)
    assert calls == ["setup a", "a", "after a", "setup b", "b", "after b"] * 3
    assert [len(times) for times, _ in measured] == [2, 2]
    assert [result for _, result in measured] == ["a14", "b17"], "each run's last result"
