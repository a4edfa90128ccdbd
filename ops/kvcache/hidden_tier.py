"""host_format "hidden": which chunks of a batch go to the host tier as layer inputs, and the
partial chunk each user's next forward may complete.

A chunk is stored as hidden states only when the layer inputs of all its tokens are at hand when
it fills. A forward computes a user's tokens [cached, n): the chunks wholly inside are at hand; the
chunk the forward starts inside (cached off a chunk boundary) began in an earlier forward, whose
layer inputs are gone unless kept. HiddenTails keeps, per admitted user, the layer inputs of the
last, partial chunk its forward left ([L, r, D] on the device, r < chunk_tokens), tied to the
digest of the prefix they end at; the forward that completes the chunk takes them (only if it
extends exactly that prefix) and the chunk goes to the host as hidden states instead of K/V. A
tail is an optimisation: missing (never kept, evicted by the byte budget, another history), its
chunk is stored as K/V from the pages. Model thread only (plan, finish).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from hstu.ops.kvcache.batch import BatchPlan
from hstu.ops.kvcache.transfers import HiddenChunks


@dataclass
class _Tail:
    chunk: int  # the chunk the rows start
    rows: torch.Tensor  # [L, r, D]: layer inputs of tokens chunk * chunk_tokens .. + r - 1
    digest: bytes  # the user's prefix digest at chunk * chunk_tokens + r (what the rows end)


class HiddenTails:
    """Each admitted user's partial last chunk of layer inputs, least recently kept evicted first
    beyond `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._tails: OrderedDict[int, _Tail] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tails)

    def take(self, user: int, end: int, chunk_tokens: int, digest: bytes) -> torch.Tensor | None:
        """The user's tail rows if they end at token `end` of a prefix with `digest` (then forgotten:
        the caller extends or stores them); else None, and any other tail of the user is dropped."""
        tail = self.drop(user)
        if tail is None or tail.chunk * chunk_tokens + tail.rows.shape[1] != end or tail.digest != digest:
            return None
        return tail.rows

    def put(self, user: int, chunk: int, rows: torch.Tensor, digest: bytes) -> None:
        self.drop(user)
        size = rows.numel() * rows.element_size()
        if size > self.budget_bytes:
            return
        self._tails[user] = _Tail(chunk, rows, digest)
        self.bytes += size
        while self.bytes > self.budget_bytes:
            _, old = self._tails.popitem(last=False)
            self.bytes -= old.rows.numel() * old.rows.element_size()

    def drop(self, user: int) -> _Tail | None:
        tail = self._tails.pop(user, None)
        if tail is not None:
            self.bytes -= tail.rows.numel() * tail.rows.element_size()
        return tail


def keeps_layer_inputs(plan: BatchPlan, chunk_tokens: int, admits) -> dict[int, tuple[int, int]]:
    """Batch row b -> (first, end): the chunks [first, end) its forward computes whole, for each
    admitted user that computes history tokens (its partial chunks may complete a tail or leave
    one); `admits(user)` is the admission policy."""
    out = {}
    for b, (u, n, cached) in enumerate(zip(plan.user_ids, plan.history_lens, plan.cached_lens)):
        if n > cached and u not in plan.read_only and admits(u):
            out[b] = (-(-cached // chunk_tokens), n // chunk_tokens)
    return out


def gather_hidden(
    plan: BatchPlan, rows: list[int], chunk_tokens: int, tails: HiddenTails, digests: dict[int, bytes]
) -> dict[int, HiddenChunks]:
    """The hidden chunks of the offloaded batch rows `rows`, gathered now on the current (compute)
    stream from the forward's layer inputs (before any later replay overwrites a graph's copy of
    them), and the users' new tails kept. A chunk the forward starts inside is included when the
    user's tail holds its beginning. digests[b]: the digest of row b's whole history."""
    spans = [b for b in rows if b in plan.hidden_chunks]
    if not spans or plan.layer_inputs is None:
        return {}
    ct = chunk_tokens
    pieces: list[tuple[int, int]] = []  # (first token row, count) of every run gathered, in order
    work = []
    for b in spans:
        u, n, cached = plan.user_ids[b], plan.history_lens[b], plan.cached_lens[b]
        base = int(plan.layout.q_offsets[b]) - cached  # the row of the user's token 0
        first, end = plan.hidden_chunks[b]
        lead = None  # a tail the forward extends: (its rows, its chunk)
        if cached % ct:
            rows_before = tails.take(u, cached, ct, plan.identities[b].prefix(cached))
            if rows_before is not None:
                lead = (rows_before, cached // ct)
        lead_end = min(n, first * ct)  # the tokens of the chunk the forward starts inside
        lead_run = len(pieces)
        pieces.append((base + cached, lead_end - cached if lead is not None else 0))
        full_run = len(pieces)
        pieces.append((base + first * ct, max(end - first, 0) * ct))
        trail_start = max(end, first) * ct
        trail_run = len(pieces)
        pieces.append((base + trail_start, n - trail_start if n > trail_start and end >= first else 0))
        work.append((b, u, n, first, end, lead, lead_run, full_run, trail_run))
    index = np.concatenate([np.arange(r, r + k, dtype=np.int64) for r, k in pieces])
    gathered = _gather_rows(plan.layer_inputs, index)  # [L, R, D]
    offsets = np.cumsum([0] + [k for _, k in pieces])

    def run(i: int) -> torch.Tensor:
        return gathered[:, offsets[i] : offsets[i + 1]]

    out = {}
    for b, u, n, first, end, lead, lead_run, full_run, trail_run in work:
        L, D = gathered.shape[0], gathered.shape[2]
        chunks = list(run(full_run).view(L, max(end - first, 0), ct, D).unbind(1))
        start = first
        if lead is not None:
            rows_before, lead_chunk = lead
            joined = torch.cat([rows_before, run(lead_run)], dim=1)
            if joined.shape[1] == ct:  # the forward completed the chunk its tail began
                chunks.insert(0, joined)
                start = lead_chunk
            else:  # still partial: the longer tail is kept
                tails.put(u, lead_chunk, joined, digests[b])
        trail = run(trail_run)
        if trail.shape[1]:
            tails.put(u, trail_start_of(n, ct), trail.clone(), digests[b])
        if chunks:
            out[b] = HiddenChunks(torch.stack(chunks), start, start + len(chunks))
    return out


def trail_start_of(n: int, chunk_tokens: int) -> int:
    """The chunk a history of n tokens ends inside."""
    return n // chunk_tokens


def _gather_rows(inputs: list[torch.Tensor] | torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """[L, len(index), D]: rows `index` of every layer's input (a list of [rows, D] tensors, or one
    [L, rows, D] tensor: a graph's static copy, gathered in one op)."""
    device = inputs[0].device
    idx = torch.from_numpy(index).to(device, non_blocking=True)
    if isinstance(inputs, torch.Tensor):
        return inputs.index_select(1, idx)
    return torch.stack([x.index_select(0, idx) for x in inputs])
