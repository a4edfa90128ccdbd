"""`hstu loadgen`: open-loop load against a running server, fit to measure the server, not itself.

Requests come from the synthetic workload (scripts/workload.py) for the server's own model (read
from GET /v2/models/hstu), pre-encoded as bodies before the clock starts (columnar form by
default). Request i is due at a Poisson arrival time for --rate requests/s; it is sent at that
time, or when the same user's previous request was answered (--order answered: a user's session
waits for its results) or sent (--order sent: only the arrival order is kept, the server's
batcher runs a user's requests in that order), over a pool of --connections keep-alive HTTP/1.1
connections (a minimal client on asyncio streams: no per-request client objects). --processes splits the users over several client
processes, each with its own loop and share of the rate. Reports achieved vs offered rate,
p50/p99 latency, answers by status, the server's mean batch size and the mean time of a request
in each server phase (read and parse, the pipes to and from an engine process, the batcher's
queue, rank, respond: from /metrics, this run's counter deltas), each answer's latency split into
the handler's own (its latency_ms) and the rest (HTTP both ways, event loops, the client), a short
table last and JSON under --out; --verify checks every answer against the no-cache model of the
server's config, built here (as `hstu replay --server --verify`). Loopback servers only.
--in-process 'SERVE FLAGS' runs the same requests, arrivals and order through a serving runtime in
this process built from those `hstu serve` flags (its batcher and engine, no HTTP, parsing or
pipes): the server's like-for-like reference for requests/s, p50 and mean batch under one load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np

logger = logging.getLogger(__name__)


def encode(request, form: str) -> bytes:
    """The POST /v1/rank body of one RankingRequest, in the "columns" or "events" form."""
    doc: dict[str, Any] = {"user_id": request.user_id, "candidates": request.candidates.tolist()}
    if form == "columns":
        doc.update(item_ids=request.item_ids.tolist(), actions=request.actions.tolist(), timestamps=request.timestamps.tolist())
    else:
        doc["history"] = [
            {"item_id": i, "action": a, "timestamp": t}
            for i, a, t in zip(request.item_ids.tolist(), request.actions.tolist(), request.timestamps.tolist())
        ]
    doc["contextual"] = request.contextual.tolist()
    return json.dumps(doc, separators=(",", ":")).encode()


class _Connection:
    """One keep-alive HTTP/1.1 connection: POST a body, read the status and the body."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes, sent: asyncio.Event | None = None) -> tuple[int, bytes]:
        """The status and body of one POST; `sent` is set once the request is written."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        await self.writer.drain()
        if sent is not None:
            sent.set()
        status_line = await self.reader.readline()
        length, close = 0, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
            elif name.lower() == "connection" and "close" in value.lower():
                close = True
        payload = await self.reader.readexactly(length)
        if close:
            self.writer.close()
            self.reader = self.writer = None
        return int(status_line.split(b" ", 2)[1]), payload


async def _schedule(users: list[int], due: list[float], order: str, send) -> dict:
    """Request i at due[i] seconds from the start, after the same user's previous request was
    answered or sent (`order`); `send(i, sent)` makes it, sets the asyncio.Event `sent` once it is
    out, and returns (status, answer or None)."""
    latencies, statuses, answers = [None] * len(users), {}, {}
    sent = [asyncio.Event() for _ in users]
    start = time.perf_counter()

    async def one(i: int, before: int | None) -> None:
        delay = start + due[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if before is not None:
            await (tasks[before] if order == "answered" else sent[before].wait())
        t0 = time.perf_counter()
        status, answer = await send(i, sent[i])
        sent[i].set()
        latencies[i] = (time.perf_counter() - t0) * 1e3
        statuses[status] = statuses.get(status, 0) + 1
        if answer is not None:
            answers[i] = answer

    last_of_user: dict[int, int] = {}
    tasks: list[asyncio.Future] = []
    for i, user in enumerate(users):
        tasks.append(asyncio.ensure_future(one(i, last_of_user.get(user))))
        last_of_user[user] = i
    await asyncio.gather(*tasks)
    return {"wall_s": time.perf_counter() - start, "latencies_ms": latencies, "statuses": statuses, "answers": answers}


async def _drive(
    url: str, bodies: list[tuple[int, bytes]], due: list[float], connections: int, timeout_s: float, order: str
) -> dict:
    parsed = urlparse(url)
    pool: asyncio.Queue = asyncio.Queue()
    for _ in range(connections):
        pool.put_nowait(_Connection(parsed.hostname, parsed.port or 80))

    async def send(i: int, sent: asyncio.Event) -> tuple[Any, bytes | None]:
        conn = await pool.get()
        answer = None
        try:
            status, payload = await asyncio.wait_for(conn.post("/v1/rank", bodies[i][1], sent), timeout_s)
            if status == 200:
                answer = payload
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            status = f"error:{type(exc).__name__}"
            conn = _Connection(parsed.hostname, parsed.port or 80)
        pool.put_nowait(conn)
        return status, answer

    return await _schedule([user for user, _ in bodies], due, order, send)


def _client(args: tuple) -> dict:
    return asyncio.run(_drive(*args))


_BATCH_SAMPLES = ("hstu_batch_size_count", "hstu_batch_size_sum", "hstu_batch_latency_seconds_sum")


# histogram (without _sum/_count) -> the name of its phase, "{}" standing for the phase="..." label it carries;
# batch phases are means per batch, the others per request
_PHASE_HISTOGRAMS = {
    "hstu_request_phase_seconds": "{}",
    "hstu_queue_wait_seconds": "engine_queue",
    "hstu_batch_phase_seconds": "batch_{}",
    "hstu_forward_phase_seconds": "forward_{}",
}


def _server_counters(url: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """_counters of the server's /metrics."""
    import httpx

    return _counters(httpx.get(f"{url}/metrics", timeout=10).text)


def _counters(text: str) -> tuple[dict[str, float], dict[tuple[str, str], float]]:
    """From a Prometheus exposition, every replica's samples added up: the batch counters (batches,
    requests batched, model seconds), and each phase's seconds and count (_PHASE_HISTOGRAMS)."""
    from prometheus_client.parser import text_string_to_metric_families

    batch = dict.fromkeys(_BATCH_SAMPLES, 0.0)
    phases: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            histogram, _, part = s.name.rpartition("_")
            if s.name in batch:  # summed over labels: an engine process or Ray replicas add replica="..."
                batch[s.name] += s.value
            elif histogram in _PHASE_HISTOGRAMS and part in ("sum", "count", "bucket"):
                if part == "bucket":  # cumulative count at or under the edge s.labels["le"]
                    part = f"le={s.labels['le']}"
                key = (_PHASE_HISTOGRAMS[histogram].format(s.labels.get("phase")), part)
                phases[key] = phases.get(key, 0.0) + s.value
    return batch, phases


def _phase_means_ms(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, float]:
    """Mean milliseconds of each phase over a run (counter deltas): per request, or per batch for
    the batch_* and forward_* phases."""
    means = {}
    for phase in sorted({phase for phase, _ in after}):
        count = after.get((phase, "count"), 0.0) - before.get((phase, "count"), 0.0)
        if count > 0:
            means[phase] = 1e3 * (after.get((phase, "sum"), 0.0) - before.get((phase, "sum"), 0.0)) / count
    return means


def _phase_quantiles_ms(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], q: float
) -> dict[str, float]:
    """Each phase's q-quantile (ms) over a run, from its histogram's bucket deltas, interpolated
    within the bucket as Prometheus' histogram_quantile does: whether a phase's mean is its typical
    request's wait or a few long ones'. Past the last finite edge: that edge."""
    out = {}
    for phase in sorted({phase for phase, _ in after}):
        edges = sorted(
            (float(part[3:]), after[(phase, part)] - before.get((phase, part), 0.0))
            for p, part in after if p == phase and part.startswith("le=")
        )
        total = edges[-1][1] if edges else 0.0
        if total <= 0:
            continue
        rank, lower, below = q * total, 0.0, 0.0
        for edge, cumulative in edges:
            if cumulative >= rank:
                if edge == float("inf"):
                    out[phase] = 1e3 * lower
                else:
                    share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
                    out[phase] = 1e3 * (lower + (edge - lower) * share)
                break
            lower, below = edge, cumulative
    return out


def _due(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) of n requests at `rate` (0: all at once)."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n) if rate > 0 else np.zeros(n)
    return np.cumsum(gaps).tolist()


def run(
    url: str,
    requests: list,
    rate: float,
    connections: int,
    processes: int,
    form: str,
    timeout_s: float,
    seed: int,
    order: str = "answered",
) -> dict:
    """Send every request open-loop at `rate`; the report (see the module docstring)."""
    bodies = [(r.user_id, encode(r, form)) for r in requests]
    due = _due(len(bodies), rate, seed)
    shares = [[i for i, (u, _) in enumerate(bodies) if u % processes == p] for p in range(processes)]
    jobs = [(url, [bodies[i] for i in s], [due[i] for i in s], max(1, connections // processes), timeout_s, order) for s in shares]
    before = _server_counters(url)
    if processes == 1:
        results = [_client(jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = pool.map(_client, jobs)
    after = _server_counters(url)
    doc = _report(results, shares, before, after, rate, order)
    doc.update(form=form, connections=connections, processes=processes)
    return doc


def run_in_process(settings, requests: list, rate: float, timeout_s: float, seed: int, order: str = "answered") -> dict:
    """The same requests, arrivals and order, submitted to a serving runtime in this process
    (`settings`: the server's, its engine in this process): the server's batcher and engine
    without HTTP, parsing or pipes, for a like-for-like reference (issue 18: requests/s, p50, mean
    batch of the server against its own core under the same load). Answers are RankOutputs."""
    return asyncio.run(_in_process(settings, requests, _due(len(requests), rate, seed), timeout_s, order, rate))


async def _in_process(settings, requests: list, due: list[float], timeout_s: float, order: str, rate: float) -> dict:
    from hstu.serving.errors import RankError
    from hstu.serving.runtime import ServingRuntime

    runtime = ServingRuntime.standalone(settings)
    await runtime.start()
    try:
        if not runtime.ready:
            raise RuntimeError(f"the in-process runtime did not start: {runtime.detail}")

        async def send(i: int, sent: asyncio.Event) -> tuple[Any, Any]:
            sent.set()  # submit() queues it before its first await: the user's next one queues after it
            try:
                return 200, await runtime.submit(requests[i], time.monotonic() + timeout_s)
            except RankError as exc:
                return exc.status, None

        before = _counters((await runtime.exposition()).decode())
        result = await _schedule([r.user_id for r in requests], due, order, send)
        after = _counters((await runtime.exposition()).decode())
    finally:
        await runtime.close()
    doc = _report([result], [list(range(len(requests)))], before, after, rate, order)
    doc.update(form="in-process", connections=None, processes=1)
    return doc


def _report(results: list[dict], shares: list[list[int]], before, after, rate: float, order: str) -> dict:
    """The run's figures from each client's result (their requests' indices in `shares`) and the
    server's counters before and after."""
    (batch_before, phases_before), (batch_after, phases_after) = before, after
    latencies = np.asarray([x for r in results for x in r["latencies_ms"]], dtype=np.float64)
    statuses: dict[str, int] = {}
    for r in results:
        for k, v in r["statuses"].items():
            statuses[str(k)] = statuses.get(str(k), 0) + v
    wall = max(r["wall_s"] for r in results)
    answers = {share[i]: payload for share, r in zip(shares, results) for i, payload in r["answers"].items()}
    batches, batched, model_s = (batch_after[k] - batch_before[k] for k in _BATCH_SAMPLES)
    n = len(latencies)
    handler, outside = _handler_split(results)
    return {
        "requests": n,
        "order": order,
        "offered_rate": rate,
        "achieved_rate": n / wall if wall > 0 else float("nan"),
        "ok_rate": statuses.get("200", 0) / wall if wall > 0 else float("nan"),
        "latency_p50_ms": float(np.percentile(latencies, 50)),
        "latency_p99_ms": float(np.percentile(latencies, 99)),
        "statuses": statuses,
        "mean_batch_size": batched / batches if batches else float("nan"),
        "mean_batch_model_ms": 1e3 * model_s / batches if batches else float("nan"),
        "model_busy_share": model_s / wall if wall > 0 else float("nan"),
        "phase_mean_ms": _phase_means_ms(phases_before, phases_after),
        "phase_p50_ms": _phase_quantiles_ms(phases_before, phases_after, 0.5),
        "phase_p90_ms": _phase_quantiles_ms(phases_before, phases_after, 0.9),
        # each 200 answer's own latency_ms (the handler, from its first line to the body encoded) and
        # the rest of what the client measured (HTTP both ways, the event loops' queues, the client)
        "handler_p50_ms": _percentile(handler, 50),
        "outside_handler_p50_ms": _percentile(outside, 50),
        "outside_handler_p99_ms": _percentile(outside, 99),
        "wall_s": wall,
        "answers": answers,  # request index -> 200 body (bytes; RankOutput in process); main() checks them with --verify
    }


_LATENCY_FIELD = re.compile(rb'"latency_ms":(-?[0-9][0-9.eE+-]*)')


def _handler_split(results: list[dict]) -> tuple[list[float], list[float]]:
    """(the server's own latency_ms, the client's latency less it) of every answer that is a 200
    body (bytes) naming its latency_ms; empty in process (answers are RankOutputs: no handler)."""
    handler, outside = [], []
    for r in results:
        for i, payload in r["answers"].items():
            found = _LATENCY_FIELD.search(payload) if isinstance(payload, bytes) else None
            if found is not None:
                handler.append(float(found.group(1)))
                outside.append(r["latencies_ms"][i] - handler[-1])
    return handler, outside


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def in_process_settings(flags: str):
    """ServerSettings of `hstu serve FLAGS` (no config file or environment), with the engine in
    this process and one front end: what an in-process run measures is the batcher and the engine."""
    import dataclasses
    import shlex

    from hstu.serving.cli import add_parser as add_serve_parser
    from hstu.serving.cli import settings_from_args

    parser = argparse.ArgumentParser(prog="hstu")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    settings = settings_from_args(parser.parse_args(["serve", *shlex.split(flags)]), env={})
    return dataclasses.replace(settings, engine_process=False, model_on_loop=False, front_ends=1, parse_processes=0)


def main(args: argparse.Namespace) -> int:
    from hstu.model.config import HSTUConfig
    from hstu.scripts.replay_server import check_loopback, fetch_server_model
    from hstu.scripts.workload import Workload, WorkloadConfig

    in_process = getattr(args, "in_process", None)
    if (args.server is None) == (in_process is None):
        raise SystemExit("hstu loadgen: give either --server URL or --in-process 'SERVE FLAGS'")
    if in_process is not None:
        if args.verify:
            raise SystemExit("hstu loadgen: --verify checks a server's answers; it needs --server")
        settings = in_process_settings(in_process)
        model = settings.resolve_model_config()
        from hstu.serving.schemas import RequestLimits

        max_candidates = RequestLimits.for_model(model, settings.max_candidates, settings.max_body_bytes).max_candidates
    else:
        check_loopback(args.server)
        meta = fetch_server_model(args.server)
        model = HSTUConfig(**meta["config"])
        max_candidates = meta["limits"]["max_candidates"]
    limit = min(4096, model.max_seq_len - 1) - model.num_contextual  # history tokens past the contextual ones
    even = lambda n: max(2, n // 2 * 2)  # noqa: E731
    if args.workload == "replay":  # the requests `hstu replay` sends (its default workload)
        work = WorkloadConfig(num_requests=args.requests, num_users=args.users, seed=args.seed, first_user=args.first_user)
    else:
        work = WorkloadConfig(
            num_requests=args.requests,
            num_users=args.users,
            seed=args.seed,
            first_user=args.first_user,
            new_tokens=(2, even(min(256, limit // 8))),
            initial_tokens=(8, even(min(2048, limit // 2))),
            candidates=(16, min(256, max_candidates)),
        )
    requests = list(Workload(work, model))
    reference = None
    if args.verify:  # built first: a server whose weights this client cannot build is refused before any load
        import torch

        from hstu.scripts.replay_server import server_reference

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        reference = server_reference(meta, args.server, torch.device(device))
    if in_process is not None:
        doc = run_in_process(settings, requests, args.rate, args.timeout_s, args.seed, args.order)
    else:
        doc = run(args.server, requests, args.rate, args.connections, args.processes, args.form, args.timeout_s,
                  args.seed, args.order)
    answers = doc.pop("answers")
    if reference is not None:
        from hstu.client import rank_result
        from hstu.scripts.replay_server import verify_answers

        checked = [(requests[i], rank_result(json.loads(body))) for i, body in sorted(answers.items())]
        doc["verify_mismatches"], doc["verify_max_abs_diff"] = verify_answers(reference, checked, meta["task_names"])
        doc["verified"] = len(checked)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loadgen.json").write_text(json.dumps(doc, indent=1))
    print(f"offered {doc['offered_rate']:.0f} req/s  achieved {doc['achieved_rate']:.1f} req/s  "
          f"(200s {doc['ok_rate']:.1f}/s)  p50 {doc['latency_p50_ms']:.1f} ms  p99 {doc['latency_p99_ms']:.1f} ms  "
          f"mean batch {doc['mean_batch_size']:.2f} ({doc['mean_batch_model_ms']:.1f} ms from start to outputs, summing "
          f"to {doc['model_busy_share']:.0%} of the wall)  statuses {doc['statuses']}")
    if doc["handler_p50_ms"] == doc["handler_p50_ms"]:  # not NaN: answers over HTTP
        print(f"per answer: the handler's own latency_ms p50 {doc['handler_p50_ms']:.2f} ms; the rest of the client's "
              f"latency (HTTP, event loops, client) p50 {doc['outside_handler_p50_ms']:.2f} ms, "
              f"p99 {doc['outside_handler_p99_ms']:.2f} ms")
    if doc["phase_mean_ms"]:
        means = ", ".join(f"{k} {v:.2f}" for k, v in doc["phase_mean_ms"].items())
        print(f"server phases, mean ms per request (batch_*, forward_*: per batch): {means}")
        quantiles = ", ".join(f"{k} {v:.2f}/{doc['phase_p90_ms'][k]:.2f}" for k, v in doc["phase_p50_ms"].items())
        print(f"server phases, p50/p90 ms from the histograms' buckets: {quantiles}")
    if reference is not None:
        print(f"verified {doc['verified']} answers against the no-cache model: {doc['verify_mismatches']} mismatches "
              f"(max abs logit diff {doc['verify_max_abs_diff']:.3g})")
    return 0 if set(doc["statuses"]) <= {"200"} and not doc.get("verify_mismatches") else 1


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("loadgen", help="open-loop load against a running server", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default=None, help="base URL of a loopback server, e.g. http://127.0.0.1:8000")
    p.add_argument("--in-process", default=None, metavar="'SERVE FLAGS'",
                   help="instead of a server: a serving runtime in this process built from these `hstu serve` flags "
                   "(its engine here: no HTTP, parsing or pipes), the same requests and arrivals; the server's "
                   "like-for-like reference")
    p.add_argument("--rate", type=float, default=1000.0, help="offered requests/s (0: all at once)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--form", choices=["columns", "events"], default="columns")
    p.add_argument("--order", choices=["answered", "sent"], default="answered",
                   help="a user's next request waits for the previous one's answer, or only for it to be sent")
    p.add_argument("--workload", choices=["fit", "replay"], default="fit",
                   help="fit: sessions sized to the server's limits; replay: the requests `hstu replay` sends")
    p.add_argument("--verify", action="store_true",
                   help="check every 200 answer against the no-cache model of the server's config (built locally)")
    p.add_argument("--device", default=None, help="device of the --verify reference model (default cuda if available)")
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first-user", type=int, default=0,
                   help="user ids start here: runs against one server with their own users do not invalidate each other's")
    p.add_argument("--out", type=Path, default=Path("out/loadgen"))
    p.set_defaults(func=main)
    return p
