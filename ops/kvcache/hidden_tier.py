"""host_format "hidden": which chunks of a batch go to the host tier as layer inputs, and the
partial chunk each user's next forward may complete.

A chunk is stored as hidden states only when the layer inputs of all its tokens are at hand when
it fills. A forward computes a user's tokens [cached, n): the chunks wholly inside are at hand; the
chunk the forward starts inside (cached off a chunk boundary) began in an earlier forward, whose
layer inputs are gone unless kept. HiddenTails keeps, per admitted user, the layer inputs of the
last, partial chunk its forward left, in a slot of one device buffer [L, slots, chunk_tokens, D],
tied to the digest of the prefix they end at; the forward that completes the chunk writes its rows
into the slot (only if it extends exactly that prefix) and the chunk goes to the host as hidden
states instead of K/V. A tail is an optimisation: missing (never kept, evicted for want of slots,
another history), its chunk is stored as K/V from the pages.

gather_hidden does a batch's work in a fixed number of ops whatever its users (one index upload,
one gather of the chunks to offload, whose views it returns, two writes into the tail buffer and
one read of the slots completed), all on the compute stream in this order: the tail rows a forward extends are written, then the
completed slots are read, then new tails are written (possibly into slots just read), so every
read of a slot precedes the next write to it. Model thread only (plan, finish).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from hstu.ops.kvcache.batch import BatchPlan
from hstu.ops.kvcache.transfers import HiddenChunks, upload


@dataclass
class _Tail:
    slot: int  # its slot in HiddenTails.buffer
    chunk: int  # the chunk the rows start
    rows: int  # tokens chunk * chunk_tokens .. + rows - 1 are kept (rows < chunk_tokens)
    digest: bytes  # the user's prefix digest at chunk * chunk_tokens + rows (what the rows end)


class HiddenTails:
    """Each admitted user's partial last chunk of layer inputs, one slot each of a device buffer of
    `budget_bytes`; the least recently kept tail gives up its slot when none is free."""

    def __init__(self, budget_bytes: int, num_layers: int, chunk_tokens: int, hidden_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (num_layers, chunk_tokens, hidden_dim)
        self.dtype, self.device = dtype, device
        self.slot_bytes = num_layers * chunk_tokens * hidden_dim * dtype.itemsize
        self.num_slots = budget_bytes // self.slot_bytes if self.slot_bytes else 0
        self.buffer: torch.Tensor | None = None  # [L, slots, chunk_tokens, D], made at first use
        self._tails: OrderedDict[int, _Tail] = OrderedDict()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._tails)

    def take(self, user: int, end: int, digest: bytes) -> _Tail | None:
        """The user's tail if it ends at token `end` of a prefix with `digest`, now owned by the
        caller (who puts it back or frees its slot); else None, and any other tail dropped."""
        tail = self._tails.pop(user, None)
        if tail is None:
            return None
        if tail.chunk * self.shape[1] + tail.rows != end or tail.digest != digest:
            self._free.append(tail.slot)
            return None
        return tail

    def put(self, user: int, tail: _Tail) -> None:
        """Keep `tail` (its slot owned by the caller) as the user's, most recently kept."""
        self.drop(user)
        self._tails[user] = tail

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def allocate(self) -> int | None:
        """A free slot, the least recently kept tail's if none is (None: no slots at all)."""
        if not self._free:
            if not self._tails:
                return None
            _, old = self._tails.popitem(last=False)
            return old.slot
        return self._free.pop()

    def drop(self, user: int) -> None:
        tail = self._tails.pop(user, None)
        if tail is not None:
            self._free.append(tail.slot)

    def rows_view(self) -> torch.Tensor:
        """The buffer as [L, slots * chunk_tokens, D] rows (made at first use)."""
        L, ct, D = self.shape
        if self.buffer is None:
            self.buffer = torch.zeros((L, self.num_slots, ct, D), dtype=self.dtype, device=self.device)
        return self.buffer.view(L, self.num_slots * ct, D)


def keeps_layer_inputs(plan: BatchPlan, chunk_tokens: int, admits) -> dict[int, tuple[int, int]]:
    """Batch row b -> (first, end): the chunks [first, end) its forward computes whole, for each
    admitted user that computes history tokens (its partial chunks may complete a tail or leave
    one); `admits(user)` is the admission policy."""
    out = {}
    for b, (u, n, cached) in enumerate(zip(plan.user_ids, plan.history_lens, plan.cached_lens)):
        if n > cached and u not in plan.read_only and admits(u):
            out[b] = (-(-cached // chunk_tokens), n // chunk_tokens)
    return out


class _Index:
    """Int64 index runs collected on the host, uploaded as one tensor."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.size = 0

    def add(self, values: np.ndarray) -> tuple[int, int]:
        self.parts.append(values)
        self.size += len(values)
        return self.size - len(values), self.size

    def upload(self, device: torch.device) -> torch.Tensor:
        return upload(np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int64), device)


def gather_hidden(
    plan: BatchPlan, rows: list[int], chunk_tokens: int, tails: HiddenTails, digests: dict[int, bytes],
    stored: dict[int, int],
) -> dict[int, HiddenChunks]:
    """The hidden chunks to offload of batch rows `rows` (those planned to keep their layer
    inputs), gathered now on the current (compute) stream from the forward's layer inputs, before
    any later replay overwrites a graph's copy of them; the users' tails extended, completed or
    kept. digests[b]: the digest of row b's whole history; stored[b]: the host chunks row b's user
    holds (offloaded rows only: only chunks past them are gathered)."""
    if not rows or plan.layer_inputs is None:
        return {}
    ct = chunk_tokens
    index = _Index()
    lead_rows, trail_rows, chunk_rows = [], [], []  # layer-input rows to gather, by use
    lead_dst, trail_dst = [], []  # tail-buffer rows they are written to
    done_slots = []  # tail slots completed by this batch, read back as chunks
    plans: dict[int, tuple[int, list[tuple[str, int]]]] = {}  # b -> (its first chunk, [(source, i)] in chunk order)
    n_full = 0
    kept: list[tuple[int, _Tail]] = []
    for b in rows:
        u, n, cached = plan.user_ids[b], plan.history_lens[b], plan.cached_lens[b]
        base = int(plan.layout.q_offsets[b]) - cached  # the row of the user's token 0
        first, end = plan.hidden_chunks[b]
        need = stored.get(b)  # None: nothing of this user is offloaded now
        sources: list[tuple[str, int]] = []
        full_from = max(first, need) if need is not None else end  # the whole chunks offloaded from here
        start = full_from
        if cached % ct:  # the forward starts inside a chunk: extend its tail, if kept
            tail = tails.take(u, cached, plan.identities[b].prefix(cached))
            if tail is not None:
                stop = min(n, first * ct)  # this forward's tokens of that chunk
                lead_rows.append(np.arange(base + cached, base + stop, dtype=np.int64))
                at = tail.slot * ct + tail.rows
                lead_dst.append(np.arange(at, at + stop - cached, dtype=np.int64))
                if stop == first * ct:  # completed: offloaded as hidden states if new; its slot free after
                    if need is not None and need <= first - 1:
                        sources.append(("done", len(done_slots)))
                        done_slots.append(tail.slot)
                        start = first - 1
                    tails.release(tail.slot)
                else:  # still partial: kept, longer
                    kept.append((u, _Tail(tail.slot, tail.chunk, tail.rows + stop - cached, digests[b])))
        for c in range(full_from, end):
            chunk_rows.append(base + c * ct)
            sources.append(("full", n_full))
            n_full += 1
        if sources:
            plans[b] = (start, sources)
        if n % ct and end >= first:  # a new partial last chunk, begun in this forward
            slot = tails.allocate()
            if slot is not None:
                trail_rows.append(np.arange(base + end * ct, base + n, dtype=np.int64))
                trail_dst.append(np.arange(slot * ct, slot * ct + n - end * ct, dtype=np.int64))
                kept.append((u, _Tail(slot, end, n - end * ct, digests[b])))
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # noqa: E731
    inputs = plan.layer_inputs
    stacked = isinstance(inputs, torch.Tensor)  # a graph's static copy [L, max rows, D], else a tensor a layer
    L = inputs.shape[0] if stacked else len(inputs)
    rows_per_layer = inputs.shape[1] if stacked else 0
    first_rows = np.asarray(chunk_rows, dtype=np.int64)
    if stacked:  # flat rows of [L * max rows, D] in (chunk, layer, token) order: one gather gives the chunks
        per_chunk = (np.arange(L, dtype=np.int64)[:, None] * rows_per_layer + np.arange(ct, dtype=np.int64)).reshape(-1)
        chunk_index = (first_rows[:, None] + per_chunk).reshape(-1)
    else:
        chunk_index = (first_rows[:, None] + np.arange(ct, dtype=np.int64)).reshape(-1)
    spans = [index.add(a) for a in (cat(lead_rows), cat(trail_rows), chunk_index, cat(lead_dst), cat(trail_dst),
                                    np.asarray(done_slots, dtype=np.int64))]
    idx = index.upload(_device_of(inputs))
    lead_x, trail_x, chunk_x, lead_t, trail_t, done_s = (idx[a:z] for a, z in spans)
    if len(lead_x):
        tails.rows_view().index_copy_(1, lead_t, _rows_by_layer(inputs, lead_x))
    done = tails.rows_view().view(L, tails.num_slots, ct, -1).index_select(1, done_s) if done_slots else None
    if n_full and stacked:
        full = inputs.reshape(L * rows_per_layer, -1).index_select(0, chunk_x).view(n_full, L, ct, -1)
        full_chunk = full.__getitem__
    elif n_full:
        full = _rows_by_layer(inputs, chunk_x).view(L, n_full, ct, -1)
        full_chunk = lambda i: full[:, i]  # noqa: E731
    if len(trail_x):
        tails.rows_view().index_copy_(1, trail_t, _rows_by_layer(inputs, trail_x))
    for u, tail in kept:
        tails.put(u, tail)
    out = {}
    for b, (start, sources) in plans.items():
        chunks = [done[:, i] if kind == "done" else full_chunk(i) for kind, i in sources]
        out[b] = HiddenChunks(chunks, start, start + len(chunks))
    return out


def _rows_by_layer(inputs: list[torch.Tensor] | torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[L, len(index), D]: rows `index` of every layer's input."""
    if isinstance(inputs, torch.Tensor):
        return inputs.index_select(1, index)
    return torch.stack([x.index_select(0, index) for x in inputs])


def _device_of(inputs: list[torch.Tensor] | torch.Tensor) -> torch.device:
    return inputs.device if isinstance(inputs, torch.Tensor) else inputs[0].device
