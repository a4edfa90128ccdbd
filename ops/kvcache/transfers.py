"""TierTransfers: the copies between the cache tiers, each on its own worker thread and stream.

  onload   host chunks -> reserved GPU pages, layer by layer on the onload stream (after the
           compute stream's work so far, the batch's own inputs copy included: the model thread
           starts it, PreparedBatch.start_onload, and enqueues every layer's copies), one event
           per layer in the batch's OnloadHandle; the users' host pins are dropped once the copies
           completed, before the handle reports done.
  offload  a batch's newly full chunks: host slots reserved, all layers gathered in one op on the
           offload stream, copied into the slots, committed to the host index only after the copy
           completed (with the digest of the prefix they hold), then the users' GPU pins dropped.
Both fail open: a failed onload fails its handle (the engine recomputes those users), a failed
offload drops the users' host copies. Index changes run under the manager's index lock, copies
outside it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from hstu.model.identity import HistoryIdentity
from hstu.ops._build import load_extension
from hstu.ops.kv_ops import gather_kvcache_all_layers, onload_kvcache, store_host_chunks
from hstu.ops.kvcache.admission import ByteBudget
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.handle import OnloadHandle
from hstu.ops.kvcache.stats import CacheStats

logger = logging.getLogger(__name__)

_CapacityError = load_extension().CacheCapacityError


@dataclass
class OffloadJob:
    """One user's committed history in a batch: its pages and the identity of its tokens."""

    user: int
    history_len: int
    pages: list[int]
    identity: HistoryIdentity


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
    ) -> None:
        self.config, self.device = config, device
        self.gpu, self.host = gpu, host
        self.kv_pages, self.host_arena = kv_pages, host_arena
        self.stats, self._index_lock, self._count_evictions = stats, index_lock, count_evictions
        self.onload_fault = onload_fault
        self.budget = ByteBudget(config.offload_bytes_per_s)
        cuda = device.type == "cuda"
        self._onload_pool = ThreadPoolExecutor(1, thread_name_prefix="hstu-onload")
        self._offload_pool = ThreadPoolExecutor(1, thread_name_prefix="hstu-offload")
        self._onload_stream = torch.cuda.Stream(device) if cuda else None
        self._offload_stream = torch.cuda.Stream(device) if cuda else None
        self._offloads: dict[int, Future] = {}
        self._offloads_lock = threading.Lock()

    # ----------------------------------------------------------------- onload
    def onload_async(
        self, handle: OnloadHandle, users: list[int], slot_ids: torch.Tensor, page_ids: torch.Tensor,
        after: "torch.cuda.Event | None" = None,
    ) -> None:
        """Start copying host slots `slot_ids` into page rows `page_ids` [n, pages_per_chunk], after
        the work enqueued so far on the caller's (compute) stream, or after `after` (an event the
        caller recorded on it earlier): the reserved pages may have been read by a batch launched
        before and not yet finished on the device. (A front pass, which writes other pages, is
        enqueued before its batch's onload and must not be waited for: on the H200 that serialised
        the copies after it, 18.7 ms at batch 8 against 12.8 ms overlapped.)

        Every layer's copies are enqueued here, on the caller's (model) thread, and the onload
        worker only waits for them to complete and settles the onload. Handing the enqueues to the
        worker cost a thread wake-up and GIL hand-off before the first copy (0.47 ms from a batch-1
        batch's inputs copy to its first onload copy on the H200, run AZ) and, with only the first
        layer enqueued here, a 0.13 ms gap in the copy engine before the second (run BA). An
        enqueue costs ~0.03 ms a layer at batch 1 and ~0.2 ms at batch 8, less than the layer's
        copies it queues behind, so the layers' launches still run ahead of their pages."""
        stream = self._onload_stream
        compute_done = after if after is not None else self._compute_event()
        error: BaseException | None = None
        try:
            with torch.cuda.stream(stream):  # a no-op for None (CPU)
                if stream is not None and compute_done is not None:
                    stream.wait_event(compute_done)
                for layer in range(self.config.num_layers):
                    if self.onload_fault is not None:
                        self.onload_fault(users, layer)
                    onload_kvcache(self.kv_pages, self.host_arena, slot_ids, page_ids, layer)
                    handle.mark_ready(layer, stream)
        except BaseException as exc:  # settled on the worker, as a failed copy would be
            error = exc
        self._onload_pool.submit(self._settle_onload, handle, users, page_ids, error)

    def _settle_onload(self, handle, users, page_ids, error: BaseException | None = None) -> None:
        """After onload_async enqueued the copies: wait for them, then drop the users' host pins and
        mark the handle done, or failed (with `error`, or the copies' own) so the batch recomputes
        the users."""
        stream = self._onload_stream
        try:
            if error is not None:
                raise error
            if stream is not None:
                stream.synchronize()
            self.stats.add(bytes_onloaded=int(page_ids.numel()) * self.config.page_bytes * self.config.num_layers)
        except BaseException as exc:  # fail-open: the batch recomputes these users
            error = exc
            logger.warning("onload of users %s failed: %s; they will be recomputed", users, exc)
            self.stats.add(onload_failures=1)
            if stream is not None:
                try:
                    stream.synchronize()
                except BaseException:
                    logger.exception("onload stream failed to synchronize")
        finally:
            with self._index_lock:
                self.host.unpin(users)
            if error is None:
                handle.mark_done()
            else:
                handle.fail(error)

    def prefetch_async(self, user: int, slot_ids: torch.Tensor, page_ids: torch.Tensor, length: int, digest: bytes) -> None:
        """Onload a user's whole host prefix into its reserved (pinned) pages outside any batch, then
        commit it (length, digest) and drop the pins; a plan for the user joins it first. The copies
        wait for the compute stream's work so far: free pages may still be read by a batch the
        engine launched and has not waited for (their owner evicted or invalidated since)."""
        compute_done = self._compute_event()
        future = self._onload_pool.submit(self._prefetch, user, slot_ids, page_ids, length, digest, compute_done)
        with self._offloads_lock:
            self._offloads[user] = future

    def _prefetch(self, user, slot_ids, page_ids, length, digest, compute_done) -> None:
        stream = self._onload_stream
        try:
            with torch.cuda.stream(stream):
                if stream is not None:
                    stream.wait_event(compute_done)
                for layer in range(self.config.num_layers):
                    onload_kvcache(self.kv_pages, self.host_arena, slot_ids, page_ids, layer)
            if stream is not None:
                stream.synchronize()
            self.stats.add(bytes_onloaded=int(page_ids.numel()) * self.config.page_bytes * self.config.num_layers)
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
    def offload_async(self, jobs: list[OffloadJob]) -> None:
        """Offload the jobs' newly full chunks after the compute stream's work so far."""
        compute_done = self._compute_event()
        future = self._offload_pool.submit(self._offload, jobs, compute_done)
        with self._offloads_lock:
            for job in jobs:
                self._offloads[job.user] = future

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
            page_rows, slot_list = [], []
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
                    self._count_evictions()
                    reserved.append((job, first, slots))
                    page_rows += [job.pages[(first + c) * ppc : (first + c + 1) * ppc] for c in range(count)]
                    slot_list.extend(slots)
            if reserved:
                delay = self.budget.delay_for(len(slot_list) * self.config.chunk_bytes)
                if delay > 0:  # paced: D2H stays under its share of the link
                    time.sleep(min(delay, 1.0))
                page_ids = torch.tensor(page_rows, dtype=torch.int32).reshape(-1, ppc)
                slot_ids = torch.tensor(slot_list, dtype=torch.int32)
                with torch.cuda.stream(stream):  # a no-op for None (CPU)
                    if stream is not None:
                        stream.wait_event(compute_done)
                        page_ids = page_ids.to(self.device, non_blocking=True)
                    chunks = gather_kvcache_all_layers(self.kv_pages, page_ids)
                    store_host_chunks(self.host_arena, chunks, slot_ids)
                    if stream is not None:
                        stream.synchronize()
                self.stats.add(bytes_offloaded=len(slot_list) * self.config.chunk_bytes)
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
                    self.host.invalidate(job.user)
        finally:
            with self._index_lock:
                self.gpu.release([j.user for j in jobs])

    def join(self, user_ids: list[int] | None) -> None:
        """Wait for the in-flight offloads of these users (None: of every user)."""
        with self._offloads_lock:
            users = list(self._offloads) if user_ids is None else [u for u in user_ids if u in self._offloads]
            futures = {self._offloads.pop(u) for u in users}
        for f in futures:
            f.result()

    def close(self) -> None:
        """Wait for every offload, then join both workers."""
        self.join(None)
        for pool in (self._onload_pool, self._offload_pool):
            pool.shutdown(wait=True)
