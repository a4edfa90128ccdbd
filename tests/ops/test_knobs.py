"""ops/knobs.py: experiment knobs read strictly from the environment."""

import pytest

from hstu.ops import knobs


def test_flag_defaults_and_rejects_anything_but_0_or_1(monkeypatch):
    monkeypatch.delenv("HSTU_TEST_KNOB", raising=False)
    assert knobs.flag("HSTU_TEST_KNOB") is False and knobs.flag("HSTU_TEST_KNOB", default=True) is True
    monkeypatch.setenv("HSTU_TEST_KNOB", "true")
    with pytest.raises(ValueError, match="HSTU_TEST_KNOB must be 0 or 1, got 'true'"):
        knobs.flag("HSTU_TEST_KNOB", default=True)


def test_number_defaults_and_rejects_non_finite_or_below_its_minimum(monkeypatch):
    monkeypatch.delenv("HSTU_TEST_KNOB", raising=False)
    assert knobs.number("HSTU_TEST_KNOB", 0.8, "a share") == 0.8
    monkeypatch.setenv("HSTU_TEST_KNOB", "-0.5")
    assert knobs.number("HSTU_TEST_KNOB", 0.8, "a share") == -0.5
    with pytest.raises(ValueError, match=r"HSTU_TEST_KNOB must be a number >= 0 \(a share\), got '-0.5'"):
        knobs.number("HSTU_TEST_KNOB", 0.8, "a share", minimum=0.0)
    for bad in ("nan", "inf", "often"):
        monkeypatch.setenv("HSTU_TEST_KNOB", bad)
        with pytest.raises(ValueError, match=f"got '{bad}'"):
            knobs.number("HSTU_TEST_KNOB", 0.8, "a share")


def test_choice_defaults_when_unset_or_empty_and_rejects_anything_else_naming_the_choices(monkeypatch):
    monkeypatch.delenv("HSTU_TEST_KNOB", raising=False)
    assert knobs.choice("HSTU_TEST_KNOB", ("copy", "kernel"), "copy") == "copy"
    monkeypatch.setenv("HSTU_TEST_KNOB", "")
    assert knobs.choice("HSTU_TEST_KNOB", ("copy", "kernel"), "copy") == "copy"
    monkeypatch.setenv("HSTU_TEST_KNOB", "kernel")
    assert knobs.choice("HSTU_TEST_KNOB", ("copy", "kernel"), "copy") == "kernel"
    monkeypatch.setenv("HSTU_TEST_KNOB", "dma")
    with pytest.raises(ValueError, match="HSTU_TEST_KNOB must be one of copy, kernel; got 'dma'"):
        knobs.choice("HSTU_TEST_KNOB", ("copy", "kernel"), "copy")
