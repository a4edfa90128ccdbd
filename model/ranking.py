"""InferenceRankingGR: the HSTU ranking model, with or without the KV cache.

forward(requests) with a cache manager runs the asynchronous flow of DESIGN.md:
  1. lookup (sync, microseconds) -> cached lengths; prepare_async on the prepare worker
     (page reservation, metadata, onload start) ...
  2. ... while this thread embeds only the new history tokens and the candidates;
  3. wait_prepared joins the prepare future;
  4. the block runs layer by layer, layer i waiting only for its own onload;
  5. offload_async commits, starts the offload and names users whose onload failed: they are recomputed
     from scratch in a second pass, so a failed onload never serves stale K/V;
  6. postprocessor and head -> logits.
forward_no_cache(requests) is the reference: each user's whole sequence through the dense path.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.hstu_block import HSTUBlock
from hstu.model.postprocessor import MultiTaskHead, Postprocessor
from hstu.model.preprocessor import JaggedLayout, Preprocessor


@dataclass
class RankOutput:
    """Per-user result of a forward: logits [M, num_tasks] and how much was reused."""

    user_id: int
    logits: torch.Tensor
    cached_tokens: int
    computed_tokens: int

    @property
    def scores(self) -> np.ndarray:
        return torch.sigmoid(self.logits.float()).cpu().numpy()


class InferenceRankingGR(nn.Module):
    """HSTU ranking model for inference; deterministic weights from config.seed."""

    def __init__(self, config: HSTUConfig, device: torch.device | str = "cpu", kv_cache=None) -> None:
        super().__init__()
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.preprocessor = Preprocessor(config)
            self.block = HSTUBlock(config)
            self.postprocessor = Postprocessor(config)
            self.head = MultiTaskHead(config)
            self._init_weights()
        self.to(device=device, dtype=config.torch_dtype)
        self.eval()
        self.kv_cache = kv_cache
        self.layer_fns: list[Callable] | None = None
        self.graphs = None
        self._lock = threading.Lock()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_normal_(module.weight)
                if module.bias is not None:
                    nn.init.normal_(module.bias, std=0.02)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, mean=1.0, std=0.05)
                nn.init.normal_(module.bias, std=0.02)

    def compile_paged_layers(self, **compile_kwargs) -> None:
        """torch.compile each paged layer on its own (fullgraph), so the per-layer onload waits
        stay outside the compiled regions. Eager batches then recompile per new shape; for serving,
        enable_cuda_graphs(compile=True) compiles once per row bucket instead."""
        self.layer_fns = self._compiled_layers(**compile_kwargs)

    def _compiled_layers(self, **compile_kwargs) -> list[Callable]:
        return [
            torch.compile(functools.partial(self.block.paged_layer, i), fullgraph=True, **compile_kwargs)
            for i in range(self.config.num_layers)
        ]

    def enable_cuda_graphs(
        self,
        max_batch: int = 8,
        buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096),
        compile: bool = False,
    ) -> None:
        """Replay the paged layers as per-layer CUDA graphs for batches that fit a row bucket
        (padded); larger batches run eagerly. Captures every bucket now, before serving.

        compile: the graphs capture torch.compile'd layers (Inductor fuses each layer's
        projections, norms and gating around the custom ops), compiled once per (layer, bucket)
        with static shapes; eager fallback batches keep the eager layers, so no batch ever
        triggers a compile while serving.
        """
        if self.kv_cache is None or self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA model with a KV cache manager")
        from hstu.model.cuda_graphs import PagedLayerGraphs

        layer_fns = self._compiled_layers(dynamic=False) if compile else None
        self.graphs = PagedLayerGraphs(
            self.block, self.kv_cache.kv_cache, self.kv_cache.scratch_page, max_batch, buckets, layer_fns
        )
        # Every layer is one code object (paged_layer) compiled once per (layer, bucket): lift
        # Dynamo's per-code recompile limit for the captures, else the later ones run uncompiled.
        limit = max(torch._dynamo.config.recompile_limit, self.config.num_layers * len(buckets) + 8)
        with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=limit):
            self.graphs.capture_all()

    def _run_block(self, x: torch.Tensor, prepared) -> torch.Tensor:
        wait = prepared.handle.wait
        if self.graphs is not None:
            y = self.graphs.run(x, prepared.metadata, wait)
            if y is not None:
                return y
        return self.block.forward_paged(x, self.kv_cache.kv_cache, prepared.metadata, wait, self.layer_fns)

    @property
    def device(self) -> torch.device:
        return self.head.mlp[0].weight.device

    def _validate(self, requests: list[RankingRequest]) -> None:
        if not requests:
            raise ValueError("a batch needs at least one request")
        for r in requests:
            r.validate(self.config)

    def _logits(self, y: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
        rows = torch.from_numpy(layout.candidate_rows)
        if y.is_cuda:  # pinned + async: no host sync on the compute stream
            rows = rows.pin_memory().to(y.device, non_blocking=True)
        return self.head(self.postprocessor(y.index_select(0, rows)))

    @torch.inference_mode()
    def forward_no_cache(self, requests: list[RankingRequest]) -> torch.Tensor:
        """Reference logits [sum M, num_tasks]: every user's full sequence, dense, one at a time."""
        self._validate(requests)
        return self._dense_logits(requests)

    def _dense_logits(self, requests: list[RankingRequest]) -> torch.Tensor:
        out = []
        for r in requests:
            n = r.history_tokens(self.config)
            x, layout = self.preprocessor([r], [0])
            y = self.block.forward_dense(x, n)
            out.append(self._logits(y, layout))
        return torch.cat(out)

    @torch.inference_mode()
    def forward(self, requests: list[RankingRequest]) -> torch.Tensor:
        """Logits [sum M, num_tasks] in request order; uses the KV cache when one is attached."""
        return torch.cat([o.logits for o in self.rank(requests)])

    @torch.inference_mode()
    def rank(self, requests: list[RankingRequest]) -> list[RankOutput]:
        """Per-user outputs; batches are serialised, the cache workers overlap them."""
        self._validate(requests)
        if self.kv_cache is None:
            logits = self._dense_logits(requests)
            return self._split(requests, logits, [0] * len(requests))
        with self._lock:
            return self._rank_cached(requests)

    def _split(self, requests: list[RankingRequest], logits: torch.Tensor, cached: list[int]) -> list[RankOutput]:
        counts = [r.candidates.shape[0] for r in requests]
        parts = torch.split(logits, counts)
        return [
            RankOutput(r.user_id, p, c, r.history_tokens(self.config) - c + r.candidates.shape[0])
            for r, p, c in zip(requests, parts, cached)
        ]

    def _rank_cached(self, requests: list[RankingRequest]) -> list[RankOutput]:
        mgr, cfg = self.kv_cache, self.config
        users = [r.user_id for r in requests]
        hist = [r.history_tokens(cfg) for r in requests]
        lookup = mgr.lookup(users, hist, [r.token_keys(cfg) for r in requests])
        try:
            layout = JaggedLayout.build(hist, lookup.cached_lens, [r.candidates.shape[0] for r in requests])
            future = mgr.prepare_async(lookup, layout)
        except BaseException:
            mgr.release_lookup(lookup)
            raise
        try:
            x = self.preprocessor.embed(requests, lookup.cached_lens)
        except BaseException:
            mgr.abort(mgr.wait_prepared(future))
            raise
        prepared = mgr.wait_prepared(future)
        try:
            y = self._run_block(x, prepared)
            logits = self._logits(y, layout)
        except BaseException:
            mgr.abort(prepared)
            raise
        failed = mgr.offload_async(prepared)
        outputs = self._split(requests, logits, lookup.cached_lens)
        if failed:
            redo = [r for r in requests if r.user_id in failed]
            fixed = {o.user_id: o for o in self._rank_cached(redo)}
            outputs = [fixed.get(o.user_id, o) for o in outputs]
        return outputs
