"""ops/gluon_attention.py on the CPU: its schedule (plan_items) computes the attention exactly when
each item's partial sums are added as the kernels add them, the Triton plan kernel writes the same
items (Triton's interpreter), the Gluon kernel compiles for sm_90a without spills (Triton with
ptxas), and the config knob's checks. The kernel's outputs are tested on a Hopper GPU in
tests/ops/test_cuda_kernels.py."""

from __future__ import annotations

import os
import random

import pytest
import torch

from hstu.ops import gluon_attention as ga
from tests.ops.paged_cases import Float64Rows, make_paged_case, reference_fp64, rel_err
from tests.ops.interpreted import run_interpreted


def emulate(case, items: list[tuple[int, ...]]) -> torch.Tensor:
    """The kernels' arithmetic in float64 from `items`: each item's rows summed over the keys in
    [key_lo, key_cap) each row sees (its own key too for a candidate, first piece only), a whole
    unit written, a cut unit's pieces added."""
    f = Float64Rows(case)
    out = torch.full_like(f.q, float("nan"))
    part = {}
    for g, (b, row0, q_end, h, key_lo, key_cap, piece, pieces, stride) in enumerate(items):
        if b < 0:
            continue
        acc = torch.zeros(ga.BLOCK_M, f.q.shape[-1], dtype=torch.float64)
        for i, r in enumerate(range(row0, min(row0 + ga.BLOCK_M, q_end))):
            keys = torch.arange(key_lo, min(key_cap, f.last_key(b, r) + 1))
            acc[i] = f.row(b, r, h, keys, own=piece == 0 and f.q_pos[r] < 0)
        acc /= case.scale_len
        n = min(row0 + ga.BLOCK_M, q_end) - row0
        if pieces == 1:
            out[row0 : row0 + n, h] = acc[:n]
        else:
            part[g] = acc
    for g, (b, row0, q_end, h, _, _, piece, pieces, stride) in enumerate(items):
        if b >= 0 and pieces > 1 and piece == 0:
            n = min(row0 + ga.BLOCK_M, q_end) - row0
            out[row0 : row0 + n, h] = sum(part[g + p * stride] for p in range(pieces))[:n]
    return out


def case_items(case, num_sms: int, forced: int, waves: int = 1) -> list[tuple[int, ...]]:
    m = case.meta
    T, H = case.q.shape[0], case.q.shape[1]
    grid = ga.grid_programs(T, len(m.kv_lens), H, num_sms, forced, waves)
    return ga.plan_items(m.q_offsets.tolist(), m.kv_lens.tolist(), H, num_sms, grid, forced, waves)


@pytest.mark.parametrize("num_sms,forced,waves", [(132, 0, 1), (8, 0, 1), (132, 1, 1), (132, 3, 1), (4, 0, 1),
                                                  (40, 0, 3), (132, 0, 3)])
def test_the_schedule_adds_up_to_the_attention(num_sms, forced, waves):
    """Whole units at many SMs, cut units at few (or forced, or over several waves): every row of
    every head exactly once."""
    case = make_paged_case([300, 45, 700, 1], [260, 0, 690, 0], [40, 7, 64, 3], page_size=16, heads=2, head_dim=8,
                           seed=4)
    items = case_items(case, num_sms, forced, waves)
    pieces = {it[7] for it in items if it[0] >= 0}
    assert len(pieces) == 1
    if forced:
        assert pieces == {forced}
    assert rel_err(emulate(case, items), reference_fp64(case)) < 1e-12


def test_pieces_fill_one_wave_or_trade_waves_for_shorter_pieces():
    """The seed shapes on 132 SMs (64 key tiles a user): batch 1's 12 units cut 11 ways either
    way; batch 8's 96 units whole in one wave, or 4 pieces in 3 waves (3 x 18 tiles against 66);
    the re-rank's 64 units in 2 pieces (one wave is already best); units that fill the SMs whole."""
    assert ga.choose_pieces(12, 64, 132, waves=1) == ga.choose_pieces(12, 64, 132, waves=3) == 11
    assert ga.choose_pieces(96, 64, 132, waves=1) == 1
    assert ga.choose_pieces(96, 64, 132, waves=3) == 4
    assert ga.choose_pieces(64, 62, 132, waves=1) == ga.choose_pieces(64, 62, 132, waves=3) == 2
    assert ga.choose_pieces(136, 64, 132, waves=3) == 1
    assert ga.choose_pieces(12, 3, 132, waves=3) == 3  # never more pieces than key tiles
    assert ga.choose_pieces(96, 64, 132, forced_splits=5, waves=3) == 5


def test_items_run_a_users_row_blocks_side_by_side_last_block_first():
    items = ga.plan_items([0, 300, 340], [280, 900], heads=2, num_sms=132, grid=132)
    work = [it for it in items if it[0] >= 0]
    # user 0: 3 row blocks, user 1: one, 2 heads: 8 units; 132 // 8 = 16 pieces, capped at the
    # longest history's 15 key tiles
    assert {it[7] for it in work} == {15} and len(work) == 15 * 8
    assert [(it[0], it[1], it[3], it[6]) for it in work[:4]] == [(0, 256, 0, 0), (0, 128, 0, 0), (0, 0, 0, 0),
                                                                  (0, 256, 0, 1)]
    unit = [(it[4], it[5]) for it in work if it[0] == 0 and it[3] == 0 and it[1] == 0]
    assert unit[0] == (0, 0) and unit[-1] == (256, 280)  # 5 tiles in 15 pieces: some empty


def test_plan_kernel_writes_the_reference_items():
    pytest.importorskip("triton.experimental.gluon")
    code = (
        "import random, torch\n"
        "from hstu.ops import gluon_attention as ga\n"
        "rng = random.Random(0)\n"
        "for trial in range(12):\n"
        "    B, H, sms = rng.randint(1, 9), rng.choice([1, 2, 4]), rng.choice([8, 20, 132])\n"
        "    rows = [rng.choice([0, 1, 5, 128, 129, 384, 700]) for _ in range(B)]\n"
        "    kv = [rng.choice([0, 1, 63, 64, 65, 1000, 3968]) for _ in range(B)]\n"
        "    offs = [0]\n"
        "    for r in rows: offs.append(offs[-1] + r)\n"
        "    forced, waves = rng.choice([0, 0, 1, 3]), rng.choice([1, 3])\n"
        "    grid = ga.grid_programs(max(offs[-1], 1), B, H, sms, forced, waves)\n"
        "    items = ga.write_items(torch.tensor(offs, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32),\n"
        "                           H, sms, forced, grid, waves)\n"
        "    want = ga.plan_items(offs, kv, H, sms, grid, forced, waves)\n"
        "    assert [tuple(r) for r in items.tolist()] == want, trial\n"
        "print('same items')\n"
    )
    run_interpreted(code, "same items")


@pytest.mark.parametrize("head_dim,page_size,masked_tma", [(256, 32, False), (128, 8, False), (64, 128, False),
                                                         (256, 32, True)])
def test_kernel_compiles_for_sm90_with_tma_and_no_spills(head_dim, page_size, masked_tma):
    pytest.importorskip("triton.experimental.gluon")
    from hstu.scripts.kernel_regs import compile_gluon, ptxas_path

    try:
        ptxas_path()
    except FileNotFoundError:
        pytest.skip("this triton bundles no ptxas")
    r = compile_gluon(head_dim, page_size, masked_tma=masked_tma)
    assert r["spill_store_bytes"] == 0 and r["registers"] <= 255
    assert r["tma"] > 0 and r["wgmma"] > 0


def test_fits_only_16_bit_cuda_tensors():
    q = torch.zeros(4, 2, 256, dtype=torch.bfloat16)
    cache = torch.zeros(1, 2, 2, 32, 2, 256, dtype=torch.bfloat16)
    assert not ga.fits(q, cache)  # a CPU tensor


def test_kernel_knob_is_checked(monkeypatch):
    from hstu.ops import triton_attention as ta

    with pytest.raises(ValueError, match="AttentionConfig.kernel must be one of .*'cutlass'"):
        ta.AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, kernel="cutlass")
    monkeypatch.setenv("HSTU_ATTENTION_KERNEL", "fast")
    with pytest.raises(ValueError, match="HSTU_ATTENTION_KERNEL must be one of .*'fast'"):
        ta._kernel_from_env()
    monkeypatch.setenv("HSTU_ATTENTION_KERNEL", "triton")
    assert ta._kernel_from_env() == "triton"
    monkeypatch.delenv("HSTU_ATTENTION_KERNEL")
    assert ta._kernel_from_env() == "gluon"  # the default: the Gluon kernel wherever it fits


def test_items_in_grid_order_cover_random_batches():
    """Random batches: each (user, row block, head) gets `pieces` items whose key ranges tile
    [0, kv) in order, the last capped at kv."""
    rng = random.Random(1)
    for _ in range(50):
        B, H, sms = rng.randint(1, 6), rng.choice([1, 4]), rng.choice([16, 132])
        rows = [rng.choice([0, 1, 130, 384]) for _ in range(B)]
        kv = [rng.choice([0, 5, 64, 3968]) for _ in range(B)]
        offs = [0]
        for r in rows:
            offs.append(offs[-1] + r)
        grid = ga.grid_programs(max(offs[-1], 1), B, H, sms, 0)
        units = {}
        for it in ga.plan_items(offs, kv, H, sms, grid):
            if it[0] >= 0:
                units.setdefault((it[0], it[1], it[3]), []).append((it[6], it[4], it[5]))
        assert len(units) == sum(-(-r // ga.BLOCK_M) for r in rows) * H
        for (b, _, _), pieces in units.items():
            assert [p for p, _, _ in pieces] == list(range(len(pieces)))
            assert pieces[0][1] == 0 and pieces[-1][2] == kv[b]
            assert all(pieces[i][2] == pieces[i + 1][1] for i in range(len(pieces) - 1))


def test_one_plan_a_forward_written_at_layer_0_and_read_by_the_others(monkeypatch):
    """planned (both Gluon kernels): layer 0 writes the batch's plan and keeps it on the metadata;
    later layers of that forward read it; the next forward's layer 0 writes afresh (a graph
    bucket's metadata holds another batch by then); another launch shape, a bare call or
    HSTU_GLUON_PLAN_ONCE=0 writes its own. Pure Python: runs without Triton."""
    written = []

    def write(key):
        def fresh():
            written.append(key)
            return object()
        return fresh

    plans: dict = {}
    shape, other_shape = (4, 132, 0, 132, 1), ("stream", 4, 132, 0, 132, 140, 140)
    first = [ga.planned(plans, layer, shape, write(shape)) for layer in range(8)]
    assert len(written) == 1 and all(t is first[0] for t in first)
    again = ga.planned(plans, 0, shape, write(shape))
    assert len(written) == 2 and again is not first[0] and ga.planned(plans, 5, shape, write(shape)) is again
    other = ga.planned(plans, 3, other_shape, write(other_shape))  # another shape: its own plan
    assert len(written) == 3 and other is not again and list(plans) == [other_shape]
    ga.planned(None, 3, shape, write(shape))
    ga.planned(None, 3, shape, write(shape))
    assert len(written) == 5
    monkeypatch.setattr(ga, "PLAN_ONCE", False)
    ga.planned(plans, 4, other_shape, write(other_shape))
    assert len(written) == 6


def test_stream_kernel_takes_launches_whose_units_reach_a_quarter_of_the_sms(monkeypatch):
    """takes_stream: none without HSTU_GLUON_STREAM_AUTO; HSTU_GLUON_STREAM takes every launch;
    HSTU_GLUON_STREAM_AUTO (the default) takes batch 8 (3,072 rows: 96 units), mixed5 (1,187 rows: at least 40 units), the re-rank
    (2,048 rows: 64 units) and the uncached batch, and leaves batch 1 (384 rows: 12 units) and
    batch 2 (24 units) to the default kernel, on 132 SMs."""
    shapes = {"b1": 384, "b2": 768, "mixed5": 1187, "rerank8": 2048, "b8": 3072, "uncached8": 8 * 4352}
    assert ga.STREAM_AUTO or "HSTU_GLUON_STREAM_AUTO" in os.environ
    monkeypatch.setattr(ga, "STREAM_AUTO", False)
    assert not any(ga.takes_stream(rows, 4, 132) for rows in shapes.values())
    monkeypatch.setattr(ga, "STREAM_AUTO", True)
    assert {name for name, rows in shapes.items() if not ga.takes_stream(rows, 4, 132)} == {"b1", "b2"}
    assert ga.takes_stream(1187, 4, 200) is False  # 40 units under a quarter of 200 SMs
    monkeypatch.setattr(ga, "STREAM", True)
    assert all(ga.takes_stream(rows, 4, 132) for rows in shapes.values())
