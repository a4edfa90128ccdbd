"""use_attention_backend: a real switch for paged_hstu_attention's dispatch, restored on exit."""

from __future__ import annotations

import pytest
import torch

from hstu.ops import attention
from hstu.ops.attention import attention_backend, paged_hstu_attention, use_attention_backend
from tests.ops.test_attention import SCALE_LEN, _paged_case


def test_the_switch_applies_inside_the_block_and_is_restored_after():
    assert attention_backend() == "auto"
    with use_attention_backend("torch"):
        assert attention_backend() == "torch"
        with use_attention_backend("auto"):
            assert attention_backend() == "auto"
        assert attention_backend() == "torch"
    assert attention_backend() == "auto"


def test_the_previous_backend_is_restored_when_the_block_raises():
    with pytest.raises(RuntimeError), use_attention_backend("torch"):
        raise RuntimeError("inside")
    assert attention_backend() == "auto"


def test_an_unknown_backend_is_rejected_by_name():
    with pytest.raises(ValueError, match="'triton2'"):
        with use_attention_backend("triton2"):
            pass


def test_forced_torch_backend_gives_the_dense_result():
    q, k, v, kv_cache, meta, expected = _paged_case([9, 6], [4, 0], [3, 2])
    with use_attention_backend("torch"):
        out = paged_hstu_attention(q, k, v, kv_cache, 0, meta, SCALE_LEN)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forced_torch_backend_bypasses_triton_on_cuda(monkeypatch):
    from hstu.ops import triton_attention

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernel ran under use_attention_backend('torch')")

    monkeypatch.setattr(triton_attention, "paged_hstu_attention_triton", refuse)
    case = [t.cuda() if isinstance(t, torch.Tensor) else t for t in _paged_case([9], [4], [3])]
    q, k, v, kv_cache, meta, expected = case
    with use_attention_backend("torch"):
        out = paged_hstu_attention(q, k, v, kv_cache, 0, meta.to(q.device, non_blocking=False), SCALE_LEN)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert attention.attention_backend() == "auto"
