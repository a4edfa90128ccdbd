"""ops/gluon_stream_attention.py on the CPU: its schedule (plan_items, stream-K with and without
lanes) computes the attention exactly when each item's partial sums are added as the kernels add
them, the Triton plan kernel writes the same items and STARTS (Triton's interpreter), and the
Gluon kernel compiles for sm_90a (Triton with ptxas). The kernel's outputs are tested on a Hopper
GPU in tests/ops/test_cuda_kernels.py."""

from __future__ import annotations

import random

import pytest
import torch

from hstu.ops import gluon_stream_attention as ga
from tests.ops.paged_cases import Float64Rows, make_paged_case, reference_fp64, rel_err
from tests.ops.interpreted import run_interpreted


def emulate(case, items: list[tuple[int, ...]]) -> torch.Tensor:
    """The kernels' arithmetic in float64 from `items`: each item's rows summed over its tiles
    [t_lo, t_hi) of the unit (the history's key tiles each row sees, then the own tiles: a
    candidate row's own key where its own tile is among them), a whole unit written, a cut
    unit's items added."""
    f = Float64Rows(case)
    out = torch.full_like(f.q, float("nan"))
    part = {}
    for i, (b, row0, q_end, h, t_lo, t_hi, piece, pieces, _) in enumerate(items):
        if b < 0:
            continue
        history_tiles = ga.unit_tiles(f.kv_lens[b]) - ga.OWN
        acc = torch.zeros(ga.BLOCK_M, f.q.shape[-1], dtype=torch.float64)
        for r_i, r in enumerate(range(row0, min(row0 + ga.BLOCK_M, q_end))):
            lo = t_lo * ga.BLOCK_N
            keys = torch.arange(lo, max(min(min(t_hi, history_tiles) * ga.BLOCK_N, f.last_key(b, r) + 1), lo))
            own = f.q_pos[r] < 0 and t_lo <= history_tiles + r_i // ga.BLOCK_N < t_hi
            acc[r_i] = f.row(b, r, h, keys, own)
        acc /= case.scale_len
        n = min(row0 + ga.BLOCK_M, q_end) - row0
        if pieces == 1:
            out[row0 : row0 + n, h] = acc[:n]
        else:
            part[i] = acc
    for i, (b, row0, q_end, h, _, _, piece, pieces, _) in enumerate(items):
        if b >= 0 and pieces > 1 and piece == 0:
            n = min(row0 + ga.BLOCK_M, q_end) - row0
            total, at = 0, i
            for _ in range(pieces):  # each piece names the next one's item
                total, at = total + part.pop(at), items[at][8]
            out[row0 : row0 + n, h] = total[:n]
    assert not part, "every cut unit's pieces summed once"
    return out


def plan_of(offs: list[int], kv: list[int], heads: int, num_sms: int, forced: int = 0):
    """plan_items at the launch's grid and capacity: (items, starts)."""
    rows, users = max(offs[-1], 1), len(kv)
    grid = ga.grid_programs(rows, users, heads, num_sms, forced)
    return ga.plan_items(offs, kv, heads, num_sms, grid, ga.plan_capacity(rows, users, heads, grid), forced)


def case_plan(case, num_sms: int, forced: int):
    m = case.meta
    return plan_of(m.q_offsets.tolist(), m.kv_lens.tolist(), case.q.shape[1], num_sms, forced)


def program_items(items, starts) -> list[list[tuple[int, ...]]]:
    """Each program's items (STARTS: the programs with work, then each program's first item)."""
    return [items[starts[1 + g] : starts[2 + g]] for g in range(starts[0])]


@pytest.mark.parametrize("num_sms,forced", [(132, 0), (8, 0), (132, 1), (132, 3), (4, 0), (40, 0), (1, 0)])
def test_the_schedule_adds_up_to_the_attention(num_sms, forced):
    """Whole units at few SMs, stream-K shares at many (or forced): every row of every head
    exactly once, candidates' own keys included."""
    case = make_paged_case([300, 45, 700, 1], [260, 0, 690, 0], [40, 7, 64, 3], page_size=16, heads=2, head_dim=8,
                           seed=4)
    items, starts = case_plan(case, num_sms, forced)
    cut = [it for it in items if it[0] >= 0 and it[7] > 1]
    assert bool(cut) == (num_sms > 16 or forced > 0)  # the case has 16 units
    assert rel_err(emulate(case, items), reference_fp64(case)) < 1e-12


def test_stream_k_gives_every_sm_an_equal_share_at_the_seed_shapes():
    """Batch 8 (96 units of 64 history + 2 own tiles on 132 SMs): every program takes 48 tiles in
    one or two items, where whole units left 36 SMs idle; batch 1's 12 units likewise (6 tiles a
    program); units that fill the SMs run whole, one a program."""
    offs = [384 * b for b in range(9)]
    items, starts = plan_of(offs, [4096] * 8, 4, 132)
    shares = [sum(it[5] - it[4] for it in p) for p in program_items(items, starts)]
    assert len(shares) == 132 and set(shares) == {48} and sum(shares) == 96 * 66
    assert max(len(p) for p in program_items(items, starts)) == 2
    items, starts = plan_of([0, 384], [4096], 4, 132)
    assert {sum(it[5] - it[4] for it in p) for p in program_items(items, starts)} == {6}
    items, starts = plan_of([0, 384 * 11], [4096] * 1, 4, 132)  # one user of 33 row blocks: 132 units
    programs = program_items(items, starts)
    assert len(programs) == 132 and all(len(p) == 1 and p[0][4:8] == (0, 66, 0, 1) for p in programs)


@pytest.mark.parametrize("lanes", [True, False])
@pytest.mark.parametrize("num_sms", [20, 7, 132])
def test_lanes_add_up_to_the_attention(lanes, num_sms):
    """Users of two row blocks each: in lanes (tuples of 2 programs), or plain stream-K."""
    case = make_paged_case([400, 380, 500], [200, 180, 300], [56, 56, 56], page_size=16, heads=2, head_dim=8,
                           seed=5)
    m = case.meta
    offs, kv = m.q_offsets.tolist(), m.kv_lens.tolist()
    grid = ga.grid_programs(offs[-1], 3, 2, num_sms, 0)
    items, starts = ga.plan_items(offs, kv, 2, num_sms, grid, ga.plan_capacity(offs[-1], 3, 2, grid), lanes=lanes)
    blocks = [2, 2, 2]
    assert ga.lane_width(blocks, [ga.unit_tiles(k) for k in kv], 2, num_sms, lanes=lanes) == (2 if lanes else 1)
    assert rel_err(emulate(case, items), reference_fp64(case)) < 1e-12


def test_groups_alike_are_cut_into_whole_shares_where_that_saves_an_item():
    """The re-rank (8 users of 256 candidates over 4,096 keys: 32 groups of 66 tiles in lanes of 2)
    runs 64 tuples of 33 tiles, one item a program, not 66 of 32; batch 8 (lanes of 3) keeps 44
    equal shares of 48; groups of different sizes keep equal shares."""
    assert ga.share_count(32, 32 * 66, {66}, 66) == 64
    assert ga.share_count(32, 32 * 66, {66}, 44) == 44
    assert ga.share_count(4, 4 * 66, {66}, 44) == 44
    assert ga.share_count(3, 66 + 20 + 9, {66, 20, 9}, 44) == 44
    items, starts = plan_of([256 * b for b in range(9)], [4096] * 8, 4, 132)
    programs = program_items(items, starts)
    assert len(programs) == 128 and all(len(p) == 1 and p[0][5] - p[0][4] == 33 for p in programs)


def test_lanes_run_a_users_row_blocks_over_the_same_keys_side_by_side():
    """Batch 8 in lanes: 44 tuples of 3 programs, each of 48 (user, head, key tile) steps; the
    programs of a tuple run the three row blocks of the same users, heads and tiles."""
    offs = [384 * b for b in range(9)]
    items, starts = plan_of(offs, [4096] * 8, 4, 132)
    programs = program_items(items, starts)
    for p in range(44):
        lanes = programs[3 * p : 3 * p + 3]
        assert [[(it[0], it[3], it[4], it[5]) for it in lane] for lane in lanes[1:]] == [
            [(it[0], it[3], it[4], it[5]) for it in lanes[0]]] * 2
        assert {it[1] % 384 for lane in lanes for it in lane} == {0, 128, 256}


def test_items_run_a_users_row_blocks_side_by_side_last_block_first():
    items, starts = plan_of([0, 300, 340], [280, 900], heads=2, num_sms=8)
    work = [it for it in items if it[0] >= 0]
    # 8 units on 8 SMs: whole, in the order user, head, row block from the last
    assert [(it[0], it[1], it[3]) for it in work[:4]] == [(0, 256, 0), (0, 128, 0), (0, 0, 0), (0, 256, 1)]
    assert all(it[4:8] == (0, ga.unit_tiles(280 if it[0] == 0 else 900), 0, 1) for it in work)
    assert starts[:10] == [8] + list(range(9))


def test_plan_kernel_writes_the_reference_items():
    pytest.importorskip("triton.experimental.gluon")
    code = (
        "import random, torch\n"
        "from hstu.ops import gluon_stream_attention as ga\n"
        "rng = random.Random(0)\n"
        "lanes_seen = 0\n"
        "for trial in range(24):\n"
        "    ga.LANES = trial % 2 == 0\n"
        "    B, H, sms = rng.randint(1, 9), rng.choice([1, 2, 4]), rng.choice([8, 20, 132])\n"
        "    rows = [rng.choice([0, 1, 5, 128, 129, 384, 700]) for _ in range(B)]\n"
        "    if trial % 4 == 0:  # users alike, fewer units than SMs: lanes\n"
        "        rows, sms = [rng.choice([129, 256, 384])] * B, 132\n"
        "    kv = [rng.choice([0, 1, 63, 64, 65, 1000, 3968]) for _ in range(B)]\n"
        "    offs = [0]\n"
        "    for r in rows: offs.append(offs[-1] + r)\n"
        "    forced = 0 if trial % 4 == 0 else rng.choice([0, 0, 1, 3])\n"
        "    T = max(offs[-1], 1)\n"
        "    grid = ga.grid_programs(T, B, H, sms, forced)\n"
        "    cap = ga.plan_capacity(T, B, H, grid)\n"
        "    slots = ga.plan_slots(cap, sms, forced)\n"
        "    items, starts = ga.write_items(torch.tensor(offs, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32),\n"
        "                                   H, sms, forced, grid, cap, slots)\n"
        "    want_items, want_starts = ga.plan_items(offs, kv, H, sms, grid, cap, forced)\n"
        "    used = want_starts[0]\n"
        "    read = max(want_starts[1 + used], slots)  # the items and the padded rows the sum kernel reads\n"
        "    assert starts.tolist()[: used + 2] == want_starts[: used + 2], trial\n"
        "    assert [tuple(r) for r in items.tolist()[:read]] == want_items[:read], trial\n"
        "    blocks = [-(-r // ga.BLOCK_M) for r in rows]\n"
        "    per = [ga.unit_tiles(k) if n else 0 for n, k in zip(blocks, kv)]\n"
        "    lanes_seen += sum(blocks) * H < sms and ga.lane_width(blocks, per, H, sms, forced) > 1\n"
        "assert lanes_seen >= 2, lanes_seen\n"
        "print('same items')\n"
    )
    run_interpreted(code, "same items")


def test_sum_kernel_adds_each_cut_units_pieces_along_its_chain():
    """_sum_pieces_kernel (Triton's interpreter) over plans with cut units (lanes, plain stream-K,
    forced pieces): each cut unit's rows of out are its pieces' PART tiles summed; whole units'
    rows are left as they were."""
    pytest.importorskip("triton.experimental.gluon")
    code = (
        "import torch\n"
        "from hstu.ops import gluon_stream_attention as ga\n"
        "torch.manual_seed(0)\n"
        "cut = 0\n"
        "for offs, kv, H, sms, forced in [([0, 384], [3968], 4, 132, 0), ([0, 256, 512], [4096, 4096], 2, 20, 0),\n"
        "                                  ([0, 130, 300], [70, 1000], 1, 8, 3)]:\n"
        "    T, B, d = offs[-1], len(kv), 16\n"
        "    grid = ga.grid_programs(T, B, H, sms, forced)\n"
        "    cap = ga.plan_capacity(T, B, H, grid)\n"
        "    slots = ga.plan_slots(cap, sms, forced)\n"
        "    items, _ = ga.plan_items(offs, kv, H, sms, grid, cap, forced)\n"
        "    part = torch.randn(slots, ga.BLOCK_M, d)\n"
        "    out = torch.full((T, H, d), 7.0)\n"
        "    ga.sum_pieces(torch.tensor(items, dtype=torch.int32), part, out, slots)\n"
        "    want = torch.full((T, H, d), 7.0)\n"
        "    for i, (b, row0, q_end, h, _, _, piece, pieces, _) in enumerate(items[:slots]):\n"
        "        if b >= 0 and pieces > 1 and piece == 0:\n"
        "            total, at, n = 0, i, min(row0 + ga.BLOCK_M, q_end) - row0\n"
        "            for _ in range(pieces):\n"
        "                total, at = total + part[at], items[at][8]\n"
        "            want[row0 : row0 + n, h] = total[:n]\n"
        "            cut += 1\n"
        "    assert torch.allclose(out, want, atol=1e-5), (offs, kv, H, sms, forced)\n"
        "assert cut >= 12, cut\n"
        "print('summed')\n"
    )
    run_interpreted(code, "summed")


@pytest.mark.parametrize("head_dim,page_size,masked_tma,own_tma", [(256, 32, False, False), (128, 8, False, False),
                                                                   (64, 128, False, False), (256, 32, True, True),
                                                                   (128, 8, True, True)])
def test_kernel_compiles_for_sm90_with_tma_and_its_key_loop_in_registers(head_dim, page_size, masked_tma, own_tma):
    """ptxas keeps the kernel within 255 registers; the item loop's few scalars may spill (sm_90a,
    Triton 3.6: at most 7 words at head dim 256, outside the pipelined loop's wgmma), not more."""
    pytest.importorskip("triton.experimental.gluon")
    from hstu.scripts.kernel_regs import compile_gluon, ptxas_path

    try:
        ptxas_path()
    except FileNotFoundError:
        pytest.skip("this triton bundles no ptxas")
    r = compile_gluon(head_dim, page_size, masked_tma=masked_tma, own_tma=own_tma, stream=True)
    assert r["spill_store_bytes"] <= 32 and r["registers"] <= 255
    assert r["tma"] > 0 and r["wgmma"] > 0


def test_items_cover_every_units_tiles_in_order_on_random_batches():
    """Random batches: each (user, row block, head) gets `pieces` items, each naming the next,
    whose tile ranges tile [0, unit_tiles) in order; the shares of a stream-K batch's programs
    differ by at most one tile (plain stream-K; lanes idle where a user has fewer row blocks)."""
    rng = random.Random(1)
    for _ in range(50):
        B, H, sms = rng.randint(1, 6), rng.choice([1, 4]), rng.choice([16, 132])
        rows = [rng.choice([0, 1, 130, 384]) for _ in range(B)]
        kv = [rng.choice([0, 5, 64, 3968]) for _ in range(B)]
        offs = [0]
        for r in rows:
            offs.append(offs[-1] + r)
        lanes = rng.random() < 0.5
        grid = ga.grid_programs(max(offs[-1], 1), B, H, sms, 0)
        items, starts = ga.plan_items(offs, kv, H, sms, grid, ga.plan_capacity(max(offs[-1], 1), B, H, grid),
                                      lanes=lanes)
        units: dict = {}
        for i, it in enumerate(items[: starts[-1]]):
            units.setdefault((it[0], it[1], it[3]), []).append((i, it[6], it[7], it[4], it[5]))
        assert all(it[0] < 0 for it in items[starts[-1]:])
        assert len(units) == sum(-(-r // ga.BLOCK_M) for r in rows) * H
        for (b, _, _), parts in units.items():
            assert [p for _, p, _, _, _ in parts] == list(range(len(parts))) and {n for _, _, n, _, _ in parts} == {
                len(parts)}
            assert [items[i][8] for i, *_ in parts] == [i for i, *_ in parts[1:]] + [-1]  # each names the next
            assert parts[0][3] == 0 and parts[-1][4] == ga.unit_tiles(kv[b])
            assert all(parts[i][4] == parts[i + 1][3] for i in range(len(parts) - 1))
        shares = [sum(it[5] - it[4] for it in p) for p in program_items(items, starts) if p]
        if not lanes and any(it[7] > 1 for it in items if it[0] >= 0):
            assert max(shares) - min(shares) <= 1
