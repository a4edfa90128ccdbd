"""`hstu build-ext`: build the C++/CUDA extension ahead of time (at image build or install time),
so a serving host starts without compiling. The build lands in HSTU_BUILD_DIR (default
~/.cache/hstu_kvcache/<torch version>); ship or mount that directory on hosts without a compiler."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("build-ext", help="build the C++/CUDA extension now (serving hosts then need no compiler)",
                              description=__doc__)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hstu.ops._build import load_extension

    module = load_extension()
    logger.info("hstu ops ready: %s", module.__file__)
    return 0
