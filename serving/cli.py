"""`hstu serve`: run the ranking server with uvicorn.

The flags' defaults are ServerSettings' own (read when the parser is built); the app is imported
when the command runs. A configuration that cannot work is
refused with one logged line (exit status 2) before the model loads or the port is bound.
`--replicas N` serves the same app on Ray Serve instead (serving/ray_app.py): N ranking replicas
routed by user; Ray is imported only then.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


# (flag, settings field, type, help); each default comes from ServerSettings, never repeated here.
_FLAGS = (
    ("--device", "device", str, "cpu, cuda or cuda:N"),
    ("--config", "model_config_path", str, "HSTUConfig JSON file (default: the embedded config)"),
    ("--checkpoint", "checkpoint", str, "InferenceRankingGR state_dict file (default: seeded weights)"),
    ("--num-pages", "num_pages", int, "KV pages in the device tier"),
    ("--page-size", "page_size", int, "tokens per KV page"),
    ("--chunk-tokens", "chunk_tokens", int, "tokens per host chunk, a multiple of --page-size"),
    ("--max-batch-size", "max_batch_size", int, "most requests in one model batch"),
    ("--max-wait-ms", "max_wait_ms", float, "longest wait in ms for a batch to fill"),
    ("--max-queue", "max_queue", int, "most queued requests before 503 overloaded"),
    ("--max-candidates", "max_candidates", int, "most candidates per request"),
    ("--max-queue-wait-ms", "max_queue_wait_ms", float, "longest wait in the queue before 503 overloaded with Retry-After"),
    ("--request-timeout-ms", "request_timeout_ms", float, "deadline of a request from arrival; past it the answer is 504"),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body, else 413 (default: sized for the longest valid request)"),
    ("--parse-processes", "parse_processes", int,
     "worker processes parsing large bodies off the model's GIL (0: a thread; default 4 on CUDA, 0 on CPU)"),
    ("--front-ends", "front_ends", int,
     "HTTP front-end processes sharing --port, each forwarding parsed requests to the one engine process "
     "(needs the engine process; incremental requests find the histories their front end saw); with "
     "--replicas, the HTTP ingress replicas"),
    ("--gil-switch-interval-ms", "gil_switch_interval_ms", float,
     "the GIL switch interval of the process running the engine (default: Python's 5 ms)"),
    ("--shutdown-timeout-s", "shutdown_timeout_s", float, "on SIGTERM/SIGINT, time for queued requests to finish; the rest get 503"),
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from hstu.serving.settings import ServerSettings

    defaults = ServerSettings()
    p = subparsers.add_parser(
        "serve",
        help="run the ranking HTTP server",
        description=(
            "Serve POST /v1/rank, /v2/health/{live,ready}, /v2/models/hstu[/ready], /metrics and /docs with uvicorn. "
            "Settings come from --config-file (JSON or TOML; the model config as a nested \"model\" section), "
            "then HSTU_<SETTING> / HSTU_MODEL__<FIELD> environment variables, then these flags."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="bind port, 0 for any free port (default %(default)s)")
    p.add_argument("--config-file", default=None, help="settings file (JSON or TOML) with ServerSettings keys")
    for flag, field, kind, text in _FLAGS:
        default = getattr(defaults, field)
        shown = f" (default {default})" if default is not None and "default" not in text else ""
        p.add_argument(flag, dest=field, type=kind, default=None, help=text + shown)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="override config dtype")
    p.add_argument(
        "--host-cache-mb",
        type=float,
        default=None,
        help=f"host tier MiB, 0 for none (default {defaults.host_cache_bytes / 2**20:g})",
    )
    p.add_argument(
        "--history-store-mb",
        type=float,
        default=None,
        help="MiB of users' histories kept so a client may send only new events (incremental requests); "
        f"0 for none (default {defaults.history_store_bytes / 2**20:g})",
    )
    p.add_argument(
        "--on-shorter-history",
        choices=["reuse", "invalidate", "raise"],
        default=None,
        help="a history shorter than the cached one: rank it from the cached prefix when it is exactly its "
        "first tokens, else recompute it (reuse, the default), always recompute it (invalidate) or answer "
        "409 (raise, strict mode)",
    )
    p.add_argument("--host-split", choices=["load_front", "compute_front", "auto"], default=None,
                   # ops/kvcache/config.py's HOST_SPLITS and HOST_SPLIT_HELP, spelled out: this module stays torch-free
                   help="host-tier prefixes split by the planner: onload the front and recompute the back (load_front), "
                   "recompute the front in a pass of its own beside the back's onload (compute_front, Cake's order), "
                   "or either, per batch, whichever the cost model predicts faster (auto, the default)")
    p.add_argument("--host-format", choices=["kv", "hidden"], default=None,
                   # ops/kvcache/config.py's HOST_FORMATS and HOST_FORMAT_HELP, spelled out (torch-free module)
                   help="what the host tier holds of a chunk: its K/V pages (kv, the default), or, for chunks whose layer "
                   "inputs the forwards kept, each layer's input rows (hidden: half the bytes at D = H*d, rebuilt into K/V "
                   "on the GPU when onloaded)")
    p.add_argument(
        "--prepare-worker", action="store_true", default=None,
        help="run each batch's prepare job (pages, metadata) on a worker thread, not on the model thread (an experiment)",
    )
    p.add_argument(
        "--model-on-loop", action=argparse.BooleanOptionalAction, default=None,
        help="with the engine process: launch batches on its event loop's thread, not a model thread of its own "
        "(no GIL hand-offs between them; default: on with the engine process)",
    )
    p.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=None,
        help="run the engine (model, KV cache, batcher) in a child process, so HTTP and parsing never hold its GIL "
        "(default: on for CUDA devices)",
    )
    p.add_argument("--cuda-graphs", action="store_true", default=None, help="replay the paged layers as CUDA graphs (CUDA only)")
    p.add_argument(
        "--compile", action="store_true", default=None,
        help="CUDA graphs of torch.compile'd layers (implies --cuda-graphs; slower start)",
    )
    p.add_argument("--task-names", default=None, help="comma-separated names of the task heads (default task_0,...)")
    p.add_argument(
        "--replicas", type=int, default=None,
        help="serve N ranking replicas on Ray Serve, routed by user (needs the `ray` extra); a local Ray "
        "cluster, or the one RAY_ADDRESS names",
    )
    p.add_argument(
        "--gpus-per-replica", type=float, default=None,
        help="GPUs of each ranking replica with --replicas (default 1 on cuda, 0 on cpu)",
    )
    p.add_argument(
        "--calls-per-replica", type=int, default=None,
        help="with --replicas: calls the ingress keeps in flight to each replica; requests beyond them "
        "wait and share the next call (default 4)",
    )
    p.add_argument(
        "--direct-ingress", action="store_true",
        help="with --replicas: the ingress replicas (--front-ends) serve HTTP on --port themselves, sharing "
        "it (SO_REUSEPORT), and Serve runs no proxy",
    )
    p.set_defaults(func=run)
    return p


def settings_from_args(args: argparse.Namespace, env: dict[str, str] | None = None):
    """ServerSettings for parsed `hstu serve` arguments over --config-file and HSTU_* variables
    (`env`, os.environ when None)."""
    from hstu.serving.settings import ServerSettings

    flags = {field: getattr(args, field) for _, field, _, _ in _FLAGS}
    flags.update(
        dtype=args.dtype,
        host_cache_bytes=_mib_bytes(args.host_cache_mb),
        history_store_bytes=_mib_bytes(args.history_store_mb),
        on_shorter_history=args.on_shorter_history,
        task_names=tuple(args.task_names.split(",")) if args.task_names else None,
        cuda_graphs=True if (args.cuda_graphs or args.compile) else None,
        compile_layers=True if args.compile else None,
        engine_process=args.engine_process,
        prepare_worker=args.prepare_worker,
        model_on_loop=args.model_on_loop,
        host_split=args.host_split,
        host_format=args.host_format,
    )
    return ServerSettings.load(args.config_file, env, **flags)


def _mib_bytes(mib: float | None) -> int | None:
    return None if mib is None else int(mib * 2**20)


def checked_settings(args: argparse.Namespace):
    """ServerSettings for `args`, checked against this machine (ServerSettings.check()); ValueError otherwise."""
    settings = settings_from_args(args)
    settings.check()
    return settings


def run(args: argparse.Namespace) -> int:
    try:
        settings = checked_settings(args)
    except ValueError as exc:
        logger.error("hstu serve: %s", exc)
        return 2

    if args.replicas is not None:
        return _run_on_ray(settings, args)

    logger.info("serving on http://%s:%d (docs at /docs)", args.host, args.port)
    if settings.front_ends > 1:
        from hstu.serving.front_ends import serve_front_ends

        serve_front_ends(settings, args.host, args.port)
        return 0

    from hstu.serving.app import create_app
    from hstu.serving.server import draining_server

    draining_server(create_app(settings), args.host, args.port).run()
    return 0


def _run_on_ray(settings, args: argparse.Namespace) -> int:
    if args.replicas < 1:
        logger.error("hstu serve: --replicas must be at least 1, got %d", args.replicas)
        return 2
    try:
        from hstu.serving.ray_app import serve_locally
    except ImportError as exc:
        logger.error("hstu serve --replicas needs Ray Serve (pip install 'hstu-kvcache[ray]'): %s", exc)
        return 2
    calls = {} if args.calls_per_replica is None else {"max_calls_per_replica": args.calls_per_replica}
    calls["ingress_replicas"] = settings.front_ends
    try:
        serve_locally(
            settings, args.host, args.port, args.replicas, args.gpus_per_replica, args.direct_ingress, **calls
        )
    except ValueError as exc:
        logger.error("hstu serve: %s", exc)
        return 2
    except RuntimeError as exc:  # Serve could not deploy the app (a replica kept failing to start)
        logger.error("hstu serve: the Ray Serve application did not start: %s", exc)
        return 1
    return 0
