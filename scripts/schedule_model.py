"""A model of the attention kernel's schedule over a replay's batches: how far each schedule's
makespan is from the batch's work spread evenly over the SMs.

Why: the replay's batches mix users (a miss recomputing a causal history beside hits that
attend 4k cached keys). The kernel schedules units (one row block of one user and head) aligned,
one a program, or balanced, in equal shares of iterations. Which one keeps the SMs busy depends
on the mix, and a device call costs more than this model, which reads a replay.json.

Model: a unit costs its key tiles as time. Causal: a history row block sees keys up to its last
row's position, a block holding candidates sees the whole history. Aligned programs go to SMs in
order, greedily, one at a time. Balanced programs take equal shares of the iterations the kernel
accounts (every unit of a user at its full key length, as ops/triton_attention.py _batch_plan
counts them). It ignores memory bandwidth: on an H100/H200 the kernel is partly bandwidth-bound,
and the model overstated the balanced schedule's gain at batch 8 (27% against 4% measured, run
AV), so treat its ratios as an upper bound on what a schedule can gain.

    python -m hstu.scripts.schedule_model out/replay/replay.json [--sms 132]

Rows: now; align_tail=1 (HSTU_ATTENTION_ALIGN_TAIL=1); long_first (HSTU_ATTENTION_LONG_FIRST=1);
both; all three (and HSTU_ATTENTION_CAUSAL_SHARES=1: balanced shares of the work itself).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

BLOCK_M, BLOCK_N, HEADS = 128, 64, 4


@dataclass(frozen=True)
class Unit:
    """One row block of one user and head: the iterations the kernel accounts and those it runs."""

    accounted: int
    actual: int


def units_of(batch: list[dict], long_first: bool = False) -> list[Unit]:
    """The batch's units in the kernel's order (user after user, row block after row block, head
    fastest; long_first: each user's row blocks last first). Each request: history_tokens,
    cached_tokens, candidates."""
    out: list[Unit] = []
    for r in batch:
        n, c, m = r["history_tokens"], r["cached_tokens"], r["candidates"]
        rows, accounted = n - c + m, max(math.ceil(n / BLOCK_N), 1)
        blocks = []
        for j in range(math.ceil(rows / BLOCK_M)):
            last_row = min(rows, (j + 1) * BLOCK_M) - 1
            last_key = c + last_row if last_row < n - c else n - 1  # history rows first, then candidates
            blocks.append([Unit(accounted, math.ceil((last_key + 1) / BLOCK_N))] * HEADS)
        for block in reversed(blocks) if long_first else blocks:
            out += block
    return out


def aligned_makespan(units: list[Unit], sms: int) -> int:
    """One unit a program, programs started in order on the first free SM."""
    free = [0] * sms
    for u in units:
        heapq.heappush(free, heapq.heappop(free) + u.actual)
    return max(free)


def balanced_makespan(units: list[Unit], sms: int, causal_shares: bool = False) -> int:
    """min(sms, accounted iterations) programs, each a contiguous equal share of the accounted
    iterations; a unit's actual iterations are its first ones (keys past its causal end skipped).
    causal_shares: each unit accounted at its actual iterations (HSTU_ATTENTION_CAUSAL_SHARES)."""
    if causal_shares:
        units = [Unit(u.actual, u.actual) for u in units]
    total = sum(u.accounted for u in units)
    programs = max(min(sms, total), 1)
    bounds = [p * total // programs for p in range(programs + 1)]
    work = [0] * programs
    start = 0
    for u in units:
        for p in range(bisect.bisect_right(bounds, start) - 1, programs):  # from the share holding `start`
            lo, hi = max(bounds[p], start), min(bounds[p + 1], start + u.accounted)
            if lo >= hi:
                break
            work[p] += max(0, min(hi - start, u.actual) - (lo - start))
        start += u.accounted
    return max(work)


def schedule(units: list[Unit], sms: int, align_tail: float = 0.0, balance_below: float = 0.75) -> str:
    """The kernel's choice: aligned when the units fill their waves at least balance_below (and,
    align_tail > 0, the longest unit is at most align_tail x an SM's even share), else balanced."""
    waves = math.ceil(len(units) / sms)
    full = len(units) >= balance_below * waves * sms
    if full and align_tail > 0:
        full = max(u.accounted for u in units) * sms <= align_tail * sum(u.accounted for u in units)
    return "aligned" if full else "balanced"


def model(batches: list[list[dict]], sms: int, align_tail: float = 0.0, long_first: bool = False,
          causal_shares: bool = False) -> float:
    """The batches' summed makespans over their summed ideal times (work / sms)."""
    spent = ideal = 0.0
    for batch in batches:
        units = units_of(batch, long_first)
        ideal += sum(u.actual for u in units) / sms
        if schedule(units, sms, align_tail) == "aligned":
            spent += aligned_makespan(units, sms)
        else:
            spent += balanced_makespan(units_of(batch), sms, causal_shares)
    return spent / ideal if ideal else float("nan")


def batches_of(requests: list[dict]) -> list[list[dict]]:
    """A replay pass's requests grouped by batch_index, in order."""
    grouped: dict[int, list[dict]] = collections.defaultdict(list)
    for r in requests:
        grouped[r["batch_index"]].append(r)
    return [grouped[k] for k in sorted(grouped)]


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("replay_json", type=Path, help="a replay.json written by `hstu replay`")
    parser.add_argument("--sms", type=int, default=132)
    args = parser.parse_args(argv)
    doc = json.loads(args.replay_json.read_text())
    rows = {"now": (0.0, False, False), "align_tail=1": (1.0, False, False), "long_first": (0.0, True, False),
            "both": (1.0, True, False), "all three": (1.0, True, True)}
    report = {}
    for name, requests in doc["requests"].items():
        batches = batches_of(requests)
        report[name] = {row: model(batches, args.sms, *knobs) for row, knobs in rows.items()}
    print(f"{'pass':<10}" + "".join(f"{row:>14}" for row in rows))
    for name, ratios in report.items():
        print(f"{name:<10}" + "".join(f"{ratios[row]:>14.3f}" for row in rows))
    return report


if __name__ == "__main__":
    main()
