"""The Gluon attention (ops/gluon_attention.py: its semantics, tiles and key loop) with a stream-K
schedule and the candidates' own keys in the TMA pipeline. Opt-in (HSTU_GLUON_STREAM=1 for every
launch; HSTU_GLUON_STREAM_AUTO=1 where a launch's units reach a quarter of the SMs, gluon_attention.takes_stream).
Run KA (H100) found it slower at batch 1 (105 against 33 us a layer): its sum kernel walked each cut
unit's chain over all its rows in one program. Over 8 rows a program again, run LA (H100, 2026-12-07)
timed it ahead of the default Gluon kernel at batch 8 (128 against 145 us a layer) and mixed5 (83
against 126), level at the re-rank (89 / 88) and uncached (702-711 / 710-716), behind at batch 1 (36
against 33); end to end (run LB) b8 3.31 against 3.50 ms, b1 1.19 against 1.14 (benchmarks/RESULTS.md,
forty-second session). Its pipeline and graph tests and a --verify replay have not run yet.

Why: ops/gluon_attention.py runs batch 8's 96 units (row block x head) one a program, so 36 of an
H100's 132 SMs idle through the whole call (151 us a layer, 0.45 of the bf16 matmul peak; issue 12
asks 0.55), and gathers each candidate block's two own-key tiles by cp.async after its cache tiles,
each waited at once. Here fewer units than SMs share their tiles evenly (batch 8: 48 tiles a
program against 66; run JA without the plan's cost: 128 against 145 us), and the own tiles run in
the two-stage TMA loop.

Work is counted in key tiles of BLOCK_N keys. A unit is a row block of BLOCK_M rows of one user
and one head; its tiles are the user's history tiles (cdiv(kv_len, BLOCK_N), at least 1) followed
by OWN = BLOCK_M // BLOCK_N tiles of the block's own k/v rows (candidates see their own key, which
is not in the cache; a block without candidates skips them). Units are numbered user after user,
then head, then row block, last (longest causal) block first, so a user's row blocks read the same
keys side by side (L2 reuse).

Four launches, all graph-safe (every decision read from the batch's metadata on the device); the
plan once a forward, at layer 0, kept on the metadata for the other layers (gluon_attention.planned):
  _plan_whole_kernel,     write ITEMS (user, first row, row end, head, first tile, end tile,
  _plan_stream_kernel     piece, pieces, the next piece's item; user -1 past the last) and
  (Triton)                STARTS (the programs with work; program g runs items STARTS[1 + g] ..
                          STARTS[2 + g]), each only for its kind of batch. Units that fill the SMs
                          run whole, one a program (the hardware's dispatch packs a causal
                          history's short row blocks behind its long ones), planned in parallel.
                          Fewer units than SMs run stream-K, planned in one program: programs take
                          equal contiguous shares of all units' tiles, so a share may end one
                          unit's tiles and start the next's (an item a unit it touches). Run FA's
                          fixed pieces left batch 8's 96 units one a SM, 36 of 132 SMs idle; its
                          equal shares are 48 tiles against 66. In lanes (LANES), a tuple of R
                          programs takes each share of (user, head, key tile) steps, program r row
                          block r of each user, so the row blocks reading a key tile run side by
                          side (L2 reuse).
  _attention_kernel       its items in turn: Q tile to shared memory; the tiles whose keys are all
                          the history's, and the own tiles whose rows are all the user's, by TMA
                          (two stages, an mbarrier each, serial Q K^T / SiLU / W V; tiles across
                          the causal boundary masked by each row's last key, own tiles to each
                          candidate's own key); a tile across the history's (or the user's rows')
                          end gathered by masked cp.async (zeros past it: never a stale page's or
                          a padded row's values). A whole unit writes out, a cut unit's item its
                          float32 sum to PART[item].
  _sum_pieces_kernel      adds each cut unit's items into out (nothing for a whole unit).

Layout assumed: kv_cache [L, P, 2, page_size, H, d] contiguous (keys at index 0, values at 1), seen
by TMA as [L * P * 2 * page_size, H * d] rows; q/k/v [T, H, d] with unit stride over d (k and v
seen by TMA as [T, H * d] rows when their heads are contiguous and rows 16-byte aligned, else the
own tiles are gathered); 16-bit dtypes; d in {64, 128, 256}; page_size a power of 2 from 8 to 256
(a 64-key tile is 64 // page_size pages, or a slice of one page). `fits` says whether a call
qualifies; others take the Triton kernel.
"""

from __future__ import annotations

import math

import torch

from hstu.ops import gluon_attention, knobs
from hstu.ops.gluon_attention import BLOCK_M, BLOCK_N, WARPS, available, fits  # noqa: F401
from hstu.ops.triton_attention import MAX_SPLITS, _grid_programs, _unit_bound

try:
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from hstu.ops.gluon_attention import (
        _gather_history, _gather_own, _issue_tile, _kv_descriptor, _silu, _write_rows,
    )
    from hstu.ops.triton_attention import _user_blocks
except ImportError:  # no Triton or no Gluon (CPU installs, older Triton): the Triton kernel or torch serves
    gluon = None

OWN = BLOCK_M // BLOCK_N  # a row block's own-key tiles: its k/v rows, which its candidates attend to
FIELDS = 9  # an item: user, row0, q_end, head, first tile, end tile, piece, pieces, next piece's item
# The own tiles by TMA in the pipelined loop where k and v allow it (heads contiguous, rows 16-byte
# aligned) and the tile's rows are all the user's; HSTU_GLUON_OWN_TMA=0 gathers every own tile by
# cp.async after the cache's tiles, each waited at once (the kernel of sessions 29-39), for comparisons.
OWN_TMA = knobs.flag("HSTU_GLUON_OWN_TMA", default=True)
# Lanes: a batch whose users' row blocks would each read their keys from DRAM again when cut
# apart by plain stream-K (ncu, run CR: batch 8's three row blocks a user and head, out of step,
# read its K/V about twice) runs in tuples of R programs (R: its most row blocks of a user) that
# take one share of (user, head, key tile) steps, program r of a tuple row block r of each user,
# so a key tile's readers run side by side; while the lanes stay busy at least LANES_ABOVE of
# the steps (batches whose users have as many row blocks). HSTU_GLUON_LANES=0: plain stream-K.
LANES = knobs.flag("HSTU_GLUON_LANES", default=True)
LANES_ABOVE = 0.8
# An item's fixed cost in key tiles (its Q tile, the pipeline's fill, its float32 partial written
# and summed), against which a batch of equal groups (users alike) weighs an aligned schedule, each
# group cut into the same whole number of shares (every program one item), with equal shares that
# cut across groups (some programs two items): the re-rank's 32 groups of 66 tiles on 66 tuples of
# two programs run 64 shares of 33 (one item each) rather than 66 of 32 (run JA: the equal shares
# ran the re-rank slower than the fixed pieces); batch 8's 32 groups on 44 tuples keep 48-tile shares.
ITEM_COST = 3


def unit_tiles(kv_len: int) -> int:
    """A unit's tiles: its user's history tiles (at least one) and its own tiles."""
    return max(-(-kv_len // BLOCK_N), 1) + OWN


def plan_capacity(rows: int, users: int, heads: int, grid: int) -> int:
    """Rows of ITEMS: at most one item a unit and one more a program."""
    return _unit_bound(rows, users, heads, BLOCK_M) + grid


def plan_items(q_offsets: list[int], kv_lens: list[int], heads: int, num_sms: int, grid: int, capacity: int,
               forced_splits: int = 0, lanes: bool | None = None) -> tuple[list[tuple[int, ...]], list[int]]:
    """(ITEMS, STARTS) as the plan kernels write them, in Python: the reference their tests hold
    them to, and the schedule's definition (see the module docstring). ITEMS has `capacity` rows
    (user -1 past the last item); STARTS grid + 2 entries: the programs with work, then program
    g's first item at 1 + g (the kernels write it up to the programs with work). lanes: LANES
    unless given."""
    lanes = LANES if lanes is None else lanes
    blocks = [-(-(q_offsets[b + 1] - q_offsets[b]) // BLOCK_M) for b in range(len(kv_lens))]
    per = [unit_tiles(kv) if n else 0 for n, kv in zip(blocks, kv_lens)]
    units = sum(blocks) * heads
    pad = [(-1, 0, 0, 0, 0, 0, 0, 1, -1)]
    if units == 0:
        return pad * capacity, [0] * (grid + 2)
    if forced_splits <= 0 and units >= num_sms:  # whole units, one a program
        items = [(b, q_offsets[b] + (n - 1 - rev) * BLOCK_M, q_offsets[b + 1], h, 0, per[b], 0, 1, -1)
                 for b, n in enumerate(blocks) for h in range(heads) for rev in range(n)]
        return items + pad * (capacity - len(items)), [units] + [min(g, units) for g in range(grid + 1)]
    width = lane_width(blocks, per, heads, num_sms, forced_splits, lanes)
    # groups: (user, head, row block (None in lanes: member r runs block members - 1 - r), tiles, members)
    if width > 1:
        groups = [(b, h, None, per[b], n) for b, n in enumerate(blocks) if n for h in range(heads)]
    else:
        groups = [(b, h, n - 1 - rev, per[b], 1) for b, n in enumerate(blocks) for h in range(heads)
                  for rev in range(n)]
    total = sum(grp[3] for grp in groups)
    if forced_splits > 0:
        tuples = max(min(units * min(forced_splits, MAX_SPLITS), total, grid), 1)
    else:
        tuples = share_count(len(groups), total, {grp[3] for grp in groups}, num_sms // width)
    begins = [0]
    for grp in groups:
        begins.append(begins[-1] + grp[3])

    def tuple_of(step: int) -> int:  # the tuple whose share holds `step`
        return ((step + 1) * tuples - 1) // total

    per_program: list[list[list[int]]] = []
    for g in range(tuples * width):
        p, r = divmod(g, width)
        lo, hi = p * total // tuples, (p + 1) * total // tuples
        mine = []
        for (b, h, block, tiles, members), c in zip(groups, begins):
            if c + tiles <= lo or c >= hi or r >= members:
                continue
            first, last = tuple_of(c), tuple_of(c + tiles - 1)
            row_block = members - 1 - r if block is None else block
            mine.append([b, q_offsets[b] + row_block * BLOCK_M, q_offsets[b + 1], h, max(lo, c) - c,
                         min(hi, c + tiles) - c, p - first, last - first + 1])
        per_program.append(mine)
    starts = [0]
    for mine in per_program:
        starts.append(starts[-1] + len(mine))
    starts += [starts[-1]] * (grid - len(per_program))
    items = []
    for g, mine in enumerate(per_program):
        for it in mine:  # a cut unit's next piece: the first item of the same lane in the next tuple
            items.append(tuple(it) + ((starts[g + width] if it[6] < it[7] - 1 else -1),))
    return items + pad * (capacity - len(items)), [len(per_program)] + starts


def share_count(groups: int, total: int, group_tiles: set[int], tuples_max: int) -> int:
    """Tuples a stream-K batch runs (_plan_stream_kernel computes the same on the device): at most
    tuples_max equal shares of the `total` steps; or, for groups of equal size W, groups x k
    (k = tuples_max // groups), every group cut into k shares, when W / k + ITEM_COST is at most
    the equal shares' total / tuples_max + 2 ITEM_COST."""
    stream = max(min(tuples_max, total), 1)
    k = tuples_max // max(groups, 1)
    if len(group_tiles) == 1 and k >= 1:
        (tiles,) = group_tiles
        k = min(k, tiles)
        if -(-tiles // k) + ITEM_COST <= -(-total // stream) + 2 * ITEM_COST:
            return groups * k
    return stream


def lane_width(blocks: list[int], per: list[int], heads: int, num_sms: int, forced_splits: int = 0,
               lanes: bool | None = None) -> int:
    """Programs in a tuple (1: plain stream-K): the batch's most row blocks of a user, when every
    user's row blocks then keep their lanes busy at least LANES_ABOVE of the tuple's steps."""
    lanes = LANES if lanes is None else lanes
    rows_max = max(blocks, default=0)
    busy = sum(n * heads * w for n, w in zip(blocks, per))
    steps = sum(heads * w for w in per)
    wide = lanes and forced_splits <= 0 and 1 < rows_max <= num_sms and busy >= LANES_ABOVE * rows_max * steps
    return rows_max if wide else 1


def plan_slots(capacity: int, num_sms: int, forced_splits: int) -> int:
    """Items that may write PART (those of cut units), so the rows of ITEMS the sum kernel reads:
    without forced splits, cut units exist only below SMs units, on at most SMs programs, so
    fewer than 2 x SMs items."""
    return capacity if forced_splits > 0 else min(capacity, 2 * num_sms)


def grid_programs(rows: int, users: int, heads: int, num_sms: int, forced_splits: int) -> int:
    """Programs a call launches (fixed for a CUDA graph's bucket): the Triton kernel's count at
    BLOCK_M rows (one a unit, at least one a SM, units x forced_splits when forced)."""
    return _grid_programs(rows, users, heads, BLOCK_M, num_sms, forced_splits)


if gluon is not None:

    @triton.jit
    def _pick(values, one_hot):
        """values[b] per row of one_hot ([R, MAX_USERS], one b set a row; values [1, MAX_USERS]):
        a masked sum. (The per-user rows are expanded once, outside the loops: Triton 3.6's layout
        pass broke dominance when each loop expanded its own.)"""
        return tl.sum(tl.where(one_hot, values, 0), axis=1)

    @triton.jit
    def _user_of(x, ends, users):
        """One-hot [R, MAX_USERS] of the user whose range [end - count, end) holds each x (ends,
        users: [1, MAX_USERS])."""
        return users == tl.sum((ends <= x[:, None]).to(tl.int32), axis=1)[:, None]

    @triton.jit
    def _batch_units(Q_OFF, KV_LENS, num_users, num_heads, num_sms, forced_splits, MAX_USERS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OWN: tl.constexpr):
        """Per user (vectors over MAX_USERS) first row, end row, row blocks and tiles a unit; the
        batch's units and whether they run whole (fill the SMs, no forced splits)."""
        q_lo, q_hi, kv, blocks = _user_blocks(Q_OFF, KV_LENS, num_users, MAX_USERS, BLOCK_M)
        per = tl.where(blocks > 0, tl.maximum((kv + BLOCK_N - 1) // BLOCK_N, 1) + OWN, 0)
        units = tl.sum(blocks, axis=0) * num_heads
        return q_lo, q_hi, blocks, per, units, (forced_splits <= 0) & (units >= num_sms)

    @triton.jit(do_not_specialize=["num_users", "forced_splits", "slots"])
    def _plan_whole_kernel(
        Q_OFF, KV_LENS, ITEMS, STARTS, num_users, num_heads, num_sms, forced_splits, slots,
        MAX_USERS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        OWN: tl.constexpr, FIELDS: tl.constexpr,
    ):
        """A batch of whole units (nothing otherwise): item g = unit g, program g runs it, rows
        past the units up to `slots` padded; BLOCK_G items a program, in parallel."""
        users = tl.arange(0, MAX_USERS)
        q_lo, q_hi, blocks, per, units, whole = _batch_units(Q_OFF, KV_LENS, num_users, num_heads, num_sms,
                                                             forced_splits, MAX_USERS, BLOCK_M, BLOCK_N, OWN)
        if whole:
            count = blocks * num_heads
            ends = tl.cumsum(count, axis=0)
            g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
            mine = _user_of(g, ends[None, :], users[None, :])
            local = g - _pick((ends - count)[None, :], mine)
            n = tl.maximum(_pick(blocks[None, :], mine), 1)
            work = g < units
            fields = (
                tl.where(work, _pick(users[None, :], mine), -1),
                tl.where(work, _pick(q_lo[None, :], mine) + (n - 1 - local % n) * BLOCK_M, 0),
                tl.where(work, _pick(q_hi[None, :], mine), 0),
                tl.where(work, local // n, 0),
                g * 0,
                tl.where(work, _pick(per[None, :], mine), 0),
                g * 0,
                g * 0 + 1,
                g * 0 - 1,
            )
            for f in tl.static_range(FIELDS):
                tl.store(ITEMS + g * FIELDS + f, fields[f], mask=work | (g < slots))
            tl.store(STARTS + 1 + g, g, mask=g <= units)
            if tl.program_id(0) == 0:
                tl.store(STARTS, units)

    @triton.jit(do_not_specialize=["num_users", "forced_splits", "grid", "slots"])
    def _plan_stream_kernel(
        Q_OFF, KV_LENS, ITEMS, STARTS, num_users, num_heads, num_sms, forced_splits, grid, slots,
        MAX_USERS: tl.constexpr, P_BLOCK: tl.constexpr, SLOT_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, OWN: tl.constexpr, MAX_SPLITS: tl.constexpr, FIELDS: tl.constexpr,
        LANES: tl.constexpr, LANES_ABOVE: tl.constexpr, ITEM_COST: tl.constexpr,
    ):
        """A stream-K batch (nothing for whole units), in one program, every program's share at
        once (P_BLOCK lanes > the programs used); plan_items (lane_width) is its reference."""
        users = tl.arange(0, MAX_USERS)
        q_lo, q_hi, blocks, per, units, whole = _batch_units(Q_OFF, KV_LENS, num_users, num_heads, num_sms,
                                                             forced_splits, MAX_USERS, BLOCK_M, BLOCK_N, OWN)
        if not whole:
            rows_max = tl.max(blocks, axis=0)
            busy = tl.sum(blocks * num_heads * per, axis=0)
            lane_steps = tl.sum(num_heads * per, axis=0)
            in_lanes = LANES & (forced_splits <= 0) & (rows_max > 1) & (rows_max <= num_sms)
            in_lanes = in_lanes & (busy.to(tl.float32) >= LANES_ABOVE * (rows_max * lane_steps).to(tl.float32))
            width = tl.where(in_lanes, rows_max, 1)
            # groups a user: (user, head) in lanes, else its units (head, then row block from the last)
            grp_count = tl.where(in_lanes, num_heads * (blocks > 0).to(tl.int32), num_heads * blocks)
            grp_ends = tl.cumsum(grp_count, axis=0)
            grp_starts = grp_ends - grp_count
            tile_count = grp_count * per
            tile_ends = tl.cumsum(tile_count, axis=0)
            tile_starts = tile_ends - tile_count
            total = tl.sum(tile_count, axis=0)
            stream = tl.maximum(tl.minimum(num_sms // width, total), 1)
            # groups alike (one tile count): each cut into `shares` whole shares when that costs less (share_count)
            groups = tl.sum(grp_count, axis=0)
            per_max = tl.max(per, axis=0)
            alike = tl.min(tl.where(blocks > 0, per, per_max), axis=0) == per_max
            shares = tl.minimum((num_sms // width) // tl.maximum(groups, 1), per_max)
            aligned = alike & (shares >= 1)
            aligned = aligned & ((per_max + shares - 1) // tl.maximum(shares, 1) + ITEM_COST
                                 <= (total + stream - 1) // stream + 2 * ITEM_COST)
            tuples = tl.where(aligned, groups * shares, stream)
            tuples = tl.where(forced_splits > 0,
                              tl.maximum(tl.minimum(tl.minimum(units * tl.minimum(forced_splits, MAX_SPLITS), grid),
                                                    total), 1), tuples)
            used = tl.where(units == 0, 0, tuples * width)
            total_s = tl.maximum(total, 1)
            users_r, blocks_r, per_r = users[None, :], blocks[None, :], per[None, :]
            grp_starts_r, grp_ends_r = grp_starts[None, :], grp_ends[None, :]
            tile_starts_r, tile_ends_r = tile_starts[None, :], tile_ends[None, :]

            g = tl.arange(0, P_BLOCK)
            p = g // width
            r = g % width
            lo = p * total // tuples
            hi = (p + 1) * total // tuples
            at_lo = _user_of(lo, tile_ends_r, users_r)
            at_hi = _user_of(hi - 1, tile_ends_r, users_r)
            ga = _pick(grp_starts_r, at_lo) + (lo - _pick(tile_starts_r, at_lo)) // tl.maximum(_pick(per_r, at_lo), 1)
            gb = _pick(grp_starts_r, at_hi) + (hi - 1 - _pick(tile_starts_r, at_hi)) // tl.maximum(
                _pick(per_r, at_hi), 1)
            # groups in [ga, gb] whose user has a row block for lane r (every group outside lanes)
            overlap = tl.minimum(gb[:, None] + 1, grp_ends_r) - tl.maximum(ga[:, None], grp_starts_r)
            has_lane = (~in_lanes) | (blocks_r > r[:, None])
            n_items = tl.where(g < used, tl.sum(tl.where(has_lane, tl.maximum(overlap, 0), 0), axis=1), 0)
            first_item = tl.cumsum(n_items, axis=0) - n_items
            count = tl.sum(n_items, axis=0)
            tl.store(STARTS + 1 + g, first_item, mask=g <= used)
            tl.store(STARTS, used)
            tl.debug_barrier()  # STARTS written by every thread before any reads a neighbour's back
            next_first = tl.load(STARTS + 1 + g + width, mask=g + width <= used, other=-1)
            span = tl.where(g < used, gb - ga + 1, 0)
            placed = g * 0
            for j in range(0, tl.max(span, axis=0)):
                grp = ga + j
                mine = _user_of(grp, grp_ends_r, users_r)
                n = tl.maximum(_pick(blocks_r, mine), 1)
                valid = (j < span) & ((~in_lanes) | (r < n))
                local = grp - _pick(grp_starts_r, mine)
                tiles = _pick(per_r, mine)
                begin = _pick(tile_starts_r, mine) + local * tiles
                first_t = ((begin + 1) * tuples - 1) // total_s
                last_t = ((begin + tiles) * tuples - 1) // total_s
                piece = p - first_t
                pieces = last_t - first_t + 1
                fields = (
                    _pick(users_r, mine),
                    _pick(q_lo[None, :], mine) + tl.where(in_lanes, n - 1 - r, n - 1 - local % n) * BLOCK_M,
                    _pick(q_hi[None, :], mine),
                    tl.where(in_lanes, local, local // n),
                    tl.maximum(lo, begin) - begin,
                    tl.minimum(hi, begin + tiles) - begin,
                    piece,
                    pieces,
                    tl.where(piece < pieces - 1, next_first, -1),
                )
                for f in tl.static_range(FIELDS):
                    tl.store(ITEMS + (first_item + placed) * FIELDS + f, fields[f], mask=valid)
                placed += valid.to(tl.int32)
            i = tl.arange(0, SLOT_BLOCK)  # the rows past the last item that the sum kernel reads
            pad = (i >= count) & (i < slots)
            for f in tl.static_range(FIELDS):
                tl.store(ITEMS + i * FIELDS + f, tl.where(f == 0, -1, tl.where(f == 7, 1, tl.where(f == 8, -1, 0)))
                         + i * 0, mask=pad)

    @gluon.jit
    def _issue_own(k_buf, v_buf, bar, K_DESC, V_DESC, row, h, HEAD_DIM: gl.constexpr, BOX: gl.constexpr,
                   BLOCK_N: gl.constexpr):
        """TMA copies of the k and v rows row.. (< row + BLOCK_N) of head h into one stage."""
        mbarrier.expect(bar, 2 * (BLOCK_N // BOX) * K_DESC.block_type.nbytes)
        for i in gl.static_range(BLOCK_N // BOX):
            tma.async_copy_global_to_shared(K_DESC, [row + i * BOX, h * HEAD_DIM], bar, k_buf.slice(i * BOX, BOX))
            tma.async_copy_global_to_shared(V_DESC, [row + i * BOX, h * HEAD_DIM], bar, v_buf.slice(i * BOX, BOX))

    @gluon.jit
    def _issue_step(j, k_buf, v_buf, bar, KV_DESC, K_DESC, V_DESC, pt_row, c_lo, n_cache, own_row0, layer_row0, h,
                    HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BOX: gl.constexpr, BLOCK_N: gl.constexpr,
                    OWN_TMA: gl.constexpr):
        """Pipelined step j of an item: cache tile c_lo + j, then (OWN_TMA) its own tiles from own_row0."""
        if j < n_cache:
            _issue_tile(k_buf, v_buf, bar, KV_DESC, pt_row, (c_lo + j) * BLOCK_N, layer_row0, h, HEAD_DIM, PAGE_SIZE,
                        BOX, BLOCK_N)
        else:
            if OWN_TMA:
                _issue_own(k_buf, v_buf, bar, K_DESC, V_DESC, own_row0 + (j - n_cache) * BLOCK_N, h, HEAD_DIM, BOX,
                           BLOCK_N)

    # max_pages changes with the batch: not specialised, so a new batch never pays a JIT compile
    # (as the Triton kernel; the other integers are strides and offsets fixed by the model and cache)
    @gluon.jit(do_not_specialize=["max_pages"])
    def _attention_kernel(
        Q, K, V, KV, KV_DESC, K_DESC, V_DESC, PT, KV_LENS, Q_POS, ITEMS, STARTS, OUT, PART,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        layer_offset, page_stride, token_stride, kv_stride, max_pages, layer_row0,
        SCALE: gl.constexpr, INV_SCALE_LEN: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        HEAD_DIM: gl.constexpr, PAGE_SIZE: gl.constexpr, BOX: gl.constexpr, FIELDS: gl.constexpr,
        MASKED_TMA: gl.constexpr = False, OWN_TMA: gl.constexpr = False,
    ):
        g = gl.program_id(0)
        if g >= gl.load(STARTS):  # no work for this program in this batch
            return
        item_lo = gl.load(STARTS + 1 + g)
        item_hi = gl.load(STARTS + 2 + g)
        dtype: gl.constexpr = Q.dtype.element_ty
        OWN: gl.constexpr = BLOCK_M // BLOCK_N

        load: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [gl.num_warps(), 1], [16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [gl.num_warps(), 1], [16, HEAD_DIM, 16])
        w_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
        q_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
        kv_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_shared)
        k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], kv_shared)
        v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_DIM], kv_shared)
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bars.index(0), count=1)
        mbarrier.init(bars.index(1), count=1)

        rows_ld = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, load))
        dd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, load))
        keys_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        steps = item_lo * 0  # pipelined steps so far: step s uses stage s % 2 at phase (s // 2) % 2
        for i in range(item_lo, item_hi):
            item = ITEMS + i * FIELDS
            b = gl.load(item)
            row0 = gl.load(item + 1)
            q_end = gl.load(item + 2)
            h = gl.load(item + 3)
            t_lo = gl.load(item + 4)
            t_hi = gl.load(item + 5)
            pieces = gl.load(item + 7)
            kv_len = gl.load(KV_LENS + b)
            cache_tiles = gl.maximum((kv_len + BLOCK_N - 1) // BLOCK_N, 1)

            # Each row's last key (-1 for rows past the user's): keys below lo_all every row sees.
            rows_s = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            row_ok = rows_s < q_end
            q_pos = gl.load(Q_POS + rows_s, mask=row_ok, other=0).to(gl.int32)
            is_cand = q_pos < 0
            last_key = gl.where(row_ok, gl.where(is_cand, kv_len - 1, q_pos), -1)
            key_hi = gl.max(last_key, axis=0) + 1
            lo_all = gl.min(gl.where(row_ok, last_key, 2147483647), axis=0) + 1
            full_end = gl.minimum(key_hi, lo_all) // BLOCK_N  # tiles every row sees in full
            if MASKED_TMA:  # also the tiles across the causal boundary, whose keys are all the history's
                tma_end = gl.maximum(gl.minimum((key_hi + BLOCK_N - 1) // BLOCK_N, kv_len // BLOCK_N), full_end)
            else:
                tma_end = full_end
            # this item's cache tiles [t_lo, c_hi): TMA for the first n_cache, then gathered
            c_hi = gl.minimum(gl.minimum(t_hi, cache_tiles), (key_hi + BLOCK_N - 1) // BLOCK_N)
            n_cache = gl.maximum(gl.minimum(c_hi, tma_end) - t_lo, 0)
            # its own tiles [o_lo, o_hi) (for a block with candidates): TMA while their rows are all the user's
            has_cand = gl.max(is_cand.to(gl.int32), axis=0) > 0
            o_lo = gl.maximum(t_lo - cache_tiles, 0)
            o_hi = gl.where(has_cand, gl.minimum(t_hi - cache_tiles, OWN), 0)
            if OWN_TMA:
                o_tma = gl.maximum(gl.minimum(o_hi, (q_end - row0) // BLOCK_N) - o_lo, 0)
            else:
                o_tma = o_lo * 0
            n_pipe = n_cache + o_tma
            own_row0 = row0 + o_lo * BLOCK_N
            pt_row = PT + b.to(gl.int64) * max_pages

            # every warp done with the previous item's buffers (its last reads waited), its generic
            # shared-memory accesses ordered before the TMA writes below
            gl.thread_barrier()
            fence_async_shared()
            # The pipelined steps: TMA into two stages, step j + 2 issued once step j is done; the
            # first two issued before the Q tile's load, which their flight hides.
            if n_pipe > 0:
                _issue_step(0, k_smem.index(steps % 2), v_smem.index(steps % 2), bars.index(steps % 2), KV_DESC,
                            K_DESC, V_DESC, pt_row, t_lo, n_cache, own_row0, layer_row0, h, HEAD_DIM, PAGE_SIZE, BOX,
                            BLOCK_N, OWN_TMA)
            if n_pipe > 1:
                _issue_step(1, k_smem.index((steps + 1) % 2), v_smem.index((steps + 1) % 2),
                            bars.index((steps + 1) % 2), KV_DESC, K_DESC, V_DESC, pt_row, t_lo, n_cache, own_row0,
                            layer_row0, h, HEAD_DIM, PAGE_SIZE, BOX, BLOCK_N, OWN_TMA)
            q_ptrs = Q + gl.expand_dims((row0 + rows_ld) * stride_qt + h * stride_qh, 1) + gl.expand_dims(dd, 0)
            q_smem.store(gl.load(q_ptrs, mask=gl.expand_dims(row0 + rows_ld < q_end, 1), other=0.0))
            fence_async_shared()  # every thread's Q stores ordered before the wgmma reads them
            gl.thread_barrier()

            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
            for j in range(n_pipe):
                stage = (steps + j) % 2
                mbarrier.wait(bars.index(stage), ((steps + j) // 2) % 2)
                zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
                s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s,))
                w = _silu(s * SCALE)
                if j < n_cache:
                    if MASKED_TMA:
                        if t_lo + j >= full_end:
                            keep = gl.expand_dims((t_lo + j) * BLOCK_N + keys_s, 0) <= gl.expand_dims(last_key, 1)
                            w = gl.where(keep, w, 0.0)
                else:  # an own tile: each candidate row keeps its own key alone
                    own = own_row0 + (j - n_cache) * BLOCK_N + keys_s
                    keep = (gl.expand_dims(own, 0) == gl.expand_dims(rows_s, 1)) & gl.expand_dims(is_cand, 1)
                    w = gl.where(keep, w, 0.0)
                w = gl.convert_layout(w.to(dtype), w_layout)
                acc = warpgroup_mma(w, v_smem.index(stage), acc, is_async=True)
                acc, w = warpgroup_mma_wait(0, deps=(acc, w))
                gl.thread_barrier()  # every warp's wgmma done reading this stage before it is refilled
                if j + 2 < n_pipe:
                    _issue_step(j + 2, k_smem.index(stage), v_smem.index(stage), bars.index(stage), KV_DESC, K_DESC,
                                V_DESC, pt_row, t_lo, n_cache, own_row0, layer_row0, h, HEAD_DIM, PAGE_SIZE, BOX,
                                BLOCK_N, OWN_TMA)
            steps += n_pipe

            # Cache tiles past the TMA ones (across the causal boundary unless MASKED_TMA, or the
            # history's end), then own tiles past the TMA ones (rows past the user's, or OWN_TMA
            # off): gathered, masked.
            acc = _gather_history(acc, q_smem, k_smem.index(0), v_smem.index(0), KV, pt_row, (t_lo + n_cache) * BLOCK_N,
                                  c_hi * BLOCK_N, kv_len, last_key, layer_offset, h, page_stride, token_stride,
                                  kv_stride, SCALE, s_layout, w_layout, load, BLOCK_M, BLOCK_N, HEAD_DIM, PAGE_SIZE,
                                  dtype)
            acc = _gather_own(acc, q_smem, k_smem.index(0), v_smem.index(0), K, V, row0 + (o_lo + o_tma) * BLOCK_N,
                              row0 + o_hi * BLOCK_N, q_end, rows_s, is_cand, h, stride_kt, stride_kh, stride_vt,
                              stride_vh, SCALE, s_layout, w_layout, load, BLOCK_M, BLOCK_N, HEAD_DIM, dtype)
            _write_rows(acc, OUT, PART, i, row0, q_end, h, pieces, stride_ot, stride_oh, INV_SCALE_LEN, o_layout,
                        BLOCK_M, HEAD_DIM, dtype)
        mbarrier.invalidate(bars.index(0))
        mbarrier.invalidate(bars.index(1))

    @triton.jit
    def _sum_pieces_kernel(ITEMS, PART, OUT, stride_ot, stride_oh, FIELDS: tl.constexpr, BLOCK_M: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr):
        """out of a cut unit's rows = the sum of its items' PART tiles, from its first item along
        each item's next: one program an item and BLOCK_R of its rows (nothing unless it is a cut
        unit's first). Each step of the chain waits for the item it reads, so a program walks it
        over BLOCK_R rows only: one program an item looping over all its rows (7c2a20d) made those
        waits serial, pieces x BLOCK_M / BLOCK_R of them (run KA, H100: batch 1 105 us a layer
        against run JA's 52 with this form)."""
        g = tl.program_id(0) // (BLOCK_M // BLOCK_R)
        chunk = tl.program_id(0) % (BLOCK_M // BLOCK_R)
        item = ITEMS + g * FIELDS
        b = tl.load(item)
        piece = tl.load(item + 6)
        pieces = tl.load(item + 7)
        if (b >= 0) & (pieces > 1) & (piece == 0):
            row0 = tl.load(item + 1)
            q_end = tl.load(item + 2)
            h = tl.load(item + 3)
            r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
            dd = tl.arange(0, HEAD_DIM)
            mask = (row0 + r < q_end)[:, None]
            offs = r[:, None] * HEAD_DIM + dd[None, :]
            acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
            slot = g
            for _ in range(pieces):
                acc += tl.load(PART + slot.to(tl.int64) * (BLOCK_M * HEAD_DIM) + offs, mask=mask, other=0.0)
                slot = tl.load(ITEMS + slot * FIELDS + 8)
            out_ptrs = OUT + (row0 + r)[:, None] * stride_ot + h * stride_oh + dd[None, :]
            tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask)

    def sum_pieces(items: torch.Tensor, part: torch.Tensor, out: torch.Tensor, slots: int, block_r: int = 8) -> None:
        """Each cut unit's rows of out [T, H, d] = the sum of its items' PART [slots, BLOCK_M, d]
        tiles (ITEMS' first `slots` rows; whole units untouched)."""
        _sum_pieces_kernel[(slots * (BLOCK_M // block_r),)](
            items, part, out, out.stride(0), out.stride(1), FIELDS=FIELDS, BLOCK_M=BLOCK_M, HEAD_DIM=out.shape[-1],
            BLOCK_R=block_r, num_warps=4,
        )

    def own_tma_fits(t: torch.Tensor) -> bool:
        """Whether TMA can read t [T, H, d] as [T, H * d] rows: heads contiguous, 16-byte aligned base and rows."""
        T, H, d = t.shape
        size = t.element_size()
        return (t.stride(2) == 1 and t.stride(1) == d and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0
                and T > 0)

    def _rows_descriptor(t: torch.Tensor, box: int) -> "TensorDescriptor":
        """t [T, H, d] as [T, H * d] rows (own_tma_fits holds), a [box, d] block."""
        T, H, d = t.shape
        dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
        layout = gl.NVMMASharedLayout.get_default_for([box, d], dtype)
        return TensorDescriptor(t, [T, H * d], [t.stride(0), 1], [box, d], layout)

    def write_items(q_offsets: torch.Tensor, kv_lens: torch.Tensor, heads: int, num_sms: int, forced_splits: int,
                    grid: int, capacity: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ITEMS [capacity, FIELDS], STARTS [grid + 2]) int32 on the metadata's device: STARTS[0]
        the programs with work, program g's items STARTS[1 + g] .. STARTS[2 + g]; the rows of ITEMS
        past the last item and below `slots` padded. Two plan kernels, each writing only when the
        batch is its kind (whole units in parallel; stream-K in one program); plan_items is their
        reference."""
        B = kv_lens.shape[0]
        items = torch.empty((capacity, FIELDS), dtype=torch.int32, device=kv_lens.device)
        starts = torch.empty((grid + 2,), dtype=torch.int32, device=kv_lens.device)
        max_users = max(16, triton.next_power_of_2(B + 1))
        block_g = 64
        _plan_whole_kernel[(triton.cdiv(max(grid, slots), block_g),)](
            q_offsets, kv_lens, items, starts, B, heads, num_sms, forced_splits, slots,
            MAX_USERS=max_users, BLOCK_G=block_g, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, OWN=OWN, FIELDS=FIELDS,
            num_warps=4,
        )
        used_max = min(grid, max(num_sms, 1)) if forced_splits <= 0 else grid
        _plan_stream_kernel[(1,)](
            q_offsets, kv_lens, items, starts, B, heads, num_sms, forced_splits, grid, slots,
            MAX_USERS=max_users, P_BLOCK=triton.next_power_of_2(used_max + 2),
            SLOT_BLOCK=triton.next_power_of_2(max(slots, 1)), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, OWN=OWN,
            MAX_SPLITS=MAX_SPLITS, FIELDS=FIELDS, LANES=LANES, LANES_ABOVE=LANES_ABOVE, ITEM_COST=ITEM_COST,
            num_warps=8,
        )
        return items, starts

    def launch(q, k, v, kv_cache, layer, page_table, kv_lens, q_offsets, q_pos, scale_len: int,
               num_sms: int, num_splits: int = 0, plans: dict | None = None) -> torch.Tensor:
        """The attention output [T, H, d] in q's dtype (the Triton op's contract); num_splits > 0
        runs units x num_splits programs stream-K (tests: cut units). plans: the metadata's
        attention_plans, so one plan serves every layer of a forward (gluon_attention.planned)."""
        T, H, d = q.shape
        L, P, _, page_size, _, _ = kv_cache.shape
        B, max_pages = page_table.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if T == 0 or B == 0:
            return out
        num_splits = min(num_splits, MAX_SPLITS)
        grid = grid_programs(T, B, H, num_sms, num_splits)
        capacity = plan_capacity(T, B, H, grid)
        slots = plan_slots(capacity, num_sms, num_splits)
        items, starts = gluon_attention.planned(
            plans, layer, ("stream", H, num_sms, num_splits, grid, capacity, slots),
            lambda: write_items(q_offsets, kv_lens, H, num_sms, num_splits, grid, capacity, slots))
        part = torch.empty((slots, BLOCK_M, d), dtype=torch.float32, device=q.device)
        box = min(page_size, BLOCK_N)
        own_tma = OWN_TMA and own_tma_fits(k) and own_tma_fits(v)
        k_desc = _rows_descriptor(k, box) if own_tma else None
        v_desc = _rows_descriptor(v, box) if own_tma else None
        _attention_kernel[(grid,)](
            q, k, v, kv_cache, _kv_descriptor(kv_cache, box), k_desc, v_desc, page_table, kv_lens, q_pos, items, starts,
            out, part,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            layer * kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(3), kv_cache.stride(2), max_pages,
            layer * P * 2 * page_size,
            SCALE=1.0 / math.sqrt(d), INV_SCALE_LEN=1.0 / scale_len, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=d,
            PAGE_SIZE=page_size, BOX=box, FIELDS=FIELDS, MASKED_TMA=gluon_attention.MASKED_TMA, OWN_TMA=own_tma, num_warps=WARPS,
        )
        sum_pieces(items, part, out, slots)
        return out
