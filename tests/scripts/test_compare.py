"""Logit comparison is relative to the logits' scale: bf16 rounding passes, a wrong history fails."""

from __future__ import annotations

import pytest
import torch

from hstu.scripts.compare import compare_logits


def test_rounding_noise_passes_and_a_shift_of_the_scale_fails():
    ref = torch.randn(64, 3) * 0.1
    assert compare_logits(ref.to(torch.bfloat16), ref, "bfloat16").ok
    assert not compare_logits(ref + 0.05, ref, "bfloat16").ok
    assert compare_logits(ref + 1e-7, ref, "float32").ok
    assert not compare_logits(ref + 1e-3, ref, "float32").ok


def test_shapes_must_match():
    with pytest.raises(ValueError, match="cannot be compared"):
        compare_logits(torch.zeros(2, 3), torch.zeros(3, 3), "float32")
