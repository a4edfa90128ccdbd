"""The engine process's own work per request, the forward left out: issue 18's limit on a GPU.

    python -m hstu.scripts.bench_engine_process [--requests 3000] [--modes thread loop] [--out F]

Why: with two front ends on the H200 the engine process was the limit (busy 105-108%, its model
thread 3.75-4.85 ms a batch against 1.75 ms in process: seventeenth session), and on a CPU the
model's forward hides everything else. Here the engine process (serving/engine_process.py, a
narrow CPU model) runs with RankingEngine._forward replaced by zeros, so what it spends is its own
work: reading and unpickling requests from two front-end pipes, the batcher, the cache's plan and
finish, pickling and writing the answers. This process plays both front ends: it sends
pre-built, validated and hashed requests (as a front end does) over the two pipes, at most
--window in flight, and counts the answers. Each mode runs in its own engine process: `thread`
(the model thread and pipe reader threads of `--engine-process`) and `loop` (`--model-on-loop`).
Reports requests/s and the engine process's CPU ms per request (all its threads; /proc), and
writes JSON. A dev-machine benchmark of the host work; ratios between modes in one run only.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import numpy as np

from hstu.model.batch import RankingRequest
from hstu.model.config import HSTUConfig

# Narrow (no kernel time to speak of), long histories (the seed workload's request sizes).
CONFIG = HSTUConfig(embedding_dim=32, num_layers=2, num_heads=2, head_dim_qk=16, head_dim_v=16, mlp_hidden=32)
_USERS = 64
_FRONT_ENDS = 2


def _stubbed_engine_main(conns, settings, log_level: int) -> None:
    """engine_main with the forward replaced by zeros (the plan is still waited for and finished)."""
    import torch

    from hstu.engine import engine as engine_module
    from hstu.serving.engine_process import engine_main

    def zeros_forward(self, requests, plan, timing, owned=True):
        self.cache.wait(plan)
        return torch.zeros(plan.layout.num_candidate_rows, len(self.task_names))

    engine_module.RankingEngine._forward = zeros_forward
    engine_main(conns, settings, log_level)


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _requests(n: int, model_id: bytes) -> list[RankingRequest]:
    """n requests over _USERS users, each extending its previous history by 4 events (about
    1,000-1,800 events each), validated and hashed as a front end sends them."""
    rng = np.random.default_rng(0)
    items, actions = rng.integers(0, 1000, 2000), rng.integers(0, CONFIG.num_actions, 2000)
    stamps, candidates = np.cumsum(rng.integers(1, 60, 2000)), rng.integers(0, 1000, 256)
    out = []
    for i in range(n):
        user = i % _USERS
        events = min(1000 + 10 * user + 4 * (i // _USERS), 1800)
        r = RankingRequest.create(user, items[:events], actions[:events], stamps[:events], candidates, config=CONFIG)
        r.identity(model_id).prefix(r.history_tokens(CONFIG))
        out.append(r)
    return out


def run_mode(model_on_loop: bool, requests: list[RankingRequest], window: int = 32) -> dict:
    """Requests/s and engine CPU ms per request through one engine process in this mode."""
    from hstu.serving.settings import ServerSettings

    settings = ServerSettings(
        model_config=CONFIG, num_pages=_USERS * 130, host_cache_bytes=0, engine_process=True, model_on_loop=model_on_loop
    )
    ctx = multiprocessing.get_context("spawn")
    fronts, engine_ends = zip(*[ctx.Pipe() for _ in range(_FRONT_ENDS)])
    process = ctx.Process(target=_stubbed_engine_main, args=(list(engine_ends), settings, 30), daemon=True)
    process.start()
    for end in engine_ends:
        end.close()
    try:
        for conn in fronts:
            first = conn.recv()
            if first[0] != "ready":
                raise RuntimeError(f"the engine process did not start: {first}")
        n, answered, errors = len(requests), [0], []
        lock, slots = threading.Lock(), threading.Semaphore(window)

        def read(conn) -> None:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                for m in message[1] if message[0] == "_many" else [message]:
                    if m[0] != "done":
                        continue
                    if isinstance(m[2], Exception):
                        errors.append(repr(m[2]))
                    with lock:
                        answered[0] += 1
                    slots.release()

        readers = [threading.Thread(target=read, args=(c,), daemon=True) for c in fronts]
        for t in readers:
            t.start()
        cpu0, t0 = _cpu_seconds(process.pid), time.perf_counter()
        for i, r in enumerate(requests):
            slots.acquire()
            now = time.monotonic()  # the engine process's rank message: request, seconds left, sent at, arrived
            fronts[i % _FRONT_ENDS].send(("rank", i, r, 60.0, now, now))
        while answered[0] < n:
            time.sleep(0.001)
        wall, cpu = time.perf_counter() - t0, _cpu_seconds(process.pid) - cpu0
    finally:
        for conn in fronts:
            try:
                conn.send(("close",))
            except OSError:
                pass
        process.join(30)
        if process.is_alive():
            process.terminate()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    return {"requests_per_s": n / wall, "engine_cpu_ms_per_request": cpu / n * 1e3}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--modes", nargs="+", choices=("thread", "loop"), default=["thread", "loop"])
    p.add_argument("--out", type=Path, default=Path("out/bench_engine_process.json"))
    args = p.parse_args(argv)
    from hstu.model.ranking import InferenceRankingGR

    requests = _requests(args.requests, InferenceRankingGR(CONFIG).identity)  # the engine's model: same seed
    doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "requests": args.requests, "modes": {}}
    for mode in args.modes:
        doc["modes"][mode] = r = run_mode(mode == "loop", requests)
        print(f"{mode}: {r['requests_per_s']:.0f} requests/s, engine CPU {r['engine_cpu_ms_per_request']:.3f} ms a request")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
