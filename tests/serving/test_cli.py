"""`hstu serve` flags and how they become ServerSettings."""

from __future__ import annotations

import argparse
import json

import pytest

from hstu.serving.cli import add_parser, settings_from_args
from hstu.serving.settings import ServerSettings

from .conftest import TINY


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hstu")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_serve_defaults_bind_loopback_port_8000_on_cpu_with_the_embedded_config():
    args = parse(["serve"])
    assert (args.host, args.port, args.device) == ("127.0.0.1", 8000, "cpu")
    settings = settings_from_args(args)
    assert settings.resolve_model_config().num_items == 100_000
    assert settings.host_cache_bytes == 1 << 30 and settings.num_pages == 1024
    assert callable(args.func)


def test_serve_flags_map_to_settings_and_the_config_file(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(TINY.to_dict()))
    args = parse(
        "serve --port 0 --device cuda:1 --checkpoint w.pt --num-pages 50 --page-size 8 --chunk-tokens 16 "
        "--host-cache-mb 1.5 --max-batch-size 4 --max-wait-ms 0.5 --dtype bfloat16 "
        "--task-names click,like,share".split()
        + ["--config", str(path)]
    )
    s = settings_from_args(args)
    assert (s.device, s.checkpoint, s.num_pages, s.page_size, s.chunk_tokens) == ("cuda:1", "w.pt", 50, 8, 16)
    assert (s.host_cache_bytes, s.max_batch_size, s.max_wait_ms) == (int(1.5 * 2**20), 4, 0.5)
    cfg = s.resolve_model_config()
    assert cfg.num_items == TINY.num_items and cfg.dtype == "bfloat16"
    assert s.resolve_task_names(cfg) == ("click", "like", "share")
    kv = s.kv_config(cfg)
    assert (kv.on_no_new_tokens, kv.on_shorter_history) == ("candidates", "invalidate")


def test_compile_flag_turns_on_cuda_graphs_of_compiled_layers():
    s = settings_from_args(parse(["serve", "--device", "cuda", "--compile"]))
    assert s.cuda_graphs and s.compile_layers
    s = settings_from_args(parse(["serve", "--device", "cuda", "--cuda-graphs"]))
    assert s.cuda_graphs and not s.compile_layers


def test_bad_settings_are_rejected_with_the_offending_value():
    with pytest.raises(ValueError, match="max_batch_size must be positive, got 0"):
        settings_from_args(parse(["serve", "--max-batch-size", "0"]))
    with pytest.raises(ValueError, match="device"):
        settings_from_args(parse(["serve", "--device", "tpu"]))
    with pytest.raises(ValueError, match="3 distinct task names"):
        s = settings_from_args(parse(["serve", "--task-names", "a,b"]))
        s.resolve_task_names(s.resolve_model_config())
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device, got device 'cpu'"):
        settings_from_args(parse(["serve", "--compile"]))
    with pytest.raises(ValueError, match="compile_layers .* needs cuda_graphs"):
        ServerSettings(device="cuda", compile_layers=True)
