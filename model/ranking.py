"""InferenceRankingGR: the HSTU ranking model as modules and math, with no cache protocol.

The engine (engine/engine.py) runs the cached pipeline around these pieces:
  embed(requests, cached_lens)   new history tokens + candidates -> jagged inputs [T, D]
  block.forward_paged(x, kv_pages, metadata, ready)   all layers over cached + new K/V
  logits(y, layout)              candidate rows -> postprocessor -> multi-task head
forward_no_cache(requests) is the reference: each user's whole sequence through the dense path.
`identity` is the digest of config and weights that every cached prefix's identity includes.
"""

from __future__ import annotations

import torch
from torch import nn

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig
from hstu.model.hstu_block import HSTUBlock
from hstu.model.identity import model_identity
from hstu.model.postprocessor import MultiTaskHead, Postprocessor
from hstu.model.preprocessor import Preprocessor
from hstu.ops.kvcache.layout import JaggedLayout


class InferenceRankingGR(nn.Module):
    """HSTU ranking model for inference; deterministic weights from config.seed."""

    def __init__(self, config: HSTUConfig, device: torch.device | str = "cpu") -> None:
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
        self._identity: bytes | None = None

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

    @property
    def identity(self) -> bytes:
        """Digest of the config and weights (model/identity.py): part of every cached prefix's
        identity, so K/V never outlive the weights that computed them. Recomputed after a
        load_state_dict; weights changed in place any other way must call reset_identity()."""
        if self._identity is None:
            self._identity = model_identity(self, self.config)
        return self._identity

    def reset_identity(self) -> None:
        self._identity = None

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.reset_identity()
        return result

    @property
    def device(self) -> torch.device:
        return self.head.mlp[0].weight.device

    def validate(self, requests: list[RankingRequest]) -> None:
        """Raise ValueError naming the first offending value of any request."""
        if not requests:
            raise ValueError("a batch needs at least one request")
        for r in requests:
            r.validate(self.config)

    def embed(self, requests: list[RankingRequest], cached_lens: list[int]) -> torch.Tensor:
        """Inputs [T, D] of the rows of JaggedLayout.build(history, cached_lens, candidates)."""
        return self.preprocessor.embed(requests, cached_lens)

    def logits(self, y: torch.Tensor, layout: JaggedLayout) -> torch.Tensor:
        """Logits [sum M, num_tasks] of the candidate rows of the block output y [T, D]."""
        rows = torch.from_numpy(layout.candidate_rows)
        if y.is_cuda:  # pinned + async: no host sync on the compute stream
            rows = rows.pin_memory().to(y.device, non_blocking=True)
        return self.logits_at(y, rows)

    def logits_at(self, y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits [len(rows), num_tasks] of rows `rows` (a device tensor) of the block output y."""
        return self.head(self.postprocessor(y.index_select(0, rows)))

    def embed_rows(self, features: torch.Tensor) -> torch.Tensor:
        """Inputs [T, D] from features [4, T] (table index, position, time bucket, token type)."""
        return self.preprocessor.embeddings(features[0], features[1], features[2], features[3])

    def static_inputs(self, requests: list[RankingRequest], layout: JaggedLayout, out: torch.Tensor) -> torch.Tensor:
        """Fill `out`, a host [5, rows] int64 tensor (a CUDA-graph bucket's staging, engine/graphs.py),
        with the features of the batch's rows (embed_rows' input), then its candidate rows
        (logits_at's), zero past the batch, in one pass (csrc/batch_features.cpp); returns `out`."""
        if layout.num_rows > out.shape[1]:
            raise ValueError(f"a batch of {layout.num_rows} rows does not fit a bucket of {out.shape[1]}")
        return self.preprocessor.features(requests, layout.cached_lens, out)

    @torch.inference_mode()
    def forward_no_cache(self, requests: list[RankingRequest]) -> torch.Tensor:
        """Reference logits [sum M, num_tasks]: every user's full sequence, dense, one at a time."""
        self.validate(requests)
        return self.dense_logits(requests)

    def dense_logits(self, requests: list[RankingRequest]) -> torch.Tensor:
        out = []
        for r in requests:
            n = r.history_tokens(self.config)
            x, layout = self.preprocessor([r], [0])
            y = self.block.forward_dense(x, n)
            out.append(self.logits(y, layout))
        return torch.cat(out)
