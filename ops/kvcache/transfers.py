"""TierTransfers: the copies between the cache tiers, each on its own worker thread and stream.

  onload   host chunks -> reserved GPU pages, layer by layer on the onload stream (after the last
           batch that used those pages, page_reuse.py; the model thread starts it after the
           batch's own inputs copy, or before a kernel stages them, PreparedBatch.start_onload,
           and enqueues the layers' copies, one
           ahead of the layer it runs next or all at once, onload_async), one event
           per layer in the batch's OnloadHandle, which is `enqueued` once the last layer is (the
           batch may then commit); the worker waits for the batch's last event, drops the users'
           host pins and marks the handle done.
  offload  a batch's newly full chunks: host slots reserved, all layers gathered in one op on the
           offload stream, copied into the slots, committed to the host index only after the copy
           completed (with the digest of the prefix they hold), then the users' GPU pins dropped.
Under host_format "hidden" a chunk whose layer inputs the batch gathered (OffloadJob.hidden) is
stored as those input rows instead (store_hidden_chunks), and its onload copies the rows and
rebuilds the layer's K/V from them on the rebuild stream (kv_rebuilder: the model's norm + K/V
projection) before marking the layer ready; slot_hidden says which format each host slot holds.
Both fail open: a failed onload fails its handle (the engine recomputes those users), a failed
offload drops the users' host copies. Index changes run under the manager's index lock, copies
outside it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from hstu.model.identity import HistoryIdentity
from hstu.ops._build import load_extension
from hstu.ops.kv_ops import (
    append_kvcache,
    gather_kvcache_all_layers,
    onload_hidden,
    onload_kvcache,
    store_hidden_chunks,
    store_host_chunks,
)
from hstu.ops.kvcache.admission import ByteBudget
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.handle import OnloadHandle, wait_stream
from hstu.ops.kvcache.page_reuse import ALL_EARLIER
from hstu.ops.kvcache.rebuild_graphs import RebuildGraphs
from hstu.ops.kvcache.stats import CacheStats

logger = logging.getLogger(__name__)

_CapacityError = load_extension().CacheCapacityError
_MAX_TRACKED = 4096  # futures kept per user (offloads, settles) before the finished ones are dropped


def _track(futures: dict[int, Future], users: list[int], future: Future) -> dict[int, Future]:
    """`futures` with `users` mapped to `future`; past _MAX_TRACKED entries the finished ones are
    dropped first (a user that never returns is never joined: without this, one entry per user
    ever offloaded stayed for the life of the server)."""
    if len(futures) > _MAX_TRACKED:
        for u, f in futures.items():
            if f.done() and f.exception() is not None:  # (joined, it would have raised there)
                logger.error("background cache work for user %d failed: %s", u, f.exception())
        futures = {u: f for u, f in futures.items() if not f.done()}
    for u in users:
        futures[u] = future
    return futures


# HSTU_REBUILD_AHEAD=1: an onload enqueues every layer's rebuild with its copies instead of each as
# the model thread reaches the layer (an experiment knob for same-call comparisons)
_REBUILD_AHEAD = os.environ.get("HSTU_REBUILD_AHEAD", "0") == "1"


def _copy_ahead() -> int | None:
    """HSTU_ONLOAD_AHEAD: how many layers' K/V copies a batch's onload keeps enqueued beyond the
    layer the model thread is about to run (onload_async); "all": every layer's at once, as before
    (same-call comparisons)."""
    text = os.environ.get("HSTU_ONLOAD_AHEAD", "1").strip().lower()
    if text == "all":
        return None
    try:
        ahead = int(text)
    except ValueError:
        ahead = -1
    if ahead < 0:
        raise ValueError(f"HSTU_ONLOAD_AHEAD must be a layer count >= 0 or 'all', got {text!r}")
    return ahead


COPY_AHEAD = _copy_ahead()


def upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """`values` on `device`, through pinned memory when it is a GPU: a copy from pageable memory may
    wait for the stream's earlier work (the whole forward, when enqueued in finish) before it
    returns, which serialised the host behind the GPU."""
    tensor = torch.from_numpy(values)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class HiddenChunks:
    """A user's chunks [first_chunk, end_chunk) as its batch computed them (host_format "hidden"):
    chunks[c - first_chunk] is chunk c's layer inputs [L, chunk_tokens, D] (a view), gathered on the
    compute stream right after the forward (hidden_tier.gather_hidden)."""

    chunks: list[torch.Tensor]
    first_chunk: int
    end_chunk: int


@dataclass
class OffloadJob:
    """One user's committed history in a batch: its pages and the identity of its tokens."""

    user: int
    history_len: int
    pages: "np.ndarray | list[int]"  # int32 page ids (the reserve's array)
    identity: HistoryIdentity
    hidden: HiddenChunks | None = None


@dataclass
class _OnloadParts:
    """An onload's chunks by host format: K/V slots and their pages, and hidden-state slots with
    each of their tokens' page and offset (on the device: where the rebuilt K/V go)."""

    kv_slots: torch.Tensor
    kv_pages: torch.Tensor
    hidden_slots: torch.Tensor
    hidden_token_pages: torch.Tensor | None  # int32 per token of the hidden chunks: its page ...
    hidden_token_offsets: torch.Tensor | None  # ... and its offset in the page
    # the rebuild graphs' bucket when they rebuild the hidden chunks (the token index is then
    # theirs, written once per onload; the two tensors above are None)
    graph_bucket: int | None = None
    # without the graphs: each layer's copied rows until its rebuild is enqueued
    rows: dict[int, torch.Tensor | None] = field(default_factory=dict)


@dataclass(eq=False)
class _PendingOnload:
    """A batch's onload from its copies' enqueue until the worker settles it: the layers whose
    rebuilds are enqueued (next_layer), its first error, and whether it went to the worker."""

    handle: OnloadHandle
    users: list[int]
    parts: _OnloadParts | None = None
    next_layer: int = 0
    error: BaseException | None = None
    settling: bool = False
    caller_stream: "torch.cuda.Stream | None" = None  # the model thread's (compute) stream
    # K/V-only onloads enqueued lazily (onload_async's `ahead`): the layers kept enqueued beyond the
    # one the model thread is about to run; None: every copy was enqueued at once
    ahead: int | None = None


class TierTransfers:
    """Runs onloads and offloads for one cache manager (which owns every object passed in)."""

    def __init__(
        self,
        config: KVCacheConfig,
        device: torch.device,
        gpu,
        host,
        kv_pages: torch.Tensor,
        host_arena: torch.Tensor,
        stats: CacheStats,
        index_lock: threading.RLock,
        count_evictions: Callable[[], None],
        onload_fault: Callable[[list[int], int], None] | None = None,
        onload_failed_late: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.config, self.device = config, device
        self.gpu, self.host = gpu, host
        self.kv_pages, self.host_arena = kv_pages, host_arena
        self.stats, self._index_lock, self._count_evictions = stats, index_lock, count_evictions
        self.onload_fault = onload_fault
        # an onload enqueued whole (its batch may have committed) failed on the device: its users
        self.onload_failed_late = onload_failed_late
        # host_format "hidden": the arena's hidden-state view [S, L, chunk_tokens, D], which format each
        # slot holds (set for reserved slots before their commit, read only for pinned committed
        # ones), and the model's K/V projection of a layer's input; None: every chunk K/V.
        self.hidden_arena: torch.Tensor | None = None
        self.slot_hidden = np.zeros(host_arena.shape[0], dtype=bool)
        self.kv_rebuilder: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        self.rebuild_graphs: RebuildGraphs | None = None  # capture_rebuilds (CUDA graphs of the rebuild)
        # Enqueue steps of the model thread's onloads (copies; each layer's rebuild) and the prefetch
        # worker's one at a time: they share the per-layer copy events (_copied) and the streams.
        self._enqueue_lock = threading.Lock()
        if config.host_format == "hidden" and host_arena.shape[0] > 0:
            c = config
            self.hidden_arena = host_arena.view(host_arena.shape[0], -1)[
                :, : c.num_layers * c.chunk_tokens * c.hidden_dim
            ].view(host_arena.shape[0], c.num_layers, c.chunk_tokens, c.hidden_dim)
        self.budget = ByteBudget(config.offload_bytes_per_s)
        cuda = device.type == "cuda"
        self._onload_pool = ThreadPoolExecutor(1, thread_name_prefix="hstu-onload")
        self._offload_pool = ThreadPoolExecutor(1, thread_name_prefix="hstu-offload")
        self._onload_stream = torch.cuda.Stream(device) if cuda else None
        # host_format "hidden": the K/V rebuilds of hidden-state chunks run here, each after its
        # layer's copies, so the onload stream's copies of the next layers go on meanwhile (on one
        # stream each copy would wait for the rebuild before it, leaving the link idle).
        self._rebuild_stream = torch.cuda.Stream(device) if cuda else None
        # one event a layer, recorded after the layer's copies and waited for by its rebuild (made
        # once: wait_stream makes and destroys one a call). Under _enqueue_lock; a record made later
        # (another onload's) covers the earlier copies too, the same stream.
        self._copied = [torch.cuda.Event() for _ in range(config.num_layers)] if cuda else []
        self._offload_stream = torch.cuda.Stream(device) if cuda else None
        self._offloads: dict[int, Future] = {}
        # users -> the settle of their last batch onload (host pins dropped when done): finish no
        # longer waits for it, so a plan that may invalidate or rewrite such a user joins it first
        self._settles: dict[int, Future] = {}
        self._offloads_lock = threading.Lock()

    def capture_rebuilds(self, max_chunks: int, scratch_page: int, capture: bool = True) -> None:
        """host_format "hidden": rebuild onloads of up to max_chunks hidden chunks through
        RebuildGraphs (CUDA graphs when capture; else the same static buffers, eagerly)."""
        if self.kv_rebuilder is None or self.hidden_arena is None:
            raise RuntimeError("rebuild graphs need the hidden host format and a K/V rebuilder (rebuild_kv_with)")
        c = self.config
        with self._enqueue_lock:
            self.rebuild_graphs = RebuildGraphs(
                self.kv_rebuilder, self.kv_pages, c.num_layers, c.chunk_tokens, c.hidden_dim, max_chunks,
                scratch_page, capture,
            )

    # ----------------------------------------------------------------- onload
    def onload_async(
        self, handle: OnloadHandle, users: list[int], slot_ids: torch.Tensor, page_ids: torch.Tensor,
        after: "torch.cuda.Event | None" = None,
        pages_used_until: object = ALL_EARLIER,
        ahead: int | None = None,
    ) -> Callable[[int], None]:
        """Start copying host slots `slot_ids` into page rows `page_ids` [n, pages_per_chunk], after
        `pages_used_until`: the compute event of the last batch that used those pages, or None when
        it completed (the manager's PageReuse). Given ALL_EARLIER (unknown), after the work
        enqueued so far on the caller's (compute) stream, or after `after` (an event the caller
        recorded on it earlier): the reserved pages may have been read by a batch launched
        before and not yet finished on the device. (A front pass, which writes other pages, is
        enqueued before its batch's onload and must not be waited for: on the H200 that serialised
        the copies after it, 18.7 ms at batch 8 against 12.8 ms overlapped.)

        Every layer's copies are enqueued here, on the caller's (model) thread, and the onload
        worker only waits for them to complete and settles the onload. Handing the enqueues to the
        worker cost a thread wake-up and GIL hand-off before the first copy (0.47 ms from a batch-1
        batch's inputs copy to its first onload copy on the H200, run AZ) and, with only the first
        layer enqueued here, a 0.13 ms gap in the copy engine before the second (run BA). An
        enqueue costs ~0.03 ms a layer at batch 1 and ~0.2 ms at batch 8, less than the layer's
        copies it queues behind, so the layers' launches still run ahead of their pages.

        ahead: a K/V-only onload enqueues the copies of layers 0..ahead here and each later layer's
        when the model thread reaches the layer `ahead` before it (through), instead of all of them
        before the batch's first layer (None, and always with hidden-state chunks). Why: eight
        layers' enqueues (0.3-0.5 ms at batch 1, more at batch 8) held the first layer's launch,
        so a batch whose layers take longer than their copies (a split recomputing much of its
        prefix) started computing that much later: on an H100 (run GB) a batch-1 split's first
        kernel ran 0.93 ms after a GPU-resident batch's would have, its layer-0 pages landed 0.6 ms
        before it. One layer ahead keeps the copy engine fed (a layer's enqueue and segment launch
        take ~0.07 ms, its copies 0.15 ms and up); it took 0.04-0.15 ms off such splits and was
        neutral elsewhere (run GC), so most of that late start lies elsewhere (benchmarks/RESULTS.md).

        Returns through(layer): enqueue what `layer` needs (the model thread calls it just before
        running that layer): the hidden-state chunks' K/V rebuilds of every layer up to `layer`,
        or a lazy K/V onload's copies up to `layer + ahead`, marking those layers ready; the
        onload settles once the last layer's is enqueued. An onload of K/V copied whole is ready
        and settling on return (through does nothing). Why rebuilds wait for their layer: enqueued with
        the copies, all eight layers' (a graph replay or a dozen eager calls each, with their waits)
        came before the batch's first layer on the host: 2-3 ms a batch-1 forward on the H200 (runs
        CD, CE) while the GPU idled; enqueued on the onload worker instead, batch 1's pure onload
        ran 0.9 ms slower (run CB: thread hand-offs, the GIL)."""
        stream = self._onload_stream
        if pages_used_until is ALL_EARLIER:
            compute_done = after if after is not None else self._compute_event()
        else:  # the manager knows the last batch that used the pages (PageReuse): only it, or nothing
            compute_done = pages_used_until
        # looked up once: each layer's rebuild switches to the rebuild stream and back to this one
        # (torch.cuda.stream and current_stream cost ~5-10 us of Python a call, ~31 calls a batch-1
        # forward under the profiler in run CI)
        caller = torch.cuda.current_stream(self.device) if stream is not None else None
        pending = _PendingOnload(handle, users, caller_stream=caller)
        num_layers = self.config.num_layers
        try:
            with self._enqueue_lock, torch.cuda.stream(stream):  # a no-op for None (CPU)
                if stream is not None and compute_done is not None:
                    stream.wait_event(compute_done)
                parts = pending.parts = self._by_format(slot_ids, page_ids, graphs=True)
                if parts.hidden_slots.numel() > 0:  # every copy now, each layer ready once rebuilt
                    for layer in range(num_layers):
                        self._copy(pending, layer, stream, ready=False)
                else:
                    pending.ahead = ahead
                    for layer in range(num_layers if ahead is None else min(num_layers, ahead + 1)):
                        self._copy(pending, layer, stream, ready=True)
        except BaseException as exc:  # settled on the worker, as a failed copy would be
            pending.error = exc
        through = functools.partial(self._through, pending)
        if _REBUILD_AHEAD and pending.error is None:  # every rebuild now, as before (same-call comparisons)
            through(self.config.num_layers - 1)
        self._settle_if_enqueued(pending)
        return through

    def _copy(self, pending: "_PendingOnload", layer: int, stream: "torch.cuda.Stream | None", ready: bool) -> None:
        """Enqueue one layer's copies (on the current stream, `stream`); ready: the layer is then
        ready (K/V chunks only: nothing left to rebuild) and counted done in next_layer."""
        if self.onload_fault is not None:
            self.onload_fault(pending.users, layer)
        copies = self._copy_layer(pending.parts, layer, stream)
        if ready:
            pending.handle.mark_ready(layer, copies)
            pending.next_layer = layer + 1

    def _through(self, pending: "_PendingOnload", layer: int) -> None:
        """onload_async's through(layer): the rebuilds of layers up to `layer`, or a lazy K/V
        onload's copies up to `layer + ahead`, not yet enqueued."""
        lazy_copies = pending.ahead is not None  # set for K/V-only onloads enqueued lazily (onload_async)
        end = min(self.config.num_layers, layer + 1 + (pending.ahead if lazy_copies else 0))
        if pending.settling or pending.next_layer >= end:
            return  # (a K/V onload copied whole is settling: nothing is left to enqueue)
        try:
            with self._enqueue_lock:
                if lazy_copies:
                    # onto the onload stream and back to the caller's by set_stream: torch.cuda.stream's
                    # context cost ~10 us of Python a call, up to L - 1 - ahead calls a batch
                    stream = self._onload_stream
                    if stream is not None:
                        torch.cuda.set_stream(stream)
                    try:
                        while pending.next_layer < end:
                            self._copy(pending, pending.next_layer, stream, ready=True)
                    finally:
                        if stream is not None:
                            torch.cuda.set_stream(pending.caller_stream)
                else:
                    while pending.next_layer < end:
                        i = pending.next_layer
                        pending.handle.mark_ready(i, self._rebuild_layer(pending.parts, i, pending.caller_stream))
                        pending.next_layer += 1
        except BaseException as exc:
            pending.error = exc
        self._settle_if_enqueued(pending)

    def _settle_if_enqueued(self, pending: "_PendingOnload") -> None:
        """Hand the onload to the worker once every layer is enqueued (the handle is then
        `enqueued` and its bytes counted, here on the model thread), or at its first error."""
        if not pending.settling and (pending.error is not None or pending.next_layer >= self.config.num_layers):
            pending.settling = True
            if pending.error is None:
                self._count_onload(pending.parts)
                pending.handle.mark_enqueued()
            settled = self._onload_pool.submit(
                self._settle_onload, pending.handle, pending.users, pending.parts, pending.error
            )
            with self._offloads_lock:
                self._settles = _track(self._settles, pending.users, settled)

    def _by_format(self, slot_ids: torch.Tensor, page_ids: torch.Tensor, graphs: bool = False) -> _OnloadParts:
        """Split an onload's chunks by the format their slots hold. With `graphs` (a batch's onload
        on the model thread, the graph buffers' only user), hidden chunks that a rebuild graph bucket
        holds get their token index written into the graphs' buffer, on the rebuild stream, and the
        copy (current) stream waits for the rebuilds enqueued before (they may still read the rows
        these copies overwrite)."""
        if self.config.host_format != "hidden":  # every slot holds K/V
            return _OnloadParts(slot_ids, page_ids, slot_ids[:0], None, None)
        slots, rows = slot_ids.numpy(), page_ids.numpy()
        hidden = self.slot_hidden[slots] if slots.size else np.zeros(0, dtype=bool)
        if not hidden.any():
            return _OnloadParts(slot_ids, page_ids, slot_ids[:0], None, None)
        ps = self.config.page_size
        pages = rows[hidden].reshape(-1)
        token_pages = np.repeat(pages, ps).astype(np.int32)
        token_offsets = np.tile(np.arange(ps, dtype=np.int32), len(pages))
        kv = ~hidden  # split in numpy (torch's boolean indexing took twice as long on the host)
        kv_slots, kv_pages, hidden_slots = (torch.from_numpy(a) for a in (slots[kv], rows[kv], slots[hidden]))
        rebuild_graphs = self.rebuild_graphs if graphs else None
        bucket = rebuild_graphs.bucket(int(hidden.sum())) if rebuild_graphs is not None else None
        if bucket is None:
            on_device = upload(np.stack([token_pages, token_offsets]), self.kv_pages.device)
            return _OnloadParts(kv_slots, kv_pages, hidden_slots, on_device[0], on_device[1])
        rebuild = self._rebuild_stream
        if rebuild is not None:
            torch.cuda.current_stream(self.device).wait_stream(rebuild)
        with torch.cuda.stream(rebuild):
            rebuild_graphs.set_tokens(token_pages, token_offsets, bucket)
        return _OnloadParts(kv_slots, kv_pages, hidden_slots, None, None, bucket)

    def _copy_layer(
        self, parts: _OnloadParts, layer: int, copies: "torch.cuda.Stream | None"
    ) -> "torch.cuda.Stream | None":
        """Enqueue one layer's copies on the current stream, `copies` (the onload stream; None off
        CUDA): K/V chunks into their pages, hidden-state chunks' rows into the rebuild graphs' static
        rows or a tensor of their own (parts.rows), then the layer's copy event (_copied), which its
        rebuild waits for. Returns the copy stream (None off CUDA: done on return)."""
        if parts.kv_slots.numel():
            onload_kvcache(self.kv_pages, self.host_arena, parts.kv_slots, parts.kv_pages, layer)
        n = parts.hidden_slots.numel()
        if n == 0:
            return copies
        if self.kv_rebuilder is None or self.hidden_arena is None:
            raise RuntimeError("hidden-state host chunks to onload but no K/V rebuilder was given (rebuild_kv_with)")
        if parts.graph_bucket is not None:
            onload_hidden(self.rebuild_graphs.rows_for(layer, n), self.hidden_arena, parts.hidden_slots, layer)
        else:
            c = self.config
            rows = torch.empty((n, c.chunk_tokens, c.hidden_dim), dtype=self.kv_pages.dtype, device=self.kv_pages.device)
            onload_hidden(rows, self.hidden_arena, parts.hidden_slots, layer)
            parts.rows[layer] = rows
        if copies is not None:
            self._copied[layer].record(copies)
        return copies

    def _rebuild_layer(
        self, parts: _OnloadParts, layer: int, caller: "torch.cuda.Stream | None"
    ) -> "torch.cuda.Stream | None":
        """Enqueue one layer's K/V rebuild of the hidden-state chunks (the layer's norm and K/V
        projection of their rows, into their pages) on the rebuild stream, after the layer's copies
        (the event _copy_layer recorded). caller: the current stream (a graph replay sets the rebuild
        stream, then this one back, without looking it up; None off CUDA). Returns the rebuild
        stream (None off CUDA)."""
        rebuild = self._rebuild_stream
        if rebuild is not None:
            rebuild.wait_event(self._copied[layer])
        if parts.graph_bucket is not None:  # the graphs' static rows, rebuilt by one replay
            if rebuild is None:
                self.rebuild_graphs.replay(layer, parts.graph_bucket)
            else:
                torch.cuda.set_stream(rebuild)
                try:
                    self.rebuild_graphs.replay(layer, parts.graph_bucket)
                finally:
                    torch.cuda.set_stream(caller)
            return rebuild
        c = self.config
        rows, parts.rows[layer] = parts.rows[layer], None
        if rebuild is not None:
            rows.record_stream(rebuild)  # allocated on the copy stream, read on this one
        with torch.cuda.stream(rebuild), torch.inference_mode():  # (the prefetch worker is not in the engine's mode)
            k, v = self.kv_rebuilder(layer, rows.view(-1, c.hidden_dim))
            # one append kernel for K and V (views of the projection; index_copy_ into the strided
            # page halves took 0.26 ms of kernels a batch-1 forward on the H200)
            append_kvcache(self.kv_pages, k, v, parts.hidden_token_pages, parts.hidden_token_offsets, layer)
        return rebuild

    def _count_onload(self, parts: _OnloadParts) -> None:
        """Count a completed onload's bytes (K/V pages and hidden-state chunks) and hidden chunks."""
        c = self.config
        kv = int(parts.kv_pages.numel()) * c.page_bytes * c.num_layers
        hidden = int(parts.hidden_slots.numel())
        self.stats.add(bytes_onloaded=kv + hidden * c.hidden_chunk_bytes, hidden_chunks_onloaded=hidden)

    def _settle_onload(self, handle, users, parts: _OnloadParts | None, error: BaseException | None = None) -> None:
        """After onload_async enqueued the copies: wait for them (this batch's last event), then drop
        the users' host pins and mark the handle done, or failed (with `error`, the enqueue's, or
        the copies' own). A failure found only here, after the handle was `enqueued`, comes after
        the batch may have committed its users: onload_failed_late drops what it committed. (A
        copy that fails on the device is a sticky CUDA error: the batch's own logits then fail to
        copy out, so they are never served.)"""
        late = error is None
        try:
            if error is not None:
                raise error
            handle.synchronize()
        except BaseException as exc:  # fail-open: the batch recomputes these users
            error = exc
            logger.warning("onload of users %s failed: %s; they will be recomputed", users, exc)
            self.stats.add(onload_failures=1)
            if self._onload_stream is not None:
                try:
                    self._onload_stream.synchronize()
                    self._rebuild_stream.synchronize()
                except BaseException:
                    logger.exception("onload stream failed to synchronize")
        finally:
            with self._index_lock:
                self.host.unpin(users)
            if error is None:
                handle.mark_done()
            else:
                handle.fail(error)
                if late and self.onload_failed_late is not None:
                    self.onload_failed_late(users)

    def prefetch_async(self, user: int, slot_ids: torch.Tensor, page_ids: torch.Tensor, length: int, digest: bytes) -> None:
        """Onload a user's whole host prefix into its reserved (pinned) pages outside any batch, then
        commit it (length, digest) and drop the pins; a plan for the user joins it first. The copies
        wait for the compute stream's work so far: free pages may still be read by a batch the
        engine launched and has not waited for (their owner evicted or invalidated since)."""
        compute_done = self._compute_event()
        future = self._onload_pool.submit(self._prefetch, user, slot_ids, page_ids, length, digest, compute_done)
        with self._offloads_lock:
            self._offloads = _track(self._offloads, [user], future)

    def _prefetch(self, user, slot_ids, page_ids, length, digest, compute_done) -> None:
        stream = self._onload_stream
        try:
            with self._enqueue_lock, torch.cuda.stream(stream):
                if stream is not None:
                    stream.wait_event(compute_done)
                parts = self._by_format(slot_ids, page_ids)
                for layer in range(self.config.num_layers):
                    self._copy_layer(parts, layer, stream)
                    if parts.hidden_slots.numel():
                        self._rebuild_layer(parts, layer, stream)
            if stream is not None:
                wait_stream(stream)
                wait_stream(self._rebuild_stream)
            self._count_onload(parts)
            with self._index_lock:
                self.gpu.commit(user, length, digest)
        except BaseException as exc:  # fail-open: the user's next request onloads or recomputes
            logger.warning("prefetch of user %d failed: %s", user, exc)
            self.stats.add(onload_failures=1)
            with self._index_lock:
                self.gpu.release([user])
                self.gpu.invalidate(user)
                self.host.unpin([user])
            return
        with self._index_lock:
            self.gpu.release([user])
            self.host.unpin([user])

    # ---------------------------------------------------------------- offload
    def offload_async(self, jobs: list[OffloadJob], compute_done: "torch.cuda.Event | None" = None) -> None:
        """Offload the jobs' newly full chunks after the compute stream's work so far (or after
        `compute_done`, the caller's event recorded there after the work the offload reads)."""
        if compute_done is None:
            compute_done = self._compute_event()
        future = self._offload_pool.submit(self._offload, jobs, compute_done)
        with self._offloads_lock:
            self._offloads = _track(self._offloads, [job.user for job in jobs], future)

    def _compute_event(self) -> "torch.cuda.Event | None":
        """An event after the work enqueued so far on the caller's (compute) stream; None off CUDA."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _offload(self, jobs: list[OffloadJob], compute_done) -> None:
        ppc, chunk = self.config.pages_per_chunk, self.config.chunk_tokens
        stream = self._offload_stream
        reserved: list[tuple[OffloadJob, int, list[int]]] = []
        try:
            page_rows, slot_list = [], []  # K/V chunks: their pages and slots
            hidden_chunks, hidden_slots = [], []  # hidden-state chunks [L, chunk_tokens, D] and slots
            with self._index_lock:
                for job in jobs:
                    first = len(self.host.lookup(job.user)[0])
                    count = job.history_len // chunk - first
                    if count <= 0:
                        continue
                    try:
                        slots = self.host.reserve(job.user, first, count)
                    except _CapacityError:
                        self.stats.add(offload_skipped=1)
                        continue
                    reserved.append((job, first, slots))
                    h = job.hidden if self.hidden_arena is not None else None
                    if h is None:  # K/V chunks first..first+count: one run of the user's pages
                        page_rows.append(job.pages[first * ppc : (first + count) * ppc])
                        slot_list += slots
                        continue
                    for c, slot in zip(range(first, first + count), slots):
                        if h.first_chunk <= c < h.end_chunk:
                            hidden_chunks.append(h.chunks[c - h.first_chunk])
                            hidden_slots.append(slot)
                        else:
                            page_rows.append(job.pages[c * ppc : (c + 1) * ppc])
                            slot_list.append(slot)
                if reserved:
                    self._count_evictions()
            if reserved:
                c = self.config
                nbytes = len(slot_list) * c.chunk_bytes + len(hidden_slots) * c.hidden_chunk_bytes
                delay = self.budget.delay_for(nbytes)
                if delay > 0:  # paced: D2H stays under its share of the link
                    time.sleep(min(delay, 1.0))
                with torch.cuda.stream(stream):  # a no-op for None (CPU)
                    if stream is not None:
                        stream.wait_event(compute_done)
                    if slot_list:
                        page_ids = torch.from_numpy(np.concatenate(page_rows).astype(np.int32, copy=False)).reshape(-1, ppc)
                        if stream is not None:
                            page_ids = page_ids.to(self.device, non_blocking=True)
                        chunks = gather_kvcache_all_layers(self.kv_pages, page_ids)
                        store_host_chunks(self.host_arena, chunks, torch.tensor(slot_list, dtype=torch.int32))
                    if hidden_slots:
                        store_hidden_chunks(
                            self.hidden_arena, torch.stack(hidden_chunks), torch.tensor(hidden_slots, dtype=torch.int32)
                        )
                    if stream is not None:
                        wait_stream(stream)
                self.slot_hidden[slot_list] = False
                self.slot_hidden[hidden_slots] = True
                self.stats.add(bytes_offloaded=nbytes, hidden_chunks_offloaded=len(hidden_slots))
            with self._index_lock:
                for job, first, slots in reserved:
                    digest = job.identity.prefix((first + len(slots)) * chunk)
                    if not self.host.commit(job.user, slots, first, digest):
                        self.stats.add(offload_skipped=1)
        except BaseException as exc:
            logger.warning("offload of users %s failed: %s; their host copies are dropped", [j.user for j in jobs], exc)
            self.stats.add(offload_failures=1)
            with self._index_lock:
                for job, _, slots in reserved:
                    self.host.abort(slots)
                    if self.host.pin_count(job.user) == 0:  # (pinned: an onload still reads its chunks, kept)
                        self.host.invalidate(job.user)
        finally:
            with self._index_lock:
                self.gpu.release([j.user for j in jobs])

    def join(self, user_ids: list[int] | None) -> None:
        """Wait for the in-flight offloads, prefetches and onload settles of these users (None: of
        every user)."""
        if user_ids is not None and not user_ids:
            return  # (most plans: nobody to wait for)
        futures = set()
        with self._offloads_lock:
            for tracked in (self._offloads, self._settles):
                users = list(tracked) if user_ids is None else [u for u in user_ids if u in tracked]
                futures.update(tracked.pop(u) for u in users)
        for f in futures:
            f.result()

    def close(self) -> None:
        """Wait for every offload, then join both workers."""
        self.join(None)
        for pool in (self._onload_pool, self._offload_pool):
            pool.shutdown(wait=True)
