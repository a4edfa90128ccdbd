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


def _batch(users: int, history: int, cached: int, candidates: int, page_size: int) -> tuple[JaggedLayout, list[list[int]]]:
    layout = JaggedLayout.build([history] * users, [cached] * users, [candidates] * users)
    per_user = -(-history // page_size)
    return layout, [list(range(u * per_user, (u + 1) * per_user)) for u in range(users)]


def measure_compute(block, kv: KVCacheConfig, device: torch.device, max_tokens: int) -> tuple[float, float, float]:
    """(fixed_s, per_row_s, per_pair_s) of ONE layer, least-squares over synthetic batches sized
    like serving ones (several users, long histories), so device time dominates launch overhead."""
    cuda = device.type == "cuda"  # the CPU path pads attention per user: keep its batches small
    history = max(64, min(max_tokens - 1, 4096 if cuda else 512))
    wide = 8 if cuda else 2
    shapes = [  # (users, history, cached, candidates)
        (1, history // 4, 0, 16),
        (wide // 2, history, 0, 64),
        (wide, history, history - history // 32, 256),
        (wide // 2, history // 2, history // 4, 128),
        (wide, history // 4, 0, 32),
    ]
    pages = wide * -(-history // kv.page_size)
    table = torch.zeros((kv.num_layers, pages, 2, kv.page_size, kv.num_heads, kv.head_dim), dtype=kv.dtype, device=device)
    dim = block.config.embedding_dim
    rows_pairs, seconds = [], []
    with torch.inference_mode():
        for users, h, c, m in shapes:
            layout, page_lists = _batch(users, h, c, m, kv.page_size)
            meta = KVCacheMetadata.from_layout(page_lists, layout, kv.page_size).to(device, non_blocking=False)
            x = torch.randn((layout.num_rows, dim), dtype=kv.dtype, device=device)
            seconds.append(_time(lambda: block.forward_paged(x, table, meta), device) / kv.num_layers)
            rows = users * (h - c + m)
            pairs = users * ((h * (h + 1) - c * (c + 1)) // 2 + m * (h + 1))
            rows_pairs.append((1.0, rows, pairs))
    coef, *_ = np.linalg.lstsq(np.asarray(rows_pairs), np.asarray(seconds), rcond=None)
    fixed, per_row, per_pair = (max(float(v), 0.0) for v in coef)
    return fixed, per_row, per_pair


def measure_costs(block, kv: KVCacheConfig, device: torch.device, max_tokens: int) -> CostModel | None:
    """The planner's CostModel for this block and cache on `device`; None when the measurements do
    not show compute growing with the work (a fit that calls recompute free would be trusted to
    recompute everything): the caller then keeps pure onload."""
    fixed, per_row, per_pair = measure_compute(block, kv, device, max_tokens)
    if per_row <= 0 and per_pair <= 0:
        return None
    return CostModel(
        h2d_bytes_per_s=measure_h2d(device),
        bytes_per_token_layer=kv.page_bytes // kv.page_size,
        per_row_s=per_row,
        per_pair_s=per_pair,
        fixed_s=fixed,
    )
