"""scripts/overlap_probe.py: the probe's units and reference (CPU), its Gluon variants compiled for
sm_90a, the overlap ones waiting on one outstanding wgmma group and the TMA ones loading by TMA
(Triton with ptxas), and every variant against the reference on a Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from hstu.scripts import overlap_probe as probe


def test_units_cover_every_row_block_and_head_with_the_users_full_key_tiles():
    units = probe.units_of([130, 64], [200, 64], heads=2).tolist()
    assert units == [
        [0, 0, 130, 0, 3], [0, 0, 130, 1, 3], [0, 128, 130, 0, 3], [0, 128, 130, 1, 3],
        [1, 130, 194, 0, 1], [1, 130, 194, 1, 1],
    ]


def test_reference_is_silu_attention_over_the_paged_full_tiles():
    torch.manual_seed(0)
    heads, d, page = 2, 8, probe.PAGE_SIZE
    kv_cache = torch.randn(2, 12, 2, page, heads, d)
    page_table = torch.tensor([[5, 2, 9, 0, 11, 6, 8], [7, 1, 3, 4, 10, 0, 0]], dtype=torch.int32)
    q = torch.randn(130 + 64, heads, d)
    units = probe.units_of([130, 64], [200, 70], heads)
    out = probe.reference(q, kv_cache, page_table, units, 1, scale_len=10)
    for b, rows, keys in ((0, slice(0, 130), 192), (1, slice(130, 194), 64)):  # whole 64-key tiles only
        pages = page_table[b].long()
        k = kv_cache[1, pages, 0].reshape(-1, heads, d)[:keys]
        v = kv_cache[1, pages, 1].reshape(-1, heads, d)[:keys]
        for h in range(heads):
            s = q[rows, h] @ k[:, h].T * d**-0.5
            torch.testing.assert_close(out[rows, h], torch.nn.functional.silu(s) @ v[:, h] / 10)


def test_every_variant_compiles_for_sm90_and_only_the_overlap_ones_keep_w_v_in_flight():
    pytest.importorskip("triton.experimental.gluon")
    from hstu.scripts.kernel_regs import ptxas_path

    try:
        ptxas_path()
    except FileNotFoundError:
        pytest.skip("this triton bundles no ptxas")
    r = probe.compile_only()
    assert set(r) == set(probe.VARIANTS)
    for name, (overlap, tma_loads) in probe.VARIANTS.items():
        assert (1 in r[name]["wgmma_waits"]) == overlap and set(r[name]["wgmma_waits"]) <= {0, 1}, name
        assert (r[name]["tma"] > 0) == tma_loads, name
        assert r[name]["registers"] is not None and r[name]["registers"] <= 255


@pytest.mark.cuda
def test_every_variant_matches_the_reference_on_a_hopper_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    results = probe.run(torch.device("cuda"), repeats=2)
    for shape, entry in results.items():
        for kernel in probe.VARIANTS:
            assert entry[kernel]["rel_err"] < 1e-2, (shape, kernel, entry)


def _fake_device(monkeypatch, shapes: dict, failing: bool = False) -> None:
    """run() on the CPU: each kernel replaced by the reference (the TMA variants raising when
    `failing`), the graph timer by 0.1 ms, the production kernel by 1 us."""
    from types import SimpleNamespace

    def fake_launch(q, kv_cache, page_table, units, layer, scale_len, overlap, tma_loads=False, out=None, desc=None):
        if failing and tma_loads:
            raise RuntimeError("no TMA here")
        return probe.reference(q, kv_cache, page_table, units.cpu(), layer, scale_len)

    def fake_bench(fn, rep, return_mode):
        fn()
        return 0.1  # ms

    monkeypatch.setattr(probe, "launch", fake_launch)
    monkeypatch.setattr(probe, "kv_descriptor", lambda kv_cache: None)
    monkeypatch.setattr(probe, "triton", SimpleNamespace(testing=SimpleNamespace(do_bench_cudagraph=fake_bench)),
                        raising=False)
    monkeypatch.setattr(probe, "SHAPES", shapes)
    monkeypatch.setattr(probe, "_production", lambda *args: {"median_us": 1.0})


def test_run_reports_every_variant_of_every_shape(monkeypatch):
    _fake_device(monkeypatch, {"small": ([130], [128]), "two": ([64, 64], [64, 192])})
    results = probe.run(torch.device("cpu"), repeats=1)
    assert set(results) == {"small", "two"}
    for entry in results.values():
        for variant in probe.VARIANTS:
            assert entry[variant]["rel_err"] == 0.0 and entry[variant]["median_us"] == pytest.approx(100.0)
        assert entry["serial_over_overlap"] == pytest.approx(1.0) and entry["production"]["median_us"] == 1.0


def test_a_failing_variant_is_reported_and_the_others_still_run(monkeypatch):
    _fake_device(monkeypatch, {"small": ([130], [128])}, failing=True)
    entry = probe.run(torch.device("cpu"), repeats=1)["small"]
    assert "no TMA here" in entry["serial_tma"]["error"] and "no TMA here" in entry["overlap_tma"]["error"]
    assert entry["serial"]["rel_err"] == 0.0 and entry["overlap"]["median_us"] == pytest.approx(100.0)
