"""The benchmark's shapes (seed defaults and the CPU-sized TINY_SHAPE), its requests and its
up-front memory plan, shared by `hstu bench` and `hstu profile`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.ops.kvcache.config import KVCacheConfig


@dataclass(frozen=True)
class BenchShape:
    """Model and request shapes of the benchmark; history and cached counts include contextual tokens."""

    num_layers: int = 8
    embedding_dim: int = 1024
    num_heads: int = 4
    head_dim: int = 256
    page_size: int = 32
    chunk_tokens: int = 128
    history_tokens: int = 4096
    cached_tokens: int = 3968
    num_candidates: int = 256
    batch_sizes: tuple[int, ...] = (1, 8)
    dtype: str = "bfloat16"
    num_contextual: int = 2
    num_items: int = 100_000
    mlp_hidden: int = 512
    prepare_worker: bool = False  # KVCacheConfig.prepare_worker: each batch's prepare job on a worker thread
    host_split: str = "auto"  # KVCacheConfig.host_split: which end of a host-tier prefix is onloaded
    host_format: str = "kv"  # KVCacheConfig.host_format: host chunks as K/V or, computed whole, as layer inputs

    def __post_init__(self) -> None:
        C = self.num_contextual
        if not 0 < self.cached_tokens < self.history_tokens:
            raise ValueError(f"need 0 < cached_tokens < history_tokens, got {self.cached_tokens}, {self.history_tokens}")
        for name in ("cached_tokens", "history_tokens"):
            if (getattr(self, name) - C) % 2 or getattr(self, name) <= C:
                raise ValueError(
                    f"{name}={getattr(self, name)} must be num_contextual ({C}) plus a positive even count "
                    "(2 tokens per event)"
                )
        if self.cached_tokens % self.chunk_tokens:
            raise ValueError(
                f"cached_tokens {self.cached_tokens} must be a multiple of chunk_tokens {self.chunk_tokens} "
                "so that the host tier holds exactly the cached prefix"
            )
        if not self.batch_sizes or min(self.batch_sizes) <= 0:
            raise ValueError(f"batch_sizes must be positive, got {self.batch_sizes}")

    @property
    def new_tokens(self) -> int:
        return self.history_tokens - self.cached_tokens

    @property
    def pages_per_user(self) -> int:
        return -(-self.history_tokens // self.page_size)

    def model_config(self) -> HSTUConfig:
        return HSTUConfig(
            num_items=self.num_items,
            num_contextual=self.num_contextual,
            embedding_dim=self.embedding_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            head_dim_qk=self.head_dim,
            head_dim_v=self.head_dim,
            max_seq_len=self.history_tokens + self.num_candidates,
            mlp_hidden=self.mlp_hidden,
            dtype=self.dtype,
        )

    def cache_config(self, model: HSTUConfig, host_batches: int) -> KVCacheConfig:
        """Pages for two largest batches; a host tier for `host_batches` of them (0: no host tier, so
        no layer inputs kept under host_format "hidden": AsyncKVCacheManager.keeps_hidden)."""
        B = max(self.batch_sizes)
        base = KVCacheConfig.for_model(
            model,
            page_size=self.page_size,
            num_pages=2 * B * self.pages_per_user,
            chunk_tokens=self.chunk_tokens,
            host_capacity_bytes=1,
            on_no_new_tokens="candidates",
            on_shorter_history="raise",
        )
        chunks = host_batches * B * (self.history_tokens // self.chunk_tokens)
        return dataclasses.replace(base, host_capacity_bytes=chunks * base.chunk_bytes, prepare_worker=self.prepare_worker,
                                   host_split=self.host_split, host_format=self.host_format)


TINY_SHAPE = BenchShape(
    num_layers=2,
    embedding_dim=64,
    num_heads=2,
    head_dim=32,
    page_size=16,
    chunk_tokens=64,
    history_tokens=322,
    cached_tokens=256,
    num_candidates=32,
    batch_sizes=(1, 2),
    dtype="float32",
    num_items=1_000,
    mlp_hidden=64,
)


def make_requests(
    shape: BenchShape, model: HSTUConfig, batch: int, seed: int = 0
) -> tuple[list[RankingRequest], list[RankingRequest]]:
    """(prefix requests with cached_tokens, full requests with history_tokens) for users 0..batch-1."""
    rng = np.random.default_rng(seed)
    C = shape.num_contextual
    full_events, prefix_events = (shape.history_tokens - C) // 2, (shape.cached_tokens - C) // 2
    prefix, full = [], []
    for u in range(batch):
        items = rng.integers(0, model.num_items, full_events)
        actions = rng.integers(0, model.num_actions, full_events)
        stamps = np.cumsum(rng.integers(1, 600, full_events))
        candidates = rng.integers(0, model.num_items, shape.num_candidates)
        e = prefix_events
        prefix.append(RankingRequest.create(u, items[:e], actions[:e], stamps[:e], candidates, config=model))
        full.append(RankingRequest.create(u, items, actions, stamps, candidates, config=model))
    return prefix, full


def memory_plan(shape: BenchShape) -> dict[str, int]:
    """Bytes the benchmark allocates up front (device tables, pinned host arena, block inputs)."""
    model = shape.model_config()
    cached = shape.cache_config(model, host_batches=3)
    uncached = shape.cache_config(model, host_batches=0)
    B = max(shape.batch_sizes)
    table = lambda c: c.num_layers * c.num_pages * c.page_bytes  # noqa: E731
    return {
        "cached_gpu_table": table(cached),
        "uncached_gpu_table": table(uncached),
        "block_kv": B * shape.pages_per_user * model.num_layers * cached.page_bytes,
        "host_arena_pinned": cached.host_slots * cached.chunk_bytes + uncached.host_slots * uncached.chunk_bytes,
    }


def check_memory(shape: BenchShape, device: torch.device, plan: dict[str, int]) -> None:
    """Raise MemoryError naming the numbers when the device tables clearly cannot fit."""
    if device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    need = plan["cached_gpu_table"] + plan["uncached_gpu_table"] + plan["block_kv"]
    if need * 1.5 > free:
        raise MemoryError(
            f"benchmark needs ~{need * 1.5 / 2**30:.1f} GiB of device memory, "
            f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f}"
        )
