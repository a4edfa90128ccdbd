"""scripts/kernel_regs.py: the attention kernel compiles ahead of time for sm_90 without a GPU and
ptxas reports its registers (skipped where triton is not installed)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_a_small_config_compiles_for_sm90_and_reports_its_registers():
    from hstu.scripts.kernel_regs import compile_config, ptxas_path

    try:
        ptxas_path()
    except FileNotFoundError:
        pytest.skip("this triton bundles no ptxas")
    r = compile_config(32, 32, 4, 1, head_dim=64)
    assert r["config"] == (32, 32, 4, 1) and r["shared_bytes"] > 0
    assert r["registers"] is not None and 0 < r["registers"] <= 255
