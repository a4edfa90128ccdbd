"""The two records a batch carries through the manager: BatchPlan (plan() to finish()/abort())
and PreparedBatch (what the prepare worker reserved). Kept apart from manager.py so the host-tier
policy (host_tier.py) can read a plan without importing the manager."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from hstu.model.identity import HistoryIdentity
from hstu.ops.kvcache.handle import OnloadHandle
from hstu.ops.kvcache.layout import JaggedLayout
from hstu.ops.kvcache.metadata import KVCacheMetadata, PackedMetadata, PadSpec
from hstu.ops.kvcache.transfers import COPY_AHEAD


@dataclass
class PreparedBatch:
    """A batch whose pages are reserved: what the block needs, and what finish() commits."""

    pages: list[np.ndarray]  # per user, int32 page ids (GpuPageManager.reserve_arrays)
    # Packed on the host (by the prepare job, after an onload it started at reserve: None until then);
    # on the device after AsyncKVCacheManager.wait, except for CUDA-graph batches.
    metadata: KVCacheMetadata | PackedMetadata
    handle: OnloadHandle
    kv_pages: torch.Tensor
    onload_users: list[int]
    # host_split "compute_front": the front pass's metadata (tokens [0, q) of each front user, no
    # candidates), packed like `metadata`; None when no user recomputes a front.
    front_metadata: KVCacheMetadata | PackedMetadata | None = None
    # Enqueues the host->GPU copies (TierTransfers.onload_async); None once started (or nothing to onload).
    _start_onload: Callable[..., Callable[[int], None]] | None = field(default=None, repr=False)
    # What it returned: enqueues the hidden-state chunks' rebuilds of the layers up to the one given.
    _through: Callable[[int], None] | None = field(default=None, repr=False)
    # Packs `metadata` when it is first asked for (defer_metadata); None once packed.
    _pack: Callable[[], KVCacheMetadata | PackedMetadata] | None = field(default=None, repr=False)

    def defer_metadata(self, pack: Callable[[], KVCacheMetadata | PackedMetadata]) -> None:
        """Leave `metadata` to pack() until packed_metadata() first asks for it (a front pass's batch:
        packed after the front's launch, which it does not feed)."""
        self.metadata, self._pack = None, pack

    def packed_metadata(self) -> KVCacheMetadata | PackedMetadata:
        """`metadata`, packed now if its packing was deferred."""
        pack, self._pack = self._pack, None
        if pack is not None:
            self.metadata = pack()
        return self.metadata

    def start_onload(self, after: "torch.cuda.Event | None" = None, ahead: int | None = None) -> None:
        """Enqueue the copies, once, from the model thread: after the batch's own host->device
        inputs when those go through a copy engine, since copies share the engines in enqueue
        order (a batch's metadata and features enqueued behind all layers' onloads held its
        first layer until every onload had landed; on the H200 a batch that onloaded 3/4 of its
        prefix took load + compute instead of their overlap); before them when a kernel stages
        them (ForwardGraphs.onload_before_stage: RankingEngine starts it right after the plan).
        after: the compute-stream event the copies wait for (default: all work enqueued so far;
        TierTransfers.onload_async). ahead: K/V copies kept enqueued beyond the layer about to run,
        the rest as the model thread reaches them (None: every layer's now; onload_async)."""
        start, self._start_onload = self._start_onload, None
        if start is not None:
            self._through = start(after=after, ahead=ahead)

    @property
    def onload_started(self) -> bool:
        """Whether the copies were enqueued (or there is nothing to onload)."""
        return self._start_onload is None

    def ready(self, layer: int) -> None:
        """Block hook: order the compute stream after layer's onload (raises on timeout); the
        first call starts the onload, and each enqueues what its layer needs (rebuilds up to it,
        or K/V copies COPY_AHEAD layers beyond it)."""
        self.start_onload(ahead=COPY_AHEAD)
        if self._through is not None:
            self._through(layer)
        self.handle.wait(layer)

    def enqueue_onload(self) -> None:
        """Start the onload and enqueue every layer's part of it, so that it settles (finish and
        abort, before waiting for it: a forward that never asked for some layer)."""
        self.start_onload()
        if self._through is not None:
            self._through(self.handle.num_layers - 1)


@dataclass
class BatchPlan:
    """One batch from plan() to finish()/abort(): how much each user reuses, and its row layout."""

    user_ids: list[int]
    history_lens: list[int]
    identities: list[HistoryIdentity]
    cached_lens: list[int]
    sources: list[str]
    layout: JaggedLayout | None = None
    pad: PadSpec | None = None
    onload_slots: dict[int, list[int]] = field(default_factory=dict)
    # Users ranked read-only from a longer GPU entry (on_shorter_history="reuse") -> that entry's
    # length: its pages are kept whole, nothing is committed or offloaded for them.
    read_only: dict[int, int] = field(default_factory=dict)
    # host_split "compute_front": users -> q, the first q tokens of their host-tier prefix recomputed
    # by the front pass (the rest of the prefix onloaded: onload_slots start at chunk q / chunk_tokens);
    # front_layout / front_pad: that pass's rows (tokens 0..q-1 of each, batch order) and padding.
    front_tokens: dict[int, int] = field(default_factory=dict)
    front_layout: JaggedLayout | None = None
    front_pad: PadSpec | None = None
    # host_format "hidden": batch row -> the chunks [first, end) it computes whole (ops/kvcache/
    # hidden_tier.py), and the forward's layer inputs kept for them until finish(): a [rows, D]
    # tensor a layer (eager), or the graphs' static copy [L, largest bucket, D] (its first rows).
    hidden_chunks: dict[int, tuple[int, int]] = field(default_factory=dict)
    layer_inputs: list[torch.Tensor] | torch.Tensor | None = None
    # users whose GPU entry or host-tier prefix the batch reuses before their prefix was compared
    # with it (the manager's check_after_launch) -> (the identity the user's entry was committed
    # with, or None; the cached length and digest), compared by finish() after the launch
    unchecked: dict[int, tuple[HistoryIdentity | None, int, bytes]] = field(default_factory=dict)
    # the batch's number (PageReuse), the earlier batch its onload waits for (-1: none) and what it
    # waits for on the device (an event, None, or page_reuse.ALL_EARLIER)
    seq: int = -1
    reuse_wait: int = -1
    # the onload's first copies start as soon as the pages are reserved, before the metadata is
    # packed (the plan() caller's onload_at_reserve said so)
    onload_at_reserve: bool = False
    # a planner's host-tier plan to measure (plan_feedback.py): (kind, users, predicted layer seconds)
    measure: tuple[str, int, float] | None = None
    pages_used_until: object = None
    _future: Future | None = field(default=None, repr=False)  # (or the manager's _Settled: result() alike)
    _prepared: PreparedBatch | None = field(default=None, repr=False)
