"""hstu profile on the CPU at the tiny shapes: every phase, the host and device sections, with the
requests prepared where the server prepares them and cold (as hstu bench times them)."""

from __future__ import annotations

import argparse
import json

import pytest

from hstu.scripts import profile_forward


def _run_host_only(tmp_path, *flags: str) -> dict:
    """`hstu profile --tiny --host-only --device cpu <flags> --out tmp_path`; its profile_host.json."""
    parser = argparse.ArgumentParser()
    profile_forward.add_parser(parser.add_subparsers())
    args = parser.parse_args(["profile", "--tiny", "--host-only", "--device", "cpu", *flags, "--out", str(tmp_path)])
    assert args.func(args) == 0
    return json.loads((tmp_path / "profile_host.json").read_text())


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


def test_stream_timeline_merges_runs_of_one_kind_per_stream():
    from types import SimpleNamespace as NS

    def event(name, stream, start, end):
        return NS(name=name, device_resource_id=stream, thread=0, time_range=NS(start=start, end=end))

    events = [
        event("Memcpy HtoD", 7, 100, 200), event("Memcpy HtoD", 7, 201, 300),  # one run (gap 1 us)
        event("attn", 3, 110, 150), event("gemm", 3, 151, 160),  # one kernel run
        event("ln", 3, 200, 210),  # a gap: a new run
        event("Memcpy DtoH", 7, 400, 420),
    ]
    timeline = profile_forward.stream_timeline(events)
    assert timeline == {
        "7": [[0.0, 200.0, "copy", 2], [300.0, 320.0, "copy", 1]],
        "3": [[10.0, 60.0, "kernel", 2], [100.0, 110.0, "kernel", 1]],
    }


def test_profile_with_an_onload_split_on_cpu(tmp_path):
    parser = argparse.ArgumentParser()
    profile_forward.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["profile", "--tiny", "--device", "cpu", "--batch", "2", "--forwards", "2", "--onload-fraction", "0.5",
         "--trace", "--pipelined", "3", "--out", str(tmp_path)]
    )
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert doc["onload_fraction"] == 0.5 and doc["2"]["phases"]["total_ms"] > 0
    piped = doc["2"]["pipelined"]
    assert piped["batches"] == 3 and piped["wall_ms_per_batch"] > 0
    assert piped["host_hits"] == 3 * 2, "with an onload split every pipelined batch onloads its users"
    assert "gpu_busy_share" not in piped, "the GPU's share is measured on CUDA only"


def test_resident_pipelined_batches_offload_only_their_new_chunks(tmp_path):
    """The GPU-resident pipelined profile measures a returning user's steady state: each batch's
    users keep the host copy of their prefix from its prefill, so a batch offloads only the chunk
    its new tokens filled (not the whole histories, which measured the D2H link: H100 run CL)."""
    from hstu.scripts.bench_shapes import TINY_SHAPE

    parser = argparse.ArgumentParser()
    profile_forward.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["profile", "--tiny", "--device", "cpu", "--batch", "2", "--forwards", "2", "--pipelined", "3", "--out", str(tmp_path)]
    )
    assert args.func(args) == 0
    piped = json.loads((tmp_path / "profile.json").read_text())["2"]["pipelined"]
    new_chunks = TINY_SHAPE.history_tokens // TINY_SHAPE.chunk_tokens - TINY_SHAPE.cached_tokens // TINY_SHAPE.chunk_tokens
    chunk_bytes = TINY_SHAPE.cache_config(TINY_SHAPE.model_config(), 1).chunk_bytes
    assert new_chunks >= 1 and piped["host_hits"] == 0
    assert piped["bytes_offloaded_per_batch"] == 2 * new_chunks * chunk_bytes


@pytest.mark.parametrize("host_split", ["load_front", "compute_front"])
def test_a_profiled_split_gets_a_graph_bucket_of_its_own_rows(monkeypatch, host_split):
    """With --onload-fraction under CUDA graphs the profiled split runs unpadded: the bucket added
    holds the recomputed back with the batch (load_front), or the front pass (compute_front)."""
    import dataclasses

    from hstu.engine import RankingEngine
    from hstu.scripts.bench_shapes import TINY_SHAPE

    seen = {}
    monkeypatch.setattr(RankingEngine, "enable_cuda_graphs", lambda self, max_batch, buckets, capture=True: seen.update(rows=buckets))
    shape = dataclasses.replace(TINY_SHAPE, host_split=host_split)
    engine = profile_forward.profile_engine(shape, profile_forward.torch.device("cpu"), 2, True, onload_fraction=0.5)
    engine.close()
    onload = shape.cached_tokens // shape.chunk_tokens // 2 * shape.chunk_tokens
    split_rows = 2 * (shape.cached_tokens - onload if host_split == "compute_front"
                      else shape.history_tokens - onload + shape.num_candidates)
    cached_rows = 2 * (shape.new_tokens + shape.num_candidates)
    assert seen["rows"] == tuple(sorted({cached_rows, 2 * shape.num_candidates, split_rows}))


def test_host_only_profile_times_the_host_phases_without_the_forward(tmp_path):
    doc = _run_host_only(tmp_path, "--batch", "1", "2", "--forwards", "3")
    assert doc["host_only"] is True and doc["shape"]["embedding_dim"] == 32  # the narrow model
    for batch in ("1", "2"):
        phases = doc[batch]["phases"]
        assert set(phases) == {
            "validate_ms", "plan_ms", "inputs_ms", "wait_ms", "onload_ms", "finish_ms", "split_ms", "total_ms"
        }
        assert phases["plan_ms"] > 0 and phases["inputs_ms"] > 0 and phases["total_ms"] >= phases["plan_ms"]
        assert any("plan" in row["function"] for row in doc[batch]["top_own_time"])


def test_host_only_cold_requests_reach_the_timed_batch_validated_but_not_hashed(tmp_path, monkeypatch):
    """--cold-requests with --host-only: the timed batch hashes its requests itself, as rank() does
    for an in-process caller's requests, which RankingRequest.create validated (the plan's hashing
    is timed)."""
    from hstu.scripts import profile_host

    seen = []
    run = profile_host.run_host_phases

    def spy(engine, requests):
        seen.append([(r._valid_for is None, not r._identities) for r in requests])
        return run(engine, requests)

    monkeypatch.setattr(profile_host, "run_host_phases", spy)
    doc = _run_host_only(tmp_path, "--cold-requests", "--batch", "2", "--forwards", "2")
    assert doc["cold_requests"] is True
    # every second call is a timed batch: its requests arrive validated, not hashed
    assert all(all(not v and h for v, h in batch) for batch in seen[1::2]) and seen[1::2]


def test_host_only_profile_of_the_unchanged_history_rerank(tmp_path, monkeypatch):
    """--rerank with --host-only: every timed batch re-ranks histories committed whole (GPU hits of
    the full length, no new tokens)."""
    from hstu.scripts import profile_host

    sources = []
    run = profile_host.run_host_phases

    def spy(engine, requests):
        out = run(engine, requests)
        sources.append([engine.cache.stats.snapshot()["computed_tokens"]])
        return out

    monkeypatch.setattr(profile_host, "run_host_phases", spy)
    doc = _run_host_only(tmp_path, "--rerank", "--batch", "2", "--forwards", "2")
    assert doc["rerank"] is True and doc["2"]["phases"]["plan_ms"] > 0
    # a re-rank computes no history token: each timed batch (every second call) leaves the count as it was
    counts = [c[0] for c in sources]
    assert all(counts[i + 1] == counts[i] for i in range(0, len(counts) - 1, 2))


def test_host_only_profile_of_a_host_tier_split(tmp_path, monkeypatch):
    """--onload-fraction with --host-only: every timed batch finds its users in the host tier, onloads
    that share of their prefix (enqueued layer by layer, the copies left out) and recomputes the rest."""
    from hstu.scripts import profile_host

    onloaded = []
    run = profile_host.run_host_phases

    def spy(engine, requests):
        before = engine.cache.stats.snapshot()
        out = run(engine, requests)
        after = engine.cache.stats.snapshot()
        onloaded.append((after["tokens_onloaded"] - before["tokens_onloaded"], after["tokens_recomputed"] - before["tokens_recomputed"]))
        return out

    monkeypatch.setattr(profile_host, "run_host_phases", spy)
    doc = _run_host_only(tmp_path, "--onload-fraction", "0.5", "--batch", "2", "--forwards", "2")
    assert doc["onload_fraction"] == 0.5 and doc["2"]["phases"]["onload_ms"] > 0
    timed = onloaded[1::2]  # every second call is a timed batch, after its untimed prefill
    assert timed and all(o > 0 and r > 0 for o, r in timed)


def test_the_forward_busy_share_counts_the_compute_stream_only():
    from types import SimpleNamespace as NS

    def event(name, stream, start, end):
        return NS(name=name, device_resource_id=stream, thread=0, time_range=NS(start=start, end=end))

    events = [
        event("attn", 3, 0, 100), event("gemm", 3, 50, 150), event("ln", 3, 200, 210),  # 160 us of compute
        event("gather", 9, 300, 340), event("Memcpy DtoH", 9, 340, 900),  # the offload after it
        event("Memcpy HtoD", 3, 150, 200),  # a copy is not compute
    ]
    assert profile_forward.compute_stream_busy_us(events) == 160
    assert profile_forward.kernel_busy_us(events) == 200
    assert profile_forward.compute_stream_busy_us([]) == 0.0


def test_the_table_gives_the_forward_busy_share_over_the_wall_without_the_profiler():
    """The compute stream's kernel time over the profiled forward's wall reads low (the profiler
    slows the host work the GPU waits for); the table also divides it by the unprofiled wall."""
    phases = {p.removesuffix("_s") + "_ms": 0.1 for p in profile_forward._PHASES} | {"wall_ms": 3.0, "forward_wall_ms": 2.5}
    device = {"gpu_busy_share": 0.4, "kernel_busy_ms_per_forward": 2.0, "forward_wall_ms": 5.0, "forward_busy_share": 0.4,
              "compute_stream_busy_ms_per_forward": 2.0, "top_kernels": [], "top_runtime_calls": []}
    doc = {"8": {"phases": phases, "host": {"wall_ms_per_forward": 3.0, "profiled_host_ms_per_forward": 1.0,
                                            "top_own_time": []},
                 "device": device, "forward_busy_share_unprofiled_wall": 2.0 / 2.5}}
    header, _, row = profile_forward.format_table(doc, [8]).splitlines()[:3]
    assert "forward busy (no profiler)" in header
    assert row.split()[-2:] == ["2.50", "80%"] and "40%" in row
