"""`hstu export`: the cached ranking model as an AOTInductor package (.pt2) that a C++ program
runs without Python (tools/aoti_runner/). The package holds the weights and the whole cache flow
of engine/exported.py (GPU tier: lookup, page allocation with LRU eviction, append, commit); it
starts with an empty cache each time it is loaded.

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
    p.add_argument("--num-pages", type=int, default=1024, help="KV pages in the cache (default %(default)s)")
    p.add_argument("--page-size", type=int, default=32, help="tokens per page (default %(default)s)")
    p.add_argument("--device", default="cpu", help="device the package runs on (default %(default)s)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from hstu.engine.exported import ExportableRanker, package_ranker
    from hstu.model.config import HSTUConfig
    from hstu.model.ranking import InferenceRankingGR

    if args.num_pages <= 0 or args.page_size <= 0:
        raise SystemExit(f"hstu export: --num-pages {args.num_pages} and --page-size {args.page_size} must be positive")
    config = HSTUConfig.from_json(args.config) if args.config else HSTUConfig()
    model = InferenceRankingGR(config, device=args.device)
    if args.checkpoint:
        model.load_state_dict(torch.load(args.checkpoint, map_location=args.device, weights_only=True))
    started = time.monotonic()
    path = package_ranker(ExportableRanker(model, args.num_pages, args.page_size), args.out)
    logger.info("wrote %s in %.0f s (%d pages x %d tokens cache)", path, time.monotonic() - started, args.num_pages, args.page_size)
    return 0
