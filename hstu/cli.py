"""`hstu` console command (also `python -m hstu`): serve, replay, bench, profile, loadgen,
import-checkpoint, --version. Each subcommand lives with the code it runs."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from hstu import __version__

_SUBCOMMANDS = {
    "serve": "hstu.serving.cli",
    "replay": "hstu.scripts.replay",
    "bench": "hstu.scripts.bench",
    "profile": "hstu.scripts.profile_forward",
    "loadgen": "hstu.scripts.loadgen",
    "import-checkpoint": "hstu.model.checkpoint_cli",
}


def build_parser() -> argparse.ArgumentParser:
    """The full parser; importing each subcommand's module (only its parser, torch loads on run)."""
    early = _version_parser()
    parser = argparse.ArgumentParser(
        prog="hstu", parents=[early], description="HSTU ranking runtime with a tiered KV cache"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in _SUBCOMMANDS.values():
        command = importlib.import_module(module).add_parser(sub)
        if not any("--log-level" in a.option_strings for a in command._actions):
            # `hstu serve --log-level DEBUG` as well as `hstu --log-level DEBUG serve`
            command.add_argument("--log-level", default=argparse.SUPPRESS, help="logging level (default INFO)")
    return parser


def _version_parser() -> argparse.ArgumentParser:
    early = argparse.ArgumentParser(prog="hstu", add_help=False)
    early.add_argument("--version", action="version", version=f"hstu {__version__}")
    return early


def main(argv: list[str] | None = None) -> int:
    _version_parser().parse_known_args(argv)  # answers --version before the subcommands import torch
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)

if __name__ == "__main__":
    sys.exit(main())
