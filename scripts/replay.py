"""`hstu replay`: run a synthetic workload through the cached model and the uncached pipeline.

In-process (default): the workload (scripts/workload.py) is cut into batches of distinct users
(`distinct_user_batches`), then run twice over the same batches:
  cached    InferenceRankingGR with an AsyncKVCacheManager (GPU pages + host chunks);
  uncached  the same paged pipeline and kernels, but every request gets a never-seen user id, so
            each lookup misses and the whole history is recomputed (and its manager has the
            smallest host tier, so almost nothing is offloaded).
Each pass starts with one warm-up batch of never-seen users (lazy initialisation and kernel
compilation stay out of the numbers). Batches are pipelined as the server's batcher runs them
(`--pipeline K`, default 2: up to K batches launched before the oldest one's logits are read, so
one batch's host work overlaps the previous one's kernels); a request's latency is from its batch's
launch to its logits on the host. `--pipeline 1` ranks and synchronises one batch at a time (a
request's latency is then its batch's rank() plus a device sync). `--verify` checks every cached
result against forward_no_cache (dense reference), outside the timed pass. The cached pass runs the
cache as `hstu serve` does by default: host-tier admission after `--offload-min-seen` sightings,
and on CUDA the compute-or-load planner, its costs measured before the pass (`--no-planner`: off).

Server mode (`--server URL`, loopback only): the replay first reads the server's model metadata
(GET /v2/models/hstu) and adopts its model config, so the workload fits the served model; then the
same requests go over HTTP, `--concurrency` at a time, each user's requests in order. The server
rejects a history shorter than its cached one with 409, so workload restarts show up as history
conflicts (counted apart from errors); cache counters come from the server's /metrics. With
`--verify` the replay builds the no-cache model from the server's config and seed, refuses to run
unless its weights fingerprint equals the server's (the server may serve a checkpoint this client
lacks), and checks every answered request's scores against it (mismatches make the exit non-zero).

Presets: `--preset cpu` (default) is a small embedded model that replays 200 requests on CPU in
well under a minute; `--preset seed` is the benchmark's model (8 layers, hidden 1024, 4x256 heads,
bf16, page 32) for a GPU. `--model-config` replaces the preset's model.

Outputs: a progress bar on stderr, `replay.json`, `replay.png` (per-request latency vs history
length, lookups by tier: scripts/replay_plot.py) in --out, and a table printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hstu.model.config import HSTUConfig
from hstu.ops.kvcache.config import HOST_FORMAT_HELP, HOST_FORMATS, HOST_SPLIT_HELP, HOST_SPLITS
from hstu.scripts import report
from hstu.scripts.replay_passes import (
    UNCACHED_METHOD,
    CacheSettings,
    PassResult,
    format_table,
    run_pass,
    speedups,
    uncached_cache_config,
)
from hstu.scripts.replay_plot import plot_latency
from hstu.scripts.replay_server import (
    VerifyRefused,
    check_loopback,
    fetch_server_model,
    run_server,
    server_reference,
    verify_answers,
)
from hstu.scripts.workload import Workload, WorkloadConfig, count_restarts, distinct_user_batches
from hstu.serving.settings import ServerSettings

logger = logging.getLogger(__name__)

DEFAULT_MODEL = HSTUConfig(
    num_items=10_000,
    num_contextual=2,
    embedding_dim=64,
    num_layers=2,
    num_heads=2,
    head_dim_qk=32,
    head_dim_v=32,
    max_seq_len=1024,
    mlp_hidden=64,
    dtype="float32",
)
"""Embedded CPU model: small enough that the default replay takes about a minute on 2 cores."""


@dataclass(frozen=True)
class ReplaySettings:
    model: HSTUConfig = DEFAULT_MODEL
    workload: WorkloadConfig = WorkloadConfig()
    cache: CacheSettings = CacheSettings()
    batch_size: int = 8
    device: str = "cpu"
    uncached: bool = True
    verify: bool = False
    server: str | None = None
    concurrency: int = 8
    incremental: bool = False
    progress: bool = True
    cuda_graphs: bool = False
    compile_layers: bool = False
    pipeline: int = 2
    planner: bool = False


def _passes(
    settings: ReplaySettings, model_cfg: HSTUConfig, requests: list, device: torch.device, meta: dict[str, Any] | None
) -> tuple[list[PassResult], Any]:
    """(pass results, the in-process KVCacheConfig or None): the server pass, or cached + uncached.
    With --verify in server mode, VerifyRefused before anything is sent unless the client can build
    the served weights."""
    if settings.server:
        reference = server_reference(meta, settings.server, device) if settings.verify else None
        answers = [] if reference is not None else None
        result = run_server(
            settings.server, requests, model_cfg, settings.concurrency, progress=settings.progress, answers=answers,
            incremental=settings.incremental,
        )
        if reference is not None:
            result.mismatches, result.max_abs_diff = verify_answers(reference, answers, meta["task_names"])
        return [result], None
    kv_cfg = settings.cache.build(model_cfg, settings.workload, settings.batch_size)
    batches = list(distinct_user_batches(requests, settings.batch_size))
    common = dict(
        progress=settings.progress, cuda_graphs=settings.cuda_graphs, compile_layers=settings.compile_layers,
        pipeline=settings.pipeline,
    )
    results = [
        run_pass("cached", model_cfg, kv_cfg, batches, device, fresh_users=False, verify=settings.verify,
                 planner=settings.planner, **common)
    ]
    if settings.uncached:
        results.append(run_pass("uncached", model_cfg, uncached_cache_config(kv_cfg), batches, device, fresh_users=True, **common))
    return results, kv_cfg


def replay(settings: ReplaySettings, out_dir: Path) -> dict[str, Any]:
    """Run the replay, write replay.json and replay.png to out_dir, return the JSON document."""
    device = torch.device(settings.device)
    model_cfg, wl_cfg = settings.model, settings.workload
    meta = None
    if settings.server:
        meta = fetch_server_model(settings.server)
        served = HSTUConfig(**meta["config"])
        if served != model_cfg:
            logger.info("adopting the model config of the server at %s", settings.server)
        model_cfg = served
    requests = list(Workload(wl_cfg, model_cfg))
    restarts = count_restarts(requests)
    lengths = [r.history_tokens(model_cfg) for r in requests]
    logger.info("workload: %d requests, %d users, %d restarts, history %d..%d tokens", len(requests),
                len({r.user_id for r in requests}), restarts, min(lengths, default=0), max(lengths, default=0))
    results, kv_cfg = _passes(settings, model_cfg, requests, device, meta)
    summaries = {r.name: r.summary() for r in results}
    speed = speedups(summaries["cached"], summaries["uncached"]) if "uncached" in summaries else None
    tier_device = str(meta.get("device", "server")) if meta is not None else str(device)
    doc = {
        "settings": {
            "model": model_cfg.to_dict(),
            "workload": dataclasses.asdict(wl_cfg),
            "cache": None if kv_cfg is None else {**dataclasses.asdict(kv_cfg), "dtype": str(kv_cfg.dtype)},
            "batch_size": settings.batch_size,
            "device": str(device),
            "cuda_graphs": settings.cuda_graphs,
            "compile_layers": settings.compile_layers,
            "pipeline": None if settings.server else settings.pipeline,
            "planner": None if settings.server else settings.planner,
            "server": settings.server,
            "server_weights_fingerprint": None if meta is None else meta["weights_fingerprint"],
            "concurrency": settings.concurrency if settings.server else None,
            "incremental": settings.incremental if settings.server else None,
            "uncached_method": None if settings.server or not settings.uncached else UNCACHED_METHOD,
        },
        "environment": report.environment(device),
        "workload_restarts": restarts,
        "summary": summaries,
        "speedup": speed,
        "requests": {r.name: [dataclasses.asdict(x) for x in r.records] for r in results},
    }
    report.write_json(out_dir / "replay.json", doc)
    mode = f"server at {settings.server} ({tier_device})" if settings.server else f"in-process, {device}"
    title = (
        f"{len(requests)} requests, {wl_cfg.num_users} users, batch {settings.batch_size}, "
        f"{model_cfg.num_layers}L d{model_cfg.embedding_dim} {model_cfg.dtype}; {mode}"
    )
    plot_latency(results, out_dir / "replay.png", title, tier_device)
    doc["table"] = format_table(summaries, speed, tier_device)
    return doc


def presets() -> dict[str, tuple[HSTUConfig, CacheSettings]]:
    """Named (model, cache) setups: "cpu" the embedded small model, "seed" the benchmark's model
    (8 layers, hidden 1024, 4x256 heads, bf16) with page 32 / chunk 128 and a 4 GiB host tier."""
    from hstu.scripts.bench_shapes import BenchShape

    return {
        "cpu": (DEFAULT_MODEL, CacheSettings()),
        "seed": (BenchShape().model_config(), CacheSettings(page_size=32, chunk_tokens=128, host_capacity_bytes=4 << 30)),
    }


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    d, w = ReplaySettings(), WorkloadConfig()
    p = subparsers.add_parser(
        "replay",
        help="replay a synthetic workload: cached vs uncached (or against a running server)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=["cpu", "seed"], default="cpu", help="model + cache sizes (default cpu: small model)")
    p.add_argument("--config", "--model-config", dest="model_config", type=Path, help="HSTUConfig JSON, as hstu serve --config (overrides the preset's model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-batch-size", "--batch-size", dest="batch_size", type=int, default=d.batch_size, help="max distinct users per batch")
    p.add_argument("--requests", type=int, default=w.num_requests)
    p.add_argument("--users", type=int, default=w.num_users)
    p.add_argument("--zipf-alpha", type=float, default=w.zipf_alpha)
    p.add_argument("--new-tokens", type=int, nargs=2, default=w.new_tokens, metavar=("LO", "HI"), help="tokens per session")
    p.add_argument(
        "--initial-tokens", type=int, nargs=2, default=w.initial_tokens, metavar=("LO", "HI"), help="tokens of a new history"
    )
    p.add_argument(
        "--max-history-tokens", type=int, default=w.max_history_tokens, help="restart a user beyond this (max_seq_len-1 caps it)"
    )
    p.add_argument("--candidates", type=int, nargs=2, default=w.candidates, metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=w.seed)
    p.add_argument("--first-user", type=int, default=w.first_user, help="user ids start here (another run's users stay apart)")
    p.add_argument("--page-size", type=int, help="tokens per page (default: the preset's)")
    p.add_argument("--num-pages", type=int, help="GPU pages (default: two batches at the history limit)")
    p.add_argument("--chunk-tokens", type=int, help="tokens per host chunk (default: the preset's)")
    p.add_argument("--host-cache-mb", "--host-capacity-mb", dest="host_capacity_mb", type=float, help="host tier size (default: the preset's)")
    p.add_argument("--no-uncached", action="store_true", help="skip the uncached comparison pass")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every cached (or, with --server, every answered) result against forward_no_cache",
    )
    p.add_argument("--server", help="URL of a running `hstu serve` on loopback, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight in --server mode")
    p.add_argument("--incremental", action="store_true",
                   help="--server mode: send only the events after each user's last answered history (hstu.client incremental)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true", help="whole-forward CUDA graphs per row bucket (CUDA only)")
    p.add_argument(
        "--pipeline", type=int, default=d.pipeline, metavar="K",
        help="in-process: batches launched before the oldest one's logits are read (1: rank and sync each batch)",
    )
    p.add_argument("--compile", action="store_true", help="CUDA graphs of torch.compile'd layers (implies --cuda-graphs)")
    p.add_argument(
        "--planner", action=argparse.BooleanOptionalAction, default=None,
        help="in-process cached pass: the compute-or-load planner, costs measured first (default: on for CUDA, as hstu serve)",
    )
    p.add_argument("--offload-min-seen", type=int, help="host-tier admission: sightings before a user's chunks are offloaded (default: hstu serve's)")
    p.add_argument("--host-split", choices=HOST_SPLITS, default=None, help=HOST_SPLIT_HELP)
    p.add_argument("--host-format", choices=HOST_FORMATS, default=None, help=HOST_FORMAT_HELP)
    p.add_argument("--prepare-worker", action="store_true", help="each batch's prepare job on a worker thread (as hstu serve --prepare-worker)")
    p.add_argument("--out", type=Path, default=Path("out/replay"))
    p.set_defaults(func=main)
    return p


def settings_from_args(args: argparse.Namespace) -> ReplaySettings:
    preset_model, preset_cache = presets()[args.preset]
    model = HSTUConfig.from_json(args.model_config) if args.model_config else preset_model
    workload = WorkloadConfig(
        num_requests=args.requests,
        num_users=args.users,
        zipf_alpha=args.zipf_alpha,
        new_tokens=tuple(args.new_tokens),
        initial_tokens=tuple(args.initial_tokens),
        max_history_tokens=args.max_history_tokens,
        candidates=tuple(args.candidates),
        seed=args.seed,
        first_user=args.first_user,
    )
    overrides = {
        "page_size": args.page_size,
        "num_pages": args.num_pages,
        "chunk_tokens": args.chunk_tokens,
        "host_capacity_bytes": None if args.host_capacity_mb is None else int(args.host_capacity_mb * 2**20),
        "offload_min_seen": args.offload_min_seen,
        "prepare_worker": args.prepare_worker or None,
        "host_split": args.host_split,
        "host_format": args.host_format,
    }
    cache = dataclasses.replace(preset_cache, **{k: v for k, v in overrides.items() if v is not None})
    if args.server:
        check_loopback(args.server)
    return ReplaySettings(
        model=model,
        workload=workload,
        cache=cache,
        batch_size=args.batch_size,
        device=args.device,
        uncached=not args.no_uncached,
        verify=args.verify,
        server=args.server,
        concurrency=args.concurrency,
        incremental=args.incremental,
        progress=not args.no_progress,
        cuda_graphs=args.cuda_graphs or args.compile,
        compile_layers=args.compile,
        pipeline=args.pipeline,
        planner=ServerSettings(device=args.device).planner if args.planner is None else args.planner,
    )


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    try:
        doc = replay(settings_from_args(args), args.out)
    except VerifyRefused as exc:
        logger.error("%s", exc)
        return 2
    logger.info("wrote %s and %s", args.out / "replay.json", args.out / "replay.png")
    for name, summary in doc["summary"].items():
        phases = {
            k.removeprefix("forward_").removesuffix("_ms"): v
            for k, v in summary.items()
            if k.startswith("forward_") and k.endswith("_ms")
        }
        if phases:
            logger.info("%s: model-thread ms per batch: %s", name, ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    print(doc["table"])
    mismatches = sum(s.get("verify_mismatches") or 0 for s in doc["summary"].values())
    errors = sum(s.get("errors", 0) for s in doc["summary"].values())
    return 1 if (mismatches or errors) else 0
