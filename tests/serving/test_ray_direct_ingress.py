"""`hstu serve --replicas 1 --front-ends 2 --direct-ingress --engine-process` (two ingress replicas
serving HTTP on --port themselves, sharing it through SO_REUSEPORT, no Serve proxy; the ranking
replica runs its engine in a child process): it ranks a few users' growing histories over that
port, every answer equal to the no-cache model's, with cache hits. Its own local Ray cluster, in a
child process. And the port sharing itself."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time

import pytest

pytest.importorskip("ray.serve")

from hstu.scripts.loadtest import wait_until_ready  # noqa: E402
from hstu.serving.ray_app import reuse_port_socket  # noqa: E402
from tests.serving.conftest import Timeline, free_port, tiny_serve_argv  # noqa: E402
from tests.serving.test_ray_app import assert_all_match, post_all  # noqa: E402


_ALL_LISTENING = "through the ingress replicas directly"


def _serve(tmp_path, port: int) -> subprocess.Popen:
    argv = tiny_serve_argv(tmp_path, port, "--replicas", "1", "--front-ends", "2", "--direct-ingress", "--engine-process")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(300)
def test_direct_ingress_and_engine_process_replica_match_the_no_cache_model(tmp_path, reference):
    port = free_port()
    server = _serve(tmp_path, port)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True)
    reader.start()
    base = f"http://127.0.0.1:{port}"

    def printed() -> str:  # (an exited server's last lines reach `lines` once the reader hits the end)
        if server.poll() is not None:
            reader.join(timeout=10)
        return "".join(lines)[-5000:]

    try:
        wait_until_ready(base, lambda: server.poll() is None, timeout_s=240, log=printed)
        timelines = [Timeline(30_000 + u) for u in range(4)]
        payloads = [t.payload(6 + 3 * step, num_candidates=3) for step in range(3) for t in timelines]
        responses = asyncio.run(post_all(base, payloads))
        # logged once serve.run saw both ingress replicas healthy, i.e. both bound the one port (an
        # ingress answers as soon as it listens, which can be before that)
        deadline = time.monotonic() + 120
        while not any(_ALL_LISTENING in line for line in lines) and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        reader.join(timeout=10)
    output = "".join(lines)
    assert_all_match(reference, payloads, responses)
    assert all(r.json()["cached_tokens"] > 0 for r in responses[4:]), output[-3000:]
    assert _ALL_LISTENING in output, output[-3000:]


def test_reuse_port_sockets_share_one_port():
    first = reuse_port_socket("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        second = reuse_port_socket("127.0.0.1", port)
        second.close()
        with socket.socket() as plain:
            plain.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):  # a socket without SO_REUSEPORT still cannot take it
                plain.bind(("127.0.0.1", port))
    finally:
        first.close()
    with socket.socket() as other:  # another server on the port: the ingress says which port and why
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{taken}"):
            reuse_port_socket("127.0.0.1", taken)


@pytest.mark.timeout(300)
def test_direct_ingress_on_a_taken_port_exits_naming_it(tmp_path):
    with socket.socket() as other:  # another server holds the port (no SO_REUSEPORT)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        server = _serve(tmp_path, port)
        try:
            output = server.communicate(timeout=240)[0]
        except subprocess.TimeoutExpired:
            server.kill()
            output = server.communicate()[0]
    assert server.returncode == 1, output[-3000:]
    assert f"cannot listen on 127.0.0.1:{port}" in output and "did not start" in output, output[-3000:]

