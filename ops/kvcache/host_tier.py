"""Host-tier policy of the manager: how much of a host-tier prefix a batch onloads (the planner's
compute-or-load split), which users' new chunks are offloaded (admission), and which host-tier
users are onloaded ahead of their request (prefetch).

These are decisions about what moves between the tiers, not the lookup/prepare/commit protocol,
so they live here and manager.py keeps only that protocol and its locking. Each function is
called by the manager under the locking it documents; none takes `_index_lock` itself except
Prefetcher.start, which runs outside any batch.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from hstu.ops.kvcache.admission import FrequencyAdmission
from hstu.ops.kvcache.batch import BatchPlan
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.plan_feedback import PlanFeedback, plan_kind, reprice
from hstu.ops.kvcache.planner import CostModel, FixedSplit, UserShape, choose_split, front_tokens
from hstu.ops.kvcache.stats import CacheStats
from hstu.ops.kvcache.transfers import TierTransfers


def split_host_prefixes(
    plan: BatchPlan,
    num_candidates: list[int],
    config: KVCacheConfig,
    cost_model: CostModel | FixedSplit | None,
    stats: CacheStats,
    buckets: tuple[int, ...] | None = None,
    slot_hidden: np.ndarray | None = None,
    feedback: PlanFeedback | None = None,
) -> list[int]:
    """Keep only the planner's share of each host-tier prefix in `plan` (the rest is recomputed:
    after the onloaded front, or with host_split "compute_front" before the onloaded back, in a
    front pass of its own, plan.front_tokens);
    with no cost model every host prefix is onloaded whole (buckets: see planner.plan). Returns
    the users that now onload nothing, whose host pins the caller must release. slot_hidden: which
    host slots hold hidden states (host_format "hidden"; the planner prices their onload so).
    feedback: what earlier plans measured (plan_feedback.py): a planner's (CostModel's) choice is
    re-priced with it, and the batch is marked to be measured (plan.measure)."""
    host = [b for b, s in enumerate(plan.sources) if s == "host"]
    if not host:
        return []
    onload = [plan.cached_lens[b] for b in host]
    front = config.host_split == "compute_front"  # (a planner's choice under "auto")
    if cost_model is not None:
        shapes = [
            UserShape(
                plan.cached_lens[b] if s == "host" else 0,
                plan.cached_lens[b] if s == "gpu" else 0,
                plan.history_lens[b],
                num_candidates[b],
                _hidden_flags(plan.onload_slots[plan.user_ids[b]], slot_hidden) if s == "host" else (),
            )
            for b, s in enumerate(plan.sources)
        ]
        host_tokens = [u.host_tokens for u in shapes]
        measured = None
        if feedback is not None and isinstance(cost_model, CostModel):
            feedback.follow(cost_model)

            def measured(chosen, front: bool) -> float:  # each order's plan priced by what its kind measured
                return feedback.factor(plan_kind(chosen.onload_tokens, host_tokens, front), len(shapes))

        chosen, front = choose_split(
            cost_model, shapes, config.num_layers, config.chunk_tokens, buckets, config.host_split, measured
        )
        if measured is not None:
            planned = plan_kind(chosen.onload_tokens, host_tokens, front)
            chosen, kind = reprice(
                chosen, planned, shapes, cost_model, feedback, config.num_layers, config.chunk_tokens, buckets
            )
            stats.add(**{f"plans_{kind}": 1, "plans_overridden": int(kind != planned)})
            plan.measure = (kind, len(shapes), chosen.predicted_s - cost_model.forward_s)
        onload = [min(chosen.onload_tokens[b], plan.cached_lens[b]) for b in host]
    chunk, unpin = config.chunk_tokens, []
    onloaded = recomputed = 0  # (counted once: a stats.add a user was a fifth of this function)
    for b, p in zip(host, onload):
        u, cached = plan.user_ids[b], plan.cached_lens[b]
        if front and 0 < p < cached:
            q = front_tokens(cached, p, chunk)
            if q > 0:  # tokens [0, q) recomputed by the front pass, [q, cached) onloaded
                onloaded, recomputed = onloaded + cached - q, recomputed + q
                plan.front_tokens[u] = q
                plan.onload_slots[u] = plan.onload_slots[u][q // chunk :]
                continue
            p = cached
        onloaded, recomputed = onloaded + p, recomputed + cached - p
        plan.cached_lens[b] = p
        if p == 0:
            del plan.onload_slots[u]
            plan.sources[b] = "miss"
            unpin.append(u)
        else:
            plan.onload_slots[u] = plan.onload_slots[u][: -(-p // chunk)]
    stats.add(tokens_onloaded=onloaded, tokens_recomputed=recomputed)
    return unpin


def prefilled_host_user(config: KVCacheConfig, host_tokens: int, history_tokens: int, candidates: int) -> UserShape:
    """The planner's shape of a user whose host prefix of host_tokens was computed in one forward
    and offloaded (an admitted user: a benchmark's or the calibration's), so under host_format
    "hidden" every chunk of it holds hidden states."""
    hidden = (True,) * (host_tokens // config.chunk_tokens) if config.host_format == "hidden" else ()
    return UserShape(host_tokens, 0, history_tokens, candidates, hidden)


def _hidden_flags(slots: list[int], slot_hidden: np.ndarray | None) -> tuple[bool, ...]:
    """Which of a user's host chunks hold hidden states (empty: none)."""
    if slot_hidden is None:
        return ()
    flags = slot_hidden[slots]
    return tuple(flags.tolist()) if flags.any() else ()


def admitted(
    plan: BatchPlan,
    jobs: list[tuple[int, int]],
    config: KVCacheConfig,
    admission: FrequencyAdmission,
    host,
    stats: CacheStats,
) -> list[tuple[int, int]]:
    """The (user, row) jobs whose new full chunks go to the host tier (admission policy); counts the
    rejected ones. A user with no full chunk beyond what the host holds (a re-rank of an unchanged
    history, new tokens inside a chunk) is no job: the offload worker would find nothing to store,
    yet its submit and its Python would run beside the model thread's next batch, holding the GIL,
    and its pages stay pinned until it ran. The caller holds `_index_lock` (it reads the host
    index)."""
    chunk, out = config.chunk_tokens, []
    if config.host_slots == 0:
        return out
    for u, b in jobs:
        new_chunks = plan.history_lens[b] // chunk - len(host.lookup(u)[0])
        if new_chunks <= 0:
            continue
        if admission.admits(u):
            out.append((u, b))
        else:
            stats.add(offload_rejected_users=1, offload_rejected_bytes=new_chunks * config.chunk_bytes)
    return out


class Prefetcher:
    """Onloads host-tier users expected to rank soon into free GPU pages, and counts the lookups
    that found a prefetched user on the GPU. Model thread only."""

    def __init__(
        self, config: KVCacheConfig, gpu, host, transfers: TierTransfers, stats: CacheStats, index_lock: threading.RLock
    ) -> None:
        self.config, self.gpu, self.host, self.transfers, self.stats = config, gpu, host, transfers, stats
        self._index_lock = index_lock
        self._pending: dict[int, None] = {}  # users onloaded by prefetch, not yet looked up

    def start(self, user_ids: list[int], max_users: int) -> int:
        """Start onloading users (never evicting anyone); users on the GPU or in flight are skipped.
        Returns the number started."""
        ppc, started = self.config.pages_per_chunk, 0
        for u in list(dict.fromkeys(user_ids))[:max_users]:
            self.transfers.join([u])
            with self._index_lock:
                slots, digest = self.host.lookup(u)
                n = len(slots) * self.config.chunk_tokens
                need = -(-n // self.config.page_size)
                if not slots or self.gpu.lookup(u)[0] > 0 or self.gpu.pin_count(u) or need > self.gpu.num_free_pages():
                    continue
                self.gpu.invalidate(u)  # an empty (uncommitted) GPU entry, if any
                (pages,) = self.gpu.reserve([u], [0], [n])
                self.host.pin([u])
                self.host.touch(u)
            page_ids = torch.tensor(pages, dtype=torch.int32).reshape(-1, ppc)
            self.transfers.prefetch_async(u, torch.tensor(slots, dtype=torch.int32), page_ids, n, digest)
            self._pending[u] = None
            started += 1
        if len(self._pending) > 4 * max_users:  # bounded: forget the oldest
            for u in list(self._pending)[: len(self._pending) - 4 * max_users]:
                del self._pending[u]
        self.stats.add(prefetches=started)
        return started

    def looked_up(self, user: int, source: str) -> None:
        """A batch looked the user up: a GPU hit on a prefetched user counts as a prefetch hit."""
        if self._pending.pop(user, 1) is None and source == "gpu":
            self.stats.add(prefetch_hits=1)
