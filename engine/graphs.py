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
Every tensor field of KVCacheMetadata is refreshed before a replay, whichever attention backend
the graphs captured (the torch path reads q_batch/q_local, Triton reads q_offsets): `_PADDING`
names the fill of each field past the batch's own entries, and a field without a rule is an error.
Padded rows get q_batch 0 and q_local = their row index (>= T, so never a real row's slot).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch

from hstu.ops.kvcache.metadata import KVCacheMetadata


# Fill of each metadata field past the batch's entries: a value, "scratch" (the scratch page),
# "last" (the batch's last offset: padded users and rows own nothing) or "row" (the row index).
_PADDING: dict[str, int | str] = {
    "page_table": "scratch",
    "page_indices": "scratch",
    "page_indptr": "last",
    "last_page_len": 1,
    "kv_lens": 0,
    "cached_lens": 0,
    "q_offsets": "last",
    "q_batch": 0,
    "q_local": "row",
    "q_pos": -1,
    "append_rows": 0,
    "append_page_ids": "scratch",
    "append_offsets": 0,
}


def _tensor_fields() -> set[str]:
    return {f.name for f in fields(KVCacheMetadata)} - {"max_q", "packed"}


def static_metadata(rows: int, max_batch: int, max_pages: int, scratch_page: int, device) -> KVCacheMetadata:
    """A bucket's metadata: the largest shapes a padded batch of `rows` rows can need."""
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    B = max_batch
    return KVCacheMetadata(
        page_table=torch.full((B, max_pages), scratch_page, **i32),
        page_indices=torch.full((B * max_pages,), scratch_page, **i32),
        page_indptr=torch.zeros(B + 1, **i32),
        last_page_len=torch.ones(B, **i32),
        kv_lens=torch.zeros(B, **i32),
        cached_lens=torch.zeros(B, **i32),
        q_offsets=torch.zeros(B + 1, **i32),
        q_batch=torch.zeros(rows, **i64),
        q_local=torch.arange(rows, **i64),
        q_pos=torch.full((rows,), -1, **i64),
        append_rows=torch.zeros(rows, **i64),
        append_page_ids=torch.full((rows,), scratch_page, **i32),
        append_offsets=torch.zeros(rows, **i32),
        max_q=rows,
    )


def pad_metadata(static: KVCacheMetadata, meta: KVCacheMetadata, scratch_page: int) -> None:
    """Copy a batch's metadata into a bucket's static (larger) metadata, padding every field."""
    missing = _tensor_fields() - set(_PADDING)
    if missing:
        raise RuntimeError(f"no CUDA-graph padding rule for metadata fields {sorted(missing)}")
    for name, src in meta.tensors().items():
        dst, fill = getattr(static, name), _PADDING[name]
        if name == "page_table":
            dst.fill_(scratch_page)
            dst[: src.shape[0], : src.shape[1]].copy_(src)
            continue
        n = src.shape[0]
        if n > dst.shape[0]:
            raise ValueError(f"metadata field {name} has {n} entries; the bucket holds {dst.shape[0]}")
        dst[:n].copy_(src)
        rest = dst[n:]
        if rest.numel() == 0:
            continue
        if fill == "scratch":
            rest.fill_(scratch_page)
        elif fill == "last":
            rest.copy_(src[-1:].expand_as(rest))
        elif fill == "row":
            torch.arange(n, dst.shape[0], out=rest)
        else:
            rest.fill_(fill)


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

    def _capture(self, rows: int) -> _Bucket:
        x = torch.zeros((rows, self.block.config.embedding_dim), dtype=self.dtype, device=self.device)
        meta = static_metadata(rows, self.max_batch, self.max_pages, self.scratch_page, self.device)
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
        bucket.x[: x.shape[0]].copy_(x)
        pad_metadata(bucket.meta, meta, self.scratch_page)

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
