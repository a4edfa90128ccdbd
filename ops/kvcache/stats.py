"""Thread-safe cache counters (hits per tier, misses, evictions, bytes moved, recomputes)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class CacheStats:
    gpu_hits: int = 0
    host_hits: int = 0
    misses: int = 0
    gpu_evictions: int = 0
    host_evictions: int = 0
    invalidations: int = 0  # both reasons below
    invalidated_shorter: int = 0
    invalidated_diverged: int = 0
    diverged_after_launch: int = 0  # of those: found by finish(), the batch launched (ranked again)
    shorter_reused: int = 0  # shorter histories ranked from a longer GPU entry, read-only (kept)
    recomputes: int = 0
    onload_failures: int = 0
    offload_failures: int = 0
    offload_skipped: int = 0
    bytes_onloaded: int = 0
    bytes_offloaded: int = 0
    hidden_chunks_onloaded: int = 0  # host_format "hidden": chunks onloaded as layer inputs, K/V rebuilt
    hidden_chunks_offloaded: int = 0  # chunks offloaded as layer inputs (the rest of bytes_offloaded: K/V)
    cached_tokens: int = 0
    computed_tokens: int = 0
    tokens_onloaded: int = 0  # host-tier prefix tokens onloaded
    tokens_recomputed: int = 0  # host-tier prefix tokens the planner chose to recompute instead
    candidate_tokens: int = 0
    offload_rejected_users: int = 0  # not admitted to the host tier (seen too rarely)
    offload_rejected_bytes: int = 0
    plans_split: int = 0  # host-tier batches by the planner's kind of plan (after feedback)
    plans_front: int = 0  # (a split recomputing the fronts: host_split compute_front)
    plans_onload: int = 0
    plans_recompute: int = 0
    plans_overridden: int = 0  # plans the measured feedback changed (plan_feedback.py)
    prefetches: int = 0
    prefetch_hits: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self, name, getattr(self, name) + value)

    def reset(self) -> None:
        """Zero every counter (e.g. after a server's warm-up, so metrics count real traffic only)."""
        with self._lock:
            for f in fields(self):
                if f.name != "_lock":
                    setattr(self, f.name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
