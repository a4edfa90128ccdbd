"""Benchmark at tiny shapes on CPU: every section runs, its self-checks pass, JSON/markdown/table out."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from hstu.scripts import bench


@pytest.fixture(scope="module")
def tiny_doc(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    return bench.run_bench(bench.TINY_SHAPE, torch.device("cpu"), warmup=1, repeats=2, out_dir=out), out


def test_tiny_bench_runs_every_section_without_errors(tiny_doc):
    doc, out = tiny_doc
    assert doc["errors"] == []
    for batch in map(str, bench.TINY_SHAPE.batch_sizes):
        block, e2e = doc["block"][batch], doc["e2e"][batch]
        assert block["cached"]["rows"] < block["uncached"]["rows"]
        assert block["speedup"] > 0 and e2e["speedup"] > 0
        for name in ("uncached", "cached_gpu", "cached_host"):
            assert e2e[name]["repeats"] == 2 and e2e[name]["median_ms"] > 0
        assert e2e["cached_gpu"]["bytes_onloaded_per_forward"] == 0
        assert e2e["cached_host"]["bytes_onloaded_per_forward"] > 0
        assert e2e["cached_gpu"]["max_abs_diff_vs_uncached"] < 1e-3
        assert e2e["exposed_cache_ms"] == pytest.approx(e2e["cached_host"]["median_ms"] - e2e["cached_gpu"]["median_ms"])
        for name in ("uncached", "cached_gpu", "cached_host", "cached_rerank"):  # the model thread's host phases
            phases = e2e[name]["host_phases_ms"]
            assert 0 < phases["plan"] <= phases["total"] and phases["forward"] <= phases["total"]
    assert doc["e2e"]["1"]["max_abs_diff_uncached_vs_dense"] < 1e-3
    assert json.loads((out / "bench.json").read_text())["errors"] == []
    assert (out / "bench.md").read_text().startswith("| measure |")


def test_the_table_names_the_seed_figures(tiny_doc):
    table = bench.format_table(tiny_doc[0])
    assert "3-8x" in table and "1.3-2.6x" in table
    assert "FAILED" not in table


def test_a_failing_section_is_recorded_and_the_rest_still_runs(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "bench_block", broken)
    shape = dataclasses.replace(bench.TINY_SHAPE, batch_sizes=(1,))
    doc = bench.run_bench(shape, torch.device("cpu"), warmup=0, repeats=1, out_dir=tmp_path)
    assert doc["errors"] == [{"section": "block", "batch": 1, "error": "RuntimeError: boom"}]
    assert doc["e2e"]["1"]["check_failures"] == []
    assert "FAILED block batch 1" in bench.format_table(doc)


def test_cli_tiny_prints_the_table_last_and_forcing_torch_attention_works(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["bench", "--tiny", "--device", "cpu", "--batch-sizes", "1", "--warmup", "0", "--repeats", "1",
         "--attention", "torch", "--out", str(tmp_path)]
    )
    assert args.func(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["measure", "batch"]
    assert "attention torch" in lines[-1]


def test_seed_shape_requests_and_memory_fit_one_h200():
    shape = bench.BenchShape()
    model = shape.model_config()
    prefix, full = bench.make_requests(shape, model, batch=2)
    assert [r.history_tokens(model) for r in prefix] == [3968, 3968]
    assert [r.history_tokens(model) for r in full] == [4096, 4096]
    assert all(r.candidates.shape[0] == 256 for r in full)
    plan = bench.memory_plan(shape)
    # 8 layers x 2048 pages x 2 x 32 x 4 x 256 x bf16 = 2 GiB per manager; 1 GiB of block K/V.
    assert plan["cached_gpu_table"] == plan["uncached_gpu_table"] == 2 << 30
    assert plan["block_kv"] == 1 << 30
    assert sum(v for k, v in plan.items() if k != "host_arena_pinned") < 16 << 30


@pytest.mark.parametrize(
    "overrides",
    [{"cached_tokens": 4096}, {"cached_tokens": 3969}, {"cached_tokens": 3970}, {"batch_sizes": ()}],
)
def test_inconsistent_shapes_are_rejected(overrides):
    with pytest.raises(ValueError):
        bench.BenchShape(**overrides)


@pytest.mark.parametrize("flag", ["--cuda-graphs", "--compile"])
def test_cuda_graphs_flags_need_a_cuda_device(tmp_path, flag):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--tiny", "--device", "cpu", flag, "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="need a CUDA device"):
        args.func(args)


def test_the_bench_runs_under_the_attention_backend_it_was_given(tmp_path, monkeypatch):
    from hstu.ops.attention import attention_backend

    seen = []
    monkeypatch.setattr(bench, "_run_bench", lambda *args: seen.append(attention_backend()) or {})
    bench.run_bench(bench.TINY_SHAPE, torch.device("cpu"), 0, 1, tmp_path, attention="torch")
    assert seen == ["torch"]
    assert attention_backend() == "auto", "restored after the run"


def test_trace_adds_one_untimed_forward_per_pass(tmp_path):
    """--trace: every pass gets a trace entry (empty on a CPU, where the profiler is not used) and
    the timed figures and checks are those of a run without it."""
    doc = bench.run_bench(bench.TINY_SHAPE, torch.device("cpu"), 0, 1, tmp_path, sections=("e2e",), trace=True)
    assert doc["errors"] == []
    for name in ("uncached", "cached_gpu", "cached_host", "cached_host_planned", "cached_rerank"):
        assert doc["e2e"]["1"][name]["trace"] == {} and doc["e2e"]["1"][name]["repeats"] == 1


def test_the_split_section_times_the_fractions_asked_for_and_matches_the_uncached_model(tmp_path):
    shape = dataclasses.replace(bench.TINY_SHAPE, batch_sizes=(2,))
    doc = bench.run_bench(shape, torch.device("cpu"), 0, 1, tmp_path, sections=("split",), split_fractions=(0.0, 0.5, 1.0))
    assert doc["errors"] == []
    rows = doc["split"]["2"]["splits"]
    assert [r["fraction"] for r in rows] == [0.0, 0.5, 1.0]
    onloaded = [r["onload_tokens_per_user"] for r in rows]
    assert onloaded[0] == 0 < onloaded[1] < onloaded[2]


def test_cli_refuses_a_split_fraction_outside_zero_to_one(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--tiny", "--device", "cpu", "--sections", "split", "--split-fractions", "0.5", "1.5",
                              "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"\[1\.5\]"):
        args.func(args)
