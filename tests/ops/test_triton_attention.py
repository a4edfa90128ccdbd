"""The Triton paged HSTU attention kernel on the CPU, through Triton's interpreter.

The interpreter runs the kernel's logic (page-table walk, causal and candidate masks, the batch's
schedule read on the device: one unit per program, the balanced wave that cuts units, in lanes or
not, forced pieces, with their partial sums; random batches under each; TMA key tiles; a batch
padded like a CUDA graph bucket) on
CPU tensors; it needs TRITON_INTERPRET=1 before the kernel module is
imported, so the checks run in a fresh interpreter process. Skipped where triton is missing. The
interpreter of Triton 3.6 cannot take a tensor as a loop bound under numpy >= 2.4 (3.9's can), and
it truncates float32 -> bfloat16 (the GPU rounds to nearest), so bf16 accuracy against the 2x
bound is checked on the GPU only (test_cuda_kernels.py).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.ops.interpreted import run_interpreted

triton = pytest.importorskip("triton")
_TRITON = tuple(int(x) for x in triton.__version__.split(".")[:2])
if _TRITON < (3, 7) and tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 4):
    pytest.skip("Triton 3.6's interpreter needs numpy < 2.4 for tensor loop bounds", allow_module_level=True)

_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {root!r})
    from tests.ops.paged_cases import make_paged_case, padded_like_graph_bucket, reference_fp64, rel_err
    from hstu.ops import triton_attention as ta

    cases = [
        # (history, cached, candidates, page_size, head_dim, heads, config, splits)
        ([37, 16, 70], [30, 0, 64], [5, 3, 0], 16, 64, 2, ta.AttentionConfig(16, 16, 4, 1), 0),
        ([37, 16, 70], [30, 0, 64], [5, 3, 0], 16, 64, 2, ta.AttentionConfig(16, 32, 4, 1), 3),
        ([65, 1], [1, 0], [4, 17], 32, 40, 3, ta.AttentionConfig(32, 16, 4, 1), 1),
        ([130], [0], [2], 64, 64, 1, ta.AttentionConfig(64, 64, 4, 1), 2),
        ([20, 33, 5], [20, 0, 5], [0, 2, 1], 16, 32, 2, ta.AttentionConfig(16, 16, 4, 1), 0),
        ([300], [256], [40], 16, 32, 2, ta.AttentionConfig(16, 16, 4, 1, silu="tanh"), 0),
    ]
    for sms in (1, 132):  # 132 (an H200's SMs): the automatic key splits of few programs
        ta._num_sms = lambda device: sms
        for i, (hist, cached, cand, ps, d, h, cfg, splits) in enumerate(cases):
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
                c = make_paged_case(hist, cached, cand, page_size=ps, head_dim=d, heads=h, dtype=dtype, seed=i)
                out = ta.paged_hstu_attention_triton(
                    c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=cfg, num_splits=splits
                )
                assert out.dtype == dtype and out.shape == c.q.shape
                err = rel_err(out, reference_fp64(c))
                assert err < tol, (sms, i, dtype, err)

    # Random batches under every schedule: SM counts, balance thresholds, forced pieces.
    import random
    rng = random.Random(0)
    for i in range(15):
        B = rng.randint(1, 5)
        hist = [rng.randint(1, 90) for _ in range(B)]
        cached = [rng.randint(0, h - 1) if rng.random() < 0.7 else 0 for h in hist]
        cand = [rng.randint(0, 6) for _ in range(B)]
        sms = rng.choice([1, 3, 7, 132])
        ta._num_sms = lambda device, sms=sms: sms
        cfg = ta.AttentionConfig(16, rng.choice([16, 32]), 4, 1, balance_below=rng.choice([0.0, 0.5, 1.0]),
                                 lanes_above=rng.choice([0.0, 0.8, 1.01]))
        splits = rng.choice([0, 0, 1, 2, 5])
        c = make_paged_case(hist, cached, cand, page_size=rng.choice([8, 16]), head_dim=16, heads=rng.choice([1, 3]),
                            dtype=torch.float32, seed=100 + i)
        out = ta.paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=cfg,
                                             num_splits=splits)
        err = rel_err(out, reference_fp64(c))
        assert err < 1e-5, (i, hist, cached, cand, sms, cfg, splits, err)

    # Lanes (a user's row blocks side by side over the same keys): users of equal and of unequal row
    # blocks (lanes idle past a user's blocks), shares cutting units, every SM count; against the
    # stream schedule, which must give the same sums.
    lane_cases = [
        ([70, 70, 70], [20, 20, 20], [9, 9, 9]),  # three users of 4 row blocks (59 rows, 16-row blocks)
        ([90, 40, 65], [10, 38, 0], [6, 0, 30]),  # 6, 1 and 6 row blocks
        ([33], [0], [40]),  # one user, 5 row blocks
    ]
    for i, (hist, cached, cand) in enumerate(lane_cases):
        for sms in (2, 5, 11, 132):
            ta._num_sms = lambda device, sms=sms: sms
            c = make_paged_case(hist, cached, cand, page_size=8, head_dim=16, heads=2, dtype=torch.float32, seed=200 + i)
            ref = reference_fp64(c)
            for lanes_above in (0.0, 1.01):
                cfg = ta.AttentionConfig(16, 16, 4, 1, balance_below=1.0, lanes_above=lanes_above)
                out = ta.paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=cfg)
                err = rel_err(out, ref)
                assert err < 1e-5, ("lanes", i, sms, lanes_above, err)

    # TMA key tiles (AttentionConfig.tma: one page a tile through a descriptor), in lanes and not,
    # float32 and bfloat16 (its bound as above), a forced split too.
    for i, (hist, cached, cand, ps, d, h) in enumerate([
        ([70, 70, 70], [20, 20, 20], [9, 9, 9], 16, 32, 2),
        ([90, 40, 65], [10, 38, 0], [6, 0, 30], 16, 16, 3),
        ([300], [256], [40], 32, 64, 1),
    ]):
        for sms, lanes_above, splits in ((3, 0.0, 0), (132, 0.0, 0), (132, 1.01, 0), (132, 0.8, 2)):
            ta._num_sms = lambda device, sms=sms: sms
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
                c = make_paged_case(hist, cached, cand, page_size=ps, head_dim=d, heads=h, dtype=dtype, seed=300 + i)
                cfg = ta.AttentionConfig(16, ps, 4, 1, balance_below=1.0, lanes_above=lanes_above, tma=True)
                out = ta.paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=cfg,
                                                     num_splits=splits)
                err = rel_err(out, reference_fp64(c))
                assert err < tol, ("tma", i, sms, lanes_above, splits, dtype, err)

    # Padded as a CUDA graph bucket pads it (rows past T, empty user slots): the same rows, bit for bit.
    c = make_paged_case([70], [48], [9], page_size=16, head_dim=32, heads=2, dtype=torch.float32, seed=9)
    T, cfg = c.q.shape[0], ta.AttentionConfig(16, 16, 4, 1)
    q, k, v, padded = padded_like_graph_bucket(c, rows=96, user_slots=4)
    want = ta.paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=cfg)
    got = ta.paged_hstu_attention_triton(q, k, v, c.kv_cache, c.layer, padded, c.scale_len, config=cfg)
    assert torch.equal(got[:T], want)
    print("ok")
    """
)


def test_triton_kernel_matches_fp64_reference_in_interpreter():
    run_interpreted(_SCRIPT.format(root=str(Path(__file__).resolve().parents[2])), "ok")


_TAIL_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import triton
    import triton.language as tl
    sys.path.insert(0, {root!r})
    from tests.ops.paged_cases import make_paged_case, reference_fp64, rel_err
    from hstu.ops import triton_attention as ta

    @triton.jit
    def probe(Q_OFF, KV_LENS, Q_POS, OUT, num_users, num_heads, num_sms, MAX_USERS: tl.constexpr):
        plan = ta._batch_plan(Q_OFF, KV_LENS, Q_POS, num_users, num_heads, num_sms, 0, 1 << 20, MAX_USERS, 16, 16,
                              0.5, 1.01)
        tl.store(OUT, plan[10].to(tl.int32))  # aligned
        tl.store(OUT + 1, plan[8])  # total iterations

    def planned(c, sms):
        out = torch.zeros(2, dtype=torch.int32)
        probe[(1,)](c.meta.q_offsets, c.meta.kv_lens, c.meta.q_pos, out, c.meta.kv_lens.shape[0], c.q.shape[1], sms,
                    MAX_USERS=8)
        return bool(out[0].item()), int(out[1].item())

    def aligned(c, sms):
        return planned(c, sms)[0]

    # A wave of equal users stays aligned; one long hit beside short misses is the wave's tail.
    equal = make_paged_case([40, 40, 40], [20, 20, 20], [4, 4, 4], page_size=8, head_dim=16, heads=2,
                            dtype=torch.float32, seed=1)
    tail = make_paged_case([300, 20, 24, 18], [290, 0, 0, 0], [6, 3, 2, 5], page_size=8, head_dim=16, heads=2,
                           dtype=torch.float32, seed=2)
    assert ta._ALIGN_TAIL == 0 and aligned(equal, 6) and aligned(tail, 10), "off: both aligned"
    ta._ALIGN_TAIL = tl.constexpr(1.0)
    assert aligned(equal, 6) and not aligned(tail, 10), "on: the tail batch runs balanced"
    for c, sms in ((equal, 6), (tail, 10), (tail, 3), (tail, 132)):
        ta._num_sms = lambda device, sms=sms: sms
        cfg = ta.AttentionConfig(16, 16, 4, 1, balance_below=0.5, lanes_above=1.01)
        out = ta.paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=cfg)
        err = rel_err(out, reference_fp64(c))
        assert err < 1e-5, (sms, err)

    # HSTU_ATTENTION_LONG_FIRST: aligned programs take each user's row blocks last first; the same sums.
    ta._ALIGN_TAIL = tl.constexpr(0.0)
    causal = make_paged_case([90, 50], [0, 10], [5, 7], page_size=8, head_dim=16, heads=2, dtype=torch.float32, seed=3)
    for long_first in (False, True):
        ta._LONG_FIRST = tl.constexpr(long_first)
        for c, sms in ((equal, 3), (tail, 10), (causal, 4), (causal, 132)):
            assert sms == 132 or aligned(c, sms), (long_first, sms)
            ta._num_sms = lambda device, sms=sms: sms
            cfg = ta.AttentionConfig(16, 16, 4, 1, balance_below=0.5, lanes_above=1.01)
            out = ta.paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len, config=cfg)
            err = rel_err(out, reference_fp64(c))
            assert err < 1e-5, ("long first", long_first, sms, err)

    # HSTU_ATTENTION_CAUSAL_SHARES: iterations counted per row block as the keys its rows see; a
    # miss's early row blocks count fewer, a re-rank's (no new history) all of the history.
    rerank = make_paged_case([60, 45], [60, 45], [20, 9], page_size=8, head_dim=16, heads=2, dtype=torch.float32, seed=4)
    accounted = planned(causal, 132)[1]
    ta._CAUSAL_SHARES = tl.constexpr(True)
    # causal: user 0 (90 new rows + 5 candidates, 6 blocks of 16) sees 1, 2, .., 6 tiles of 16 keys by block;
    # user 1 (40 new rows from position 10 + 7 candidates, 3 blocks) 2, 3, 4; 2 heads
    assert planned(causal, 132)[1] == 2 * (1 + 2 + 3 + 4 + 5 + 6) + 2 * (2 + 3 + 4) < accounted
    assert planned(rerank, 132)[1] == 2 * 2 * 4 + 2 * 1 * 3  # whole histories: 4 and 3 tiles
    for long_first in (False, True):
        ta._LONG_FIRST = tl.constexpr(long_first)
        for c in (equal, tail, causal, rerank):
            # (SMs, balance_below, forced pieces, lanes_above): balanced waves of 1, 10 and 132 SMs, in lanes
            # too; aligned (balance_below 0); forced pieces
            for sms, balance_below, splits, lanes_above in ((1, 0.5, 0, 1.01), (10, 0.5, 0, 1.01), (132, 0.5, 0, 0.0),
                                                            (132, 0.5, 0, 1.01), (3, 0.0, 0, 1.01), (7, 0.5, 3, 1.01)):
                ta._num_sms = lambda device, sms=sms: sms
                cfg = ta.AttentionConfig(16, 16, 4, 1, balance_below=balance_below, lanes_above=lanes_above)
                out = ta.paged_hstu_attention_triton(c.q, c.k, c.v, c.kv_cache, c.layer, c.meta, c.scale_len,
                                                     config=cfg, num_splits=splits)
                err = rel_err(out, reference_fp64(c))
                assert err < 1e-5, ("causal shares", long_first, sms, balance_below, splits, lanes_above, err)
    print("ok")
    """
)


def test_align_tail_long_first_and_causal_shares_schedules_in_interpreter():
    """HSTU_ATTENTION_ALIGN_TAIL (off by default): the plan of a full wave whose longest unit
    exceeds an SM's even share is balanced, one of equal units stays aligned, and either's sums
    match the float64 reference; HSTU_ATTENTION_LONG_FIRST (off by default): aligned batches
    taking each user's row blocks last first give the same sums; HSTU_ATTENTION_CAUSAL_SHARES
    (off by default): the plan counts each row block's own key tiles, and every schedule (aligned,
    balanced, lanes, forced pieces, long first) gives the same sums."""
    run_interpreted(_TAIL_SCRIPT.format(root=str(Path(__file__).resolve().parents[2])), "ok",
                    unset=("HSTU_ATTENTION_ALIGN_TAIL", "HSTU_ATTENTION_LONG_FIRST", "HSTU_ATTENTION_CAUSAL_SHARES"))
