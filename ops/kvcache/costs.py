"""Measure the planner's cost model on the device in use, at start-up (a few ms to a second).

  h2d_bytes_per_s   pinned host -> device copies of a realistic size (CUDA), or a host copy (CPU)
  per-layer compute the paged block on synthetic batches of its own page table (never the cache's
                    pages), fitted as fixed + rows * per_row + attention pairs * per_pair
Either can be overridden (settings); the result is reported in the metrics.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.layout import JaggedLayout
from hstu.ops.kvcache.metadata import KVCacheMetadata
from hstu.ops.kvcache.planner import CostModel


def _time(fn, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of fn() after one warm-up call (device-synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_h2d(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Bytes per second of a pinned host -> device copy (host copy on CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / _time(lambda: dst.copy_(src, non_blocking=True), device)


def _batch(history: int, cached: int, candidates: int, page_size: int) -> tuple[JaggedLayout, list[list[int]]]:
    layout = JaggedLayout.build([history], [cached], [candidates])
    return layout, [list(range(-(-history // page_size)))]


def measure_compute(block, kv: KVCacheConfig, device: torch.device, max_tokens: int) -> tuple[float, float, float]:
    """(fixed_s, per_row_s, per_pair_s) of ONE layer, least-squares over synthetic batches."""
    history = max(64, min(max_tokens, 1024))
    shapes = [(history // 4, 0, 16), (history, 0, 16), (history, history - 32, 256), (history // 2, history // 4, 64)]
    pages = -(-history // kv.page_size)
    table = torch.zeros((kv.num_layers, pages, 2, kv.page_size, kv.num_heads, kv.head_dim), dtype=kv.dtype, device=device)
    dim = block.config.embedding_dim
    rows_pairs, seconds = [], []
    with torch.inference_mode():
        for h, c, m in shapes:
            layout, page_lists = _batch(h, c, m, kv.page_size)
            meta = KVCacheMetadata.from_layout(page_lists, layout, kv.page_size).to(device, non_blocking=False)
            x = torch.randn((layout.num_rows, dim), dtype=kv.dtype, device=device)
            seconds.append(_time(lambda: block.forward_paged(x, table, meta), device) / kv.num_layers)
            rows = h - c + m
            pairs = (h * (h + 1) - c * (c + 1)) // 2 + m * (h + 1)
            rows_pairs.append((1.0, rows, pairs))
    coef, *_ = np.linalg.lstsq(np.asarray(rows_pairs), np.asarray(seconds), rcond=None)
    fixed, per_row, per_pair = (max(float(v), 0.0) for v in coef)
    return fixed, per_row, per_pair


def measure_costs(block, kv: KVCacheConfig, device: torch.device, max_tokens: int) -> CostModel:
    """The planner's CostModel for this block and cache on `device`."""
    fixed, per_row, per_pair = measure_compute(block, kv, device, max_tokens)
    return CostModel(
        h2d_bytes_per_s=measure_h2d(device),
        bytes_per_token_layer=kv.page_bytes // kv.page_size,
        per_row_s=per_row,
        per_pair_s=per_pair,
        fixed_s=fixed,
    )
