"""Replay on a tiny config: JSON + PNG written, cached results equal the dense reference, CLI table."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from hstu.engine import RankingEngine
from hstu.model.config import HSTUConfig
from hstu.model.identity import model_identity
from hstu.model.ranking import InferenceRankingGR
from hstu.scripts import replay as rp
from hstu.scripts.replay_passes import PassResult, RequestRecord
from hstu.scripts import replay_server
from hstu.scripts.workload import Workload, WorkloadConfig, count_restarts
from tests.configs import REPLAY_MODEL

MODEL = REPLAY_MODEL
WORKLOAD = WorkloadConfig(
    num_requests=40, num_users=12, new_tokens=(8, 64), initial_tokens=(8, 128),
    max_history_tokens=255, candidates=(4, 24), seed=1,
)
# 72 pages of 8 tokens: one batch of 2 users at the limit (64 pages) fits, the 12 users do not, so
# users are evicted to the host tier and come back from it.
CACHE = rp.CacheSettings(page_size=8, num_pages=72, chunk_tokens=16, host_capacity_bytes=8 << 20)


@pytest.fixture(scope="module")
def replay_doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    settings = rp.ReplaySettings(model=MODEL, workload=WORKLOAD, cache=CACHE, batch_size=2, verify=True, progress=False)
    return rp.replay(settings, out), out


def test_replay_writes_json_and_png(replay_doc):
    doc, out = replay_doc
    on_disk = json.loads((out / "replay.json").read_text())
    assert on_disk["summary"] == json.loads(json.dumps(doc["summary"]))
    assert (out / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(on_disk["requests"]["cached"]) == len(on_disk["requests"]["uncached"]) == WORKLOAD.num_requests


def test_every_cached_result_matches_the_dense_reference(replay_doc):
    cached = replay_doc[0]["summary"]["cached"]
    assert cached["verify_mismatches"] == 0
    assert cached["verify_max_abs_diff"] < 1e-4


def test_cached_pass_uses_both_tiers_and_invalidates_restarts(replay_doc):
    doc = replay_doc[0]
    cached, uncached = doc["summary"]["cached"], doc["summary"]["uncached"]
    assert count_restarts(Workload(WORKLOAD, MODEL)) > 0
    assert cached["gpu_hits"] > 0 and cached["host_hits"] > 0 and cached["bytes_onloaded"] > 0
    assert cached["invalidations"] >= doc["workload_restarts"] > 0
    assert cached["recomputes"] == 0 and cached["errors"] == 0
    assert uncached["gpu_hits"] == uncached["host_hits"] == uncached["cached_tokens"] == 0
    assert uncached["misses"] == WORKLOAD.num_requests
    assert set(doc["speedup"]) == {"speedup req/s (cached/uncached)", "speedup p50 latency"}


def test_cli_prints_the_table_last(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    rp.add_parser(parser.add_subparsers())
    model_path = tmp_path / "model.json"
    model_path.write_text(json.dumps(MODEL.to_dict()))
    args = parser.parse_args(
        ["replay", "--model-config", str(model_path), "--device", "cpu", "--requests", "12", "--users", "4",
         "--new-tokens", "8", "32", "--initial-tokens", "8", "64", "--candidates", "4", "8", "--page-size", "8",
         "--chunk-tokens", "16", "--batch-size", "2", "--no-uncached", "--verify", "--no-progress", "--out", str(tmp_path / "o")]
    )
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["metric", "cached"]
    assert lines[-1].startswith("errors")
    assert (tmp_path / "o" / "replay.png").exists()


def test_server_mode_refuses_non_loopback_hosts():
    for url in ("http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1"):
        with pytest.raises(ValueError, match="loopback"):
            rp.check_loopback(url)
    rp.check_loopback("http://127.0.0.1:8000")
    rp.check_loopback("http://localhost:1")


def test_replay_body_from_the_client_is_accepted_by_the_server_schema():
    schemas = pytest.importorskip("hstu.serving.schemas", reason="hstu.serving is not importable")
    from hstu.client import rank_body

    request = next(iter(Workload(WORKLOAD, MODEL)))
    model = schemas.build_rank_columns_model(schemas.RequestLimits.for_model(MODEL, max_candidates=64))
    history = (request.item_ids, request.actions, request.timestamps)
    body = model.model_validate(rank_body(request.user_id, history, request.candidates, contextual=request.contextual))
    assert body.user_id == request.user_id
    assert body.item_ids == request.item_ids.tolist()
    assert body.contextual == request.contextual.tolist()


def test_parse_server_metrics_reads_the_cache_counters():
    text = "\n".join(
        [
            "# TYPE hstu_cache_lookups counter",
            'hstu_cache_lookups_total{result="gpu_hit"} 5.0',
            'hstu_cache_lookups_total{result="host_hit"} 2.0',
            'hstu_cache_lookups_total{result="miss"} 1.0',
            "# TYPE hstu_cache_recomputes counter",
            "hstu_cache_recomputes_total 3.0",
            "# TYPE hstu_batch_size histogram",
            'hstu_batch_size_bucket{le="1.0"} 1.0',
            'hstu_batch_size_bucket{le="+Inf"} 4.0',
            "hstu_batch_size_count 4.0",
            "hstu_batch_size_sum 8.0",
            "",
        ]
    )
    stats = replay_server.parse_server_metrics(text)
    assert stats == {"gpu_hits": 5, "host_hits": 2, "misses": 1, "recomputes": 3, "batches": 4, "batched_requests": 8}


def test_a_pool_smaller_than_one_batch_is_rejected():
    with pytest.raises(ValueError, match="cannot hold one batch"):
        rp.CacheSettings(page_size=8, num_pages=40).build(MODEL, WORKLOAD, batch_size=2)


def test_mean_batch_size_is_requests_per_batch():
    """As the server's metrics count it (batched requests over batches), not weighted by size."""
    records = [RequestRecord(u, 10, 1, 0, b, size, 1.0) for u, b, size in [(1, 0, 3), (2, 0, 3), (3, 0, 3), (1, 1, 1)]]
    assert PassResult("cached", records, 1.0, {}).mean_batch_size() == 2.0


def test_uncached_pass_never_reuses_anything():
    kv = CACHE.build(MODEL, WORKLOAD, 2)
    requests = list(Workload(WorkloadConfig(**{**WORKLOAD.__dict__, "num_requests": 6}), MODEL))
    result = rp.run_pass("uncached", MODEL, rp.uncached_cache_config(kv), [requests[:3], requests[3:]], torch.device("cpu"),
                         fresh_users=True, progress=False)
    assert [r.cached_tokens for r in result.records] == [0] * 6
    assert result.stats["misses"] == 6


def test_a_pipelined_pass_ranks_like_a_synchronous_one():
    """--pipeline 3 launches batches before reading earlier ones: same cached lengths, same
    batches, every result verified (after the timed pass)."""
    kv = CACHE.build(MODEL, WORKLOAD, 2)
    requests = list(Workload(WORKLOAD, MODEL))
    batches = list(rp.distinct_user_batches(requests, 2))
    runs = {
        k: rp.run_pass("cached", MODEL, kv, batches, torch.device("cpu"), fresh_users=False, verify=True, progress=False, pipeline=k)
        for k in (1, 3)
    }
    shape = lambda r: [(x.user_id, x.cached_tokens, x.batch_index) for x in r.records]  # noqa: E731
    assert shape(runs[1]) == shape(runs[3]) and len(runs[3].records) == WORKLOAD.num_requests
    assert runs[3].mismatches == 0 and runs[3].wall_s > 0
    with pytest.raises(ValueError, match="pipeline must be >= 1 batch in flight, got 0"):
        rp.run_pass("cached", MODEL, kv, batches, torch.device("cpu"), fresh_users=False, progress=False, pipeline=0)


def test_the_cached_pass_runs_the_servers_planner_and_admission(monkeypatch):
    """As `hstu serve` on CUDA: the planner calibrated before the timed pass (its synthetic users
    are not in the pass's counters), admission after two sightings; results still verified."""
    calibrated = []
    monkeypatch.setattr(RankingEngine, "calibrate", lambda self: calibrated.append(self.cache.config) or None)
    kv = CACHE.build(MODEL, WORKLOAD, 2)
    assert kv.offload_min_seen == 2
    requests = list(Workload(WORKLOAD, MODEL))
    result = rp.run_pass("cached", MODEL, kv, list(rp.distinct_user_batches(requests, 2)), torch.device("cpu"),
                         fresh_users=False, verify=True, progress=False, planner=True)
    assert calibrated == [kv] and result.mismatches == 0
    assert result.stats["misses"] + result.stats["gpu_hits"] + result.stats["host_hits"] == WORKLOAD.num_requests
    parser = argparse.ArgumentParser()
    rp.add_parser(parser.add_subparsers())
    flags = parser.parse_args(["replay", "--device", "cpu", "--offload-min-seen", "1"])
    assert not rp.settings_from_args(flags).planner and rp.settings_from_args(flags).cache.offload_min_seen == 1
    assert rp.settings_from_args(parser.parse_args(["replay", "--device", "cpu", "--planner"])).planner


def test_seed_preset_resolves_to_the_benchmark_model_and_fits_the_history_limit():
    parser = argparse.ArgumentParser()
    rp.add_parser(parser.add_subparsers())
    settings = rp.settings_from_args(parser.parse_args(["replay", "--preset", "seed", "--page-size", "64"]))
    assert (settings.model.num_layers, settings.model.embedding_dim, settings.model.dtype) == (8, 1024, "bfloat16")
    assert settings.cache.page_size == 64 and settings.cache.chunk_tokens == 128
    assert settings.workload.history_limit(settings.model) == 4096


SERVED = dataclasses.replace(MODEL, seed=7)
SERVER_WORKLOAD = dataclasses.replace(WORKLOAD, num_requests=16)


def served_settings(**overrides):
    from hstu.scripts.loadtest import tiny_server_settings

    return tiny_server_settings(SERVED, page_size=8, chunk_tokens=16, max_candidates=64, **overrides)


def replay_cli(url: str, out, *extra: str) -> int:
    parser = argparse.ArgumentParser()
    rp.add_parser(parser.add_subparsers())
    argv = ["replay", "--server", url, "--requests", "16", "--users", "12", "--new-tokens", "8", "64",
            "--initial-tokens", "8", "128", "--max-history-tokens", "255", "--candidates", "4", "24",
            "--seed", "1", "--no-progress", "--out", str(out), *extra]
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_server_replay_adopts_the_server_model_config_and_verifies_every_answer(tmp_path, incremental):
    from hstu.scripts.loadtest import local_server

    with local_server(served_settings()) as url:
        settings = rp.ReplaySettings(
            workload=SERVER_WORKLOAD, server=url, verify=True, progress=False, incremental=incremental
        )
        doc = rp.replay(settings, tmp_path)
    server = doc["summary"]["server"]
    assert HSTUConfig(**doc["settings"]["model"]) == SERVED, "the server's config replaces the local default"
    assert server["requests"] > 0 and server["errors"] == 0
    assert server["verify_mismatches"] == 0 and server["verify_max_abs_diff"] < 1e-4
    assert doc["settings"]["server_weights_fingerprint"] == model_identity(InferenceRankingGR(SERVED), SERVED).hex()


def test_verify_refuses_a_server_whose_weights_the_client_cannot_build(tmp_path, caplog):
    from hstu.scripts.loadtest import local_server

    model = InferenceRankingGR(SERVED)
    state = {k: v + 0.01 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "tuned.pt")
    with local_server(served_settings(checkpoint=str(tmp_path / "tuned.pt"))) as url:
        served = rp.fetch_server_model(url)["weights_fingerprint"]
        assert replay_cli(url, tmp_path / "o", "--verify") == 2
    refusal = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    local = model_identity(model, SERVED).hex()
    assert served != local
    assert len(refusal) == 1 and served in refusal[0] and local in refusal[0] and "checkpoint" in refusal[0], refusal
    assert not (tmp_path / "o" / "replay.json").exists(), "nothing was replayed"


def test_verify_counts_every_mismatching_answer_and_exits_non_zero(tmp_path, monkeypatch):
    from hstu.scripts.loadtest import local_server
    from hstu.serving.runtime import ServingRuntime

    rank = ServingRuntime._rank

    def shifted(self, requests):
        return [dataclasses.replace(o, logits=o.logits + 0.5) for o in rank(self, requests).result()]

    monkeypatch.setattr(ServingRuntime, "_rank", shifted)
    with local_server(served_settings()) as url:
        assert replay_cli(url, tmp_path, "--verify") == 1
    server = json.loads((tmp_path / "replay.json").read_text())["summary"]["server"]
    assert server["verify_mismatches"] == server["requests"] > 0
