"""`hstu serve --replicas 1 --direct-ingress --engine-process` (Ray Serve's direct ingress: the
ingress replica serves HTTP on --port itself; the ranking replica runs its engine in a child
process): it ranks a few users' growing histories over its own port, every answer equal to the
no-cache model's, with cache hits; on a cluster named by RAY_ADDRESS it refuses with exit status
2. Its own local Ray cluster, in a child process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

pytest.importorskip("ray.serve")

from hstu.scripts.loadtest import wait_until_ready  # noqa: E402
from tests.serving.conftest import TINY, Timeline  # noqa: E402
from tests.serving.test_ray_app import assert_all_match, post_all  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(tmp_path, port: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    config = tmp_path / "model.json"
    config.write_text(json.dumps(TINY.to_dict()))
    argv = [sys.executable, "-m", "hstu.cli", "serve", "--device", "cpu", "--config", str(config), "--host", "127.0.0.1",
            "--port", str(port), "--num-pages", "512", "--page-size", "8", "--chunk-tokens", "16",
            "--task-names", "click,like,share", "--replicas", "1", "--direct-ingress", "--engine-process"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


@pytest.mark.timeout(300)
def test_direct_ingress_and_engine_process_replica_match_the_no_cache_model(tmp_path, reference):
    port = _free_port()
    server = _serve(tmp_path, port)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base, lambda: server.poll() is None, timeout_s=240)
        timelines = [Timeline(30_000 + u) for u in range(4)]
        payloads = [t.payload(6 + 3 * step, num_candidates=3) for step in range(3) for t in timelines]
        responses = asyncio.run(post_all(base, payloads))
    finally:
        server.send_signal(signal.SIGINT)
        try:
            output = server.communicate(timeout=90)[0]
        except subprocess.TimeoutExpired:
            server.kill()
            output = server.communicate()[0]
    assert_all_match(reference, payloads, responses)
    assert all(r.json()["cached_tokens"] > 0 for r in responses[4:]), output[-3000:]  # the proxy is on another port


def test_direct_ingress_refuses_a_cluster_it_did_not_start(tmp_path):
    server = _serve(tmp_path, _free_port(), env={"RAY_ADDRESS": "127.0.0.1:1"})
    output = server.communicate(timeout=120)[0]
    assert server.returncode == 2, output[-2000:]
    assert "direct ingress needs a Ray cluster started here" in output and "RAY_SERVE_ENABLE_DIRECT_INGRESS=1" in output
