"""Python face of the exportable cache protocol (csrc/export_cache.cpp): the opaque cache handle,
its fake class and the fakes of the ops that take it, so torch.export can trace a forward that
looks users up, allocates pages, appends and gathers K/V and commits (engine/exported.py).

The handle is a TorchScript custom class, `torch.classes.hstu.ExportKVCache`; ops taking it are
ordered by torch.export's effect tokens, so lookup -> append/gather per layer -> commit keep their
order in the exported graph and in an AOTInductor package. cache_allocate is the exception: its
outputs have data-dependent sizes, which Inductor cannot bind through an effect token (torch
2.13: IndexError in compute_unbacked_bindings), so it is registered without an effect; data
dependencies order it instead (it reads lookup's cached lengths, the appends read its pages).

Shapes (B users, N history tokens in all, M candidates, T = new history tokens + candidates,
Tn new history tokens, P pages of the longest user; every index tensor int64):
  cache_lookup(cache, user_ids [B], records [N, 2], record_offsets [B+1]) -> cached_lens [B]
                 (GPU entry, else host chunks)
  cache_allocate(cache, user_ids, cached_lens, record_offsets, candidate_offsets [B+1]) ->
      (pins, reserves pages, onloads host-tier users' chunks)
      rows, q_batch, q_local, q_pos [T]; append_rows, append_page_ids, append_offsets [Tn];
      page_table [B, P]; kv_lens [B]; max_q (0-dim, host)
  cache_append(cache, layer, k [Tn, H, d], v [Tn, H, d], page_ids [Tn], offsets [Tn]) -> ()
  cache_gather(cache, layer, page_table [B, P]) -> keys, values [B, P * page_size, H, d]
  cache_commit(cache, user_ids, records, record_offsets) -> ()   (offloads newly full chunks)
"""

from __future__ import annotations

import torch

from hstu.ops._build import load_extension
from hstu.ops.kvcache.config import KVCacheConfig

load_extension()


def new_export_cache(config: KVCacheConfig, device: torch.device | str) -> torch.ScriptObject:
    """An empty cache shaped by `config`: num_pages pages of page_size tokens on `device`, and a
    host tier of config.host_slots chunks of chunk_tokens tokens (0 slots: none)."""
    c = config
    dtype = str(c.dtype).removeprefix("torch.")
    return torch.classes.hstu.ExportKVCache(
        c.num_layers, c.num_pages, c.page_size, c.num_heads, c.head_dim, c.host_slots, c.chunk_tokens, dtype, str(device)
    )


@torch._library.register_fake_class("hstu::ExportKVCache")
class FakeExportKVCache:
    """The handle as torch.export sees it while tracing: its configuration, no state (a fake op
    reads it through _shape_of)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_heads: int,
        head_dim: int,
        host_slots: int,
        chunk_tokens: int,
        dtype: str,
        device: str,
    ) -> None:
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_heads, self.head_dim = num_heads, head_dim
        self.host_slots, self.chunk_tokens = host_slots, chunk_tokens
        self.dtype, self.device = getattr(torch, dtype), torch.device(device)

    @classmethod
    def __obj_unflatten__(cls, flat: tuple) -> "FakeExportKVCache":
        return cls(**dict(flat))

    # The counters of the real class; a traced cache stays empty, so they are all 0.
    def num_users(self) -> int:
        return 0

    def num_free_pages(self) -> int:
        return self.num_pages

    def host_users(self) -> int:
        return 0

    def evictions(self) -> int:
        return 0

    def invalidations(self) -> int:
        return 0

    def reused_tokens(self) -> int:
        return 0

    def onloaded_tokens(self) -> int:
        return 0

    def offloaded_chunks(self) -> int:
        return 0


torch.library._register_effectful_op("hstu::cache_allocate", None)


def _shape_of(cache) -> FakeExportKVCache:
    """The configuration of the cache a fake op was given: the fake object under torch.export,
    the real handle under plain fake-tensor mode (opcheck)."""
    if isinstance(cache, torch._library.fake_class_registry.FakeScriptObject):
        return cache.wrapped_obj
    return FakeExportKVCache.__obj_unflatten__(cache.__obj_flatten__())


def _long(device, *shape) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.long, device=device)


@torch.library.register_fake("hstu::cache_lookup")
def _lookup_fake(cache, user_ids, records, record_offsets):
    return torch.empty_like(user_ids, dtype=torch.long)


@torch.library.register_fake("hstu::cache_allocate")
def _allocate_fake(cache, user_ids, cached_lens, record_offsets, candidate_offsets):
    ctx = torch.library.get_ctx()
    rows, new, pages = (ctx.new_dynamic_size() for _ in range(3))
    dev = _shape_of(cache).device
    B = user_ids.shape[0]
    return (
        *(_long(dev, rows) for _ in range(4)),
        *(_long(dev, new) for _ in range(3)),
        _long(dev, B, pages),
        _long(dev, B),
        torch.empty((), dtype=torch.long),
    )


@torch.library.register_fake("hstu::cache_append")
def _append_fake(cache, layer, k, v, page_ids, offsets) -> None:
    return None


@torch.library.register_fake("hstu::cache_gather")
def _gather_fake(cache, layer, page_table):
    cache = _shape_of(cache)
    shape = (page_table.shape[0], page_table.shape[1] * cache.page_size, cache.num_heads, cache.head_dim)
    empty = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    return empty, empty.clone()


@torch.library.register_fake("hstu::cache_commit")
def _commit_fake(cache, user_ids, records, record_offsets) -> None:
    return None
