"""`hstu export`: the cached ranking model as an AOTInductor package (.pt2) that a C++ program
runs without Python (tools/aoti_runner/). The package holds the weights and the whole cache flow
of engine/exported.py (lookup in both tiers, page allocation with LRU eviction, onload, append,
commit, offload); it starts with an empty cache each time it is loaded.

Import-light (argparse only): torch loads when the command runs."""

from __future__ import annotations

import argparse
import logging
import time

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export", help="export the cached ranking model as an AOTInductor package", description=__doc__
    )
    p.add_argument("--out", required=True, help="package path to write (model.pt2)")
    p.add_argument("--config", default=None, help="HSTUConfig JSON file (default: the embedded config)")
    p.add_argument("--checkpoint", default=None, help="InferenceRankingGR state_dict file (default: seeded weights)")
    p.add_argument("--num-pages", type=int, default=1024, help="KV pages in the device tier (default %(default)s)")
    p.add_argument("--page-size", type=int, default=32, help="tokens per KV page (default %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=128, help="tokens per host chunk, a multiple of --page-size (default %(default)s)")
    p.add_argument("--host-cache-mb", type=float, default=1024, help="host tier MiB, 0 for none (default %(default)s)")
    p.add_argument("--device", default="cpu", help="device the package runs on (default %(default)s)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from hstu.engine.exported import ExportableRanker, package_ranker
    from hstu.model.config import HSTUConfig
    from hstu.model.ranking import InferenceRankingGR
    from hstu.ops.kvcache.config import KVCacheConfig

    config = HSTUConfig.from_json(args.config) if args.config else HSTUConfig()
    try:
        cache_config = KVCacheConfig.for_model(
            config, num_pages=args.num_pages, page_size=args.page_size, chunk_tokens=args.chunk_tokens,
            host_capacity_bytes=int(args.host_cache_mb * 2**20),
        )
    except ValueError as e:
        raise SystemExit(f"hstu export: {e}") from e
    model = InferenceRankingGR(config, device=args.device)
    if args.checkpoint:
        model.load_state_dict(torch.load(args.checkpoint, map_location=args.device, weights_only=True))
    started = time.monotonic()
    path = package_ranker(ExportableRanker(model, cache_config), args.out)
    logger.info(
        "wrote %s in %.0f s (cache: %d pages x %d tokens, %d host chunks x %d tokens)", path, time.monotonic() - started,
        cache_config.num_pages, cache_config.page_size, cache_config.host_slots, cache_config.chunk_tokens,
    )
    return 0
