"""ExportableRanker: the cached ranking forward as one traceable module, for torch.export and
AOTInductor (`hstu export`, tools/aoti_runner/).

The Python engine (engine.py) keeps the cache protocol in Python objects and worker threads; this
module runs the same math with the protocol as ops on an opaque cache handle it owns
(ops/cache_ops.py, csrc/export_cache.cpp), so the whole flow is in the graph:
  history tokens' records and features from the raw events (torch, what preprocessor.py computes
  in numpy) -> cache_lookup -> cache_allocate (pins, LRU eviction, onload, row layout) -> embed only the
  new history tokens and the candidates -> per layer: cache_append, cache_gather, attention ->
  cache_commit -> candidate rows -> postprocessor -> head.
What it covers: both tiers with exact prefix identity: the GPU page pool (user LRU), and the host
chunks (user LRU) that a user evicted from the GPU is onloaded from, inside cache_allocate; newly
full chunks are offloaded inside cache_commit. Both copies are synchronous (no side streams, no
overlap with compute), every full chunk is offloaded (no admission, no pacing), there is no
compute-or-load planner, a history with no new tokens ranks its candidates over the cached K/V
and a shorter or diverging one is recomputed.

Inputs (all int64; B users, E events in all, M candidates), see `batch_inputs`:
  user_ids [B], contextual [B, num_contextual], item_ids, actions, timestamps [E] (users' events
  one after the other), event_counts [B], candidates [M] (likewise), candidate_counts [B].
Output: logits [M, num_tasks], user by user. The exported program takes any B, M >= 1 and E >= 1
(a batch whose users have no events at all is outside its shapes).
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from hstu.model.config import HSTUConfig
from hstu.model.batch import TOKEN_ACTION, TOKEN_CANDIDATE, TOKEN_CONTEXTUAL, TOKEN_ITEM, RankingRequest
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.attention import padded_hstu_attention
from hstu.ops.cache_ops import new_export_cache
from hstu.ops.kvcache.config import KVCacheConfig

_ops = torch.ops.hstu


class BatchInputs(NamedTuple):
    """The exported forward's inputs, in argument order."""

    user_ids: torch.Tensor
    contextual: torch.Tensor
    item_ids: torch.Tensor
    actions: torch.Tensor
    timestamps: torch.Tensor
    event_counts: torch.Tensor
    candidates: torch.Tensor
    candidate_counts: torch.Tensor


def batch_inputs(requests: list[RankingRequest], device: torch.device | str = "cpu") -> BatchInputs:
    """The exported forward's inputs for a batch of requests (distinct users)."""

    def cat(parts: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)

    def counts(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return BatchInputs(
        torch.tensor([r.user_id for r in requests], dtype=torch.long, device=device),
        torch.from_numpy(np.stack([r.contextual for r in requests]).astype(np.int64)).to(device),
        cat([r.item_ids for r in requests]),
        cat([r.actions for r in requests]),
        cat([r.timestamps for r in requests]),
        counts([r.num_events for r in requests]),
        cat([r.candidates for r in requests]),
        counts([r.candidates.shape[0] for r in requests]),
    )


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """CSR offsets [B+1] of per-user counts [B]."""
    return torch.cat([torch.zeros_like(counts[:1]), torch.cumsum(counts, 0)])


class ExportableRanker(nn.Module):
    """`model`'s cached forward with its own cache, sized by `cache_config` (KVCacheConfig's
    page and host-tier sizes; its policy fields do not apply, see the module docstring)."""

    def __init__(self, model: InferenceRankingGR, cache_config: KVCacheConfig) -> None:
        super().__init__()
        self.config = model.config
        self.embeddings = model.preprocessor.embeddings
        self.layers = model.block.layers
        self.postprocessor = model.postprocessor
        self.head = model.head
        self.cache = new_export_cache(cache_config, model.device)

    def history_tokens(
        self, user_ids, contextual, item_ids, actions, timestamps, event_counts
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(records [N, 2], features [4, N], record_offsets [B+1]) of every history token, user by
        user: records as model/identity.py lays them out, features (table index, position, time
        bucket, type) as preprocessor.batch_features computes them."""
        C, nb = self.config.num_contextual, self.config.num_time_buckets
        emb = self.embeddings
        B, E, dev = user_ids.shape[0], item_ids.shape[0], item_ids.device
        starts = torch.cumsum(event_counts, 0) - event_counts  # each user's first event
        event_user = torch.repeat_interleave(torch.arange(B, device=dev), event_counts, output_size=E)
        first_event = starts.index_select(0, event_user)
        event = torch.arange(E, device=dev)
        local = event - first_event
        prev = torch.where(local > 0, event - 1, event)
        gap = (timestamps - timestamps.index_select(0, prev)).double()
        bucket = 1 + torch.clamp(torch.floor(torch.log2(1.0 + gap)).long(), max=nb - 3)
        item_pos = C + 2 * local
        item_tok = (event_user + 1) * C + 2 * event  # the user's contextual tokens, then 2 per event

        ctx_pos = torch.arange(C, device=dev).expand(B, C)
        ctx_tok = (torch.arange(B, device=dev) * C + 2 * starts).unsqueeze(1) + ctx_pos
        zeros_ctx = torch.zeros_like(contextual.reshape(-1))
        grouped_records = torch.cat(
            [
                torch.stack([contextual.reshape(-1), zeros_ctx], dim=1),
                torch.stack([item_ids, timestamps], dim=1),
                torch.stack([actions, timestamps], dim=1),
            ]
        )
        grouped_features = torch.cat(
            [
                torch.stack([contextual.reshape(-1), ctx_pos.reshape(-1), zeros_ctx, zeros_ctx + TOKEN_CONTEXTUAL]),
                torch.stack([emb.item_offset + item_ids, item_pos, bucket, torch.full_like(item_ids, TOKEN_ITEM)]),
                torch.stack([emb.action_offset + actions, item_pos + 1, bucket, torch.full_like(actions, TOKEN_ACTION)]),
            ],
            dim=1,
        )
        order = torch.cat([ctx_tok.reshape(-1), item_tok, item_tok + 1])
        records = torch.empty_like(grouped_records).index_copy(0, order, grouped_records)
        features = torch.empty_like(grouped_features).index_copy(1, order, grouped_features)
        return records, features, _offsets(C + 2 * event_counts)

    def candidate_features(self, candidates, candidate_user, event_counts) -> torch.Tensor:
        """Features [4, M] of the candidates: each sits at its user's history length."""
        position = (self.config.num_contextual + 2 * event_counts).index_select(0, candidate_user)
        bucket = torch.full_like(candidates, self.config.num_time_buckets - 1)
        kind = torch.full_like(candidates, TOKEN_CANDIDATE)
        return torch.stack([self.embeddings.item_offset + candidates, position, bucket, kind])

    def forward(
        self, user_ids, contextual, item_ids, actions, timestamps, event_counts, candidates, candidate_counts
    ) -> torch.Tensor:
        records, hist_features, record_offsets = self.history_tokens(
            user_ids, contextual, item_ids, actions, timestamps, event_counts
        )
        B, M = user_ids.shape[0], candidates.shape[0]
        cand_user = torch.repeat_interleave(torch.arange(B, device=candidates.device), candidate_counts, output_size=M)
        features = torch.cat([hist_features, self.candidate_features(candidates, cand_user, event_counts)], dim=1)
        cached = _ops.cache_lookup(self.cache, user_ids, records, record_offsets)
        cand_offsets = _offsets(candidate_counts)
        allocated = _ops.cache_allocate(self.cache, user_ids, cached, record_offsets, cand_offsets)
        rows, q_batch, q_local, q_pos, append_rows, append_pages, append_offsets, page_table, kv_lens, max_q_t = allocated
        # At least 2 rows per user in the padded attention: Inductor's bmm lowering cannot take a
        # data-dependent size that might be 1; the extra row is padding, masked like any other.
        max_q = torch.sym_max(max_q_t.item(), 2)
        torch._check(page_table.shape[1] >= 1)
        # Candidate rows from the counts (allocate's layout: per user new history rows, then its
        # candidates), so the logits keep the input's size M rather than a data-dependent one.
        new = self.config.num_contextual + 2 * event_counts - cached
        per_user = new + candidate_counts
        first = torch.cumsum(per_user, 0) - per_user + new - (torch.cumsum(candidate_counts, 0) - candidate_counts)
        cand_rows = first.index_select(0, cand_user) + torch.arange(M, device=candidates.device)
        f = features.index_select(1, rows)
        x = self.embeddings(f[0], f[1], f[2], f[3])
        for i, layer in enumerate(self.layers):
            u, q, k, v = layer.project(x)
            _ops.cache_append(
                self.cache, i, k.index_select(0, append_rows), v.index_select(0, append_rows), append_pages, append_offsets
            )
            keys, values = _ops.cache_gather(self.cache, i, page_table)
            attn = padded_hstu_attention(
                q, k, v, keys, values, kv_lens, q_batch, q_local, q_pos, max_q, self.config.attention_scale_len
            )
            x = layer.finish(x, attn, u)
        _ops.cache_commit(self.cache, user_ids, records, record_offsets)
        return self.head(self.postprocessor(x.index_select(0, cand_rows)))


def example_requests(config: HSTUConfig) -> list[RankingRequest]:
    """A batch to trace with: two users of two events and two candidates (a size of 1 would be
    specialised by torch.export)."""
    return [
        RankingRequest.create(u, item_ids=[1, 2], actions=[0, 1], timestamps=[10, 20], candidates=[3, 4], config=config)
        for u in (0, 1)
    ]


def export_ranker(ranker: ExportableRanker) -> torch.export.ExportedProgram:
    """torch.export of the ranker's forward with dynamic batch size B, event count E and
    candidate count M. Tracing runs the fakes only: the ranker's cache is not touched (torch.export
    copies it once, empty: exporting needs room for a second cache of the same size)."""
    example = batch_inputs(example_requests(ranker.config), device=next(ranker.parameters()).device)
    B, E, M = torch.export.Dim("B", min=1), torch.export.Dim("E", min=1), torch.export.Dim("M", min=1)
    dims = BatchInputs(
        user_ids={0: B}, contextual={0: B}, item_ids={0: E}, actions={0: E}, timestamps={0: E},
        event_counts={0: B}, candidates={0: M}, candidate_counts={0: B},
    )
    return torch.export.export(ranker, tuple(example), dynamic_shapes=tuple(dims), strict=False)


def package_ranker(ranker: ExportableRanker, path: str) -> str:
    """Export the ranker and compile it into an AOTInductor package at `path` (.pt2). The package
    carries the weights, the cache's configuration (a loaded package starts with an empty cache)
    and, as metadata, the sizes a client needs to build valid batches."""
    from torch._inductor import aoti_compile_and_package

    cfg = ranker.config
    metadata = {
        "num_contextual": cfg.num_contextual,
        "num_contextual_features": cfg.num_contextual_features,
        "num_items": cfg.num_items,
        "num_actions": cfg.num_actions,
        "num_tasks": cfg.num_tasks,
        "max_seq_len": cfg.max_seq_len,
    }
    return aoti_compile_and_package(
        export_ranker(ranker),
        package_path=path,
        inductor_configs={"aot_inductor.metadata": {k: str(v) for k, v in metadata.items()}},
    )


def _share_libstdcxx() -> None:
    """Make the process's libstdc++ visible to libraries loaded later. Python loads torch's
    extension (and, through it, libstdc++) with RTLD_LOCAL, so a package's wrapper .so that
    carries its own libstdc++ symbols binds them to its uninitialised copy: on CUDA its first
    std::regex (device-string parsing) then segfaults while loading, even for a single Linear
    (H200, torch 2.11, GCC 13; RESULTS.md, eighth session). Opening the loaded library again
    with RTLD_GLOBAL promotes it, as LD_PRELOAD would; where it cannot be found this is a no-op."""
    try:
        ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL)
    except OSError:
        pass


def load_package(path: str):
    """An AOTInductor package (`package_ranker`'s) loaded for running in this process: a callable
    taking BatchInputs' tensors, with `.loader` for its metadata and cache object."""
    from torch._inductor import aoti_load_package

    _share_libstdcxx()
    return aoti_load_package(path)
