"""`hstu serve` flags and how they become ServerSettings."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest
import torch

from hstu.cli import main as hstu_main
from hstu.serving.cli import add_parser, settings_from_args
from hstu.serving.settings import ServerSettings

from .conftest import TINY


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hstu")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_serve_defaults_bind_loopback_port_8000_on_cpu_with_the_embedded_config():
    args = parse(["serve"])
    settings = settings_from_args(args, env={})
    assert (args.host, args.port, settings.device) == ("127.0.0.1", 8000, "cpu")
    assert settings.resolve_model_config().num_items == 100_000
    assert settings.host_cache_bytes == 1 << 30 and settings.num_pages == 1024
    assert settings.history_store_bytes == 256 << 20 and settings.gil_switch_interval_ms is None
    assert settings_from_args(parse(["serve", "--gil-switch-interval-ms", "0.5"]), env={}).gil_switch_interval_ms == 0.5
    assert not settings.prepare_worker and not settings.kv_config(settings.resolve_model_config()).prepare_worker
    worker = settings_from_args(parse(["serve", "--prepare-worker"]), env={})
    assert worker.kv_config(worker.resolve_model_config()).prepare_worker
    assert callable(args.func)


def test_a_cuda_server_plans_splits_and_runs_its_engine_and_parsers_in_processes_by_default_and_flags_override():
    cpu = settings_from_args(parse(["serve"]), env={})
    assert (cpu.engine_process, cpu.parse_processes, cpu.planner) == (False, 0, False)
    cuda = settings_from_args(parse(["serve", "--device", "cuda"]), env={})
    assert (cuda.engine_process, cuda.parse_processes, cuda.planner) == (True, 4, True)
    plain = settings_from_args(parse(["serve", "--device", "cuda", "--no-engine-process", "--parse-processes", "0"]), env={})
    assert (plain.engine_process, plain.parse_processes) == (False, 0)
    forced = settings_from_args(parse(["serve", "--engine-process"]), env={})
    assert forced.engine_process is True and forced.parse_processes == 0


def test_serve_flags_map_to_settings_and_the_config_file(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps(TINY.to_dict()))
    args = parse(
        "serve --port 0 --device cuda:1 --checkpoint w.pt --num-pages 50 --page-size 8 --chunk-tokens 16 "
        "--host-cache-mb 1.5 --history-store-mb 0 --max-batch-size 4 --max-wait-ms 0.5 --dtype bfloat16 "
        "--task-names click,like,share".split()
        + ["--config", str(path)]
    )
    s = settings_from_args(args)
    assert (s.device, s.checkpoint, s.num_pages, s.page_size, s.chunk_tokens) == ("cuda:1", "w.pt", 50, 8, 16)
    assert (s.host_cache_bytes, s.max_batch_size, s.max_wait_ms) == (int(1.5 * 2**20), 4, 0.5)
    assert s.history_store_bytes == 0, "0 turns incremental requests off"
    cfg = s.resolve_model_config()
    assert cfg.num_items == TINY.num_items and cfg.dtype == "bfloat16"
    assert s.resolve_task_names(cfg) == ("click", "like", "share")
    kv = s.kv_config(cfg)
    assert (kv.on_no_new_tokens, kv.on_shorter_history) == ("candidates", "reuse")


def test_settings_come_from_the_config_file_then_the_environment_then_the_flags(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('num_pages = 300\npage_size = 8\ntask_names = ["a", "b", "c"]\n[model]\nnum_layers = 2\nnum_items = 500\n')
    env = {"HSTU_PAGE_SIZE": "16", "HSTU_MAX_WAIT_MS": "0.5", "HSTU_MODEL__NUM_LAYERS": "4", "HSTU_BUILD_DIR": "/x",
           "HSTU_PIPE_THREADS": "1", "HSTU_REBUILD_AHEAD": "1", "HSTU_FINISH_WAITS_ONLOAD": "1",
           "HSTU_ONLOAD_WAITS_ALL": "1"}  # not settings: the build's and experiment knobs
    s = settings_from_args(parse(["serve", "--config-file", str(path), "--num-pages", "100"]), env=env)
    assert (s.num_pages, s.page_size, s.max_wait_ms, s.task_names) == (100, 16, 0.5, ("a", "b", "c"))
    cfg = s.resolve_model_config()
    assert (cfg.num_layers, cfg.num_items) == (4, 500), "the model section merges file and environment"


@pytest.mark.parametrize(
    "source, text, message",
    [
        ("file", '{"num_page": 3}', "unknown settings ['num_page']"),
        ("file", '{"model": {"layers": 3}}', "unknown model settings ['layers']"),
        ("file", '{"model_config": {}}', "unknown settings ['model_config']"),
        ("env", "HSTU_NUM_PAGE=3", "HSTU_NUM_PAGE names no setting"),
        ("env", "HSTU_NUM_PAGES=many", "HSTU_NUM_PAGES: expected int, got 'many'"),
        ("env", "HSTU_MODEL__LAYERS=2", "HSTU_MODEL__LAYERS names no model field"),
    ],
)
def test_unknown_or_malformed_settings_are_one_line_errors(tmp_path, source, text, message):
    path = tmp_path / "serve.json"
    path.write_text(text if source == "file" else "{}")
    env = dict([text.split("=", 1)]) if source == "env" else {}
    with pytest.raises(ValueError) as info:
        settings_from_args(parse(["serve", "--config-file", str(path)]), env=env)
    assert message in str(info.value) and "\n" not in str(info.value)


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


def test_lifecycle_flags_map_to_settings():
    s = settings_from_args(
        parse(
            "serve --max-queue-wait-ms 150 --request-timeout-ms 900 --max-body-bytes 4096 --shutdown-timeout-s 2.5".split()
        )
    )
    assert (s.max_queue_wait_ms, s.request_timeout_ms, s.max_body_bytes, s.shutdown_timeout_s) == (150, 900, 4096, 2.5)
    with pytest.raises(ValueError, match="request_timeout_ms must be positive, got 0"):
        settings_from_args(parse(["serve", "--request-timeout-ms", "0"]))


def tiny_config_file(tmp_path, **changes) -> str:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**TINY.to_dict(), **changes}))
    return str(path)


UNWORKABLE = [
    ("missing checkpoint", lambda tmp: ["--checkpoint", str(tmp / "nope.pt")], "nope.pt"),
    ("missing config", lambda tmp: ["--config", str(tmp / "absent.json")], "absent.json"),
    ("unknown config key", lambda tmp: ["--config", tiny_config_file(tmp, num_itmes=5)], "unknown keys ['num_itmes']"),
    ("config not json", lambda tmp: ["--config", str(tmp / "bad.json")], "cannot be read as JSON"),
    ("chunk not a page multiple", lambda tmp: ["--page-size", "32", "--chunk-tokens", "48"], "multiple of page_size"),
    ("zero pages", lambda tmp: ["--num-pages", "0"], "num_pages must be positive, got 0"),
    ("wrong task count", lambda tmp: ["--task-names", "a,b"], "3 distinct task names"),
    ("zero replicas", lambda tmp: ["--replicas", "0"], "--replicas must be at least 1, got 0"),
]


@pytest.mark.parametrize("name,argv,words", UNWORKABLE, ids=[u[0] for u in UNWORKABLE])
def test_unworkable_configuration_exits_2_with_one_line_before_the_server_starts(
    name, argv, words, tmp_path, monkeypatch, caplog
):
    (tmp_path / "bad.json").write_text("{num_items: 3")
    import hstu.serving.server as server

    monkeypatch.setattr(server, "draining_server", lambda *a, **k: pytest.fail("the server must not start"))
    assert hstu_main(["serve", *argv(tmp_path)]) == 2
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and words in errors[0].getMessage() and "\n" not in errors[0].getMessage()
    assert errors[0].exc_info is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_asked_for_without_cuda_is_refused_before_loading(caplog):
    assert hstu_main(["serve", "--device", "cuda"]) == 2
    assert "CUDA is not available" in caplog.text


def test_serve_with_a_missing_checkpoint_exits_non_zero_with_one_line_and_no_traceback(tmp_path):
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hstu.cli", "serve", "--port", "0", "--checkpoint", str(tmp_path / "gone.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "gone.pt" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    assert "Uvicorn running" not in proc.stderr and time.monotonic() - started < 60


def test_replicas_take_front_ends_as_their_ingress_replicas(monkeypatch):
    """On Ray Serve, --front-ends N is the number of HTTP ingress replicas, behind Serve's proxy or
    (--direct-ingress) each listening on the one --port itself."""
    import sys
    import types

    seen = {}
    fake = types.ModuleType("hstu.serving.ray_app")
    fake.serve_locally = lambda settings, host, port, replicas, gpus, direct, **options: seen.update(
        replicas=replicas, direct=direct, **options
    )
    monkeypatch.setitem(sys.modules, "hstu.serving.ray_app", fake)
    from hstu.serving import cli

    args = parse(["serve", "--replicas", "2", "--front-ends", "3", "--engine-process"])
    assert cli.run(args) == 0
    assert seen == {"replicas": 2, "direct": False, "ingress_replicas": 3}
    seen.clear()
    direct = parse(["serve", "--replicas", "1", "--front-ends", "2", "--engine-process", "--direct-ingress"])
    assert cli.run(direct) == 0
    assert seen == {"replicas": 1, "direct": True, "ingress_replicas": 2}
