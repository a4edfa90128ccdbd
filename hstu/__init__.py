"""hstu-kvcache: inference runtime for HSTU ranking models with a tiered, asynchronous KV cache.

The in-process API in one import: `from hstu import RankingEngine, RankingRequest, HSTUConfig`.
Those names load on first use, so `import hstu` (and `hstu --version`) does not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "RankingEngine": "hstu.engine",
    "RankOutput": "hstu.engine",
    "RankingRequest": "hstu.model.batch",
    "HSTUConfig": "hstu.model.config",
    "KVCacheConfig": "hstu.ops.kvcache.config",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hstu' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
