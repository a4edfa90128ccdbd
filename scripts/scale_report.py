"""Issue 17's report: the same load against the Ray Serve app with 1 and then N ranking replicas.

    python -m hstu.scripts.scale_report OUT/replicas_1 OUT/replicas_2 [--out OUT/scale.json]

Each directory is one `scripts/gpu_rest.sh` run (scripts/gpu_scale.sh makes them): its sent load's
loadgen/loadgen.json (requests/s, p50/p99, mean batch, verified answers and mismatches) and the
server's /metrics at the end (metrics_end.txt). From the metrics it reads each ranking replica's
cache lookups (hstu_cache_lookups_total, labelled replica=<name> by the ingress's merge: GPU, host
and any-tier hit rates per replica) and the router's decisions (hstu_router_decisions_total: the
affinity share). The router counts in each ingress process and a scrape reaches one ingress, so
with several ingress replicas the affinity share is that ingress's sample of the traffic (the
report says how many requests it saw). Prints one table and the scaling ratio (requests/s of the
last run over the first's), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hstu.scripts import report

LOAD = "loadgen_sent"  # the sent load of gpu_rest.sh: every answer verified
_RESULTS = ("gpu_hit", "host_hit", "miss")


def server_figures(metrics_text: str) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """From one /metrics text, in one pass: {ranking replica: {lookups, gpu, host, any}} (each
    replica's cache lookups and the share that hit each tier) and {decision: routed requests} of
    the ingress that answered the scrape (empty without a router)."""
    from prometheus_client.parser import text_string_to_metric_families

    from hstu.serving.metrics import REPLICA_LABEL

    counts: dict[str, dict[str, float]] = {}
    decisions: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "hstu_cache_lookups_total" and labels.get("result") in _RESULTS:
                replica = labels.get(REPLICA_LABEL, "")
                counts.setdefault(replica, dict.fromkeys(_RESULTS, 0.0))[labels["result"]] += sample.value
            elif sample.name == "hstu_router_decisions_total" and "decision" in labels:
                decisions[labels["decision"]] = decisions.get(labels["decision"], 0.0) + sample.value
    replicas = {}
    for replica, c in sorted(counts.items()):
        lookups = sum(c.values())
        share = [hits / lookups if lookups else 0.0 for hits in (c["gpu_hit"], c["host_hit"], c["gpu_hit"] + c["host_hit"])]
        replicas[replica] = {"lookups": lookups, **dict(zip(("gpu", "host", "any"), share))}
    return replicas, decisions


def run_summary(run: Path) -> dict[str, Any]:
    """One run's figures: its sent load's and its server's, as the report shows them."""
    load = json.loads((run / LOAD / "loadgen.json").read_text())
    metrics = (run / "metrics_end.txt").read_text() if (run / "metrics_end.txt").exists() else ""
    replicas, decisions = server_figures(metrics)
    routed = sum(decisions.values())
    return {
        "run": run.name,
        "requests_per_s": load["achieved_rate"],
        "offered_per_s": load["offered_rate"],
        "p50_ms": load["latency_p50_ms"],
        "p99_ms": load["latency_p99_ms"],
        "mean_batch": load["mean_batch_size"],
        "statuses": load["statuses"],
        "verified": load.get("verified"),
        "verify_mismatches": load.get("verify_mismatches"),
        "replicas": replicas,
        "router_decisions": decisions,
        "affinity_share": decisions.get("affinity", 0.0) / routed if routed else None,
    }


def scale_report(runs: list[Path]) -> dict[str, Any]:
    """Every run's summary and the scaling ratio of the last run's requests/s over the first's."""
    summaries = [run_summary(r) for r in runs]
    first, last = summaries[0]["requests_per_s"], summaries[-1]["requests_per_s"]
    return {"runs": summaries, "scaling": last / first if first else None}


def format_report(doc: dict[str, Any]) -> str:
    rows = [["run", "req/s", "p50 ms", "p99 ms", "mean batch", "verified (mismatches)", "affinity share",
             "per replica: lookups, GPU / any hit rate"]]
    for s in doc["runs"]:
        per_replica = "; ".join(
            f"{name or '-'}: {r['lookups']:.0f}, {r['gpu']:.3f} / {r['any']:.3f}" for name, r in s["replicas"].items()
        )
        share = s["affinity_share"]
        routed = sum(s["router_decisions"].values())
        rows.append([
            s["run"], report.fmt(s["requests_per_s"], ",.0f"), report.fmt(s["p50_ms"], ".1f"), report.fmt(s["p99_ms"], ".1f"),
            report.fmt(s["mean_batch"], ".2f"), f"{s['verified']} ({s['verify_mismatches']})",
            "-" if share is None else f"{share:.3f} of {routed:,.0f}", per_replica or "-",
        ])
    scaling = doc["scaling"]
    return report.format_table(rows) + f"\nscaling (last / first requests/s): {'-' if scaling is None else f'{scaling:.2f}x'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path, nargs="+", help="gpu_rest.sh output directories, the fewest replicas first")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default: scale.json beside the first run)")
    args = p.parse_args(argv)
    doc = scale_report(args.runs)
    out = args.out or args.runs[0].parent / "scale.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(format_report(doc))
    return 0 if all(s["verify_mismatches"] == 0 and set(s["statuses"]) <= {"200"} for s in doc["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
