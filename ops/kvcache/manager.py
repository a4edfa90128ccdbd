"""AsyncKVCacheManager: the tiered (GPU pages + host chunks) KV cache behind one model.

Interface (the engine, engine/engine.py, is its only caller; one model thread drives it):
  plan(users, history_lens, identities, num_candidates) -> BatchPlan
                   sync, microseconds: cached length per user (GPU tier, else host tier, reused
                   only when the stored digest equals the request's, model/identity.py), the
                   batch's row layout, and the prepare job (here, or started on the prepare
                   worker under config.prepare_worker): reserve
                   pages (pins users, evicts LRU unpinned users), pack the metadata (pack_layout),
                   list the host->GPU copies.
  wait(plan) -> PreparedBatch
                   joins the prepare job (re-raising its error); metadata on the device, the page
                   tensor and a per-layer ready hook for the block, whose first call enqueues the
                   copies (one event per layer on the onload stream), so they queue behind the
                   batch's own inputs copy (PreparedBatch.start_onload).
  finish(plan) -> failed users
                   after the block was launched (its onload enqueued, not yet landed): compares the
                   prefixes of users whose GPU entry the plan reused unchecked (check_after_launch),
                   commits new lengths and digests, invalidates users whose onload failed to
                   enqueue or whose prefix was not the entry's (the caller ranks them again, never
                   serving what the batch computed for them), offloads newly full chunks (the
                   offload worker gathers all layers in one op on the offload stream, copies into
                   host slots, commits them after the copy completed, then unpins).
  abort(plan)      the forward failed anywhere after plan(): wait for the workers, unpin, keep only
                   committed state.

Threads and state:
  model thread     plan, wait, finish, abort, invalidate, evict_gpu, drain, close
  prepare worker   only under config.prepare_worker (else the model thread inside plan): GPU
                   reserve (+ evictions), metadata; finish hashes the whole histories after the launch
  onload worker    waits for the onload's copies (the model thread enqueued them); host unpin when done;
                   a copy failing there drops the GPU entries finish committed (_onload_failed_late)
  offload worker   gather + D2H on the offload stream; host reserve/commit/abort; GPU unpin
  Every multi-step change of the two C++ indexes runs under `_index_lock` (the indexes also lock
  each call); no thread waits for another while holding it.

Invariants:
  - A user's pages are never evicted or shrunk while pinned (in a batch, or being offloaded).
  - An onload's copies into newly reserved pages run after the compute of the last batch that
    used any of them (page_reuse.py; a batch's users are released when it is launched, so such a
    batch may still run), and after nothing else: not behind every batch enqueued before.
  - A host slot is reused only after its user was unpinned (no onload reads it) or, if reserved,
    after its copy was committed or aborted.
  - A user's in-flight offload is joined before a plan that could shrink, drop or onload the
    user; a plain extension (GPU hit, more tokens, same prefix) runs beside it, since it only
    appends after the committed tokens the offload reads (its pages are pinned once per batch),
    and so does an unchanged history re-ranked under on_no_new_tokens="candidates", which writes
    none of the user's pages (candidates are never appended; padded appends go to the scratch page),
    and a shorter history ranked read-only from a longer entry (on_shorter_history="reuse").
  - A read-only reuse reads only the first n tokens of an entry whose committed identity
    (`_identities`, kept beside the C++ index while the user holds a GPU entry or host chunks)
    has the request's digest at n; the entry keeps its length, digest and pages, and nothing is
    committed or offloaded for it.
  - The GPU tier never holds less than the host tier for a resident user (host is filled from GPU).
  - Cached K/V are reused only when the digest stored with them equals the request's digest of the
    same prefix; a shortened or uncommitted prefix has an empty digest, which matches nothing.
    Under check_after_launch a GPU entry's prefix is compared after its batch was launched, before
    anything of the batch is committed or served: a mismatch drops the user's output and entry.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from hstu.model.identity import HistoryIdentity
from hstu.ops import knobs
from hstu.ops._build import load_extension
from hstu.ops.kvcache.admission import FrequencyAdmission
from hstu.ops.kvcache.page_reuse import PageReuse
from hstu.ops.kvcache.batch import BatchPlan, PreparedBatch
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.handle import OnloadHandle
from hstu.ops.kvcache.hidden_tier import HiddenTails, gather_hidden, keeps_layer_inputs
from hstu.ops.kvcache.host_tier import Prefetcher, admitted, split_host_prefixes
from hstu.ops.kvcache.layout import JaggedLayout
from hstu.ops.kvcache.metadata import PadSpec, pack_layout
from hstu.ops.kvcache.plan_feedback import PlanFeedback
from hstu.ops.kvcache.planner import CostModel, FixedSplit
from hstu.ops.kvcache.stats import CacheStats
from hstu.ops.kvcache.transfers import COPY_AHEAD, OffloadJob, TierTransfers

logger = logging.getLogger(__name__)
# HSTU_FINISH_WAITS_ONLOAD=1: finish() waits for the onload's copies to land before committing, as
# it did before (an experiment knob for same-call comparisons)
_FINISH_WAITS_ONLOAD = os.environ.get("HSTU_FINISH_WAITS_ONLOAD", "0") == "1"
# HSTU_CHECK_AFTER_LAUNCH=0: a GPU entry's prefix is checked against the request before the batch
# is launched, as it was before (an experiment knob for same-call comparisons); see _lookup.
_CHECK_AFTER_LAUNCH = knobs.flag("HSTU_CHECK_AFTER_LAUNCH", default=True)
# HSTU_FRONT_FIRST=0: a compute_front batch whose onload starts at reserve packs its own metadata in
# the plan and enqueues COPY_AHEAD + 1 layers' copies there, as before (same-call comparisons); see _prepare.
_FRONT_FIRST = knobs.flag("HSTU_FRONT_FIRST", default=True)

_ext = load_extension()
CacheCapacityError = _ext.CacheCapacityError


def _matches(stored: HistoryIdentity | None, ident: HistoryIdentity, length: int, digest: bytes) -> bool:
    """Whether the request's first `length` tokens (identity `ident`) are those a cached entry of
    digest `digest` over its first `length` tokens was computed from, `stored` being the identity
    the user's GPU entry was last committed with (None: none kept): see _prefix_matches."""
    if not digest:
        return False
    if stored is not None and stored.num_tokens >= length and stored.prefix(length) == digest:
        return ident.shares_prefix(stored, length)
    return ident.prefix(length) == digest


class _Settled:
    """A prepare job run on the model thread: its result, or its error re-raised by result(). Not a
    Future: one costs a Condition and its lock, ~4 us of a batch-1 plan on the dev CPU."""

    __slots__ = ("_value", "_error")

    def __init__(self, value: PreparedBatch | None = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error

    def result(self) -> PreparedBatch:
        if self._error is not None:
            raise self._error
        return self._value


class HistoryConflictError(ValueError):
    """A request's history does not extend the user's cached history (policy says raise)."""


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
        self.kv_pages = torch.zeros(
            (c.num_layers, c.num_pages + 1, 2, c.page_size, c.num_heads, c.head_dim), dtype=c.dtype, device=self.device
        )
        self.host_arena = torch.zeros(
            (c.host_slots, c.num_layers, c.pages_per_chunk, 2, c.page_size, c.num_heads, c.head_dim),
            dtype=c.dtype,
            pin_memory=self.is_cuda,
        )
        self.stats = CacheStats()
        self._index_lock = threading.RLock()
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="hstu-prepare")
        self.transfers = TierTransfers(
            c, self.device, self.gpu, self.host, self.kv_pages, self.host_arena, self.stats, self._index_lock,
            self._count_evictions, onload_fault, self._onload_failed_late,
        )
        self.admission = FrequencyAdmission(config.offload_min_seen)
        # Compute-or-load split of host-tier prefixes (ops/kvcache/planner.py): the planner's cost
        # model, or a fixed split; None: pure onload.
        self.cost_model: CostModel | FixedSplit | None = None
        # what the planner's plans measured against their predictions, fed back into its choices
        self.plan_feedback = PlanFeedback()
        # The identity each GPU entry was committed with (its digest equals the entry's), so a
        # shorter request can be checked against any prefix of it; dropped with the entry.
        self._identities: dict[int, HistoryIdentity] = {}
        # host_format "hidden": each admitted user's partial last chunk of layer inputs (model thread)
        self._tails = HiddenTails(
            c.hidden_tail_bytes if c.host_format == "hidden" else 0, c.num_layers, c.chunk_tokens, c.hidden_dim, c.dtype,
            self.device,
        )
        self._prefetcher = Prefetcher(c, self.gpu, self.host, self.transfers, self.stats, self._index_lock)
        # which earlier batch an onload must wait for before overwriting its reserved pages
        self._reuse = PageReuse(self.is_cuda)
        self.check_after_launch = _CHECK_AFTER_LAUNCH
        self._closed = False

    # ------------------------------------------------------------------- plan
    def plan(
        self,
        user_ids: list[int],
        history_lens: list[int],
        identities: list[HistoryIdentity],
        num_candidates: list[int],
        pad_for: Callable[[int, int], PadSpec | None] | None = None,
        graph_buckets: tuple[int, ...] | None = None,
        onload_at_reserve: Callable[[BatchPlan], bool] | None = None,
    ) -> BatchPlan:
        """Look the users up, lay out the batch's rows and start preparing it on the worker.

        pad_for(rows, users): the CUDA-graph bucket padding of the metadata, if any; graph_buckets:
        the buckets' row counts (the planner costs a split at its bucket's rows and keeps it within
        the largest). onload_at_reserve(plan): whether the batch's onload may start as soon as its
        pages are reserved (the caller would start it right after this call anyway; see _prepare);
        asked of a laid-out plan that onloads, when the prepare job runs on the calling thread."""
        plan = self._lookup(user_ids, history_lens, identities)
        with self._index_lock:
            plan.seq = self._reuse.begin()
        try:
            unpin = split_host_prefixes(
                plan, num_candidates, self.config, self.cost_model, self.stats, graph_buckets,
                self.transfers.slot_hidden if self.config.host_format == "hidden" else None, self.plan_feedback,
            )
            if unpin:
                with self._index_lock:
                    self.host.unpin(unpin)
            plan.layout = JaggedLayout.build(plan.history_lens, plan.cached_lens, num_candidates)
            plan.hidden_chunks = self._hidden_chunks(plan)
            plan.pad = pad_for(plan.layout.num_rows, len(user_ids)) if pad_for is not None else None
            if plan.front_tokens:  # host_split "compute_front": the front pass's rows
                fronts = [plan.front_tokens[u] for u in user_ids if u in plan.front_tokens]
                plan.front_layout = JaggedLayout.build(fronts, [0] * len(fronts), [0] * len(fronts))
                plan.front_pad = pad_for(plan.front_layout.num_rows, len(fronts)) if pad_for is not None else None
            if onload_at_reserve is not None and plan.onload_slots and not self.config.prepare_worker:
                plan.onload_at_reserve = onload_at_reserve(plan)
            plan._future = self._start_prepare(plan)
        except BaseException:
            with self._index_lock:
                self.host.unpin(list(plan.onload_slots))
            raise
        return plan

    def rebuild_kv_with(self, kv_from_hidden: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """host_format "hidden": the model's K/V of a layer's input rows (HSTUBlock.kv_from_hidden:
        layer index, [T, D] -> k, v [T, H, d]), which rebuilds hidden-state chunks when they are
        onloaded. Until it is given, every chunk is offloaded as K/V."""
        self.transfers.kv_rebuilder = kv_from_hidden

    def capture_rebuild_graphs(self, max_chunks: int, capture: bool = True) -> bool:
        """host_format "hidden": rebuild onloaded hidden chunks (up to max_chunks an onload) by CUDA
        graph replays, one a layer, instead of a dozen eager torch calls a layer on the model thread
        (ops/kvcache/rebuild_graphs.py); capture=False: the same static buffers, eagerly. Returns
        False, capturing nothing, when no hidden chunk can be onloaded (another format, no host
        tier, no K/V rebuilder)."""
        if not self.keeps_hidden:
            return False
        self.transfers.capture_rebuilds(max_chunks, self.scratch_page, capture)
        return True

    @property
    def keeps_hidden(self) -> bool:
        """host_format "hidden" in effect: a host tier to hold hidden-state chunks and a K/V rebuilder
        to onload them (without either, forwards keep no layer inputs and every chunk is K/V)."""
        t = self.transfers
        return self.config.host_format == "hidden" and t.hidden_arena is not None and t.kv_rebuilder is not None

    def _hidden_chunks(self, plan: BatchPlan) -> dict[int, tuple[int, int]]:
        """host_format "hidden": the batch rows whose layer inputs the forward keeps (hidden_tier.py)."""
        if not self.keeps_hidden:
            return {}
        return keeps_layer_inputs(plan, self.config.chunk_tokens, self.admission.admits)

    def _lookup(self, user_ids: list[int], history_lens: list[int], identities: list[HistoryIdentity]) -> BatchPlan:
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
        # Settle in-flight offloads of users this lookup may shrink, drop or onload, before taking
        # the index lock (the offload worker needs it to finish). A user whose GPU entry is reused
        # as it is (extended, re-ranked unchanged, or read in part under on_shorter_history
        # "reuse") does not wait: its pages only grow or are only read, so an offload reading the
        # entry's full chunks may run on beside it.
        # extended: users plainly extending their GPU entry, or re-ranking it unchanged, -> (its
        # length, its digest), the common cases, looked up once (under the lock only checked to be
        # the same entry still; the entry's length is then the cached length).
        # With check_after_launch, such a user's prefix is not compared with the entry's here: the
        # batch reuses the entry as if it matched, and finish() compares it after the launch,
        # while the GPU runs the batch (the records' memcmp and the identity's bookkeeping were
        # ~8 us a user of the plan before the launch, dev CPU). A user whose prefix turns out not
        # to be the entry's is never served: finish() drops its entry and returns it to be ranked
        # again, as a miss (the rare diverged history costs one forward more).
        extended: dict[int, tuple[int, bytes]] = {}
        unchecked: dict[int, tuple[HistoryIdentity | None, int, bytes]] = {}
        waiting = []
        for u, n, ident in zip(user_ids, history_lens, identities):
            entry = self.gpu.lookup(u)
            if self._may_extend(n, entry) and (self.check_after_launch or self._prefix_matches(u, ident, *entry)):
                extended[u] = entry
                if self.check_after_launch:
                    unchecked[u] = (self._identities.get(u), *entry)
            elif not self._read_only_length(u, n, ident):
                waiting.append(u)
        self.transfers.join(waiting)
        plan = BatchPlan(list(user_ids), list(history_lens), list(identities), [], [])
        for u in user_ids:
            self.admission.see(u)
        with self._index_lock:
            try:
                for u, n, ident in zip(user_ids, history_lens, identities):
                    entry = extended.get(u)
                    if entry is not None and self.gpu.lookup(u) == entry:
                        cached, source = entry[0], "gpu"
                        self._prefetcher.looked_up(u, source)
                        if u in unchecked:
                            plan.unchecked[u] = unchecked[u]
                    else:
                        cached, source = self._lookup_one(u, n, ident, plan)
                    plan.cached_lens.append(cached)
                    plan.sources.append(source)
            except BaseException:
                self.host.unpin(list(plan.onload_slots))
                raise
        self.stats.add(
            gpu_hits=plan.sources.count("gpu"), host_hits=plan.sources.count("host"), misses=plan.sources.count("miss")
        )
        return plan

    def _may_extend(self, n: int, entry: tuple[int, bytes]) -> bool:
        """Whether a request of n tokens would extend the user's GPU entry (length, digest), or
        re-rank it unchanged under on_no_new_tokens="candidates" (every cached token used, as the
        tiers' lookup would find after more lookups and a second prefix check), if its prefix is
        the entry's."""
        gpu_len, gpu_digest = entry
        if not gpu_digest or gpu_len <= 0:
            return False
        return gpu_len < n or (gpu_len == n and self.config.on_no_new_tokens == "candidates")

    def _prefix_matches(self, user: int, ident: HistoryIdentity, length: int, digest: bytes) -> bool:
        """Whether the request's first `length` tokens are those the user's GPU or host entry
        (digest `digest` over its first `length` tokens) was computed from. Against the identity
        the user's GPU entry was last committed with (kept while the user holds host chunks, after
        its GPU entry went), when that one's digest at `length` is `digest`: their block digests,
        then the records past them byte for byte (the request adopts the stored digests; no
        hashing, where the digest of a `length` off a block boundary hashed up to BLOCK_TOKENS
        records: ~7% of an engine process's loop at a GPU hit, and a request no front end hashed
        hashed its whole host-tier prefix, ~0.4 ms of a batch-8 plan, dev CPU); else by the
        request's digest."""
        return _matches(self._identities.get(user), ident, length, digest)

    def _read_only_length(self, user: int, n: int, ident: HistoryIdentity) -> int:
        """Under on_shorter_history="reuse": the length of the user's GPU entry when the request's
        n tokens are exactly its first n (checked against the identity the entry was committed
        with, itself checked against the entry's digest), else 0."""
        if self.config.on_shorter_history != "reuse":
            return 0
        gpu_len, gpu_digest = self.gpu.lookup(user)
        stored = self._identities.get(user)
        if not 0 < n < gpu_len or not gpu_digest or stored is None or stored.num_tokens != gpu_len:
            return 0
        if stored.prefix(gpu_len) != gpu_digest or not ident.shares_prefix(stored, n):
            return 0
        return gpu_len

    def _gpu_extension(
        self, user: int, n: int, ident: HistoryIdentity, entry: tuple[int, bytes] | None = None
    ) -> int:
        """Cached length when the request plainly extends the user's GPU entry (`entry`, its
        (length, digest), when already looked up), else 0."""
        gpu_len, gpu_digest = entry if entry is not None else self.gpu.lookup(user)
        if 0 < gpu_len < n and self._prefix_matches(user, ident, gpu_len, gpu_digest):
            return gpu_len
        return 0

    def _lookup_one(self, user: int, n: int, ident: HistoryIdentity, plan: BatchPlan) -> tuple[int, str]:
        cached, source = self._lookup_tiers(user, n, ident, plan)
        self._prefetcher.looked_up(user, source)
        return cached, source

    def _lookup_tiers(self, user: int, n: int, ident: HistoryIdentity, plan: BatchPlan) -> tuple[int, str]:
        extension = self._gpu_extension(user, n, ident)
        if extension:
            return extension, "gpu"
        gpu_len, gpu_digest = self.gpu.lookup(user)
        if gpu_len > 0:
            entry = self._read_only_length(user, n, ident)
            if entry:
                plan.read_only[user] = entry
                self.stats.add(shorter_reused=1)
                return n, "gpu"
            usable = self._usable_length(user, n, ident, gpu_len, gpu_digest)
            if usable > 0:
                return usable, "gpu"
        slots, host_digest = self.host.lookup(user)
        host_len = len(slots) * self.config.chunk_tokens
        if host_len > 0:
            if self.check_after_launch and 0 < host_len < n and host_digest:
                # compared after the launch too (see _lookup): the onload starts once the pages are
                # reserved, and every microsecond of plan before it is a host-tier batch's latency
                usable = host_len
                plan.unchecked[user] = (self._identities.get(user), host_len, host_digest)
            else:
                usable = self._usable_length(user, n, ident, host_len, host_digest)
            if usable > 0:
                self.host.pin([user])
                self.host.touch(user)
                plan.onload_slots[user] = list(slots[: -(-usable // self.config.chunk_tokens)])
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
        if not self._prefix_matches(user, ident, cached, cached_digest):
            self.invalidate(user)
            self.stats.add(invalidations=1, invalidated_diverged=1)
            return 0
        if n == cached and c.on_no_new_tokens == "recompute_last":
            return n - 1
        return cached

    # ---------------------------------------------------------------- prepare
    def _start_prepare(self, plan: BatchPlan) -> "Future | _Settled":
        """The prepare job on the prepare worker (config.prepare_worker), or run here, its outcome
        settled: wait() and abort() read both alike (result())."""
        if self.config.prepare_worker:
            return self._prepare_pool.submit(self._prepare, plan)
        try:
            return _Settled(self._prepare(plan))
        except BaseException as exc:  # re-raised by wait(), as the worker's error would be
            return _Settled(error=exc)

    def _prepare(self, plan: BatchPlan) -> PreparedBatch:
        try:
            keep = [
                plan.read_only.get(u, c) if s == "gpu" else 0 for u, c, s in zip(plan.user_ids, plan.cached_lens, plan.sources)
            ]
            try:
                pages = self._reserve(plan, keep)
            except CacheCapacityError:
                # Pages pinned by in-flight offloads become evictable once those finish.
                self.drain()
                pages = self._reserve(plan, keep)
        except BaseException:
            with self._index_lock:
                self.host.unpin(list(plan.onload_slots))
            raise
        onload_users = list(plan.onload_slots)
        prepared = None
        try:
            if not onload_users:
                handle, start = OnloadHandle.completed(self.config.num_layers), None
            else:
                handle = OnloadHandle(self.config.num_layers, self.device, self.config.onload_timeout_s)
                slot_ids, page_ids = self._onload_plan(plan, pages)
                start = functools.partial(
                    self.transfers.onload_async, handle, onload_users, slot_ids, page_ids,
                    pages_used_until=plan.pages_used_until,
                )
            prepared = PreparedBatch(pages, None, handle, self.kv_pages, onload_users, None, start)
            fronts, ps = plan.front_tokens, self.config.page_size
            # A front pass's batch (its onload started here, on the model thread) goes front first:
            # its own metadata is packed when the engine first needs it, after the front pass's
            # launch, and one layer's copies start here, the rest after that launch. Why: both
            # delayed the front pass, whose compute chain ends the batch with the copies' (an H100
            # host-tier batch 8: the plan took 2.0-2.5 ms of host time before the front launched).
            # Layer 0's copies at batch 8 take ~1.1 ms (run MS), longer than what runs before the next enqueue.
            front_first = _FRONT_FIRST and bool(fronts) and plan.onload_at_reserve
            if plan.onload_at_reserve:
                # The first layers' copies before the metadata is packed, which they do not need
                # (the engine starts them right after plan() otherwise): a host-tier batch 8 is
                # copy-bound, its copies began only after the whole plan (run IC). Run IH (H100),
                # same call: 10.79-10.95 -> 10.48-10.56 ms, 1.43x -> 1.47x of recomputing.
                prepared.start_onload(ahead=0 if front_first else COPY_AHEAD)
            pack = functools.partial(pack_layout, pages, plan.layout, ps, pin=self.is_cuda, pad=plan.pad)
            if front_first:
                prepared.defer_metadata(pack)
            else:
                prepared.metadata = pack()
            if fronts:  # the front pass: tokens [0, q) of each front user, in their first pages
                front_pages = [pages[b][: -(-fronts[u] // ps)] for b, u in enumerate(plan.user_ids) if u in fronts]
                prepared.front_metadata = pack_layout(
                    front_pages, plan.front_layout, ps, pin=self.is_cuda, pad=plan.front_pad
                )
        except BaseException:
            self._prepare_failed(plan, prepared)
            raise
        return prepared

    def _prepare_failed(self, plan: BatchPlan, prepared: PreparedBatch | None) -> None:
        """Undo a prepare job that failed after its reserve: its onload, if started, settles (its
        worker drops the host pins), else the pins go here; the reserved pages are released as
        abort() releases a batch's (abort finds the job failed and leaves it to this)."""
        try:
            if prepared is not None and prepared.onload_started and prepared.onload_users:
                prepared.enqueue_onload()
                prepared.handle.wait_done()
            else:
                with self._index_lock:
                    self.host.unpin(list(plan.onload_slots))
        finally:
            self._release(plan)

    def _reserve(self, plan: BatchPlan, keep: list[int]) -> list[np.ndarray]:
        """Pages per user for its whole history (int32 arrays); a read-only user keeps its longer
        entry whole and gets the pages of its first history_len tokens."""
        targets = [plan.read_only.get(u, n) for u, n in zip(plan.user_ids, plan.history_lens)]
        with self._index_lock:
            pages = self.gpu.reserve_arrays(plan.user_ids, keep, targets)
            self._count_evictions()
            plan.reuse_wait = self._reuse.reserved(plan.seq, plan.user_ids)
            plan.pages_used_until = self._reuse.wait_for(plan.reuse_wait)
        ps = self.config.page_size
        for b, u in enumerate(plan.user_ids):
            if u in plan.read_only:
                pages[b] = pages[b][: -(-plan.history_lens[b] // ps)]
        return pages

    def _onload_plan(self, plan: BatchPlan, pages: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot ids [n], page ids [n, pages_per_chunk]): chunk c of a user's onloaded tokens goes to
        its pages c * ppc .. (c + 1) * ppc - 1, the chunks counted from its front pass's end
        (plan.front_tokens) or from 0. One flat array each (a nested list per chunk cost ~0.2 ms at
        batch 8 on the H200's host)."""
        ppc, chunk = self.config.pages_per_chunk, self.config.chunk_tokens
        slots, page_ids = [], []
        for b, u in enumerate(plan.user_ids):
            user_slots = plan.onload_slots.get(u)
            if user_slots:
                first = plan.front_tokens.get(u, 0) // chunk * ppc
                slots += user_slots
                page_ids.append(pages[b][first : first + len(user_slots) * ppc])
        page_ids = np.concatenate(page_ids) if page_ids else np.zeros(0, dtype=np.int32)
        # (through numpy: 2 against 8 us for torch.tensor of a batch-1 list on the dev CPU)
        return torch.from_numpy(np.asarray(slots, dtype=np.int32)), torch.from_numpy(page_ids).reshape(-1, ppc)

    def wait(self, plan: BatchPlan) -> PreparedBatch:
        """Join the prepare job (re-raising its error); the metadata moves to the device (views over
        the same buffer on CPU), except metadata padded for a CUDA-graph bucket: the graph copies
        its packed host buffer itself."""
        if plan._prepared is None:
            prepared: PreparedBatch = plan._future.result()
            if plan.pad is None:
                prepared.metadata = prepared.packed_metadata().to(self.device, non_blocking=True)
            if prepared.front_metadata is not None and plan.front_pad is None:
                prepared.front_metadata = prepared.front_metadata.to(self.device, non_blocking=True)
            plan._prepared = prepared
        return plan._prepared

    # ---------------------------------------------------------- commit + offload
    def finish(self, plan: BatchPlan) -> list[int]:
        """After the block ran: commit the batch, start its offload (gather + D2H on the offload
        stream, host commit once the copy completed, then unpin), and return the users whose
        onload failed or whose history diverged from the GPU entry the batch reused unchecked, which
        the caller must recompute (each was counted a GPU hit at plan, and counts a miss then)."""
        prepared = self.wait(plan)
        prepared.enqueue_onload()  # (a forward that never asked for a layer: the copies still run)
        diverged = self._check_unchecked(plan)
        # Hashed here, after the launch, while the GPU runs the batch, and outside the index lock (a GPU
        # hit adopted its prefix's digests at lookup and hashes only its new blocks). A user whose
        # onload fails is hashed for nothing: rare, and its digest is then not used.
        digests = {
            b: ident.prefix(n)
            for b, (u, n, ident) in enumerate(zip(plan.user_ids, plan.history_lens, plan.identities))
            if u not in plan.read_only and u not in diverged
        }
        # Every layer's copies are enqueued by now (on this thread): commit without waiting for
        # them to land. Everything that reads these pages runs after them on the device (the
        # batch's layers waited for their events; later batches, offloads and onloads are ordered
        # after this batch's compute), and waiting here held the model thread, so the next batch's
        # host work, until the copies ended. An enqueue that failed is waited for (its copies
        # settled) and recomputed.
        handle = prepared.handle
        if handle.wait_enqueued():
            handle.wait(handle.num_layers - 1)  # (the layers did; this covers a forward that never asked)
        if _FINISH_WAITS_ONLOAD or handle.failed:
            handle.wait_done()
        jobs: list[tuple[int, int]] = []
        cached = computed = candidates = 0
        with self._index_lock:
            # read under the lock: a failure the worker finds later sees this batch committed
            # (_onload_failed_late), never half of it
            failed = sorted(prepared.onload_users) if handle.failed else []
            diverged = [u for u in diverged if u not in failed]  # (a failed onload is dropped as failed)
            dropped = failed + diverged  # neither committed nor served: ranked again
            for b, u in enumerate(plan.user_ids):
                if u in dropped:
                    continue
                n = plan.history_lens[b]
                if u not in plan.read_only:
                    self.gpu.commit(u, n, digests[b])
                    self._identities[u] = plan.identities[b]
                    jobs.append((u, b))
                cached += plan.cached_lens[b]
                computed += n - plan.cached_lens[b]
                candidates += plan.layout.num_candidates[b]
            self.stats.add(cached_tokens=cached, computed_tokens=computed, candidate_tokens=candidates)
            if dropped:  # (a diverged user's offloads settled in _check_unchecked: nothing else pins it)
                self.gpu.release(dropped)
                for u in dropped:
                    self.invalidate(u)
            if failed:
                self.stats.add(recomputes=len(failed))
            if diverged:
                self.stats.add(invalidations=len(diverged), invalidated_diverged=len(diverged),
                               diverged_after_launch=len(diverged))
            offload = admitted(plan, jobs, self.config, self.admission, self.host, self.stats)
            stored = {b: len(self.host.lookup(u)[0]) for u, b in offload} if plan.hidden_chunks else {}
            done = [u for u, b in jobs if (u, b) not in offload] + list(plan.read_only)
            if done:
                self.gpu.release(done)
        hidden = {}
        if plan.hidden_chunks:  # gathered now, on the compute stream, before any later forward
            kept = [b for b in plan.hidden_chunks if plan.user_ids[b] not in dropped]
            hidden = gather_hidden(plan, kept, self.config.chunk_tokens, self._tails, digests, stored)
        # after everything the batch enqueued (its gather included): what the offload and later
        # onloads into its pages wait for
        launched = self._launched(plan)
        if offload:
            self.transfers.offload_async(
                [OffloadJob(u, plan.history_lens[b], prepared.pages[b], plan.identities[b], hidden.get(b))
                 for u, b in offload],
                launched,
            )
        plan.layer_inputs = None  # gathered: a graph's buffer may be overwritten, an eager batch's freed
        return dropped

    def _check_unchecked(self, plan: BatchPlan) -> list[int]:
        """After the launch: the users whose GPU entry or host-tier prefix the batch reused unchecked
        (check_after_launch) and whose request's prefix is not the one it was computed from,
        compared with the identity the user's entry was committed with then (taking over its
        digests where equal, so the commit hashes only the new blocks). Their in-flight offloads
        and this batch's onload of them are waited for (settled: nothing pins them after the
        batch), so finish() may drop them."""
        if not plan.unchecked:
            return []
        identity = dict(zip(plan.user_ids, plan.identities))
        diverged = [
            u for u, (stored, length, digest) in plan.unchecked.items() if not _matches(stored, identity[u], length, digest)
        ]
        if diverged:
            self.transfers.join(diverged)
        return diverged

    def _launched(self, plan: BatchPlan) -> "torch.cuda.Event | None":
        """The batch enqueued all its compute work: later onloads into pages it used wait for the
        event returned (recorded on the compute stream now; None off CUDA)."""
        event = self.transfers._compute_event()
        with self._index_lock:
            self._reuse.launched(plan.seq, event)
        return event

    def prefetch(self, user_ids: list[int], max_users: int = 256) -> int:
        """Start onloading host-tier users expected to rank soon into free GPU pages (never evicting
        anyone); idempotent (users on the GPU or in flight are skipped). Returns the number started."""
        self._check_open()
        return self._prefetcher.start(user_ids, max_users)

    def abort(self, plan: BatchPlan) -> None:
        """The forward failed: release the batch; the new tokens were never committed."""
        if plan._future is None:
            return
        try:
            prepared = self.wait(plan)
        except BaseException:  # prepare failed: it released its pins and pages (_prepare_failed)
            return
        try:
            prepared.enqueue_onload()  # its worker drops the host pins; the pages stay reserved until it is done
            prepared.handle.wait_done()
        finally:
            self._release(plan)

    def _release(self, plan: BatchPlan) -> None:
        """Give an aborted batch's reserved users back (after whatever of its forward was enqueued)."""
        self._launched(plan)
        with self._index_lock:
            self.gpu.release(plan.user_ids)
            # Their entries keep the pages reserved for this batch beyond their committed
            # length (all of them, for a new user): a later reserve may shrink them, or a
            # prefetch drop an empty entry, into the free list with no eviction to note.
            for u in plan.user_ids:
                self._reuse.freed(u)

    # ------------------------------------------------------------ maintenance
    def drain(self) -> None:
        """Wait for every in-flight offload and onload (their host pins dropped)."""
        self.transfers.join(None)  # (onload settles included)

    def _onload_failed_late(self, users: list[int]) -> None:
        """The onload worker: a batch's onload failed on the device after its copies were all
        enqueued, so finish() may have committed these users over pages the copies never filled.
        Unpinned users are dropped; a pinned one (its batch or offload still in flight) keeps its
        pages with length 0, which no lookup reuses, until its next commit or eviction."""
        try:
            with self._index_lock:
                for u in users:
                    if not self.gpu.contains(u):
                        continue
                    if self.gpu.pin_count(u) == 0:
                        self.gpu.invalidate(u)
                    else:  # (its pages go back later, by a shrinking reserve or an empty entry dropped)
                        self.gpu.commit(u, 0, b"")
                    self._reuse.freed(u)
                    self._identities.pop(u, None)
        except BaseException:  # the worker must still settle later onloads
            logger.exception("dropping users %s after their failed onload failed", users)

    def invalidate(self, user: int) -> None:
        """Drop every tier's copy of a user (caller guarantees the user is not pinned)."""
        with self._index_lock:
            self.gpu.invalidate(user)
            self._reuse.freed(user)
            self.host.invalidate(user)
            self._identities.pop(user, None)
            self._tails.drop(user)

    def evict_gpu(self, users: list[int]) -> None:
        """Drop only the GPU copy of users (their host chunks stay), after in-flight offloads finish;
        the next request of such a user onloads from the host tier."""
        self.transfers.join(list(users))
        with self._index_lock:
            for u in users:
                self.gpu.invalidate(u)
                self._reuse.freed(u)
                if not self.host.contains(u):  # (kept for its host chunks' lookup: _prefix_matches)
                    self._identities.pop(u, None)

    def occupancy(self) -> dict[str, int]:
        """Free GPU pages and host slots (for metrics)."""
        return {"gpu_free_pages": self.gpu.num_free_pages(), "host_free_slots": self.host.num_free_slots()}

    def _count_evictions(self) -> None:
        """Count the users the indexes evicted since the last call, and forget the identities of
        those left in neither tier (a user evicted from the GPU keeps its identity while it holds
        host chunks: their lookup compares records with it instead of hashing the request)."""
        gpu_evicted, host_evicted = self.gpu.take_evicted(), self.host.take_evicted()
        for u in gpu_evicted:
            self._reuse.freed(u)
            if not self.host.contains(u):
                self._identities.pop(u, None)
        for u in host_evicted:
            if not self.gpu.contains(u):
                self._identities.pop(u, None)
        if gpu_evicted or host_evicted:
            self.stats.add(gpu_evictions=len(gpu_evicted), host_evictions=len(host_evicted))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the KV cache manager is closed")

    def close(self) -> None:
        """Drain in-flight work and join the worker threads."""
        if self._closed:
            return
        self.drain()
        self._closed = True
        self._prepare_pool.shutdown(wait=True)
        self.transfers.close()
