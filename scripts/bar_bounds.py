"""What the planner's calibrated cost model predicts for each open acceptance bar, and what it would take.

    python -m hstu.scripts.bar_bounds benchmarks/e2e_auto_h100_session33.json [--out out/bounds.json]

Why: the open bars of issues 11 and 12 are ratios of uncached to cached time on a GPU, and device
time is scarce. The cost model `hstu bench` calibrates on the device (planner.CostModel: a
per-forward cost, per-layer costs per computed row and per attention pair, the H2D rate) predicted
the measured forwards of the thirty-third session within ~10% (GPU-resident batches 1 and 8, the
re-rank, host-tier splits; benchmarks/RESULTS.md). Evaluated on its fitted numbers it says, without
a GPU, which bars the present cost structure can reach at all, and how far one cost must fall for
each to be met:
  forward_s   the per-forward cost (host work, launches, embedding, head), scaled on both sides:
              the uncached forward pays it too;
  attention   the cached side's per-pair cost alone: its attention shapes (few queries over a long
              cached history) run the same kernel less efficiently than the uncached ones (0.33 of
              the bf16 peak at the batch-8 re-rank against 0.57 uncached, run CM), so this is how
              much closer to the uncached efficiency they would have to come.
The measured column is the same call's figure where the JSONs hold it (`hstu bench`'s e2e speedups;
the seed replay from --replay-json). A factor of 1 means met as things stand; "-" that no factor of
that cost alone meets the bar. The
ceiling column is the ratio with no per-forward cost at all. `--no-padding` prices the cached side
without graph-bucket padding (rows as computed, not as a bucket runs them): the seed replay's
measured ratio sits between the two.

Shapes: bench_shapes.BenchShape (a 4,096-token history, 3,968 cached, 256 candidates), the cached
side padded to the engine's graph buckets (host_split auto), the uncached side not (it runs without
graphs); a host-tier batch takes the planner's own choice (planner.choose_split, "auto"). The seed
replay: `hstu replay --preset seed`'s workload, batched as the replay does (distinct_user_batches,
8 users); a request's GPU-resident prefix is its user's previous history when it extends it (the
seed replay's cache holds every user). Predictions only: nothing here runs a model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hstu.engine.engine import default_graph_buckets
from hstu.model.config import HSTUConfig
from hstu.ops.kvcache.planner import CostModel, UserShape, choose_split, predict
from hstu.scripts.bench_shapes import BenchShape
from hstu.scripts.report import fmt, format_table
from hstu.scripts.workload import Workload, WorkloadConfig, distinct_user_batches, is_extension

Times = Callable[[CostModel, float], tuple[float, float]]  # (cost, cached per-pair factor) -> (cached s, uncached s)


@dataclass(frozen=True)
class Bar:
    """One acceptance bar: uncached time / cached time >= target. measured_key: where `hstu bench`'s
    JSON holds what the bar measured (e2e/<batch>/<key>), None when it does not (the seed replay:
    `hstu replay`'s JSON, --replay-json)."""

    name: str
    issue: int
    target: float
    times: Times
    measured_key: tuple[str, str] | None = None

    def ratio(self, cost: CostModel, cached_pairs: float = 1.0) -> float:
        cached, uncached = self.times(cost, cached_pairs)
        return uncached / cached


def load_cost(path: Path) -> CostModel:
    """The first calibrated cost model in a `hstu bench` JSON (under e2e/<batch>/ or split/<batch>/)."""
    return cost_of(json.loads(Path(path).read_text()), path)


def cost_of(doc: dict, path: Path | str = "bench JSON") -> CostModel:
    """load_cost over a parsed document (`path` names it in the error)."""
    for section in ("e2e", "split"):
        for entry in (doc.get(section) or {}).values():
            if isinstance(entry, dict) and isinstance(entry.get("cost_model"), dict):
                return CostModel(**entry["cost_model"])
    raise ValueError(f"{path}: no cost_model under e2e/<batch>/ or split/<batch>/ (run hstu bench with the planner)")


def _scaled_pairs(cost: CostModel, factor: float) -> CostModel:
    return cost if factor == 1.0 else dataclasses.replace(cost, per_pair_s=cost.per_pair_s * factor)


def _from_scratch(users: list[UserShape]) -> list[UserShape]:
    """The same users with nothing cached (the uncached side)."""
    return [dataclasses.replace(u, gpu_tokens=0, host_tokens=0) for u in users]


def _batch_s(users: list[UserShape], cost: CostModel, layers: int, buckets: tuple[int, ...] | None = None) -> float:
    """A batch's predicted seconds computing everything past each user's GPU-resident prefix."""
    return predict(users, [0] * len(users), cost, layers, buckets)[0]


def forward_bar(name: str, issue: int, target: float, cached: list[UserShape], layers: int,
                buckets: tuple[int, ...] | None, measured_key: tuple[str, str] | None = None) -> Bar:
    """A batch whose users' GPU-resident prefixes are `cached` (gpu_tokens), against the same users
    computed from scratch."""
    uncached = _from_scratch(cached)

    def times(cost: CostModel, pairs: float) -> tuple[float, float]:
        return _batch_s(cached, _scaled_pairs(cost, pairs), layers, buckets), _batch_s(uncached, cost, layers)

    return Bar(name, issue, target, times, measured_key)


def host_tier_bar(name: str, issue: int, target: float, users: list[UserShape], layers: int, chunk_tokens: int,
                  buckets: tuple[int, ...] | None, measured_key: tuple[str, str] | None = None) -> Bar:
    """A batch whose users' prefixes sit in the host tier, split as the planner chooses (auto)."""
    uncached = _from_scratch(users)

    def times(cost: CostModel, pairs: float) -> tuple[float, float]:
        plan, _ = choose_split(_scaled_pairs(cost, pairs), users, layers, chunk_tokens, buckets, "auto")
        return plan.predicted_s, _batch_s(uncached, cost, layers)

    return Bar(name, issue, target, times, measured_key)


def replay_batches(config: HSTUConfig, workload: WorkloadConfig, max_batch: int) -> list[list[UserShape]]:
    """The replay's batches as UserShapes, each user's GPU-resident prefix its previous history when
    the request extends (or repeats) it, else nothing (a new user or a restart)."""
    previous: dict[int, Any] = {}
    out = []
    for batch in distinct_user_batches(Workload(workload, config), max_batch):
        shapes = []
        for r in batch:
            prev = previous.get(r.user_id)
            resident = prev.history_tokens(config) if prev is not None and is_extension(prev, r) else 0
            shapes.append(UserShape(0, resident, r.history_tokens(config), int(r.candidates.shape[0])))
            previous[r.user_id] = r
        out.append(shapes)
    return out


def replay_bar(name: str, issue: int, target: float, batches: list[list[UserShape]], layers: int,
               buckets: tuple[int, ...] | None) -> Bar:
    """Requests/s of the cached replay over the uncached one: the sums of their batches' times."""
    plain = [_from_scratch(b) for b in batches]

    def times(cost: CostModel, pairs: float) -> tuple[float, float]:
        cached_cost = _scaled_pairs(cost, pairs)
        c = sum(_batch_s(b, cached_cost, layers, buckets) for b in batches)
        return c, sum(_batch_s(b, cost, layers) for b in plain)

    return Bar(name, issue, target, times)


def open_bars(shape: BenchShape = BenchShape(), replay_batch: int = 8, padded: bool = True) -> list[Bar]:
    """Issues 11 and 12's ratio bars at the bench shape and the seed replay; padded: the cached
    side's rows as the engine's graph buckets run them."""
    L, chunk = shape.num_layers, shape.chunk_tokens
    buckets = default_graph_buckets(host_split="auto") if padded else None
    n, cached, m = shape.history_tokens, shape.cached_tokens, shape.num_candidates
    resident = lambda b: [UserShape(0, cached, n, m)] * b  # noqa: E731
    bars = [
        forward_bar("b1 GPU-resident", 12, 3.0, resident(1), L, buckets, ("1", "speedup")),
        forward_bar("b8 GPU-resident", 12, 6.0, resident(8), L, buckets, ("8", "speedup")),
        forward_bar("b8 re-rank", 11, 10.0, [UserShape(0, n, n, m)] * 8, L, buckets, ("8", "speedup_rerank")),
        host_tier_bar("b1 host tier", 11, 1.2, [UserShape(cached, 0, n, m)], L, chunk, buckets,
                      ("1", "speedup_host_tier_planned")),
        host_tier_bar("b8 host tier", 11, 1.5, [UserShape(cached, 0, n, m)] * 8, L, chunk, buckets,
                      ("8", "speedup_host_tier_planned")),
    ]
    batches = replay_batches(shape.model_config(), WorkloadConfig(), replay_batch)
    bars.append(replay_bar("seed replay", 12, 3.0, batches, L, buckets))
    return bars


def needed_factor(ratio: Callable[[float], float], target: float, tolerance: float = 1e-4) -> float | None:
    """The largest factor k in [0, 1] on one cost with ratio(k) >= target (ratio falling as k
    grows): 1.0 when already met, None when not even k = 0 meets it."""
    if ratio(1.0) >= target:
        return 1.0
    if ratio(0.0) < target:
        return None
    lo, hi = 0.0, 1.0  # ratio(lo) >= target > ratio(hi)
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) >= target else (lo, mid)
    return lo


def measured(bar: Bar, bench: dict | None, replay: dict | None) -> float | None:
    """What the bar measured, from `hstu bench`'s JSON (e2e speedups) or, for the seed replay,
    `hstu replay`'s (requests/s cached over uncached); None where neither has it."""
    if bar.measured_key is not None:
        value = (bench.get("e2e") or {}).get(bar.measured_key[0], {}).get(bar.measured_key[1]) if bench else None
    else:
        value = (replay.get("speedup") or {}).get("speedup req/s (cached/uncached)") if replay else None
    return float(value) if isinstance(value, (int, float)) else None


def bounds(cost: CostModel, bars: list[Bar], bench: dict | None = None, replay: dict | None = None) -> list[dict[str, Any]]:
    """Per bar: what was measured (when the JSONs hold it), the predicted times and ratio, and the
    factor each cost would need (needed_factor)."""
    rows = []
    for bar in bars:
        cached, uncached = bar.times(cost, 1.0)
        on_forward = lambda k, bar=bar: bar.ratio(dataclasses.replace(cost, forward_s=cost.forward_s * k))  # noqa: E731
        rows.append({
            "bar": bar.name, "issue": bar.issue, "target": bar.target, "measured": measured(bar, bench, replay),
            "cached_ms": cached * 1e3, "uncached_ms": uncached * 1e3, "ratio": uncached / cached,
            "ceiling": on_forward(0.0),
            "forward_factor": needed_factor(on_forward, bar.target),
            "attention_factor": needed_factor(lambda k, bar=bar: bar.ratio(cost, k), bar.target),
        })
    return rows


def format_bounds(rows: list[dict[str, Any]], cost: CostModel) -> str:
    table = [["bar", "issue", "target", "measured", "cached ms", "uncached ms", "predicted", "ceiling", "forward_s x",
              "attention x"]]
    for r in rows:
        table.append([r["bar"], str(r["issue"]), f"{r['target']:g}x", fmt(r["measured"], ".2f"), fmt(r["cached_ms"], ".2f"),
                      fmt(r["uncached_ms"], ".2f"), f"{r['ratio']:.2f}x", f"{r['ceiling']:.2f}x",
                      fmt(r["forward_factor"], ".2f"), fmt(r["attention_factor"], ".2f")])
    head = (f"cost model: forward_s {cost.forward_s * 1e3:.3f} ms, per_row_s {cost.per_row_s:.3g}, "
            f"per_pair_s {cost.per_pair_s:.3g}, H2D {cost.h2d_bytes_per_s / 1e9:.1f} GB/s")
    return head + "\n" + format_table(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hstu.scripts.bar_bounds", description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", type=Path, help="a `hstu bench` JSON with a calibrated cost_model")
    p.add_argument("--replay-batch", type=int, default=8, help="the seed replay's max distinct users per batch")
    p.add_argument("--no-padding", action="store_true", help="the cached side's rows without graph-bucket padding")
    p.add_argument("--replay-json", type=Path, help="a `hstu replay` JSON: the seed replay's measured ratio")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = p.parse_args(argv)
    bench = json.loads(args.bench_json.read_text())
    replay = json.loads(args.replay_json.read_text()) if args.replay_json and args.replay_json.exists() else None
    cost = cost_of(bench, args.bench_json)
    rows = bounds(cost, open_bars(replay_batch=args.replay_batch, padded=not args.no_padding), bench, replay)
    print(format_bounds(rows, cost))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"cost_model": cost.as_dict(), "padded": not args.no_padding, "bars": rows}
        args.out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
