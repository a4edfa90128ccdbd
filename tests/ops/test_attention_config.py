"""AttentionConfig's checks and the TMA tile fit, without triton (plain Python)."""

import dataclasses

import pytest
import torch

from hstu.ops import knobs
from hstu.ops import triton_attention as ta


def test_config_rejects_unknown_silu_and_lanes_out_of_range():
    with pytest.raises(ValueError, match="silu"):
        ta.AttentionConfig(128, 64, 8, 2, silu="relu")
    with pytest.raises(ValueError, match="lanes_above"):
        ta.AttentionConfig(128, 64, 8, 2, lanes_above=1.5)


def test_tma_tiles_take_the_page_size_or_fall_back():
    cfg = ta.AttentionConfig(128, 64, 8, 2, tma=True)
    assert ta._tma_fitted(cfg, 32, 256) == ta.AttentionConfig(128, 32, 8, 2, tma=True)
    # a page under 16 keys, or a head dim that is not a power of 2: the gathered tiles
    assert ta._tma_fitted(cfg, 8, 256) == ta.AttentionConfig(128, 64, 8, 2, tma=False)
    assert ta._tma_fitted(cfg, 32, 40) == ta.AttentionConfig(128, 64, 8, 2, tma=False)


def test_lanes_knob_must_be_a_number(monkeypatch):
    monkeypatch.setenv("HSTU_ATTENTION_LANES_ABOVE", "often")
    with pytest.raises(ValueError, match="HSTU_ATTENTION_LANES_ABOVE"):
        ta._lanes_from_env()


def test_align_tail_knob_is_off_by_default_and_must_be_a_number(monkeypatch):
    monkeypatch.delenv("HSTU_ATTENTION_ALIGN_TAIL", raising=False)
    assert ta._align_tail_from_env() == 0.0
    monkeypatch.setenv("HSTU_ATTENTION_ALIGN_TAIL", "1.5")
    assert ta._align_tail_from_env() == 1.5
    for bad in ("often", "-1", "inf"):
        monkeypatch.setenv("HSTU_ATTENTION_ALIGN_TAIL", bad)
        with pytest.raises(ValueError, match=f"HSTU_ATTENTION_ALIGN_TAIL.*{bad}"):
            ta._align_tail_from_env()


def test_flag_knobs_take_only_0_or_1(monkeypatch):
    monkeypatch.setenv("HSTU_ATTENTION_LONG_FIRST", "yes")
    with pytest.raises(ValueError, match="HSTU_ATTENTION_LONG_FIRST must be 0 or 1, got 'yes'"):
        knobs.flag("HSTU_ATTENTION_LONG_FIRST")
    monkeypatch.setenv("HSTU_ATTENTION_LONG_FIRST", "1")
    assert knobs.flag("HSTU_ATTENTION_LONG_FIRST") is True


def test_the_kernel_in_force_is_gluon_only_where_it_runs(monkeypatch):
    from hstu.ops import gluon_attention

    device = torch.device("cuda", 0)
    monkeypatch.setattr(gluon_attention, "available", lambda d=None: True)
    assert ta.kernel_in_force(device) == "gluon"
    monkeypatch.setattr(ta, "_CONFIG_LARGE_HEAD", dataclasses.replace(ta._CONFIG_LARGE_HEAD, kernel="triton"))
    assert ta.kernel_in_force(device) == "triton"
    monkeypatch.setattr(gluon_attention, "available", lambda d=None: False)
    monkeypatch.setattr(ta, "_CONFIG_LARGE_HEAD", dataclasses.replace(ta._CONFIG_LARGE_HEAD, kernel="gluon"))
    assert ta.kernel_in_force(device) == "triton"
