"""The ranking engine: one owner of the request pipeline (cache protocol, model thread, graphs).

The names load on first use, so the import-light `hstu export` parser (export_cli.py) does not
import torch."""

from __future__ import annotations

import importlib

__all__ = ["ForwardTiming", "PendingRank", "RankingEngine", "RankOutput"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'hstu.engine' has no attribute {name!r}")
    return getattr(importlib.import_module("hstu.engine.engine"), name)
