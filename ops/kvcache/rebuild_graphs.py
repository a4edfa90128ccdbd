"""RebuildGraphs: the K/V rebuild of onloaded hidden-state chunks (host_format "hidden") replayed
as CUDA graphs, one per (layer, chunk-count bucket).

Why: an onload enqueues every layer's rebuild (norm, two K/V matmuls, SiLU, append) on the model
thread before the batch's first layer runs. Eagerly that is a dozen torch calls a layer; at batch 1
on the H200 the onload's enqueue took 3.1 ms of host time a forward, against 0.8 ms for K/V chunks,
with the GPU idle meanwhile (benchmarks/RESULTS.md, run CD). A graph replay is one call a layer.

Layout (static, allocated once):
  rows        [L, max_chunks * chunk_tokens, D]: layer l's onload copies land in rows[l, :n * ct]
  token_index [2, max_chunks * chunk_tokens] int32: each row's page, then its offset in the page;
              a bucket's rows past the onload's n * ct name the scratch page, which the append skips
Graph (l, b) rebuilds rows[l, :b * ct] and appends them into kv_pages[l]; b is the smallest bucket
(powers of two up to max_chunks) holding the onload's chunks. Larger onloads rebuild eagerly.

Ordering (the caller, TierTransfers, keeps it): only batch onloads use the buffers, enqueued on
the model thread one after another (prefetches rebuild eagerly, into tensors of their own); before
writing rows, the copy stream waits for the rebuild stream (an earlier onload's graphs may still
read them); token_index is written on the rebuild stream, so an earlier onload's replays read
their own. Memory: rows plus
one graph pool the size of the largest bucket's intermediates (at the seed shapes, batch 8 of 4k
histories: 512 MB + ~200 MB).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from hstu.ops.kv_ops import append_kvcache

KVRebuilder = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk_buckets(max_chunks: int) -> tuple[int, ...]:
    """Powers of two below max_chunks, then max_chunks itself."""
    buckets, b = [], 1
    while b < max_chunks:
        buckets.append(b)
        b *= 2
    return tuple(buckets + [max_chunks])


class RebuildGraphs:
    """Static buffers and (on CUDA, capture=True) graphs of the rebuild; capture=False runs the
    same static-buffer path eagerly (CPU tests)."""

    def __init__(
        self,
        rebuild: KVRebuilder,
        kv_pages: torch.Tensor,
        num_layers: int,
        chunk_tokens: int,
        hidden_dim: int,
        max_chunks: int,
        scratch_page: int,
        capture: bool = True,
    ) -> None:
        if max_chunks <= 0:
            raise ValueError(f"max_chunks must be positive, got {max_chunks}")
        self.rebuild, self.kv_pages = rebuild, kv_pages
        self.chunk_tokens, self.scratch_page = chunk_tokens, scratch_page
        self.buckets = chunk_buckets(max_chunks)
        T = max_chunks * chunk_tokens
        device = kv_pages.device
        self.rows = torch.zeros((num_layers, T, hidden_dim), dtype=kv_pages.dtype, device=device)
        self.token_index = torch.zeros((2, T), dtype=torch.int32, device=device)
        self.token_index[0].fill_(scratch_page)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0  # layer rebuilds run through the static buffers (tests, metrics)
        self._row_views: dict[int, list[torch.Tensor]] = {}  # chunk count -> rows_for's view per layer
        if capture:
            self._capture(num_layers)

    def bucket(self, chunks: int) -> int | None:
        """The smallest bucket holding `chunks` chunks; None when none does (rebuild eagerly)."""
        return next((b for b in self.buckets if b >= chunks), None)

    def _run(self, layer: int, bucket: int) -> None:
        """What each graph holds: layer's rebuild of the bucket's rows, appended into their pages."""
        n = bucket * self.chunk_tokens
        k, v = self.rebuild(layer, self.rows[layer, :n])
        append_kvcache(
            self.kv_pages, k, v, self.token_index[0, :n], self.token_index[1, :n], layer, skip_page=self.scratch_page
        )

    def _capture(self, num_layers: int) -> None:
        """Every (layer, bucket) graph, after one eager run of each on a side stream (kernels
        loaded, cuBLAS warmed), into one shared pool: their replays never overlap (one stream)."""
        side = torch.cuda.Stream(self.kv_pages.device)
        side.wait_stream(torch.cuda.current_stream(self.kv_pages.device))
        with torch.cuda.stream(side), torch.inference_mode():  # token_index names only the scratch page
            for layer in range(num_layers):
                for b in self.buckets:
                    self._run(layer, b)
        torch.cuda.current_stream(self.kv_pages.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for layer in range(num_layers):
                for b in self.buckets:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=side):
                        self._run(layer, b)
                    self._graphs[(layer, b)] = graph
        torch.cuda.synchronize(self.kv_pages.device)

    def rows_for(self, layer: int, chunks: int) -> torch.Tensor:
        """Where layer's copies of `chunks` chunks land: [chunks, chunk_tokens, D], a static view
        (made once per chunk count: three view calls a layer were ~0.14 ms of an H200 host's
        batch-1 onload enqueue, profiled)."""
        views = self._row_views.get(chunks)
        if views is None:
            n = chunks * self.chunk_tokens
            views = self._row_views[chunks] = [self.rows[i, :n].view(chunks, self.chunk_tokens, -1) for i in range(len(self.rows))]
        return views[layer]

    def set_tokens(self, token_pages: np.ndarray, token_offsets: np.ndarray, bucket: int) -> None:
        """Each onloaded row's page and offset for the bucket's graphs, the rest of the bucket the
        scratch page; enqueued on the current stream (the rebuild stream: after the replays of
        earlier onloads, which read the previous values)."""
        n, size = len(token_pages), bucket * self.chunk_tokens
        index = np.empty((2, size), dtype=np.int32)
        index[0, :n], index[1, :n] = token_pages, token_offsets
        index[0, n:], index[1, n:] = self.scratch_page, 0
        host = torch.from_numpy(index)
        if self.token_index.device.type == "cuda":
            host = host.pin_memory()  # the caching host allocator keeps it until the copy completed
        self.token_index[:, :size].copy_(host, non_blocking=True)

    def replay(self, layer: int, bucket: int) -> None:
        """Rebuild layer's rows of the bucket on the current stream (a graph, or eagerly uncaptured)."""
        self.replays += 1
        graph = self._graphs.get((layer, bucket))
        if graph is None:
            with torch.inference_mode():
                self._run(layer, bucket)
        else:
            graph.replay()
