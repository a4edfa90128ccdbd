"""`hstu serve`: run the ranking server with uvicorn.

Kept import-light (argparse only) because hstu/cli.py imports every subcommand to build its parser;
the app and torch are imported when the command runs. A configuration that cannot work is
refused with one logged line (exit status 2) before the model loads or the port is bound.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="run the ranking HTTP server",
        description=(
            "Serve POST /v1/rank, /v2/health/{live,ready}, /v2/models/hstu[/ready], /metrics and /docs with uvicorn."
        ),
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="bind port, 0 for any free port (default %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    p.add_argument("--config", default=None, help="HSTUConfig JSON file (default: the embedded config)")
    p.add_argument("--checkpoint", default=None, help="InferenceRankingGR state_dict file (default: seeded weights)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="override config dtype")
    p.add_argument("--num-pages", type=int, default=1024, help="KV pages in the device tier (default %(default)s)")
    p.add_argument("--page-size", type=int, default=32, help="tokens per KV page (default %(default)s)")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=128,
        help="tokens per host chunk, a multiple of --page-size (default %(default)s)",
    )
    p.add_argument(
        "--host-cache-mb", type=float, default=1024.0, help="host tier MiB, 0 for none (default %(default)s)"
    )
    p.add_argument(
        "--max-batch-size", type=int, default=16, help="most requests in one model batch (default %(default)s)"
    )
    p.add_argument(
        "--max-wait-ms", type=float, default=2.0, help="longest wait in ms for a batch to fill (default %(default)s)"
    )
    p.add_argument(
        "--max-queue", type=int, default=4096, help="most queued requests before 503 overloaded (default %(default)s)"
    )
    p.add_argument("--max-candidates", type=int, default=1024, help="most candidates per request (default %(default)s)")
    p.add_argument(
        "--max-queue-wait-ms",
        type=float,
        default=2000.0,
        help="longest wait in the queue before 503 overloaded with Retry-After (default %(default)s)",
    )
    p.add_argument(
        "--request-timeout-ms",
        type=float,
        default=10000.0,
        help="deadline of a request from arrival; past it the answer is 504 (default %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body, else 413 (default: sized for the longest valid request)",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=10.0,
        help="on SIGTERM/SIGINT, time for queued requests to finish; the rest get 503 (default %(default)s)",
    )
    p.add_argument(
        "--on-shorter-history",
        choices=["invalidate", "raise"],
        default="invalidate",
        help="a history shorter than the cached one: recompute it (invalidate, the default) or answer 409 "
        "(raise, strict mode)",
    )
    p.add_argument("--cuda-graphs", action="store_true", help="replay the paged layers as CUDA graphs (CUDA only)")
    p.add_argument(
        "--compile", action="store_true", help="CUDA graphs of torch.compile'd layers (implies --cuda-graphs; slower start)"
    )
    p.add_argument("--task-names", default=None, help="comma-separated names of the task heads (default task_0,...)")
    p.set_defaults(func=run)
    return p


def settings_from_args(args: argparse.Namespace):
    """ServerSettings for parsed `hstu serve` arguments."""
    from hstu.serving.settings import ServerSettings

    return ServerSettings(
        model_config_path=args.config,
        checkpoint=args.checkpoint,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        num_pages=args.num_pages,
        chunk_tokens=args.chunk_tokens,
        host_cache_bytes=int(args.host_cache_mb * 2**20),
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        max_candidates=args.max_candidates,
        max_queue_wait_ms=args.max_queue_wait_ms,
        request_timeout_ms=args.request_timeout_ms,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout_s=args.shutdown_timeout_s,
        task_names=tuple(args.task_names.split(",")) if args.task_names else None,
        cuda_graphs=args.cuda_graphs or args.compile,
        compile_layers=args.compile,
        on_shorter_history=args.on_shorter_history,
    )


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

    from hstu.serving.app import create_app
    from hstu.serving.server import draining_server

    app = create_app(settings)
    logger.info("serving on http://%s:%d (docs at /docs)", args.host, args.port)
    draining_server(app, args.host, args.port).run()
    return 0
