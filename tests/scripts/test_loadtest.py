"""CI-sized load test: 100 requests, 8 concurrent, against the real app on 127.0.0.1."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed")
pytest.importorskip("httpx", reason="httpx is not installed")
pytest.importorskip("hstu.serving.app", reason="hstu.serving is not importable")

from hstu.scripts.loadtest import LOAD_WORKLOAD, run_load_test, wait_until_ready  # noqa: E402


def test_load_test_reports_qps_and_p99_with_no_errors():
    summary = run_load_test(LOAD_WORKLOAD, concurrency=8)
    assert summary["sent"] == summary["requests"] == 100
    assert summary["errors"] == 0 and summary["history_conflicts"] == 0
    assert summary["workload_restarts"] == 0
    assert summary["qps"] > 0 and math.isfinite(summary["latency_p99_ms"])
    assert summary["latency_p99_ms"] >= summary["latency_p50_ms"] > 0
    assert summary["gpu_hits"] > 0, "repeat users must hit the cache through the server"
    assert summary["gpu_hits"] + summary["host_hits"] + summary["misses"] >= 100


def test_a_server_that_exits_before_it_is_ready_is_reported_with_what_it_printed():
    with pytest.raises(RuntimeError, match="exited before .* was ready .*\n.*cannot listen on 127.0.0.1:1"):
        wait_until_ready("http://127.0.0.1:1", lambda: False, timeout_s=5, log=lambda: "cannot listen on 127.0.0.1:1")
