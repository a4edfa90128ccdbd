"""`hstu` console command (also `python -m hstu`): serve, replay, bench, profile, loadgen,
import-checkpoint, build-ext, export, --version. Each subcommand lives with the code it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hstu import __version__

# name -> (module with add_parser(subparsers) and the run function, one-line help for `hstu --help`)
_SUBCOMMANDS = {
    "serve": ("hstu.serving.cli", "run the ranking HTTP server"),
    "replay": ("hstu.scripts.replay", "replay a synthetic workload: cached vs uncached (or against a running server)"),
    "bench": ("hstu.scripts.bench", "cached vs uncached HSTU block and end-to-end benchmark"),
    "profile": ("hstu.scripts.profile_forward", "host and device profile of cached forwards"),
    "loadgen": ("hstu.scripts.loadgen", "open-loop load against a running server"),
    "import-checkpoint": ("hstu.model.checkpoint_cli", "convert an NVIDIA or Meta checkpoint"),
    "build-ext": ("hstu.ops.build_cli", "build the C++/CUDA extension ahead of time"),
    "export": ("hstu.engine.export_cli", "export the cached ranking model as an AOTInductor package (.pt2)"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command`'s full options; other subcommands are listed by name only, so
    only the module of the command being run is imported (`hstu --help` imports no torch)."""
    early = _version_parser()
    parser = argparse.ArgumentParser(
        prog="hstu", parents=[early], description="HSTU ranking runtime with a tiered KV cache"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, summary) in _SUBCOMMANDS.items():
        if name != command:
            sub.add_parser(name, help=summary)
            continue
        parsed = importlib.import_module(module).add_parser(sub)
        if not any("--log-level" in a.option_strings for a in parsed._actions):
            # `hstu serve --log-level DEBUG` as well as `hstu --log-level DEBUG serve`
            parsed.add_argument("--log-level", default=argparse.SUPPRESS, help="logging level (default INFO)")
    return parser


def _version_parser() -> argparse.ArgumentParser:
    early = argparse.ArgumentParser(prog="hstu", add_help=False)
    early.add_argument("--version", action="version", version=f"hstu {__version__}")
    return early


def main(argv: list[str] | None = None) -> int:
    _version_parser().parse_known_args(argv)  # answers --version before the subcommands import torch
    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if w in _SUBCOMMANDS), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)

if __name__ == "__main__":
    sys.exit(main())
