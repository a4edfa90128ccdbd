"""AsyncKVCacheManager: the tiered (GPU pages + host chunks) KV cache behind one model.

Lifecycle of a batch (one model thread drives it; workers run beside it):
  lookup()         sync, microseconds: cached length per user from the GPU tier, else the host
                   tier; checks the exact identity of the cached prefix (model/identity.py digests
                   of every input it was computed from); pins host entries it will onload.
  prepare_async()  prepare worker: reserves pages (pins users, evicts LRU unpinned users), builds
                   the batch's KVCacheMetadata, hands the host->GPU copies to the onload worker,
                   which enqueues them layer by layer on the onload stream (one event per layer).
  wait_prepared()  joins the prepare future (re-raising its error) and moves metadata to the device.
  offload_async()  after the block ran: commits new lengths, invalidates users whose onload
                   failed (the caller recomputes them), and offloads newly full chunks: the offload
                   worker gathers all layers' pages in one op on the offload stream, copies them
                   into host slots, commits them to the host index only after the copy completed,
                   then unpins the users.
  abort()          the forward failed: wait for the onload, unpin, keep only committed state.

Invariants:
  - A user's pages are never evicted or shrunk while pinned (in a batch, or being offloaded).
  - A host slot is reused only after its user was unpinned (no onload reads it) or, if reserved,
    after its copy was committed or aborted.
  - A user's in-flight offload is joined before a lookup that could shrink, drop or onload the
    user; a plain extension (GPU hit, more tokens, same prefix) runs beside it, since it only
    appends after the committed tokens the offload reads (its pages are pinned once per batch).
  - The GPU tier never holds less than the host tier for a resident user (host is filled from GPU).
  - Cached K/V are reused only when the digest stored with them equals the request's digest of the
    same prefix; a shortened or uncommitted prefix has an empty digest, which matches nothing.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from hstu.model.identity import HistoryIdentity
from hstu.ops._build import load_extension
from hstu.ops.kv_ops import gather_kvcache_all_layers, onload_kvcache, store_host_chunks
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.handle import OnloadHandle
from hstu.ops.kvcache.metadata import KVCacheMetadata
from hstu.ops.kvcache.stats import CacheStats

logger = logging.getLogger(__name__)

_ext = load_extension()
CacheCapacityError = _ext.CacheCapacityError


class HistoryConflictError(ValueError):
    """A request's history does not extend the user's cached history (policy says raise)."""


@dataclass
class LookupResult:
    """What lookup found: cached length and source tier per user, host slots to onload."""

    user_ids: list[int]
    history_lens: list[int]
    identities: list[HistoryIdentity]
    cached_lens: list[int]
    sources: list[str]
    onload_slots: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class PreparedBatch:
    """A batch whose pages are reserved; metadata is on the host until wait_prepared."""

    lookup: LookupResult
    pages: list[list[int]]
    metadata: KVCacheMetadata
    handle: OnloadHandle
    onload_users: list[int]
    # Digest of each user's whole history, for the commit: finished on the prepare worker
    # (the tail block of each history), not on the model thread.
    digests: list[bytes]


class AsyncKVCacheManager:
    """Owns the GPU page table, the host arena, both C++ indexes and the three worker threads."""

    def __init__(
        self,
        config: KVCacheConfig,
        device: torch.device | str = "cpu",
        onload_fault: Callable[[list[int], int], None] | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        c = config
        self.gpu = _ext.GpuPageManager(c.num_pages, c.page_size)
        self.host = _ext.HostStorage(c.host_slots, c.chunk_tokens)
        # One extra page that no user ever owns: padded (CUDA-graph) batches write into it.
        self.scratch_page = c.num_pages
        self.kv_cache = torch.zeros(
            (c.num_layers, c.num_pages + 1, 2, c.page_size, c.num_heads, c.head_dim), dtype=c.dtype, device=self.device
        )
        self.host_arena = torch.zeros(
            (c.host_slots, c.num_layers, c.pages_per_chunk, 2, c.page_size, c.num_heads, c.head_dim),
            dtype=c.dtype,
            pin_memory=self.is_cuda,
        )
        self.stats = CacheStats()
        self.onload_fault = onload_fault
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="hstu-prepare")
        self._onload_pool = ThreadPoolExecutor(1, thread_name_prefix="hstu-onload")
        self._offload_pool = ThreadPoolExecutor(1, thread_name_prefix="hstu-offload")
        self._onload_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._offload_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._offloads: dict[int, Future] = {}
        self._offloads_lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------- lookup
    def lookup(self, user_ids: list[int], history_lens: list[int], identities: list[HistoryIdentity]) -> LookupResult:
        """Cached length per user (GPU tier first, then host), reusing a cached prefix only when its
        digest equals the request's digest of the same prefix (identities[i] covers user i's history)."""
        self._check_open()
        if len(set(user_ids)) != len(user_ids):
            dup = next(u for u in user_ids if user_ids.count(u) > 1)
            raise ValueError(f"user {dup} appears twice in one batch; a batch must hold distinct users")
        if len(history_lens) != len(user_ids) or len(identities) != len(user_ids):
            raise ValueError(
                f"got {len(user_ids)} users but {len(history_lens)} history lengths and {len(identities)} identities"
            )
        for u, n, ident in zip(user_ids, history_lens, identities):
            if n <= 0:
                raise ValueError(f"user {u}: history length must be positive, got {n}")
            if ident.num_tokens != n:
                raise ValueError(f"user {u}: identity covers {ident.num_tokens} tokens but the history has {n}")
        result = LookupResult(list(user_ids), list(history_lens), list(identities), [], [])
        pinned: list[int] = []
        try:
            for u, n, ident in zip(user_ids, history_lens, identities):
                cached, source = self._lookup_one(u, n, ident, result)
                if source == "host":
                    pinned.append(u)
                result.cached_lens.append(cached)
                result.sources.append(source)
        except BaseException:
            self.host.unpin(pinned)
            raise
        self.stats.add(
            gpu_hits=result.sources.count("gpu"),
            host_hits=result.sources.count("host"),
            misses=result.sources.count("miss"),
        )
        return result

    def _lookup_one(self, user: int, n: int, ident: HistoryIdentity, result: LookupResult) -> tuple[int, str]:
        gpu_len, gpu_digest = self.gpu.lookup(user)
        if 0 < gpu_len < n and gpu_digest and ident.prefix(gpu_len) == gpu_digest:
            # A plain extension only appends after the committed tokens: it may run while this
            # user's previous offload still reads its full chunks.
            return gpu_len, "gpu"
        # Anything else may shrink or drop the user's pages or read its host slots: settle first.
        self._join_offloads([user])
        gpu_len, gpu_digest = self.gpu.lookup(user)
        if gpu_len > 0:
            usable = self._usable_length(user, n, ident, gpu_len, gpu_digest)
            if usable > 0:
                return usable, "gpu"
        slots, host_digest = self.host.lookup(user)
        host_len = len(slots) * self.config.chunk_tokens
        if host_len > 0:
            usable = self._usable_length(user, n, ident, host_len, host_digest)
            if usable > 0:
                n_chunks = -(-usable // self.config.chunk_tokens)
                try:
                    self.host.pin([user])
                except ValueError:  # evicted by the offload worker since the lookup: a miss
                    return 0, "miss"
                self.host.touch(user)
                result.onload_slots[user] = list(slots[:n_chunks])
                return usable, "host"
        return 0, "miss"

    def _usable_length(self, user: int, n: int, ident: HistoryIdentity, cached: int, cached_digest: bytes) -> int:
        """How much of a cached prefix of `cached` tokens a request of `n` tokens may reuse (0 = none).

        The request's history is the truth: a shorter history (policy "invalidate") or one whose
        first `cached` tokens differ from what the cache was computed from drops the entry."""
        c = self.config
        if n == cached and c.on_no_new_tokens == "raise":
            raise HistoryConflictError(
                f"user {user}: request has no new tokens: history is {n} tokens and all {cached} are cached"
            )
        if n < cached and c.on_shorter_history == "raise":
            raise HistoryConflictError(
                f"user {user}: history of {n} tokens is shorter than the {cached} cached tokens"
            )
        if n < cached:
            self.invalidate(user)
            self.stats.add(invalidations=1, invalidated_shorter=1)
            return 0
        if not cached_digest or ident.prefix(cached) != cached_digest:
            self.invalidate(user)
            self.stats.add(invalidations=1, invalidated_diverged=1)
            return 0
        return min(cached, n - 1)

    def release_lookup(self, lookup: LookupResult) -> None:
        """Undo lookup's host pins when the batch is dropped before prepare_async."""
        self.host.unpin(list(lookup.onload_slots))

    # ---------------------------------------------------------------- prepare
    def prepare_async(self, lookup: LookupResult, layout) -> Future:
        """Reserve pages, build metadata and start the onload on the prepare worker.

        `layout` is the batch's model.preprocessor.JaggedLayout (rows of new tokens and candidates).
        """
        self._check_open()
        if list(layout.history_lens) != lookup.history_lens or list(layout.cached_lens) != lookup.cached_lens:
            raise ValueError(
                f"layout (history {layout.history_lens}, cached {layout.cached_lens}) does not match the lookup "
                f"(history {lookup.history_lens}, cached {lookup.cached_lens})"
            )
        after = None
        if self.is_cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        future = self._prepare_pool.submit(self._prepare, lookup, layout, after)
        return future

    def _prepare(self, lookup: LookupResult, layout, compute_done: "torch.cuda.Event | None") -> PreparedBatch:
        try:
            keep = [c if s == "gpu" else 0 for c, s in zip(lookup.cached_lens, lookup.sources)]
            try:
                pages = self.gpu.reserve(lookup.user_ids, keep, lookup.history_lens)
            except CacheCapacityError:
                # Pages pinned by in-flight offloads become evictable once those finish.
                self.drain()
                pages = self.gpu.reserve(lookup.user_ids, keep, lookup.history_lens)
        except BaseException:
            self.host.unpin(list(lookup.onload_slots))
            raise
        self._count_evictions()
        metadata = KVCacheMetadata.from_layout(pages, layout, self.config.page_size, pin=self.is_cuda)
        onload_users = list(lookup.onload_slots)
        if not onload_users:
            handle = OnloadHandle.completed(self.config.num_layers)
        else:
            handle = OnloadHandle(self.config.num_layers, self.device, self.config.onload_timeout_s)
            slot_ids, page_ids = self._onload_plan(lookup, pages)
            self._onload_pool.submit(self._onload, handle, onload_users, slot_ids, page_ids, compute_done)
        digests = [ident.prefix(n) for ident, n in zip(lookup.identities, lookup.history_lens)]
        return PreparedBatch(lookup, pages, metadata, handle, onload_users, digests)

    def _onload_plan(self, lookup: LookupResult, pages: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ppc = self.config.pages_per_chunk
        slots, page_rows = [], []
        for b, u in enumerate(lookup.user_ids):
            for c, slot in enumerate(lookup.onload_slots.get(u, [])):
                slots.append(slot)
                page_rows.append(pages[b][c * ppc : (c + 1) * ppc])
        return torch.tensor(slots, dtype=torch.int32), torch.tensor(page_rows, dtype=torch.int32).reshape(-1, ppc)

    def _onload(
        self,
        handle: OnloadHandle,
        users: list[int],
        slot_ids: torch.Tensor,
        page_ids: torch.Tensor,
        compute_done: "torch.cuda.Event | None",
    ) -> None:
        """Onload worker: copy host chunks into the reserved pages, layer by layer.

        The host pins are dropped only once the copies completed, and before the handle reports
        done, so a finished batch never leaves pins behind.
        """
        stream = self._onload_stream
        error: BaseException | None = None
        try:
            with torch.cuda.stream(stream):  # a no-op for None (CPU)
                if stream is not None and compute_done is not None:
                    stream.wait_event(compute_done)
                for layer in range(self.config.num_layers):
                    if self.onload_fault is not None:
                        self.onload_fault(users, layer)
                    onload_kvcache(self.kv_cache, self.host_arena, slot_ids, page_ids, layer)
                    handle.mark_ready(layer, stream)
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
            self.host.unpin(users)
            if error is None:
                handle.mark_done()
            else:
                handle.fail(error)

    def wait_prepared(self, future: Future) -> PreparedBatch:
        """Join the prepare future (re-raising its error) and move the metadata to the device."""
        prepared: PreparedBatch = future.result()
        if self.device.type != "cpu":
            prepared.metadata = prepared.metadata.to(self.device, non_blocking=True)
        return prepared

    # ---------------------------------------------------------- commit + offload
    def offload_async(self, prepared: PreparedBatch) -> list[int]:
        """After the block ran: commit the batch, start its offload (gather + D2H on the offload
        stream, host commit once the copy completed, then unpin), and return the users whose
        onload failed, which the caller must recompute."""
        handle = prepared.handle
        handle.wait_done()
        lk = prepared.lookup
        failed = set(prepared.onload_users) if handle.failed else set()
        ok_users, offload_plan = [], []
        for b, u in enumerate(lk.user_ids):
            if u in failed:
                continue
            n = lk.history_lens[b]
            self.gpu.commit(u, n, prepared.digests[b])
            ok_users.append(u)
            offload_plan.append((u, b))
            self.stats.add(cached_tokens=lk.cached_lens[b], computed_tokens=n - lk.cached_lens[b])
        if failed:
            failed_list = sorted(failed)
            self.gpu.release(failed_list)
            for u in failed_list:
                self.invalidate(u)
            self.stats.add(recomputes=len(failed_list))
        self._start_offload(prepared, offload_plan)
        return sorted(failed)

    def abort(self, prepared: PreparedBatch) -> None:
        """The forward failed: release the batch; the new tokens were never committed."""
        try:
            prepared.handle.wait_done()
        finally:
            self.gpu.release(prepared.lookup.user_ids)

    # ---------------------------------------------------------------- offload
    def _start_offload(self, prepared: PreparedBatch, plan: list[tuple[int, int]]) -> None:
        chunk = self.config.chunk_tokens
        jobs = [(u, b) for u, b in plan if prepared.lookup.history_lens[b] >= chunk and self.config.host_slots > 0]
        keep = {u for u, _ in jobs}
        no_offload = [u for u, _ in plan if u not in keep]
        if no_offload:
            self.gpu.release(no_offload)
        if not jobs:
            return
        compute_done = None
        if self.is_cuda:
            compute_done = torch.cuda.Event()
            compute_done.record(torch.cuda.current_stream(self.device))
        future = self._offload_pool.submit(self._offload, prepared, jobs, compute_done)
        with self._offloads_lock:
            for u, _ in jobs:
                self._offloads[u] = future

    def _offload(self, prepared: PreparedBatch, jobs, compute_done) -> None:
        """Offload worker: reserve host slots, gather all layers in one op, copy, then commit."""
        ppc, chunk = self.config.pages_per_chunk, self.config.chunk_tokens
        stream = self._offload_stream
        reserved: list[tuple[int, int, int, list[int]]] = []
        users = [u for u, _ in jobs]
        try:
            page_rows, slot_list = [], []
            for u, b in jobs:
                # Decided here, not at submit time: only this worker evicts host entries.
                first = len(self.host.lookup(u)[0])
                count = prepared.lookup.history_lens[b] // chunk - first
                if count <= 0:
                    continue
                try:
                    slots = self.host.reserve(u, first, count)
                except CacheCapacityError:
                    self.stats.add(offload_skipped=1)
                    continue
                self._count_evictions()
                reserved.append((u, b, first, slots))
                pages = prepared.pages[b]
                for c in range(count):
                    page_rows.append(pages[(first + c) * ppc : (first + c + 1) * ppc])
                slot_list.extend(slots)
            if reserved:
                page_ids = torch.tensor(page_rows, dtype=torch.int32).reshape(-1, ppc)
                slot_ids = torch.tensor(slot_list, dtype=torch.int32)
                with torch.cuda.stream(stream):  # a no-op for None (CPU)
                    if stream is not None:
                        stream.wait_event(compute_done)
                        page_ids = page_ids.to(self.device, non_blocking=True)
                    chunks = gather_kvcache_all_layers(self.kv_cache, page_ids)
                    store_host_chunks(self.host_arena, chunks, slot_ids)
                    if stream is not None:
                        stream.synchronize()
                self.stats.add(bytes_offloaded=len(slot_list) * self.config.chunk_bytes)
            for u, b, first, slots in reserved:
                n_tokens = (first + len(slots)) * chunk
                if not self.host.commit(u, slots, first, prepared.lookup.identities[b].prefix(n_tokens)):
                    self.stats.add(offload_skipped=1)
        except BaseException as exc:
            logger.warning("offload of users %s failed: %s; their host copies are dropped", users, exc)
            self.stats.add(offload_failures=1)
            for u, _, _, slots in reserved:
                self.host.abort(slots)
                self.host.invalidate(u)
        finally:
            self.gpu.release(users)

    def _join_offloads(self, user_ids: list[int] | None) -> None:
        """Wait for the in-flight offloads of these users (None: of every user)."""
        with self._offloads_lock:
            users = list(self._offloads) if user_ids is None else [u for u in user_ids if u in self._offloads]
            futures = {self._offloads.pop(u) for u in users}
        for f in futures:
            f.result()

    def drain(self) -> None:
        """Wait for every in-flight offload."""
        self._join_offloads(None)

    # ------------------------------------------------------------ maintenance
    def invalidate(self, user: int) -> None:
        """Drop every tier's copy of a user (caller guarantees the user is not pinned)."""
        self.gpu.invalidate(user)
        self.host.invalidate(user)

    def evict_gpu(self, users: list[int]) -> None:
        """Drop only the GPU copy of users (their host chunks stay), after in-flight offloads finish;
        the next request of such a user onloads from the host tier."""
        self._join_offloads(list(users))
        for u in users:
            self.gpu.invalidate(u)

    def _count_evictions(self) -> None:
        g, h = len(self.gpu.take_evicted()), len(self.host.take_evicted())
        if g or h:
            self.stats.add(gpu_evictions=g, host_evictions=h)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the KV cache manager is closed")

    def close(self) -> None:
        """Drain in-flight work and join the worker threads."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        for pool in (self._prepare_pool, self._onload_pool, self._offload_pool):
            pool.shutdown(wait=True)

