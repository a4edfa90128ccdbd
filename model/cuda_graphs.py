"""Per-layer CUDA graphs of the paged HSTU block, padded to a few row-count buckets.

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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from hstu.ops.kvcache.metadata import KVCacheMetadata


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
        cfg = block.config
        self.max_pages = -(-cfg.max_seq_len // kv_cache.shape[3])
        self.device = kv_cache.device
        self.dtype = kv_cache.dtype
        self._pool = torch.cuda.graph_pool_handle()
        self._buckets: dict[int, _Bucket] = {}
        self.replays = 0

    def bucket_for(self, rows: int, batch: int) -> int | None:
        if batch > self.max_batch:
            return None
        return next((b for b in self.bucket_sizes if b >= rows), None)

    def capture_all(self) -> None:
        for rows in self.bucket_sizes:
            self._capture(rows)

    def _static_meta(self, rows: int) -> KVCacheMetadata:
        B, dev = self.max_batch, self.device
        i32 = dict(dtype=torch.int32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        return KVCacheMetadata(
            page_table=torch.full((B, self.max_pages), self.scratch_page, **i32),
            page_indices=torch.zeros(0, **i32),
            page_indptr=torch.zeros(B + 1, **i32),
            last_page_len=torch.ones(B, **i32),
            kv_lens=torch.zeros(B, **i32),
            cached_lens=torch.zeros(B, **i32),
            q_offsets=torch.zeros(B + 1, **i32),
            q_batch=torch.zeros(rows, **i64),
            q_local=torch.zeros(rows, **i64),
            q_pos=torch.zeros(rows, **i64),
            append_rows=torch.zeros(rows, **i64),
            append_page_ids=torch.full((rows,), self.scratch_page, **i32),
            append_offsets=torch.zeros(rows, **i32),
            max_q=rows,
        )

    def _capture(self, rows: int) -> _Bucket:
        x = torch.zeros((rows, self.block.config.embedding_dim), dtype=self.dtype, device=self.device)
        meta = self._static_meta(rows)
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

    def _load(self, bucket: _Bucket, x: torch.Tensor, meta: KVCacheMetadata) -> None:
        T, B = x.shape[0], meta.kv_lens.shape[0]
        s = bucket.meta
        bucket.x[:T].copy_(x)
        mp = meta.page_table.shape[1]
        s.page_table.fill_(self.scratch_page)
        s.page_table[:B, :mp].copy_(meta.page_table)
        s.kv_lens.zero_()
        s.kv_lens[:B].copy_(meta.kv_lens)
        s.q_offsets.fill_(T)
        s.q_offsets[: B + 1].copy_(meta.q_offsets)
        s.q_pos[:T].copy_(meta.q_pos)
        tn = meta.append_rows.shape[0]
        s.append_rows.zero_()
        s.append_rows[:tn].copy_(meta.append_rows)
        s.append_page_ids.fill_(self.scratch_page)
        s.append_page_ids[:tn].copy_(meta.append_page_ids)
        s.append_offsets.zero_()
        s.append_offsets[:tn].copy_(meta.append_offsets)

    def run(self, x: torch.Tensor, meta: KVCacheMetadata, before_layer=None) -> torch.Tensor | None:
        """Replay the layers for this batch; None when it fits no bucket (caller runs eagerly).

        The returned rows alias the bucket's static output: consume them before the next run.
        """
        rows = self.bucket_for(x.shape[0], meta.kv_lens.shape[0])
        if rows is None:
            return None
        bucket = self._buckets.get(rows) or self._capture(rows)
        self._load(bucket, x, meta)
        for i, graph in enumerate(bucket.graphs):
            if before_layer is not None:
                before_layer(i)
            graph.replay()
        self.replays += 1
        return bucket.outputs[-1][: x.shape[0]]
