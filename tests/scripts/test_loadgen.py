"""The open-loop load generator against a real uvicorn on loopback (tiny model, bounded)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from hstu.scripts import loadgen
from tests.serving.conftest import live_server, tiny_settings


def test_loadgen_reports_rate_latency_and_batch_size_gets_only_200s_and_verifies_every_answer(tmp_path):
    with live_server(tiny_settings()) as (_, _, url):
        for form, order, workload in (("columns", "sent", "fit"), ("events", "answered", "fit")):
            args = argparse.Namespace(
                server=url, rate=200.0, requests=60, users=12, connections=8, processes=1, form=form,
                timeout_s=20.0, seed=1, first_user=0, out=tmp_path / form, order=order, workload=workload, verify=True, device="cpu",
            )
            assert loadgen.main(args) == 0
            doc = json.loads((tmp_path / form / "loadgen.json").read_text())
            assert doc["statuses"] == {"200": 60} and doc["requests"] == 60 and doc["order"] == order
            assert doc["verified"] == 60 and doc["verify_mismatches"] == 0, "every answer equals the no-cache model"
            assert doc["achieved_rate"] > 0 and doc["latency_p99_ms"] >= doc["latency_p50_ms"] > 0
            assert doc["mean_batch_size"] >= 1 and doc["mean_batch_model_ms"] > 0 and 0 < doc["model_busy_share"] <= 1.05
            phases = doc["phase_mean_ms"]  # where a request's time went on the server, this run only
            batch_phases = {"batch_handoff", "batch_launch", "batch_outputs", "batch_deliver"}
            batch_phases |= {f"forward_{p}" for p in ("plan", "inputs", "prepare_wait", "onload_wait", "forward", "finish")}
            assert set(phases) == {"read_parse", "rank", "respond", "engine_queue"} | batch_phases
            assert all(v >= 0 for v in phases.values()) and phases["batch_launch"] > 0
            assert phases["rank"] >= phases["engine_queue"], "the queue wait is part of the rank phase"
            p50, p90 = doc["phase_p50_ms"], doc["phase_p90_ms"]
            assert set(p50) == set(p90) == set(phases) and all(0 <= p50[k] <= p90[k] for k in p50)
            # each answer's latency split into the handler's own latency_ms and the rest (HTTP, loops, client)
            assert 0 < doc["handler_p50_ms"] < doc["latency_p99_ms"]
            assert 0 < doc["outside_handler_p50_ms"] <= doc["outside_handler_p99_ms"]


def test_handler_split_reads_each_answers_latency_ms_and_leaves_the_rest_to_the_transport():
    results = [{"latencies_ms": [5.0, 7.5, 9.0], "answers": {0: b'{"a":1,"latency_ms":3.25,"b":2}', 2: b'{"x":[1]}'}},
               {"latencies_ms": [4.0], "answers": {0: b'{"latency_ms":1e0}'}}]
    handler, outside = loadgen._handler_split(results)
    assert handler == [3.25, 1.0] and outside == [1.75, 3.0]
    assert loadgen._handler_split([{"latencies_ms": [1.0], "answers": {0: object()}}]) == ([], [])


def test_phase_quantiles_interpolate_within_the_bucket_of_this_runs_counts():
    """From cumulative bucket counts, before and after a run: 10 of this run's 20 waits were under
    0.5 ms and 18 under 1 ms, so the median is 0.5 ms and the 0.9 quantile 1 ms; one that passed
    the last finite edge reads as that edge."""
    edges = {"le=0.0005": 10.0, "le=0.001": 18.0, "le=0.0025": 20.0, "le=+Inf": 20.0}
    before = {("pipe_to_engine", k): 5.0 for k in edges}  # an earlier run's waits, all under 0.5 ms
    after = {("pipe_to_engine", k): v + 5.0 for k, v in edges.items()}
    assert loadgen._phase_quantiles_ms(before, after, 0.5) == {"pipe_to_engine": 0.5}
    assert abs(loadgen._phase_quantiles_ms(before, after, 0.9)["pipe_to_engine"] - 1.0) < 1e-9
    assert abs(loadgen._phase_quantiles_ms(before, after, 0.25)["pipe_to_engine"] - 0.25) < 1e-9
    tail = {("x", "le=0.001"): 1.0, ("x", "le=+Inf"): 4.0}
    assert loadgen._phase_quantiles_ms({}, tail, 0.9) == {"x": 1.0}
    assert loadgen._phase_quantiles_ms({}, {("x", "le=+Inf"): 0.0}, 0.5) == {}


def test_loadgen_verify_counts_every_wrong_answer_and_exits_non_zero(tmp_path, monkeypatch):
    from hstu.serving.runtime import ServingRuntime

    rank = ServingRuntime._rank

    def shifted(self, requests):
        return [dataclasses.replace(o, logits=o.logits + 0.5) for o in rank(self, requests).result()]

    monkeypatch.setattr(ServingRuntime, "_rank", shifted)
    with live_server(tiny_settings()) as (_, _, url):
        args = argparse.Namespace(
            server=url, rate=0.0, requests=20, users=6, connections=4, processes=1, form="columns", timeout_s=20.0,
            seed=2, first_user=7, out=tmp_path, order="sent", workload="fit", verify=True, device="cpu",
        )
        assert loadgen.main(args) == 1
    doc = json.loads((tmp_path / "loadgen.json").read_text())
    assert doc["verify_mismatches"] == doc["verified"] == 20


def test_in_process_runs_the_same_arrivals_through_a_runtime_here_with_its_batch_and_phase_figures(tmp_path):
    """--in-process: the server's batcher and engine in this process (no HTTP, parsing or pipes),
    the like-for-like reference of a server run (issue 18)."""
    from tests.configs import TINY

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY.to_dict()))
    flags = f"--config {config} --page-size 8 --num-pages 64 --chunk-tokens 16 --max-batch-size 8 --max-candidates 64"
    settings = loadgen.in_process_settings(flags + " --engine-process --front-ends 2")
    assert not settings.engine_process and settings.front_ends == 1 and settings.max_batch_size == 8
    for order in ("sent", "answered"):
        args = argparse.Namespace(
            server=None, in_process=flags, rate=300.0, requests=40, users=8, connections=8, processes=1, form="columns",
            timeout_s=20.0, seed=3, first_user=0, out=tmp_path / order, order=order, workload="fit", verify=False,
            device="cpu",
        )
        assert loadgen.main(args) == 0
        doc = json.loads((tmp_path / order / "loadgen.json").read_text())
        assert doc["statuses"] == {"200": 40} and doc["form"] == "in-process" and doc["order"] == order
        assert doc["achieved_rate"] > 0 and doc["latency_p99_ms"] >= doc["latency_p50_ms"] > 0
        assert doc["mean_batch_size"] >= 1 and "engine_queue" in doc["phase_mean_ms"]
        assert "read_parse" not in doc["phase_mean_ms"], "no HTTP in process"
        assert doc["handler_p50_ms"] != doc["handler_p50_ms"], "no handler in process: NaN"


def test_loadgen_takes_a_server_or_in_process_flags_and_verifies_servers_only(tmp_path):
    import pytest

    base = dict(rate=0.0, requests=2, users=1, connections=1, processes=1, form="columns", timeout_s=5.0, seed=0,
                first_user=0, out=tmp_path, order="sent", workload="fit", device="cpu")
    with pytest.raises(SystemExit, match="either --server"):
        loadgen.main(argparse.Namespace(server=None, in_process=None, verify=False, **base))
    with pytest.raises(SystemExit, match="needs --server"):
        loadgen.main(argparse.Namespace(server=None, in_process="--device cpu", verify=True, **base))
