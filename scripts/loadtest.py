"""CI-sized server load test: the ranking app under uvicorn on loopback, a bounded request count.

`local_server(settings)` starts hstu.serving.app.create_app(settings) with uvicorn on 127.0.0.1
(a free port, a socket bound before the server starts so there is no port race) in a background
thread and yields its URL once /v2/health/ready answers 200; leaving the block shuts it down.
`run_load_test()` sends a workload (scripts/workload.py) with bounded concurrency through
replay_server.run_server and reports QPS, p50/p99 latency, errors, history conflicts and the server's
cache counters. The defaults (tiny model, 100 requests, 8 concurrent, no history restarts) run on
CPU in seconds: `python -m hstu.scripts.loadtest`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterator

from hstu.model.config import HSTUConfig
from hstu.scripts.replay_passes import format_table
from hstu.scripts.replay_server import run_server
from hstu.scripts.workload import Workload, WorkloadConfig, count_restarts

logger = logging.getLogger(__name__)

TINY_MODEL = HSTUConfig(
    num_items=1_000,
    num_contextual=2,
    num_contextual_features=100,
    embedding_dim=32,
    num_layers=2,
    num_heads=2,
    head_dim_qk=16,
    head_dim_v=16,
    max_seq_len=512,
    mlp_hidden=32,
    dtype="float32",
)

LOAD_WORKLOAD = WorkloadConfig(
    num_requests=100,
    num_users=32,
    new_tokens=(8, 24),
    initial_tokens=(8, 64),
    max_history_tokens=511,
    candidates=(8, 32),
    seed=0,
)
"""Histories stay far below the limit over 100 requests, so no user restarts (no 409s)."""


def tiny_server_settings(model: HSTUConfig = TINY_MODEL, **overrides):
    """ServerSettings for the tiny model on CPU with a small two-tier cache."""
    from hstu.serving.settings import ServerSettings

    base = dict(
        model_config=model,
        device="cpu",
        page_size=16,
        num_pages=512,
        chunk_tokens=32,
        host_cache_bytes=16 << 20,
        max_batch_size=8,
        max_wait_ms=2.0,
    )
    base.update(overrides)
    return ServerSettings(**base)


def wait_until_ready(
    url: str, alive: Callable[[], bool], timeout_s: float, log: Callable[[], str] | None = None
) -> None:
    """Poll {url}/v2/health/ready until 200; RuntimeError when `alive()` turns false (the server's
    thread or process ended) or the server reports a failed load, TimeoutError after `timeout_s`.
    log(): what the server printed, appended to those errors (a process's output says why it exited)."""
    import httpx

    def printed() -> str:
        return f"\n{log()}" if log is not None else ""

    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server exited before {url} was ready ({last}){printed()}")
        try:
            response = httpx.get(f"{url}/v2/health/ready", timeout=2.0)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text}"
            if '"failed"' in response.text:
                raise RuntimeError(f"server at {url} failed to load: {last}{printed()}")
        except httpx.HTTPError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"server at {url} not ready after {timeout_s:.0f}s ({last}){printed()}")


@contextlib.contextmanager
def local_server(settings=None, ready_timeout_s: float = 120.0) -> Iterator[str]:
    """Serve create_app(settings) on 127.0.0.1 (free port) in a thread; yields the base URL."""
    import uvicorn

    from hstu.serving.app import create_app

    app = create_app(settings if settings is not None else tiny_server_settings())
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="hstu-loadtest-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, thread.is_alive, ready_timeout_s)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()
        if thread.is_alive():
            logger.warning("server thread did not stop within 60s")


def run_load_test(
    workload: WorkloadConfig = LOAD_WORKLOAD, concurrency: int = 8, settings=None, progress: bool = False
) -> dict[str, Any]:
    """Start a local server, send the workload `concurrency` at a time; summary dict (qps, p99, ...)."""
    settings = settings if settings is not None else tiny_server_settings()
    model = settings.resolve_model_config()
    requests = list(Workload(workload, model))
    with local_server(settings) as url:
        result = run_server(url, requests, model, concurrency, progress=progress)
    summary = result.summary()
    summary.update(
        qps=summary["requests_per_s"],
        sent=len(requests),
        concurrency=concurrency,
        workload_restarts=count_restarts(requests),
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=LOAD_WORKLOAD.num_requests)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    workload = WorkloadConfig(**{**LOAD_WORKLOAD.__dict__, "num_requests": args.requests})
    summary = run_load_test(workload, args.concurrency, progress=True)
    print(format_table({"server": summary}, None))
    return 1 if summary["errors"] or summary.get("history_conflicts") else 0


if __name__ == "__main__":
    raise SystemExit(main())
