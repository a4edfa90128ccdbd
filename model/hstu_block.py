"""HSTU block: a stack of layers with two paths over the same weights.

- dense: one user's full sequence at a time (the no-cache reference);
- paged: the jagged batch of new tokens; each layer appends the new history tokens' K/V into the
  user's pages, then runs paged attention over cached + new K/V. `before_layer(i)` is called
  before layer i touches the cache (after its input projection, which reads none; before the
  whole layer when the layers are compiled one by one), so layer i waits only for its own onload.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hstu.model.config import HSTUConfig
from hstu.model.hstu_layer import HSTULayer
from hstu.ops.attention import dense_hstu_attention, paged_hstu_attention
from hstu.ops.kv_ops import append_kvcache
from hstu.ops.kvcache.metadata import KVCacheMetadata


class HSTUBlock(nn.Module):
    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))

    def forward_dense(self, x: torch.Tensor, history_len: int) -> torch.Tensor:
        """One user's full sequence [N, D] (history then candidates) without any cache."""
        for layer in self.layers:
            u, q, k, v = layer.project(x)
            x = layer.finish(x, dense_hstu_attention(q, k, v, history_len, self.config.attention_scale_len), u)
        return x

    def paged_layer(self, index: int, x: torch.Tensor, kv_cache: torch.Tensor, meta: KVCacheMetadata) -> torch.Tensor:
        """Layer `index` on the jagged new tokens [T, D]: append new history K/V, paged attention."""
        return self.paged_attend(index, x, self.layers[index].projection(x), kv_cache, meta)

    def paged_attend(
        self, index: int, x: torch.Tensor, uvqk: torch.Tensor, kv_cache: torch.Tensor, meta: KVCacheMetadata
    ) -> torch.Tensor:
        """The rest of layer `index` after its projection uvqk of x (HSTULayer.projection): the part
        that reads and writes the cache, so the one a layer's onload wait precedes."""
        layer = self.layers[index]
        u, q, k, v = layer.split_projection(uvqk)
        # the new history rows' K/V straight from the projection (no gathered copy); a graph
        # bucket's padded appends are skipped rather than written to its scratch page
        append_kvcache(
            kv_cache, k, v, meta.append_page_ids, meta.append_offsets, index, rows=meta.append_rows,
            skip_page=meta.skip_page,
        )
        attn = paged_hstu_attention(q, k, v, kv_cache, index, meta, self.config.attention_scale_len)
        return layer.finish(x, attn, u)

    def forward_paged(
        self,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: KVCacheMetadata,
        before_layer: Callable[[int], None] | None = None,
        layer_fns: list[Callable] | None = None,
        layer_inputs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """All layers on the jagged batch; layer_fns[i](x, kv_cache, meta) may replace layer i (compiled).
        layer_inputs: if given, each layer's input [T, D] is appended to it (kept, not copied: the
        host tier stores the history rows' as hidden-state chunks)."""
        for i in range(len(self.layers)):
            if layer_inputs is not None:
                layer_inputs.append(x)
            if layer_fns is not None:  # (compiled whole: the wait before it)
                if before_layer is not None:
                    before_layer(i)
                x = layer_fns[i](x, kv_cache, meta)
                continue
            # the projection reads no cached K/V: enqueued before the layer's onload wait, it runs
            # while the layer's pages are still landing
            uvqk = self.layers[i].projection(x)
            if before_layer is not None:
                before_layer(i)
            x = self.paged_attend(i, x, uvqk, kv_cache, meta)
        return x

    def kv_from_hidden(self, index: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s K and V [T, H, d] of tokens whose layer input was x [T, D]."""
        return self.layers[index].project_kv(x)
