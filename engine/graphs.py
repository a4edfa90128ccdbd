"""Per-layer CUDA graphs of the paged HSTU block, padded to a few row-count buckets (engine-owned).

Why per layer: layer i must wait for its own onload event, and a stream wait on an event recorded
by another thread cannot live inside a captured graph. So each (bucket, layer) is its own graph;
the waits run eagerly between replays, on the same stream.

Compiled layers: `layer_fns` (torch.compile'd paged layers, one static shape per bucket) replace
the eager layers inside the captures; the graphs then replay Inductor's fused kernels.

Padding (static shapes per bucket of T_pad rows, at most max_batch users):
  rows T..T_pad-1        exist in x but belong to no user (q_offsets stops at T): never attended,
                         their outputs are ignored;
  users B..max_batch-1   kv_lens 0, q_offsets == T: no programs do work for them;
  appends Tn..T_pad-1    write into a scratch page that no user owns (the manager allocates
                         num_pages + 1 pages and never hands out the last);
  page_table             [max_batch, ceil(max_seq_len / page_size)], padded with the scratch page;
  max_q                  = T_pad, the static upper bound the kernel's grid is sized for.
The prepare worker builds a batch's metadata already padded to its bucket (`pad_spec`, then
KVCacheMetadata.from_layout(pad=...)), so a replay refreshes every metadata field, whichever
attention backend the graphs captured (torch reads q_batch/q_local, Triton q_offsets), with one
device copy of the packed buffer; metadata not padded for a bucket runs eagerly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hstu.ops.kvcache.metadata import KVCacheMetadata, PadSpec


@dataclass
class _Bucket:
    rows: int
    x: torch.Tensor
    meta: KVCacheMetadata
    outputs: list[torch.Tensor]
    graphs: list[torch.cuda.CUDAGraph]


class PagedLayerGraphs:
    """Captures and replays the paged layers of `block` for row buckets on one CUDA device."""

    def __init__(
        self,
        block,
        kv_cache: torch.Tensor,
        scratch_page: int,
        max_batch: int,
        buckets: tuple[int, ...],
        layer_fns: Sequence[Callable] | None = None,
    ) -> None:
        self.block = block
        n = len(block.layers)
        if layer_fns is not None and len(layer_fns) != n:
            raise ValueError(f"layer_fns has {len(layer_fns)} functions for {n} layers")
        # layer_fns[i](x, kv_cache, meta): what each captured graph records for layer i.
        self.layer_fns = list(layer_fns) if layer_fns is not None else [functools.partial(block.paged_layer, i) for i in range(n)]
        self.kv_cache = kv_cache
        self.scratch_page = scratch_page
        self.max_batch = max_batch
        self.bucket_sizes = tuple(sorted(buckets))
        self.page_size = kv_cache.shape[3]
        self.max_pages = -(-block.config.max_seq_len // self.page_size)
        self.device = kv_cache.device
        self.dtype = kv_cache.dtype
        self._pool = torch.cuda.graph_pool_handle()
        self._buckets: dict[int, _Bucket] = {}
        self.replays = 0

    def pad_spec(self, rows: int, batch: int) -> PadSpec | None:
        """The padding of a batch of `rows` rows and `batch` users; None when no bucket fits."""
        if batch > self.max_batch:
            return None
        bucket = next((b for b in self.bucket_sizes if b >= rows), None)
        return None if bucket is None else PadSpec(bucket, self.max_batch, self.max_pages, self.scratch_page)

    def capture_all(self) -> None:
        for rows in self.bucket_sizes:
            self._capture(rows)

    def _capture(self, rows: int) -> _Bucket:
        x = torch.zeros((rows, self.block.config.embedding_dim), dtype=self.dtype, device=self.device)
        spec = PadSpec(rows, self.max_batch, self.max_pages, self.scratch_page)
        meta = KVCacheMetadata.padded_empty(spec, self.page_size).to(self.device, non_blocking=False)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: Triton and Inductor compile, allocator settles
            for _ in range(2):
                h = x
                for fn in self.layer_fns:
                    h = fn(h, self.kv_cache, meta)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graphs, outputs, h = [], [], x
        for fn in self.layer_fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, capture_error_mode="thread_local"):
                h = fn(h, self.kv_cache, meta)
            graphs.append(g)
            outputs.append(h)
        bucket = _Bucket(rows, x, meta, outputs, graphs)
        self._buckets[rows] = bucket
        return bucket

    def run(self, x: torch.Tensor, meta: KVCacheMetadata, before_layer=None) -> torch.Tensor | None:
        """Replay the layers for this batch; None when its metadata is not padded for a bucket
        (the caller runs eagerly). The returned rows alias the bucket's static output: consume
        them before the next run."""
        bucket = self._buckets.get(meta.max_q)
        if bucket is None or meta.layout_key != bucket.meta.layout_key or x.shape[0] > bucket.rows:
            return None
        bucket.x[: x.shape[0]].copy_(x)
        bucket.meta.packed[0].copy_(meta.packed[0], non_blocking=True)
        for i, graph in enumerate(bucket.graphs):
            if before_layer is not None:
                before_layer(i)
            graph.replay()
        self.replays += 1
        return bucket.outputs[-1][: x.shape[0]]
