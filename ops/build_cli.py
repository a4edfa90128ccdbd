"""`hstu build-ext`: build the C++/CUDA extension ahead of time (at image build or install time),
so a serving host starts without compiling. The build lands in HSTU_BUILD_DIR (default
~/.cache/hstu_kvcache/<torch version>); ship or mount that directory on hosts without a compiler.

`hstu build-ext --check-cuda` compiles only the CUDA sources, to objects it throws away, against
this install's torch headers: on a machine with nvcc but a CPU build of torch (no GPU) it catches
a CUDA source that would not build before a GPU session is spent on finding out. Both build the
device-launch library too (engine/device_launch.py, on unless HSTU_DEVICE_LAUNCH=0) where the
extension has its CUDA kernels: it is linked, not only compiled, so --check-cuda keeps it."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("build-ext", help="build the C++/CUDA extension now (serving hosts then need no compiler)",
                              description=__doc__)
    p.add_argument("--check-cuda", action="store_true",
                   help="only compile the CUDA sources with nvcc against torch's headers (no GPU needed), then discard them")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hstu.ops._build import check_cuda_sources, cuda_build_enabled, device_launch_library, load_extension

    if args.check_cuda:
        for source in check_cuda_sources():
            logger.info("compiles: %s", source)
        logger.info("device-launch library: %s", device_launch_library())
        return 0

    module = load_extension()
    logger.info("hstu ops ready: %s", module.__file__)
    if cuda_build_enabled():
        logger.info("device-launch library ready: %s", device_launch_library())
    return 0
