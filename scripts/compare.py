"""Comparing two sets of logits for the same requests, relative to the logits' own scale.

The ranking head's logits are small (L2-normalised candidate embeddings through an MLP: about
0.1 at the seed shapes), so a fixed absolute tolerance says nothing: ranking with a completely
wrong history prefix moves them by about 90% of their scale, while bf16 rounding moves them by
well under 1%. Two results agree when max|a - b| <= rel * max|reference| + floor, per dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# dtype -> (rel, floor)
LOGIT_TOLERANCE = {"float32": (1e-4, 1e-6), "bfloat16": (3e-2, 1e-3), "float16": (1e-2, 1e-4)}


@dataclass(frozen=True)
class LogitsComparison:
    max_abs_diff: float
    scale: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def compare_logits(logits: torch.Tensor, reference: torch.Tensor, dtype: str) -> LogitsComparison:
    """Max abs difference of two [M, tasks] logit tensors against the dtype's scaled tolerance."""
    if logits.shape != reference.shape:
        raise ValueError(f"logits of shape {tuple(logits.shape)} cannot be compared with {tuple(reference.shape)}")
    rel, floor = LOGIT_TOLERANCE[dtype]
    a, b = logits.float(), reference.float()
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return LogitsComparison(diff, scale, rel * scale + floor)


@dataclass
class VerifyTally:
    """Mismatches and the largest logit difference over every request checked against the reference."""

    dtype: str
    what: str
    mismatches: int = 0
    max_abs_diff: float = 0.0

    def check(self, user_id: int, logits: torch.Tensor, reference: torch.Tensor) -> None:
        check = compare_logits(logits, reference, self.dtype)
        self.max_abs_diff = max(self.max_abs_diff, check.max_abs_diff)
        if not check.ok:
            self.mismatches += 1
            logger.warning(
                "user %d: %s differ from the no-cache reference by %.3g (tolerance %.3g)",
                user_id,
                self.what,
                check.max_abs_diff,
                check.tolerance,
            )
