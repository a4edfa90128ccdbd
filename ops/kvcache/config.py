"""KVCacheConfig: sizes of the two tiers and what to do with histories that do not extend the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hstu.model.config import HSTUConfig


# KVCacheConfig.host_split's values, and the one help text of every command's --host-split flag.
HOST_SPLITS = ("load_front", "compute_front", "auto")
HOST_SPLIT_HELP = (
    "host-tier prefixes split by the planner: onload the front and recompute the back (load_front), "
    "recompute the front in a pass of its own beside the back's onload (compute_front, Cake's order), or "
    "either, per batch, whichever the cost model predicts faster (auto, the default)"
)


# KVCacheConfig.host_format's values, and the help text of every command's --host-format flag.
HOST_FORMATS = ("kv", "hidden")
HOST_FORMAT_HELP = (
    "what the host tier holds of a chunk: its K/V pages (kv, the default), or, for chunks whose layer inputs "
    "the forwards kept, each layer's input rows (hidden: half the bytes at D = H*d, rebuilt into K/V on the "
    "GPU by the layer's norm and K/V projection when onloaded)"
)


def check_host_split(value: str) -> None:
    if value not in HOST_SPLITS:
        raise ValueError(f"host_split must be one of {', '.join(HOST_SPLITS)}, got {value!r}")


@dataclass(frozen=True)
class KVCacheConfig:
    """Shapes of the GPU page table [L, num_pages, 2, page_size, H, d] and the host arena.

    host_capacity_bytes caps the host arena; it holds whole chunks of chunk_tokens tokens (a
    multiple of page_size) for every layer. Histories that do not strictly extend the cache:
      on_no_new_tokens  "candidates": re-ranking an unchanged history reuses every cached token and
                        computes only the candidates; "recompute_last": reuse all but the last token
                        and recompute it; "raise": HistoryConflictError naming the lengths;
      on_shorter_history "invalidate" (default): the request's history is the truth, so the entry is
                        dropped and the history recomputed; "reuse": a history whose tokens are
                        exactly the first tokens of the user's GPU entry (a request that arrives
                        after the user's next one: retries, several connections) is ranked from that
                        entry read-only, only its candidates computed, and the longer entry is kept
                        for the requests that extend it; any other shorter history is invalidated
                        (needs on_no_new_tokens="candidates"); "raise": HistoryConflictError (a
                        strict mode for clients that want to hear about it).
    A history whose cached prefix differs (digest mismatch) is always invalidated and recomputed, so
    no request can make another request for the same user fail.
    Offload: a user's chunks go to the host tier once it was seen offload_min_seen times (1: always,
    ops/kvcache/admission.py), at most offload_bytes_per_s (None: unlimited).
    prepare_worker: run each batch's prepare job (reserve, metadata, onload plan) on the prepare
    worker thread, overlapped with the model thread's features, instead of inside plan() on the
    model thread (the default). Off by default: the job and the features are both C++ passes
    holding the GIL, so the worker overlapped nothing and added a thread handoff and GIL waits; on
    the H200 the cached forward took 0.28-0.32 ms longer with it at batch 1 and 8 (e2e with CUDA
    graphs, benchmarks/RESULTS.md, fifteenth session).
    host_split: how the planner splits a host-tier prefix of n tokens it neither onloads nor
    recomputes whole. "load_front": onload tokens [0, p), recompute [p, n) with the new tokens;
    the recomputed rows attend to the onloaded ones, so each layer waits for its copies (on the
    H200 a batch-8 split stayed copy-bound, 1.04-1.07x of no cache, sixteenth session).
    "compute_front" (Cake's order): recompute [0, q) first, in a pass of its own that reads no
    onloaded page, while tokens [q, n) are onloaded beside it; then the new tokens and candidates
    attend to both. Needs an even number of contextual tokens (q falls on an event boundary).
    "auto" (the default): each batch's planner prices both and takes the faster
    (planner.choose_split): on an H100 (run GH, same call) its planner ran a batch of 8 at 1.41x of
    no cache against load_front's 1.15x, and batch 1 at 1.24x against 1.29x. A model with an odd
    number of contextual tokens gets load_front (RankingEngine).
    host_format: what a host chunk holds. "kv": every layer's K/V pages (2*H*d values a token and
    layer). "hidden": a chunk of an admitted user whose every token's layer inputs were at hand
    (computed whole by one forward, or completed from the tail its previous forward kept) holds
    each layer's input rows instead (hidden_dim values a token and layer: half at the seed shapes),
    and its onload rebuilds K/V on the GPU with the layer's norm and K/V projection (HCache,
    EuroSys 2025: restore from hidden states, fewer bytes over the link); other chunks stay "kv".
    The batch's layer inputs (eager tensors, or a graph replay's static copy of them) are gathered
    for the offload right after its forward. hidden_dim: the model's embedding dim (for_model sets
    it); a hidden chunk uses the first L*chunk_tokens*hidden_dim elements of
    its slot, so hidden_dim must be at most 2*H*d. hidden_tail_bytes: device memory for the layer
    inputs of each admitted user's partial last chunk (ops/kvcache/hidden_tier.py), so the forward
    that completes it stores it as hidden states too (least recently kept dropped beyond it: their
    chunks go as K/V).
    """

    num_layers: int
    num_heads: int
    head_dim: int
    page_size: int = 32
    num_pages: int = 1024
    chunk_tokens: int = 128
    host_capacity_bytes: int = 1 << 30
    dtype: torch.dtype = torch.float32
    on_no_new_tokens: str = "raise"
    on_shorter_history: str = "invalidate"
    onload_timeout_s: float = 60.0
    offload_min_seen: int = 1
    offload_bytes_per_s: float | None = None
    prepare_worker: bool = False
    host_split: str = "auto"
    host_format: str = "kv"
    hidden_dim: int = 0
    hidden_tail_bytes: int = 256 << 20

    @property
    def may_compute_front(self) -> bool:
        """Whether a batch may recompute host-tier prefixes' fronts in a pass of their own
        (host_split "compute_front", or "auto" when the planner picks it)."""
        return self.host_split in ("compute_front", "auto")

    def __post_init__(self) -> None:
        check_host_split(self.host_split)
        if self.hidden_tail_bytes < 0:
            raise ValueError(f"hidden_tail_bytes must be >= 0, got {self.hidden_tail_bytes}")
        if self.host_format not in HOST_FORMATS:
            raise ValueError(f"host_format must be 'kv' or 'hidden', got {self.host_format!r}")
        if self.host_format == "hidden" and not 0 < self.hidden_dim <= 2 * self.num_heads * self.head_dim:
            raise ValueError(
                f"host_format 'hidden' stores hidden_dim values a token and layer in a slot of 2*H*d = "
                f"{2 * self.num_heads * self.head_dim}; hidden_dim must lie in [1, {2 * self.num_heads * self.head_dim}], "
                f"got {self.hidden_dim}"
            )
        if self.page_size <= 0 or self.num_pages <= 0:
            raise ValueError(f"page_size and num_pages must be positive, got {self.page_size}, {self.num_pages}")
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.page_size:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} must be a positive multiple of page_size {self.page_size}")
        if self.on_no_new_tokens not in ("candidates", "recompute_last", "raise"):
            raise ValueError(
                f"on_no_new_tokens must be 'candidates', 'recompute_last' or 'raise', got {self.on_no_new_tokens!r}"
            )
        if self.on_shorter_history not in ("raise", "invalidate", "reuse"):
            raise ValueError(
                f"on_shorter_history must be 'raise', 'invalidate' or 'reuse', got {self.on_shorter_history!r}"
            )
        if self.on_shorter_history == "reuse" and self.on_no_new_tokens != "candidates":
            raise ValueError(
                "on_shorter_history 'reuse' ranks a shorter history from its cached prefix alone, which needs "
                f"on_no_new_tokens 'candidates', got {self.on_no_new_tokens!r}"
            )
        if self.offload_min_seen < 0:
            raise ValueError(f"offload_min_seen must be >= 0, got {self.offload_min_seen}")
        if self.offload_bytes_per_s is not None and not self.offload_bytes_per_s > 0:
            raise ValueError(f"offload_bytes_per_s must be positive or None, got {self.offload_bytes_per_s}")
        if self.host_capacity_bytes < 0:
            raise ValueError(f"host_capacity_bytes must be >= 0, got {self.host_capacity_bytes}")

    @classmethod
    def for_model(cls, model: HSTUConfig, **overrides) -> "KVCacheConfig":
        if model.head_dim_qk != model.head_dim_v:
            raise ValueError(
                f"the paged cache stores K and V with one head dim; got d_qk={model.head_dim_qk}, d_v={model.head_dim_v}"
            )
        base = dict(
            num_layers=model.num_layers, num_heads=model.num_heads, head_dim=model.head_dim_qk, dtype=model.torch_dtype,
            hidden_dim=model.embedding_dim,
        )
        base.update(overrides)
        return cls(**base)

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_tokens // self.page_size

    @property
    def element_size(self) -> int:
        # dtype.itemsize, not a tensor's element_size(): the offload worker asks per batch, and an
        # allocation drops and retakes the GIL the model thread needs
        return self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer (K and V)."""
        return 2 * self.page_size * self.num_heads * self.head_dim * self.element_size

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one host chunk: every layer's pages for chunk_tokens tokens."""
        return self.num_layers * self.pages_per_chunk * self.page_bytes

    @property
    def hidden_chunk_bytes(self) -> int:
        """Bytes of one hidden-state host chunk: every layer's input rows for chunk_tokens tokens."""
        return self.num_layers * self.chunk_tokens * self.hidden_dim * self.element_size

    @property
    def host_slots(self) -> int:
        return self.host_capacity_bytes // self.chunk_bytes
