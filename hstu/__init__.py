"""hstu-kvcache: inference runtime for HSTU ranking models with a tiered, asynchronous KV cache."""

__version__ = "0.1.0"
