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


def test_the_compile_is_the_runtime_one_whose_key_loop_loads_are_asynchronous():
    """With the JIT's divisibility specialisation the paged K/V loads become cp.async (pipelined)
    and both matmuls wgmma; without it every load stayed a synchronous ld.global."""
    from hstu.scripts.kernel_regs import compile_config, ptxas_path

    try:
        ptxas_path()
    except FileNotFoundError:
        pytest.skip("this triton bundles no ptxas")
    r = compile_config(64, 64, 4, 2, head_dim=64)
    assert r["cp_async"] > 0 and r["wgmma"] > 0, r
