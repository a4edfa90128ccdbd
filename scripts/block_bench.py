"""Block section of `hstu bench`: HSTUBlock.forward_paged on cached (new + candidate rows) and
uncached (whole history + candidates) inputs over random pages."""

from __future__ import annotations

from typing import Any

import torch

from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.layout import JaggedLayout
from hstu.ops.kvcache.metadata import KVCacheMetadata
from hstu.scripts.bench_shapes import BenchShape
from hstu.scripts.timing import Timer, summarize


def block_inputs(
    shape: BenchShape, model: InferenceRankingGR, batch: int, cached: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, KVCacheMetadata]:
    """(x, kv_cache, metadata) for `batch` users of history_tokens with `cached` of them in pages.

    Pages are a random permutation of the pool (no two users' pages adjacent by construction);
    cached K/V and x are random (timing does not depend on their values).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    cfg, ppu = model.config, shape.pages_per_user
    num_pages = batch * ppu
    kv = torch.randn(
        (cfg.num_layers, num_pages, 2, shape.page_size, cfg.num_heads, cfg.head_dim_qk),
        generator=g,
        device=device,
        dtype=cfg.torch_dtype,
    )
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    pages = [perm[b * ppu : (b + 1) * ppu] for b in range(batch)]
    hist, cached_lens, cands = [shape.history_tokens] * batch, [cached] * batch, [shape.num_candidates] * batch
    layout = JaggedLayout.build(hist, cached_lens, cands)
    meta = KVCacheMetadata.from_layout(pages, layout, shape.page_size).to(device, non_blocking=False)
    x = torch.randn((layout.num_rows, cfg.embedding_dim), generator=g, device=device, dtype=cfg.torch_dtype)
    return x, kv, meta


def bench_block(
    shape: BenchShape, model: InferenceRankingGR, batch: int, timer: Timer, warmup: int, repeats: int, device: torch.device
) -> dict:
    out: dict[str, Any] = {"check_failures": []}
    for name, cached in (("cached", shape.cached_tokens), ("uncached", 0)):
        x, kv, meta = block_inputs(shape, model, batch, cached, device)
        with torch.inference_mode():
            times, y = timer.measure(lambda: model.block.forward_paged(x, kv, meta), None, warmup, repeats)
        if not torch.isfinite(y).all():
            out["check_failures"].append(f"block/{name}: non-finite outputs")
        out[name] = {**summarize(times), "rows": int(x.shape[0]), "kv_tokens_per_user": shape.history_tokens}
        del x, kv, meta, y
    out["speedup"] = out["uncached"]["median_ms"] / out["cached"]["median_ms"]
    return out
