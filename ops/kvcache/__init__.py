"""Tiered asynchronous KV cache: config, per-batch metadata, onload handles and the manager."""

from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.handle import OnloadHandle
from hstu.ops.kvcache.metadata import KVCacheMetadata

__all__ = ["KVCacheConfig", "KVCacheMetadata", "OnloadHandle"]
