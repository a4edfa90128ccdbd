"""Parse time of one POST /v1/rank body: the fast parser (orjson + array checks) against the
pydantic model it replaces, for both body forms, at the embedded model's limits; and an
incremental body (one new event after the held --events - 1, serving/incremental.py) parsed and
rebuilt into the full history with its digest, against the full columns body parsed and digested.

    python -m hstu.scripts.bench_parse --events 4000 --out out/bench_parse.json

Median of --repeats parses of one pre-encoded body each, on this core (perf_counter); prints a
short table and writes JSON. Not a timed test: CI runs it at a tiny size for the numbers only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from hstu.model.config import HSTUConfig
from hstu.serving.history_store import HistoryStore
from hstu.serving.incremental import IncrementalHistories
from hstu.serving.metrics import ServingMetrics
from hstu.serving.parsing import RankBodyParser
from hstu.serving.schemas import RequestLimits, build_rank_columns_model, build_rank_request_model


def bodies(config: HSTUConfig, events: int, candidates: int, seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    items = rng.integers(0, config.num_items, events).tolist()
    actions = rng.integers(0, config.num_actions, events).tolist()
    stamps = np.cumsum(rng.integers(0, 600, events)).tolist()
    cands = rng.integers(0, config.num_items, candidates).tolist()
    history = [{"item_id": i, "action": a, "timestamp": t} for i, a, t in zip(items, actions, stamps)]
    events_body = {"user_id": 7, "history": history, "candidates": cands, "request_id": "bench"}
    columns_body = {"user_id": 7, "item_ids": items, "actions": actions, "timestamps": stamps, "candidates": cands}
    return {"events": json.dumps(events_body).encode(), "columns": json.dumps(columns_body).encode()}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(events: int, candidates: int, repeats: int) -> dict:
    config = HSTUConfig(max_seq_len=max(4096, 2 * events + 8))
    limits = RequestLimits.for_model(config, max(candidates, 1024))
    events_model, columns_model = build_rank_request_model(limits), build_rank_columns_model(limits)
    parser = RankBodyParser(limits, config, events_model, columns_model)
    out = {"events": events, "candidates": candidates, "repeats": repeats, "forms": {}}
    for form, raw in bodies(config, events, candidates).items():
        model = events_model if form == "events" else columns_model
        out["forms"][form] = {
            "body_bytes": len(raw),
            "fast_ms": _median_ms(lambda: parser(raw), repeats),
            "pydantic_ms": _median_ms(lambda: model.model_validate_json(raw), repeats),
        }
    out["incremental"] = _incremental(config, parser, json.loads(bodies(config, events, candidates)["columns"]), repeats)
    return out


def _incremental(config: HSTUConfig, parser: RankBodyParser, full: dict, repeats: int) -> dict:
    """ms to parse + rebuild an incremental body of one new event, and to parse + digest the full one."""
    model_id = b"bench-model"
    held = {**full, **{k: full[k][:-1] for k in ("item_ids", "actions", "timestamps")}}
    request = parser(json.dumps(held).encode()).request
    histories = IncrementalHistories(HistoryStore(1 << 30), config, ServingMetrics(1))
    digest = request.identity(model_id).prefix(request.history_tokens(config))
    histories.remember(request, model_id)
    prefix = {"prefix_length": request.num_events, "prefix_digest": digest.hex()}
    raw = json.dumps({**full, **{k: full[k][-1:] for k in ("item_ids", "actions", "timestamps")}, **prefix}).encode()
    full_raw = json.dumps(full).encode()

    def parse_and_digest() -> bytes:
        r = parser(full_raw).request
        return r.identity(model_id).prefix(r.history_tokens(config))

    return {
        "body_bytes": len(raw),
        "full_body_bytes": len(full_raw),
        "incremental_ms": _median_ms(lambda: histories.rebuild(parser(raw), model_id), repeats),
        "full_ms": _median_ms(parse_and_digest, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=4000)
    p.add_argument("--candidates", type=int, default=256)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("out/bench_parse.json"))
    args = p.parse_args(argv)
    doc = run(args.events, args.candidates, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"{'form':8} {'body KB':>8} {'fast ms':>8} {'pydantic ms':>12} {'speedup':>8}")
    for form, r in doc["forms"].items():
        print(f"{form:8} {r['body_bytes'] / 1024:8.0f} {r['fast_ms']:8.2f} {r['pydantic_ms']:12.2f} "
              f"{r['pydantic_ms'] / r['fast_ms']:7.1f}x")
    inc = doc["incremental"]
    print(f"{'incr.':8} {inc['body_bytes'] / 1024:8.0f} {inc['incremental_ms']:8.2f} {'':12} "
          f"{inc['full_ms'] / inc['incremental_ms']:7.1f}x  (vs the full columns body parsed + digested: {inc['full_ms']:.2f} ms)")
    print(f"{args.events} events, {args.candidates} candidates, median of {args.repeats}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
