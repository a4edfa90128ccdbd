"""CUDA graphs of the whole cached forward, one set per row bucket (engine-owned).

Why: a cached forward at the seed shapes is ~1-4 ms of kernels, and the eager glue around
per-layer graphs (embedding lookups, candidate gather, postprocessor, head, metadata views) kept
the GPU idle most of the wall time. Here everything from the token features to the logits is
captured, so the model thread's work per batch is: fill a staging slot, one H2D copy, replay.

A bucket's static inputs, one device buffer refreshed per batch by one H2D copy:
  meta     the packed KVCacheMetadata, padded to the bucket by the prepare job;
  inputs   [5, rows] int64: the four embedding features of every row (table index, position,
           time bucket, token type; InferenceRankingGR.static_inputs), then the candidate rows.
The host side is a ring of staging buffers of the same layout per bucket (pinned on CUDA):
pad_spec hands the next one to the plan (the prepare job packs the metadata into its start, the
model thread writes the inputs after it), so no batch allocates pinned memory. A slot is handed
out again only after the copy that read it completed (an event per slot).
Two captures per bucket read them:
  whole    embed -> every layer -> candidate rows -> postprocessor -> head; one replay, for
           batches with nothing to onload (GPU hits, misses, re-ranks);
  segments the same work cut after each layer's input projection (embed + projection 0, rest
           of layer 0 + projection 1, ..., rest of layer L-1 + head; HSTU_SPLIT_SEGMENTS=0, or
           compiled layers: at layer boundaries), replayed one by one with layer i's onload wait
           before the segment that reads its pages. The wait blocks the host only until layer
           i's copies are *enqueued* (by the model thread), then orders the compute stream after
           their event (OnloadHandle.wait), so layer i still waits on the GPU for its own pages
           only, and its projection runs before they land; the cost over `whole` is L launches
           (L-1 cut at layer boundaries). A projection passes to the next segment in one of two
           shared buffers of the largest bucket's rows (2 x 24,576 x 4,096 bf16, 0.4 GB at the
           seed shapes).
  waited   (waits_in_graph, issue 12's onload dependency inside the graph) the whole forward with
           an event wait before each layer i on an external event (an event wait node in the
           graph): the engine enqueues every layer's onload first, the handle records the event of
           layer i where it records layer i's own, then one replay. One capture per set of events
           (_WAIT_SETS), the sets taken in turn, a set reused only after the replay that waited on
           it completed: a later batch's record of an event an earlier replay still waits on would
           tie that replay to the later batch's copies, which may wait for it (a deadlock), should
           the device read the event when the node runs rather than at the launch.
Both end in a static logits tensor [rows, num_tasks]; the engine copies out the batch's rows
before the next replay can overwrite them. A cache with no host tier (onloads=False: no batch
ever waits for pages, as the bench's uncached engine) captures only `whole`, with no projection
buffers.
Device launch (on by default, HSTU_DEVICE_LAUNCH=0 off; engine/device_launch.py): `whole` is also
instantiated for launch from the device, with one launcher graph per staging slot that copies the
slot into the device buffer and then launches it; a batch's stage and replay are then one small
host launch. Where that is refused or stops (a profiler), torch's host launch of `whole` runs.

Padding (static shapes per bucket of T_pad rows, at most max_batch users):
  rows T..T_pad-1        features of row 0's kind (index 0, position 0): embedded, attended by no
                         user (q_offsets stops at T), their outputs ignored;
  candidate rows M..     row 0: gathered and scored, the logits past M are ignored;
  users B..max_batch-1   kv_lens 0, q_offsets == T: no programs do work for them;
  appends Tn..T_pad-1    name a scratch page that no user owns (the manager allocates
                         num_pages + 1 pages and never hands out the last); the append skips them
                         (metadata.skip_page);
  page_table             [max_batch, ceil(max_seq_len / page_size)], padded with the scratch page;
  max_q                  = T_pad, the static upper bound the attention grid is sized for.
Metadata not padded for a bucket runs eagerly.

Layer inputs (keep_layer_inputs, the host tier's hidden format): every capture also copies each
layer's input rows into one static buffer [L, largest bucket, D] shared by all buckets; the cache
gathers the rows it offloads from it on the compute stream right after the replay (finish), so
before any later replay can overwrite it.

Compiled layers: `layer_fns` (torch.compile'd paged layers, one static shape per bucket) replace
the eager layers inside the captures. `capture=False` records nothing and replays the same
functions eagerly over the same static buffers: the padding path, tested where CUDA is absent.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hstu.engine.device_launch import DeviceLaunch
from hstu.ops import knobs
from hstu.ops.kv_ops import read_pinned
from hstu.ops.kvcache.metadata import KVCacheMetadata, PackedMetadata, PadSpec

Replay = Callable[[], object]


_STAGING_SLOTS = 3  # batches in flight on the host side per bucket, plus one being copied
_WAIT_SETS = 4  # waits_in_graph: event sets (and waited captures per bucket), more than batches in flight
# How a batch's staging slot reaches its bucket's device buffer under capture: "kernel" (read_pinned: a
# kernel reading the pinned slot, no copy engine, so a host-tier batch's onload may be enqueued
# before it; RankingEngine starts it early then) or "engine" (torch's copy_, as before; the
# onload starts at the first layer). An experiment knob for same-call comparisons.
STAGE_BY_KERNEL = os.environ.get("HSTU_STAGE_COPY", "kernel").strip().lower() != "engine"
# Whether a host-tier batch's segments are cut after each layer's input projection (layer i's onload
# wait after it, so the projection runs while the layer's pages land) rather than at layer boundaries.
# HSTU_SPLIT_SEGMENTS=0: the layer-boundary cut, an experiment knob for same-call comparisons.
SPLIT_SEGMENTS = knobs.flag("HSTU_SPLIT_SEGMENTS", default=True)


@dataclass
class _Bucket:
    rows: int
    device_buffer: torch.Tensor  # [meta bytes | inputs], what one copy refreshes
    meta: KVCacheMetadata  # views into device_buffer
    staging: list[torch.Tensor]
    staged_inputs: list[torch.Tensor]  # each slot's [5, rows] inputs region (after the metadata)
    copied: list["torch.cuda.Event | None"]
    whole: Replay
    whole_logits: torch.Tensor
    segments: list[Replay]
    segment_logits: torch.Tensor
    # waits_in_graph: the whole forward with each layer's onload wait inside, one per event set
    waited: list[Replay] = field(default_factory=list)
    waited_logits: list[torch.Tensor] = field(default_factory=list)
    # device launch: per staging slot, the exec of a graph that stages the slot and launches `whole`
    launchers: list[int] = field(default_factory=list)
    next_slot: int = 0


class ForwardGraphs:
    """Captures and replays the cached forward of `model` (an InferenceRankingGR) for row buckets."""

    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        scratch_page: int,
        max_batch: int,
        buckets: tuple[int, ...],
        layer_fns: Sequence[Callable] | None = None,
        capture: bool = True,
        keep_layer_inputs: bool = False,
        waits_in_graph: bool = False,
        device_launch: DeviceLaunch | None = None,
        onloads: bool = True,
    ) -> None:
        self.model = model
        n = len(model.block.layers)
        if layer_fns is not None and len(layer_fns) != n:
            raise ValueError(f"layer_fns has {len(layer_fns)} functions for {n} layers")
        # layer_fns[i](x, kv_cache, meta): what the captures record for layer i.
        self.layer_fns = list(layer_fns) if layer_fns is not None else [
            functools.partial(model.block.paged_layer, i) for i in range(n)
        ]
        self.kv_cache = kv_cache
        self.scratch_page = scratch_page
        self.max_batch = max_batch
        self.bucket_sizes = tuple(sorted(buckets))
        self.page_size = kv_cache.shape[3]
        self.max_pages = -(-model.config.max_seq_len // self.page_size)
        self.device = kv_cache.device
        self.capture = capture
        # whole forwards launched from the device behind their staging copy (captures only)
        self.device_launch = device_launch if capture else None
        self.device_launches = 0
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._buckets: dict[int, _Bucket] = {}
        # [L, largest bucket, D]: each replay's layer inputs (keep_layer_inputs), else None
        self._layer_inputs = (
            torch.zeros((n, self.bucket_sizes[-1], model.config.embedding_dim), dtype=model.config.torch_dtype,
                        device=self.device)
            if keep_layer_inputs and self.bucket_sizes else None
        )
        # onloads=False (a cache with no host tier: no batch ever waits for pages) captures only
        # `whole`: the segments and waited graphs would never replay, nor the buffers below be read
        self.onloads = onloads
        # Segments split inside each layer (the eager layers', not compiled ones': those are one
        # function a layer): two buffers of the largest bucket's projections [rows, width], one
        # segment's projection read by the next, written by the one after it.
        self.split_layers = onloads and layer_fns is None and SPLIT_SEGMENTS
        self._projections = [
            torch.empty((self.bucket_sizes[-1], model.block.layers[0].uvqk.out_features),
                        dtype=model.config.torch_dtype, device=self.device)
            for _ in range(2)
        ] if self.split_layers and self.bucket_sizes else []
        self.replays = 0
        self.segmented_replays = 0
        self.waited_replays = 0
        # waits_in_graph: one external event per layer, recorded once now so that it exists when a
        # capture waits on it (torch skips the wait on an event never recorded: no node is made)
        self.waits_in_graph = waits_in_graph and onloads
        # [set][layer] (None without CUDA: one set, nothing to wait for), and per set an event after
        # the last replay that waited on it
        self.layer_ready: list[list | None] = [None]
        self._set_done: list = [None]
        self._next_set = 0
        if self.waits_in_graph and capture:
            stream = torch.cuda.current_stream(self.device)
            self.layer_ready = [[torch.cuda.Event(external=True) for _ in range(n)] for _ in range(_WAIT_SETS)]
            for event in (e for events in self.layer_ready for e in events):
                event.record(stream)
            self._set_done = [None] * _WAIT_SETS

    def pad_spec(self, rows: int, batch: int) -> PadSpec | None:
        """The padding of a batch of `rows` rows and `batch` users, with the bucket's next free
        staging slot; None when no bucket fits (the batch runs eagerly)."""
        if batch > self.max_batch:
            return None
        rows = next((b for b in self.bucket_sizes if b >= rows), None)
        if rows is None:
            return None
        bucket = self._buckets[rows]
        i = bucket.next_slot
        bucket.next_slot = (i + 1) % len(bucket.staging)
        if bucket.copied[i] is not None:
            bucket.copied[i].synchronize()  # its last batch's copy (batches ago) has completed
        return PadSpec(
            rows, self.max_batch, self.max_pages, self.scratch_page, bucket.staging[i], i, bucket.staged_inputs[i]
        )

    @property
    def onload_before_stage(self) -> bool:
        """Whether a batch's onload copies may be enqueued before its stage() without delaying it:
        captured graphs stage by a kernel (STAGE_BY_KERNEL), uncaptured ones (CPU) copy in place."""
        return STAGE_BY_KERNEL or not self.capture

    def take_wait_set(self) -> int:
        """The next event set, once the last replay that waited on it completed (batches ago);
        taken before the batch's onload starts (wait_events: what its layers record)."""
        j = self._next_set
        self._next_set = (j + 1) % len(self.layer_ready)
        if self._set_done[j] is not None:
            self._set_done[j].synchronize()
        return j

    def wait_events(self, wait_set: int) -> list | None:
        """The set's per-layer events (None without CUDA)."""
        return self.layer_ready[wait_set]

    def inputs_of(self, pad: PadSpec) -> torch.Tensor:
        """The [5, rows] int64 inputs region of a staging slot (after the packed metadata)."""
        if pad.inputs is None:
            raise ValueError(f"a PadSpec of {pad.rows} rows without a staging slot has no inputs region")
        return pad.inputs

    def layer_inputs(self) -> torch.Tensor | None:
        """The static buffer [L, largest bucket, D] holding the last replay's layer inputs in its
        first rows (keep_layer_inputs), valid until the next replay; None when the graphs keep none."""
        return self._layer_inputs

    def capture_all(self) -> None:
        for rows in self.bucket_sizes:
            self._buckets[rows] = self._capture(rows)

    # ----------------------------------------------------------------- capture
    def _capture(self, rows: int) -> _Bucket:
        spec = PadSpec(rows, self.max_batch, self.max_pages, self.scratch_page)
        empty = KVCacheMetadata.padded_empty(spec, self.page_size)
        meta_bytes, layout = empty.packed[0].numel(), empty.packed[1]
        total = -(-(meta_bytes + 5 * rows * 8) // 16) * 16  # a device launcher copies 16-byte words
        device_buffer = torch.zeros(total, dtype=torch.uint8, device=self.device)
        device_buffer[:meta_bytes].copy_(empty.packed[0])
        # views, no copy; the layers skip the padded appends bound for the scratch page
        meta = PackedMetadata(device_buffer[:meta_bytes], layout, rows, self.scratch_page).to(self.device)
        inputs = device_buffer[meta_bytes:].view(torch.int64).view(5, rows)
        staging = [torch.zeros(total, dtype=torch.uint8, pin_memory=self.capture) for _ in range(_STAGING_SLOTS)]
        staged_inputs = [t[meta_bytes:].view(torch.int64).view(5, rows) for t in staging]
        model, kv, fns = self.model, self.kv_cache, self.layer_fns
        kept = self._layer_inputs

        def layer(i: int, h: torch.Tensor) -> torch.Tensor:
            if kept is not None:
                kept[i, :rows].copy_(h)
            return fns[i](h, kv, meta)

        def embed() -> torch.Tensor:
            return model.embed_rows(inputs[:4])

        def head(y: torch.Tensor) -> torch.Tensor:
            return model.logits_at(y, inputs[4])

        def whole() -> torch.Tensor:
            h = embed()
            for i in range(len(fns)):
                h = layer(i, h)
            return head(h)

        if self.capture:  # warm-up off the capture: Triton and Inductor compile, allocator settles
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    whole()
            torch.cuda.current_stream(self.device).wait_stream(side)
        replay_whole, whole_logits, whole_graph = self._record(whole, keep_graph=self.device_launch is not None)
        launchers = []
        if whole_graph is not None:
            # the host launch too, instantiated now rather than at the first replay: it takes over
            # where the device launch is refused or stops being usable (a profiler)
            whole_graph.instantiate()
            forward = self.device_launch.instantiate(whole_graph)
            if forward is not None:
                launchers = [self.device_launch.launcher(t, device_buffer, forward) for t in staging]
        waited, waited_logits = [], []
        if self.waits_in_graph:

            def whole_waiting(ready: list | None) -> torch.Tensor:
                h = embed()
                for i in range(len(fns)):
                    if ready is not None:  # (CPU: nothing to wait for)
                        torch.cuda.current_stream(self.device).wait_event(ready[i])
                    h = layer(i, h)
                return head(h)

            for ready in self.layer_ready:
                replay, out, _ = self._record(functools.partial(whole_waiting, ready))
                waited.append(replay)
                waited_logits.append(out)
        segments, h = [], None
        if self.split_layers:
            # embed + projection 0, (rest of layer i-1 + projection i) for i >= 1, rest of layer L-1 +
            # head: layer i's onload wait before segment i + 1, after its projection
            block, projections = self.model.block, self._projections
            last = len(fns)
            for i in range(last + 1):
                def segment(i=i, state=h):
                    if i == 0:
                        x = embed()
                    else:
                        x = block.paged_attend(i - 1, state[0], state[1], kv, meta)
                    if i == last:
                        return head(x)
                    if kept is not None:
                        kept[i, :rows].copy_(x)
                    return x, block.layers[i].projection(x, out=projections[i % 2][:rows])

                replay, h, _ = self._record(segment)
                segments.append(replay)
        elif self.onloads:
            for i in range(len(fns)):
                def segment(i=i, h_in=h) -> torch.Tensor:
                    out = layer(i, embed() if i == 0 else h_in)
                    return head(out) if i == len(fns) - 1 else out

                replay, h, _ = self._record(segment)
                segments.append(replay)
        copied = [None] * len(staging)
        return _Bucket(
            rows, device_buffer, meta, staging, staged_inputs, copied, replay_whole, whole_logits, segments, h, waited,
            waited_logits, launchers,
        )

    def _record(
        self, fn: Callable[[], torch.Tensor], keep_graph: bool = False
    ) -> tuple[Replay, torch.Tensor, "torch.cuda.CUDAGraph | None"]:
        """(replay, static output, graph) of fn over the bucket's static buffers; the graph (else
        None) is returned uninstantiated with keep_graph, for the caller to instantiate."""
        if not self.capture:
            out = fn()
            outs = out if isinstance(out, tuple) else (out,)

            def replay() -> None:
                new = fn()
                for static, fresh in zip(outs, new if isinstance(new, tuple) else (new,)):
                    if static.data_ptr() != fresh.data_ptr():  # (a projection written in place)
                        static.copy_(fresh)

            return replay, out, None
        graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()
        return graph.replay, out, (graph if keep_graph else None)

    def close(self) -> None:
        """Release the device launch's execs once the device finished the work that uses them."""
        if self.device_launch is not None:
            torch.cuda.synchronize(self.device)
            self.device_launch.close()
            self.device_launch = None
            for bucket in self._buckets.values():
                bucket.launchers = []

    # ------------------------------------------------------------------ replay
    def stage(self, pad: PadSpec, meta: KVCacheMetadata | PackedMetadata) -> bool:
        """Enqueue the H2D copy of the batch's staging slot (packed metadata `meta` and the inputs)
        into its bucket's device buffer; False when the metadata is not the bucket's (the caller
        runs eagerly). run() does it itself unless told the batch is staged."""
        bucket = self._staged_bucket(pad, meta)
        if bucket is None:
            return False
        if self.capture and STAGE_BY_KERNEL:
            read_pinned(bucket.device_buffer, pad.staging)
        else:
            bucket.device_buffer.copy_(pad.staging, non_blocking=True)
        self._slot_read(bucket, pad.slot)
        return True

    def _staged_bucket(self, pad: PadSpec, meta: KVCacheMetadata | PackedMetadata) -> _Bucket | None:
        """The bucket whose staging slot `pad` names and holds `meta`, packed for it; else None."""
        bucket = self._buckets.get(pad.rows)
        slot = pad.slot
        if (
            bucket is None
            or not 0 <= slot < len(bucket.staging)
            or bucket.staging[slot] is not pad.staging
            or meta.max_q != pad.rows
            or meta.layout_key != bucket.meta.layout_key
            or meta.packed[0].data_ptr() != pad.staging.data_ptr()
        ):
            return None
        return bucket

    def _slot_read(self, bucket: _Bucket, slot: int) -> None:
        """Record when the work just enqueued (which reads the staging slot) completes: pad_spec
        hands the slot out again only after it."""
        if self.capture:
            if bucket.copied[slot] is None:
                bucket.copied[slot] = torch.cuda.Event()
            bucket.copied[slot].record()

    def run(
        self,
        pad: PadSpec,
        meta: KVCacheMetadata | PackedMetadata,
        num_candidates: int,
        before_layer: Callable[[int], None] | None = None,
        copy: bool = True,
        after_launch: Callable[[], None] | None = None,
        staged: bool = False,
        onload: Callable[[], None] | None = None,
        wait_set: int | None = None,
    ) -> torch.Tensor | None:
        """Logits [num_candidates, num_tasks] of one batch (a fresh tensor; with copy=False a view
        of the static output, valid until the next replay), or None when its metadata is not the
        bucket's (the caller runs eagerly).

        pad: the plan's PadSpec, whose staging slot holds the packed metadata `meta` and the
        inputs (inputs_of). before_layer(i): layer i's onload wait; None when the batch onloads
        nothing, which replays the whole forward at once. after_launch(): called once the inputs copy
        and the first replay are enqueued (a front pass starts its batch's onload there: the copies
        queue behind its inputs on the copy engine, and its kernels do not wait for their enqueue,
        ~1.1 ms of host work at batch 8 on the H200, during which the GPU idled when the onload was
        started first). staged: the caller already ran stage() for this batch (nothing else
        replayed this bucket since). onload() with wait_set (take_wait_set; waits_in_graph), instead
        of before_layer: enqueues every layer's onload after the inputs copy, each layer recording
        its event of the set (wait_events); then the set's waited graph replays once."""
        if not self.onloads and (before_layer is not None or onload is not None):
            raise RuntimeError(f"a batch that onloads pages reached graphs captured without onload segments "
                               f"(onloads=False: the cache has no host tier), bucket of {pad.rows} rows")
        # a whole forward staged and launched by the slot's device launcher, where the bucket has one
        launched = not staged and before_layer is None and onload is None and self._launch_from_device(pad, meta)
        if not staged and not launched and not self.stage(pad, meta):
            return None
        bucket = self._buckets[pad.rows]
        if onload is not None and wait_set is not None and bucket.waited:
            j = wait_set
            onload()
            bucket.waited[j]()
            if self.capture:
                if self._set_done[j] is None:
                    self._set_done[j] = torch.cuda.Event()
                self._set_done[j].record()
            logits = bucket.waited_logits[j]
            self.waited_replays += 1
        elif before_layer is None:
            if not launched:
                bucket.whole()
            logits = bucket.whole_logits
            if after_launch is not None:
                after_launch()
        else:
            # split segments: layer i's wait before segment i + 1 (after its projection)
            shift = 1 if self.split_layers else 0
            for i, segment in enumerate(bucket.segments):
                if i >= shift:
                    before_layer(i - shift)
                segment()
                if i == 0 and after_launch is not None:
                    after_launch()
            logits = bucket.segment_logits
            self.segmented_replays += 1
        self.replays += 1
        return logits[:num_candidates].clone() if copy else logits[:num_candidates]

    def _launch_from_device(self, pad: PadSpec, meta: KVCacheMetadata | PackedMetadata) -> bool:
        """Enqueue the slot's device launcher (its staging copy, then the whole forward); False when
        the bucket has no launchers (the caller stages and replays) or the metadata is not the
        bucket's (stage() then says so)."""
        bucket = self._staged_bucket(pad, meta)
        if bucket is None or not bucket.launchers or not self.device_launch.usable():
            return False
        self.device_launch.launch(bucket.launchers[pad.slot])
        self._slot_read(bucket, pad.slot)
        self.device_launches += 1
        return True
